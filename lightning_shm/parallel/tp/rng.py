"""Which random stream a draw inside a tensor-parallel model comes from (dropout's masks).

Lightning seeds every rank alike, so every tp rank's default generator holds the same stream. That
is what replicated activations need -- a dropout after a row layer must drop the same features on
every rank, or the ranks' copies of the model drift apart. Between a column layer and its row
layer each rank holds *different* features (heads, channels): there one process draws one mask
over all of them, so each rank must draw a mask of its own. Drawing those from the shared stream
gives every rank the same mask for different features and, where the split is uneven, advances
the ranks' streams by different amounts -- after which even the replicated masks differ.

So the region between a column layer's output and a row layer's input draws from a stream of the
rank's own, and the shared stream does not see it::

    replicated       draws from the shared stream S (equal on every tp rank)
    column output    enter(): keep S aside; seed the default generator from hash(S, tp index)
    split features   dropout draws from the rank's own stream
    row input        leave(): put S back; if the region drew, advance S by one draw

Why the seed is derived from S rather than kept: ``torch.utils.checkpoint`` (and the pipeline's
activation checkpointing) replay a forward from S's saved state, and a seed derived from S replays
the same masks. Why S advances when the region drew: the next region, and the next step, must not
see the same seed again. A region that draws nothing leaves S exactly as one process leaves it, so
a model without randomness between its split layers trains as before.

S is equal on every tp rank only while every rank draws the same numbers. Code outside the model need not:
a callback picking samples to log on rank 0, a split loader whose members each load their own rows through
random augmentations (torchvision's transforms draw from the default generator, a crop a varying number of
times). From there a dropout after a row layer drops other features on each rank, and the ranks' copies of
the replicated layers drift apart, silently. One process has one stream: before each step, and at each pass
of a split loader (:func:`share_stream`), every member takes member 0's::

    member 0     S0 --broadcast (5,056 bytes)--> every member: S0
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from lightning_shm.runtime import Group


class SplitRegionRandom:
    """The default generator's switch between the tp group's shared stream and this rank's own.

    One per process and tp group, handed to its column and row layers. ``enter`` is idempotent (q, k
    and v columns all enter; the first one switches), and so is ``leave``.
    """

    def __init__(self, tp_index: int) -> None:
        self.tp_index = tp_index
        self._shared: Optional[torch.Tensor] = None  # S while inside a region
        self._seeded: Optional[torch.Tensor] = None  # the rank's stream as seeded: "did the region draw?"

    @property
    def inside(self) -> bool:
        return self._shared is not None

    def enter(self) -> None:
        if self._shared is not None:
            return
        gen = torch.default_generator
        self._shared = gen.get_state()
        data = self._shared.numpy().tobytes() + self.tp_index.to_bytes(4, "little")
        gen.manual_seed(zlib.crc32(data) | zlib.adler32(data) << 32)
        self._seeded = gen.get_state()

    def leave(self) -> None:
        if self._shared is None:
            return
        gen = torch.default_generator
        drew = not torch.equal(gen.get_state(), self._seeded)
        gen.set_state(self._shared)
        self._shared = self._seeded = None
        if drew:
            torch.empty((), dtype=torch.int64).random_()  # one draw from S


def share_stream(group: Group) -> None:
    """Member 0's default generator on every member of ``group`` (a tp group, or a replica's ranks: see the
    module): one broadcast of its state, on every member at the same point."""
    if group.size == 1:
        return
    gen = torch.default_generator
    state = group.broadcast(gen.get_state(), src_member=0)
    if group.index != 0:
        gen.set_state(state)
