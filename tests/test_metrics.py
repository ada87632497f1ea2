"""torchmetrics computed by hand in epoch-end hooks -- the other common pattern beside ``self.log(name, metric)`` --
equal one process's under every layout.

Under a pipeline the steps (and the metrics' ``update``) run on the last stage only; before, ``compute()`` in
``on_validation_epoch_end`` gave rank 0 (the first stage) an empty state: accuracy 0.0, a mean nan, logged as
such. Metrics kept in a dict and metrics created after setup were not synced at all (under shm_ddp a count of
48 where one process counts 96).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torchmetrics import CatMetric, MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, SEED, layouts, loader, mnist_like, reference_loader, trainer


class ComputesByHand(MNISTClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.acc = MulticlassAccuracy(num_classes=10)
        self.train_loss = MeanMetric()
        self.step_mean = MeanMetric(dist_sync_on_step=True)  # syncs inside the (pipelined) step
        self.preds = CatMetric()  # a list state: empty on the stages that run no step
        self.plain = {"seen": SumMetric()}  # not a submodule

    def on_validation_start(self):
        self.late = SumMetric()  # created after setup

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.train_loss.update(loss.detach(), weight=len(batch[1]))
        self.log("step_mean", self.step_mean(loss.detach(), weight=len(batch[1])))
        return loss

    def on_train_epoch_end(self):
        self.log("train_loss_by_hand", self.train_loss.compute())
        self.train_loss.reset()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        pred = self(x).argmax(1)
        self.acc.update(pred, y)
        self.preds.update(pred.double())
        self.plain["seen"].update(torch.tensor(float(len(y))))
        self.late.update(torch.tensor(float(len(y))))

    def on_validation_epoch_end(self):
        preds = self.preds.compute()
        self.log_dict({"acc_by_hand": self.acc.compute(), "preds_sum": preds.sum(), "preds_n": float(preds.numel()),
                       "dict_seen": self.plain["seen"].compute(), "late_seen": self.late.compute()})
        for m in (self.acc, self.preds, self.plain["seen"], self.late):
            m.reset()


def _metrics(strategy, devices, batch, ref=False):
    pl.seed_everything(SEED)
    ds = mnist_like(GLOBAL_BATCH * 4, seed=1)
    dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
    t = trainer(strategy=strategy, devices=devices, max_epochs=1, num_sanity_val_steps=0, precision="64-true")
    t.fit(ComputesByHand(optimizer="adam"), dl, dl)
    return {k: float(v) for k, v in t.callback_metrics.items()}


@pytest.fixture(scope="module")
def one_process():
    return _metrics("auto", 1, GLOBAL_BATCH, ref=True)


@pytest.mark.parametrize("name", ["ddp", "tp2", "pp2-1f1b", "dp2xpp2-shard"])
def test_metrics_computed_in_epoch_end_hooks_equal_one_process(one_process, name):
    strategy, devices, dp = layouts(name)[name]
    got = _metrics(strategy(), devices, GLOBAL_BATCH // dp)
    assert one_process["preds_n"] == one_process["dict_seen"] == one_process["late_seen"] == GLOBAL_BATCH * 4
    for key in ("acc_by_hand", "train_loss_by_hand", "step_mean", "preds_sum", "preds_n", "dict_seen", "late_seen"):
        assert got[key] == pytest.approx(one_process[key], rel=1e-6), key  # float32 metric states
