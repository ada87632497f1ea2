"""ModelSummary of the whole model, not of the piece one rank holds.

Lightning's ``ModelSummary`` callback summarises the module it is given at ``on_fit_start``, after
the strategy's ``setup``; by then a rank holds FSDP shards, tensor-parallel slices or one pipeline
stage, and ``p.numel()`` counts only those. So the strategy takes the summary of the plain module
just before parallelizing it (on rank 0, the rank that prints) and the callback reports that one.
A line after it gives rank 0's share. The callbacks' ``_summary`` is replaced only for the run, in
:func:`full_model_summary`, and restored at teardown.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import summarize
from lightning.pytorch.utilities.rank_zero import rank_zero_info


@dataclass
class FrozenSummary:
    """The numbers ``ModelSummary.on_fit_start`` reads, taken at one moment."""

    summary_data: list = field(default_factory=list)
    total_parameters: int = 0
    trainable_parameters: int = 0
    model_size: float = 0.0
    total_training_modes: dict = field(default_factory=lambda: {"train": 0, "eval": 0})
    total_flops: int = 0

    def _get_summary_data(self) -> list:
        return self.summary_data


@contextlib.contextmanager
def full_model_summary(trainer: "pl.Trainer", module: "pl.LightningModule", rank: int) -> Iterator[Any]:
    """Inside: the trainer's ModelSummary callbacks report ``module`` as it is on entry. Yields a
    function to call once the module is parallelized (it logs this rank's share)."""
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, ModelSummary) and cb._max_depth]
    frozen = FrozenSummary()
    total = sum(p.numel() for p in module.parameters())
    if callbacks and rank == 0:
        s = summarize(module, max_depth=max(cb._max_depth for cb in callbacks))
        frozen = FrozenSummary(s._get_summary_data(), s.total_parameters, s.trainable_parameters, s.model_size,
                               s.total_training_modes, getattr(s, "total_flops", 0))
    for cb in callbacks:
        cb._summary = lambda trainer, pl_module, frozen=frozen: frozen  # type: ignore[method-assign]

    def report_share(how: str) -> None:
        mine = sum(p.numel() for p in module.parameters())
        if callbacks and mine != total:
            rank_zero_info(f"lightning_shm: rank 0 holds {mine:,} of the model's {total:,} parameters "
                           f"({mine / max(total, 1):.0%}: {how})")

    try:
        yield report_share
    finally:
        for cb in callbacks:
            cb.__dict__.pop("_summary", None)
