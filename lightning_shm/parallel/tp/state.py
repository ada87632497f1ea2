"""A module under tensor parallelism: the plan applied, and where each slice lives.

Every parameter of a parallel layer is split along one dimension (``split_dims``) over the tp group
or replicated on every tp rank; :meth:`TensorParallelState.placements` says which, so checkpoints
are consolidated (and cut again) by :class:`~lightning_shm.parallel.state.ModelState` like any other
layout.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from lightning_shm.parallel.placement import Placement, Split
from lightning_shm.parallel.tp.apply import apply_plan
from lightning_shm.parallel.tp.sizes import LayerSplit
from lightning_shm.runtime import Group


class TensorParallelState:
    """Applies a checked plan (``splits``, from :func:`~lightning_shm.parallel.tp.check.check_plan` on the
    whole model) to the modules ``module`` holds, over ``group`` (the tp group)."""

    def __init__(self, module: nn.Module, group: Group, splits: Mapping[str, LayerSplit]) -> None:
        self.module, self.group = module, group
        self.pieces: dict[int, nn.Parameter] = {}  # id of a whole parameter -> the piece that replaced it
        self.cut: dict[str, Split] = {}  # a "per_head" tensor (sinks, slopes) -> how the rank's heads were cut
        self.parallel = apply_plan(module, splits, group, self.pieces, self.cut)

    def piece_of(self, p: nn.Parameter) -> nn.Parameter:
        """What holds ``p``'s values now: its piece if the plan split it, else ``p``."""
        return self.pieces.get(id(p), p)

    def placements(self) -> dict[str, Placement]:
        """Split entries (a layer's, a per-head tensor's): their split; every other parameter: held whole by each of
        the tp ranks."""
        out: dict[str, Placement] = {}
        for qname, mod in self.parallel.items():
            blocks = getattr(mod, "split_blocks", {})  # a fused q, k, v weight: the rank's rows of each
            for entry, dim in mod.split_dims.items():
                if getattr(mod, entry, None) is not None:
                    out[f"{qname}.{entry}"] = Placement((Split(self.group, dim, tuple(mod.sizes),
                                                               blocks.get(entry, 1)),))
        out.update({name: Placement((split,)) for name, split in self.cut.items()})
        for name, _ in self.module.named_parameters():
            out.setdefault(name, Placement(copies=self.group.size))
        return out

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())
