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


class ReplayStreams:
    """The random streams a replay of a forward must draw from again that torch's own keeping misses (activation
    checkpointing; torch's default generator is the checkpoint's or the engine's to keep): Python's ``random``,
    numpy's global stream, and the generators ``module``'s submodules hold (:func:`generators_of`: a noise layer's
    own ``torch.Generator``).

    Why: a forward drawing from them -- a LayerDrop deciding with ``random.random()``, a scale from
    ``np.random.rand()``, noise from ``torch.randn(..., generator=self.gen)`` -- drew again in its replay: other
    numbers, so a gradient of another computation (0.80 and 2.1 off in probes), a different graph (torch's "A
    different number of tensors was saved"), and every later draw of the stream moved. Reading numpy's state costs
    ~30 us, so whether a forward draws is learned at its first one, and only a forward that drew keeps them::

        forward:  state = states()             (first forward, and every one of a forward that drew)
        replay:   now = states(); put(state) -> forward again -> put(now)
    """

    def __init__(self, module: Optional[torch.nn.Module] = None) -> None:
        self.own = [s for m in module.modules() for s in generators_of(m)] if module is not None else []
        self.draws: Optional[bool] = None  # unknown until the first forward

    def before_forward(self) -> Optional[tuple[Any, ...]]:
        """The streams as the forward starts (None: it is known not to draw)."""
        return None if self.draws is False else self._states()

    def after_forward(self, before: Optional[tuple[Any, ...]]) -> None:
        if self.draws is None and before is not None:
            self.draws = not _same(before, self._states())

    @contextlib.contextmanager
    def replaying(self, before: Optional[tuple[Any, ...]]) -> Iterator[None]:
        """Around a replay: the streams as its forward found them, then as they were before it."""
        if not self.draws or before is None:
            yield
            return
        now = self._states()
        self._put(before)
        try:
            yield
        finally:
            self._put(now)

    def _states(self) -> tuple[Any, ...]:
        np = sys.modules.get("numpy")
        return (random.getstate(), np.random.get_state() if np is not None else None,
                [get() for _, get, _ in self.own])

    def _put(self, states: tuple[Any, ...]) -> None:
        random.setstate(states[0])
        np = sys.modules.get("numpy")
        if np is not None and states[1] is not None:
            np.random.set_state(states[1])
        for (_, _, put), state in zip(self.own, states[2]):
            put(state)


def draws_of(fn: Callable[[], Any], own: Sequence[Stream] = ()) -> list[str]:
    """Which global streams -- and ``own`` ones (:func:`generators_of`) -- ``fn()`` draws from, each put back as it
    was before the call (also if it raises)."""
    np = sys.modules.get("numpy")
    streams: list[Stream] = [("torch", torch.default_generator.get_state, torch.default_generator.set_state),
                             ("random", random.getstate, random.setstate)]
    if np is not None:
        streams.append(("numpy", np.random.get_state, np.random.set_state))
    streams += own
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
    """Equal states: tensors, numpy arrays and the tuples and dicts that hold them compared element by element."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # a numpy array
        return a.shape == b.shape and bool((a == b).all())
    return a == b
