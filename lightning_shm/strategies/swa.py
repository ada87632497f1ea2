"""StochasticWeightAveraging when ranks hold pieces: the average kept in the trained model's layout.

Lightning's SWA callback deep-copies the LightningModule in its ``setup`` hook -- before the
strategy shards, slices or splits it -- and later zips the copy's parameters with the trained
module's (``size of tensor a (784) must match ... b (25120)``). Once the module is parallelized,
:func:`adapt_swa` gives every SWA callback an average of the same layout instead: a copy of this
rank's pieces, in the same order, whose ``state_dict`` is the consolidated plain average (a
collective; every rank dumps callback states when a checkpoint is saved) and whose
``load_state_dict`` cuts a plain average back into pieces. Checkpoints therefore hold plain
averaged weights, which resume under any layout.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn

from lightning_shm.parallel.state import ModelState


class AveragedPieces(nn.Module):
    """This rank's pieces of the averaged model; plain (consolidated) in ``state_dict``."""

    def __init__(self, pieces: nn.Module, state: ModelState) -> None:
        super().__init__()
        self.pieces = pieces
        object.__setattr__(self, "_state", state)  # not a submodule

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._state.consolidate(self.pieces.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        local = self._state.localize(state_dict, list(self.pieces.state_dict()))
        return self.pieces.load_state_dict(local, strict=strict)


def copy_pieces(module: nn.Module) -> nn.Module:
    """A private copy of what this rank holds, without the hooks that tie modules to the run (FSDP's
    gathers) or the Trainer: the average is only read and written, never run."""
    trainer = getattr(module, "_trainer", None)
    twin = copy.deepcopy(module, memo={id(trainer): None} if trainer is not None else None)
    for m in twin.modules():
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
        m._backward_hooks.clear()
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin


def adapt_swa(trainer: "pl.Trainer", module: nn.Module, state: ModelState) -> None:
    """Give each SWA callback an average in ``module``'s (parallelized) layout, and have it copy the
    average into the module only once no rank still reads the module's pieces (``state.before_load``)."""
    for cb in trainer.callbacks:
        if isinstance(cb, StochasticWeightAveraging):
            cb._average_model = AveragedPieces(copy_pieces(module), state)  # type: ignore[assignment]
            cb.transfer_weights = _after(state.before_load, cb.transfer_weights)  # type: ignore[method-assign]


def _after(first: Callable[[], None], fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        first()
        return fn(*args, **kwargs)
    return call
