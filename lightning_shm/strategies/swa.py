"""Weight averaging callbacks when ranks hold pieces: the average kept in the trained model's layout.

Lightning's SWA callback deep-copies the LightningModule in its ``setup`` hook -- before the
strategy shards, slices or splits it -- and later zips the copy's parameters with the trained
module's (``size of tensor a (784) must match ... b (25120)``). Once the module is parallelized,
:func:`adapt_swa` gives every SWA callback an average of the same layout instead: a copy of this
rank's pieces, in the same order, whose ``state_dict`` is the consolidated plain average (a
collective; every rank dumps callback states when a checkpoint is saved) and whose
``load_state_dict`` cuts a plain average back into pieces. Checkpoints therefore hold plain
averaged weights, which resume under any layout.

Lightning's ``WeightAveraging`` (and ``EMAWeightAveraging``) build a torch ``AveragedModel`` in the
same hook, with the same result; it gets an ``AveragedModel`` over this rank's pieces instead, whose
``state_dict`` / ``load_state_dict`` speak plain entries. Its swaps of the average into the module
(around validation, at the end of training) write the module's pieces: no rank may still read them
before, none may read them before all have written (FSDP's shared rows), so they run between
``state.before_load`` and ``state.after_load``; resuming loads the module's own weights through the
layout (the callback's ``pl_module.load_state_dict`` of plain entries would not fit the pieces).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.optim.swa_utils import AveragedModel

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
    """Give each weight-averaging callback an average in ``module``'s (parallelized) layout, and have it
    copy the average into the module only once no rank still reads the module's pieces
    (``state.before_load``; and, for ``WeightAveraging``, until every rank has: ``state.after_load``)."""
    for cb in trainer.callbacks:
        if isinstance(cb, StochasticWeightAveraging):
            cb._average_model = AveragedPieces(copy_pieces(module), state)  # type: ignore[assignment]
            cb.transfer_weights = _after(state.before_load, cb.transfer_weights)  # type: ignore[method-assign]
        elif isinstance(cb, WeightAveraging) and cb._average_model is not None:
            pieces = copy_pieces(module)
            _match_dtypes(pieces, cb._average_model.module, state.plain_name)
            cb._average_model = _averaged_pieces(cb, pieces, state)
            for name in ("_swap_models", "_copy_average_to_current"):
                setattr(cb, name, _between(state, getattr(cb, name)))
            cb.on_load_checkpoint = functools.partial(_load_averaging, cb, state)  # type: ignore[method-assign]


def _match_dtypes(pieces: nn.Module, original: nn.Module, plain_name: Callable[[str], str]) -> None:
    """The average keeps the dtypes of the callback's own: it copied the module in its ``setup`` hook,
    before the precision plugin converted it (float32 in a ``64-true`` run), and averages in them. By the
    plain name: a pipeline stage may hold a tied parameter under another holder's name only."""
    dtypes = {n: t.dtype for n, t in [*original.named_parameters(), *original.named_buffers()]}
    for n, t in [*pieces.named_parameters(), *pieces.named_buffers()]:
        n = plain_name(n)
        if n in dtypes and t.dtype != dtypes[n] and t.is_floating_point():
            t.data = t.data.to(dtypes[n])


def _averaged_pieces(cb: WeightAveraging, pieces: nn.Module, state: ModelState) -> AveragedModel:
    """The callback's ``AveragedModel`` (its averaging function, its ``use_buffers``) over this rank's
    pieces; ``state_dict`` holds plain ``module.<entry>`` keys (a collective), ``load_state_dict`` takes them."""
    average = AveragedModel(pieces, use_buffers=cb._use_buffers, **cb._kwargs)
    prefix = "module."

    def state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        local = AveragedModel.state_dict(average)
        plain = state.consolidate({k[len(prefix):]: v for k, v in local.items() if k.startswith(prefix)})
        return {**{prefix + k: v for k, v in plain.items()}, **{k: v for k, v in local.items()
                                                                 if not k.startswith(prefix)}}

    def load_state_dict(state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        plain = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        average.module.load_state_dict(state.localize(plain, list(average.module.state_dict())), strict=strict)
        if "n_averaged" in state_dict:
            average.n_averaged.copy_(state_dict["n_averaged"])

    average.state_dict = state_dict  # type: ignore[method-assign]
    average.load_state_dict = load_state_dict  # type: ignore[method-assign]
    return average


def _load_averaging(cb: WeightAveraging, state: ModelState, trainer: "pl.Trainer", pl_module: nn.Module,
                    checkpoint: dict[str, Any]) -> None:
    """``WeightAveraging.on_load_checkpoint`` with the module's weights loaded through the layout."""
    average = cb._average_model
    assert average is not None
    plain_average = {"module." + k: v for k, v in checkpoint["state_dict"].items()}
    if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
        average.load_state_dict({**plain_average, **checkpoint["averaging_state"]})
        state.load_full_state_dict(checkpoint["current_model_state"])
    else:  # a checkpoint written without averaging: both start from its weights (as the callback does)
        average.load_state_dict(plain_average, strict=False)


def _between(state: ModelState, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        state.before_load()
        try:
            return fn(*args, **kwargs)
        finally:
            state.after_load()
    return call


def _after(first: Callable[[], None], fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        first()
        return fn(*args, **kwargs)
    return call
