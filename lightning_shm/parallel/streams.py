"""The global random streams -- torch's default generator, Python's ``random``, numpy's global stream, what
``seed_everything`` seeds -- seeded from parts every process can compute, or kept aside and put back.

Seeded alike on every rank of a replica they give the same draws (a pipeline's step, every stage:
:mod:`lightning_shm.strategies.step_randomness`); kept aside around a call, they show whether it drew
(:func:`draws_of`: does a dataset's ``__getitem__`` augment at random -- from the global streams or from a generator
it keeps, :func:`generators_of`?); kept for the replay of a forward that drew from Python's, numpy's or a layer's
own generator (:class:`ReplayStreams`: activation checkpointing).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import random
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

import torch


def call_seed(*parts: int) -> int:
    """A 63-bit seed from ``parts`` (base seed, step count, microbatch): equal inputs, equal seed, any process."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_streams(seed: int) -> None:
    """Seed torch's default (CPU) generator, Python's ``random`` and, if imported, numpy's global stream."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)


Stream = tuple[str, Callable[[], Any], Callable[[Any], Any]]  # a name, how to read its state, how to put it back
Drawn = list[tuple[Stream, Any]]  # streams, each with its state from before a forward


class ReplayStreams:
    """The random streams a replay of a forward must draw from again that torch's own keeping misses (activation
    checkpointing; torch's default generator is the checkpoint's or the engine's to keep): Python's ``random``,
    numpy's global stream, and the generators ``module``'s submodules hold (:func:`generators_of`: a noise layer's
    own ``torch.Generator``).

    Why: a forward drawing from them -- a LayerDrop deciding with ``random.random()``, a scale from
    ``np.random.rand()``, noise from ``torch.randn(..., generator=self.gen)`` -- drew again in its replay: other
    numbers, so a gradient of another computation (0.80 and 2.1 off in probes), a different graph (torch's "A
    different number of tensors was saved"), and every later draw of the stream moved. Every forward is watched,
    not only the first: one that starts drawing later (a drop probability ramped up from 0) is the same case. The
    states are read around each forward (~40 us, numpy's ~30 of it), and only the streams it moved are put back
    around its replay::

        forward:  before = states() -> forward -> drawn = the streams that moved, with their states from before
        replay:   now = drawn's states(); put(before) -> forward again -> put(now)
    """

    def __init__(self, module: Optional[torch.nn.Module] = None) -> None:
        self.own = [s for m in module.modules() for s in generators_of(m)] if module is not None else []

    def before_forward(self) -> Drawn:
        """The streams with their states as the forward starts."""
        return [(stream, stream[1]()) for stream in _global_streams(torch_too=False) + self.own]

    @staticmethod
    def drawn(before: Drawn) -> Drawn:
        """After the forward: the streams it drew from, each with its state ``before`` it."""
        return [(stream, state) for stream, state in before if not _same(state, stream[1]())]

    @staticmethod
    @contextlib.contextmanager
    def replaying(drawn: Drawn) -> Iterator[None]:
        """Around a replay: the streams its forward drew from as that forward found them, then as they were."""
        now = [get() for (_, get, _), _ in drawn]
        for (_, _, put), state in drawn:
            put(state)
        try:
            yield
        finally:
            for ((_, _, put), _), state in zip(drawn, now):
                put(state)


def _global_streams(torch_too: bool = True) -> list[Stream]:
    """torch's default generator (``torch_too``), Python's ``random`` and, if imported, numpy's global stream."""
    torch_stream: Stream = ("torch", torch.default_generator.get_state, torch.default_generator.set_state)
    streams = [torch_stream] if torch_too else []
    streams.append(("random", random.getstate, random.setstate))
    np = sys.modules.get("numpy")
    if np is not None:
        streams.append(("numpy", np.random.get_state, np.random.set_state))
    return streams


def draws_of(fn: Callable[[], Any], own: Sequence[Stream] = ()) -> list[str]:
    """Which global streams -- and ``own`` ones (:func:`generators_of`) -- ``fn()`` draws from, each put back as it
    was before the call (also if it raises)."""
    streams = _global_streams() + list(own)
    before = [get() for _, get, _ in streams]
    try:
        fn()
    finally:
        after = [get() for _, get, _ in streams]
        for (_, _, put), state in zip(streams, before):
            put(state)
    return [name for (name, _, _), a, b in zip(streams, before, after) if not _same(a, b)]


def generators_of(obj: Any) -> list[Stream]:
    """The random generators ``obj`` keeps as attributes of its own (a ``torch.Generator``, numpy's ``Generator``
    or ``RandomState``), as streams for :func:`draws_of`: a dataset augmenting from one draws the same numbers in
    every process that holds a copy of it."""
    np = sys.modules.get("numpy")
    out: list[Stream] = []
    for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
        if isinstance(value, torch.Generator):
            out.append((name, value.get_state, value.set_state))
        elif np is not None and isinstance(value, np.random.Generator):
            bits = value.bit_generator
            out.append((name, lambda bits=bits: copy.deepcopy(bits.state),
                        lambda state, bits=bits: setattr(bits, "state", state)))
        elif np is not None and isinstance(value, np.random.RandomState):
            out.append((name, value.get_state, value.set_state))
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal states: tensors, numpy arrays and the tuples and dicts that hold them compared element by element;
    plain values at once (Python's state, 625 ints: ~10 us, element by element ~150)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    try:
        equal = a == b
    except (RuntimeError, ValueError, TypeError):  # a tensor or an array inside a tuple or dict: no single truth value
        equal = None
    if isinstance(equal, bool):
        return equal
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # a numpy array
        return a.shape == b.shape and bool((a == b).all())
    return a == b
