"""A scheduler monitoring a metric logged without ``sync_dist``: every replica steps on one value, one process's.

Each data-parallel rank holds its own batches' value of such a metric; until 2026-12-06 each rank's
``ReduceLROnPlateau`` stepped on its own, the replicas' learning rates parted and their weights drifted apart
without a word (``strategies/scheduler_metrics.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, flat_params

WARNED = "the learning-rate scheduler monitors 'val_local'"


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
    assert len(model.warned) == 1 and "steps on their mean (" in model.warned[0], model.warned


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
