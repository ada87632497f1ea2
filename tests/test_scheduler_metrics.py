"""A scheduler monitoring a metric logged without ``sync_dist``: every replica steps on one value, one process's.

Each data-parallel rank holds its own batches' value of such a metric; until 2026-12-06 each rank's
``ReduceLROnPlateau`` stepped on its own, the replicas' learning rates parted and their weights drifted apart
without a word (``strategies/scheduler_metrics.py``) -- under manual optimization, stepped by the module itself,
until 2026-12-06's second change.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import ReduceLROnPlateau

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, flat_params

WARNED = "the learning-rate scheduler monitors "


class _PlateauOnALocalMetric(MNISTClassifier):
    """``ReduceLROnPlateau`` on a validation loss logged without ``sync_dist`` (reduced over the epoch's batches by
    ``reduce_fx``); records the learning rate of each epoch, what rank 0 was warned of, how far apart the
    data-parallel replicas' weights ended and whether the fit left a hook wrapped (all plain results, which come
    back to the main process)."""

    def __init__(self, reduce_fx: str = "mean") -> None:
        super().__init__(optimizer="adam", lr=0.05)
        self.reduce_fx = reduce_fx
        self.lrs: list[float] = []
        self.warned: list[str] = []
        self.replicas_apart = -1.0
        self.left_wrapped = True

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_local", F.cross_entropy(self(x), y), reduce_fx=self.reduce_fx)  # each rank's batches

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_local"}}

    def on_train_start(self):
        self._recording = warnings.catch_warnings(record=True)  # the workers' warnings never reach pytest's
        self._records = self._recording.__enter__()
        warnings.simplefilter("always")

    def on_train_epoch_start(self):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self):
        self._recording.__exit__(None, None, None)
        self.warned = [str(w.message) for w in self._records if WARNED in str(w.message)]
        flat = flat_params(self)
        gathered = self.all_gather(flat) if self.trainer.world_size > 1 else flat[None]
        gathered = gathered.reshape(-1, flat.numel())
        self.replicas_apart = float((gathered - gathered[0]).abs().max())

    def on_fit_end(self):  # after the strategy's on_train_end
        self.left_wrapped = "lr_scheduler_step" in self.__dict__


class _PlateauOnASyncedMetric(_PlateauOnALocalMetric):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_local", F.cross_entropy(self(x), y), reduce_fx=self.reduce_fx, sync_dist=True)


def _fit(layout: str, reduce_fx: str, module=_PlateauOnALocalMetric):
    make, devices, dp = (lambda: "auto", 1, 1) if layout == "one process" else LAYOUTS[layout]
    return fit_seeded(lambda: module(reduce_fx), make(), devices, GLOBAL_BATCH // dp, ref=layout == "one process",
                      samples=GLOBAL_BATCH * 4, validate=True, max_epochs=6)[1]


@pytest.mark.parametrize("layout", ["ddp", "dp2xpp2-shard"])
def test_a_scheduler_on_a_mean_logged_without_sync_steps_every_replica_as_one_process(layout):
    one = _fit("one process", "mean")
    assert len(set(one.lrs)) > 2, one.lrs  # the plateau's decisions change the learning rate more than once
    model = _fit(layout, "mean")
    assert model.lrs == one.lrs
    assert (flat_params(model) - flat_params(one)).abs().max() < 1e-12
    if layout == "ddp":  # replicas holding the same weights (under "shard" each holds its own rows)
        assert model.replicas_apart == 0.0
    assert len(model.warned) == 1 and "monitors 'val_local'" in model.warned[0], model.warned
    assert "steps on their mean (" in model.warned[0]


def test_a_scheduler_on_a_max_logged_without_sync_steps_as_on_the_synced_max():
    """A max over the epoch's batches is not one process's (its batches are the replicas' together), but
    every replica steps on what ``sync_dist=True`` gives: the largest of the ranks' maxima."""
    synced = _fit("ddp", "max", _PlateauOnASyncedMetric)
    assert len(set(synced.lrs)) > 2 and synced.warned == [], (synced.lrs, synced.warned)
    model = _fit("ddp", "max")
    assert model.lrs == synced.lrs and model.replicas_apart == 0.0
    assert (flat_params(model) - flat_params(synced)).abs().max() == 0
    assert len(model.warned) == 1 and "steps on their max (" in model.warned[0], model.warned


def test_a_scheduler_on_a_synced_metric_is_left_as_it_is():
    model = _fit("ddp", "mean", _PlateauOnASyncedMetric)
    assert model.warned == [] and model.replicas_apart == 0.0 and not model.left_wrapped


class _PlateauSteppedByHand(_PlateauOnALocalMetric):
    """Manual optimization stepping ``ReduceLROnPlateau`` itself at each epoch's end on the last batch's loss,
    logged without ``sync_dist`` (Lightning's docs' example); records whether a copy made in the fit and the
    scheduler after it are plain ``ReduceLROnPlateau``."""

    def __init__(self, reduce_fx: str = "mean") -> None:
        super().__init__(reduce_fx)
        self.automatic_optimization = False
        self.copies_plain: list[bool] = []
        self.plain_after = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = F.cross_entropy(self(batch[0]), batch[1])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("loss", loss)  # each rank's batch

    def on_train_epoch_end(self):
        plateau = self.lr_schedulers()
        self.copies_plain.append(type(copy.copy(plateau)) is ReduceLROnPlateau)
        plateau.step(self.trainer.callback_metrics["loss"])

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.05)
        return [opt], [ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=0.5)]

    def on_fit_end(self):
        self.plain_after = type(self.trainer.lr_scheduler_configs[0].scheduler) is ReduceLROnPlateau


def _fit_by_hand(layout: str):
    make, devices, dp = (lambda: "auto", 1, 1) if layout == "one process" else LAYOUTS[layout]
    return fit_seeded(_PlateauSteppedByHand, make(), devices, GLOBAL_BATCH // dp, ref=layout == "one process",
                      samples=GLOBAL_BATCH * 4, max_epochs=6)[1]


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_a_plateau_the_module_steps_itself_on_an_unsynced_loss_steps_every_replica_as_one_process(layout):
    """Before: the replicas' learning rates parted (0.03125 on rank 0, 0.25 on rank 1 after 6 epochs)."""
    one = _fit_by_hand("one process")
    assert len(set(one.lrs)) > 2, one.lrs
    model = _fit_by_hand(layout)
    assert model.lrs == one.lrs
    assert (flat_params(model) - flat_params(one)).abs().max() < 1e-12
    if layout == "ddp":
        assert model.replicas_apart == 0.0
    assert len(model.warned) == 1 and "monitors 'loss'" in model.warned[0], model.warned
    assert model.copies_plain == [True] * 6 and model.plain_after
