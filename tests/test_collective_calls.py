"""Lightning calls every rank must make, made on rank 0 alone: the error says which call and what to change."""

from __future__ import annotations

import os
from functools import partial

import lightning.pytorch as pl
import pytest
import torch

from lightning_shm.models import MNISTClassifier
from lightning_shm.runtime import BarrierTimeoutError, CollectiveMismatchError
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded


class _SavesOnRankZeroOnly(pl.Callback):
    """Code ported from one process: the save gated on rank 0."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])  # the copies of the module's state; the whole weights' gather
def test_a_save_on_rank_zero_alone_stops_saying_every_rank_must_save(tmp_path, layout):
    """Lightning's ddp waits at its barrier for 30 minutes; the mismatch stopped the run at once but named only two
    collectives. Either member may be the one reported: rank 0's note is beside the report either way."""
    strategy, devices, dp = LAYOUTS[layout]
    with pytest.raises((CollectiveMismatchError, BarrierTimeoutError)) as raised:
        fit_seeded(MNISTClassifier, strategy(), devices, GLOBAL_BATCH // dp,
                   callbacks=[_SavesOnRankZeroOnly(str(tmp_path / "rank0.ckpt"))])
    name = type(strategy()).__name__
    said = [n for n in raised.value.__notes__ if n.startswith("rank 0 was saving a checkpoint")]
    assert said and f"which under {name} is collective" in said[0], raised.value.__notes__
    assert not os.path.exists(tmp_path / "rank0.ckpt")


class _LogsSyncedOnRankZeroOnly(MNISTClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.is_global_zero:
            self.log("rank_zero_loss", loss.detach(), sync_dist=True)
        return loss


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])  # against the bucket's all-reduce; a unit's reduce-scatter
def test_a_synced_log_on_rank_zero_alone_stops_saying_every_rank_must_log_it(layout):
    """The mismatch named two collectives; under shm_fsdp the unit's message blamed units reduced in different
    orders (a mixture of experts), where rank 0 had reduced a logged value alone."""
    strategy, devices, dp = LAYOUTS[layout]
    with pytest.raises((CollectiveMismatchError, BarrierTimeoutError)) as raised:
        fit_seeded(_LogsSyncedOnRankZeroOnly, strategy(), devices, GLOBAL_BATCH // dp)
    assert any(n.startswith("rank 0 was combining a value over the ranks (trainer.strategy.reduce: self.log(..., "
                            "sync_dist=True)") for n in raised.value.__notes__), raised.value.__notes__
    assert "reduced in different orders" not in str(raised.value)


class _CallsOnRankZeroOnly(MNISTClassifier):
    def __init__(self, call: str) -> None:
        super().__init__()
        self.call = call

    def on_train_epoch_end(self):
        if self.trainer.is_global_zero:
            {"gather": lambda: self.all_gather(torch.ones(2)),
             "broadcast": lambda: self.trainer.strategy.broadcast(3),
             "barrier": lambda: self.trainer.strategy.barrier()}[self.call]()


@pytest.mark.parametrize("call, said", [("gather", "self.all_gather (trainer.strategy.all_gather)"),
                                        ("broadcast", "trainer.strategy.broadcast"),
                                        ("barrier", "trainer.strategy.barrier")])
def test_a_collective_call_on_rank_zero_alone_stops_naming_it(call, said):
    strategy, devices, dp = LAYOUTS["ddp"]
    with pytest.raises((CollectiveMismatchError, BarrierTimeoutError)) as raised:
        fit_seeded(partial(_CallsOnRankZeroOnly, call), strategy(), devices, GLOBAL_BATCH // dp)
    assert any(n.startswith(f"rank 0 was in {said}, which every rank must call") for n in raised.value.__notes__), \
        raised.value.__notes__
