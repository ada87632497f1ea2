"""Where the pieces of a tensor live: the one protocol every parallelism describes its state with.

A rank holds each entry of the module's state (parameter or buffer) either whole or cut by one or
more :class:`Split` s, outermost first. Tensor parallelism cuts a weight along dim d over the tp
group; FSDP then cuts that slice along dim 0 over the data-parallel group (ZeRO-3)::

    full  --cut(tp, d)-->  tp slice  --cut(dp, 0)-->  this rank's piece     (narrow, in order)
    piece --gather(dp, 0)--> tp slice --gather(tp, d)--> full                (all_gather_v, reverse order)

A pipeline holds whole entries of its own layers only; the entries of the other stages come from
them (:class:`~lightning_shm.parallel.state.ModelState` merges them). ``copies`` counts the ranks
holding the very same piece (data-parallel replicas, tp ranks of a replicated layer), so a global
gradient norm counts each element once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_shm.runtime import Group


@dataclass(frozen=True)
class Split:
    """A tensor cut along ``dim`` over ``group``: member i holds ``sizes[i]`` consecutive indices -- of each of
    ``blocks`` equal blocks the dim is made of, when it has several: an attention's fused ``in_proj_weight``
    ``[3E, E]`` is q, k and v stacked, and a rank holding heads h holds their rows of each (``[3 E_r, E]``)."""

    group: Group
    dim: int
    sizes: tuple[int, ...]
    blocks: int = 1

    def __post_init__(self) -> None:
        if len(self.sizes) != self.group.size or min(self.sizes) < 0:
            raise ValueError(f"a split over {self.group.size} ranks needs {self.group.size} sizes >= 0, "
                             f"got {list(self.sizes)}")
        if self.blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {self.blocks}")

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This member's piece of ``full`` (a copy: it must not alias a checkpoint's tensor)."""
        i = self.group.index
        blocked = full.unflatten(self.dim, (self.blocks, sum(self.sizes)))
        return blocked.narrow(self.dim + 1, sum(self.sizes[:i]), self.sizes[i]).flatten(self.dim, self.dim + 1).clone()

    def gather(self, piece: torch.Tensor) -> torch.Tensor:
        """Every member's piece, concatenated along ``dim`` (within each block; collective over ``group``)."""
        moved = piece.detach().movedim(self.dim, 0).contiguous()
        rest = tuple(moved.shape[1:])
        parts = self.group.all_gather_v(moved.reshape(-1))
        full = torch.cat([p.view(self.blocks, s, *rest) for p, s in zip(parts, self.sizes)], dim=1)
        return full.flatten(0, 1).movedim(0, self.dim).contiguous()

    @property
    def whole(self) -> int:
        """The full size of ``dim``."""
        return self.blocks * sum(self.sizes)


@dataclass(frozen=True)
class Placement:
    """How the full tensor becomes this rank's piece: ``splits`` applied in order; ``copies`` ranks hold
    the same piece."""

    splits: tuple[Split, ...] = ()
    copies: int = 1

    def then(self, split: Split) -> "Placement":
        """This placement cut once more (FSDP sharding a tensor-parallel slice)."""
        return Placement(self.splits + (split,), self.copies)

    def replicated(self, n: int) -> "Placement":
        """Held identically by ``n`` times as many ranks."""
        return Placement(self.splits, self.copies * n)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        t = full
        for s in self.splits:
            t = s.cut(t)
        return t if self.splits else full.clone()

    def gather(self, piece: torch.Tensor) -> torch.Tensor:
        t = piece
        for s in reversed(self.splits):
            t = s.gather(t)
        return t

    def full_shape(self, piece_shape: torch.Size) -> torch.Size:
        shape = list(piece_shape)
        for s in reversed(self.splits):  # the outermost split knows the full size
            shape[s.dim] = s.whole
        return torch.Size(shape)


WHOLE = Placement()
