"""The global random streams -- torch's default generator, Python's ``random``, numpy's global stream, what
``seed_everything`` seeds -- seeded from parts every process can compute, or kept aside and put back.

Seeded alike on every rank of a replica they give the same draws (a pipeline's step, every stage:
:mod:`lightning_shm.strategies.step_randomness`); kept aside around a call, they show whether it drew
(:func:`draws_of`: does a dataset's ``__getitem__`` augment at random?).
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any, Callable

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


def draws_of(fn: Callable[[], Any]) -> list[str]:
    """Which global streams ``fn()`` draws from, each put back as it was before the call (also if it raises)."""
    np = sys.modules.get("numpy")
    kept = [("torch", torch.default_generator.get_state(), torch.default_generator.set_state),
            ("random", random.getstate(), random.setstate)]
    if np is not None:
        kept.append(("numpy", np.random.get_state(), np.random.set_state))
    try:
        fn()
    finally:
        after = [torch.default_generator.get_state(), random.getstate()]
        if np is not None:
            after.append(np.random.get_state())
        for _, state, put in kept:
            put(state)
    return [name for (name, state, _), now in zip(kept, after) if not _same(state, now)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and a and a[0] == "MT19937":  # numpy: (name, keys, pos, has_gauss, gauss)
        return bool((a[1] == b[1]).all()) and a[2:] == b[2:]
    return a == b
