"""torchmetrics computed by hand in epoch-end hooks -- the other common pattern beside ``self.log(name, metric)`` --
equal one process's under every layout.

Under a pipeline the steps (and the metrics' ``update``) run on the last stage only; before, ``compute()`` in
``on_validation_epoch_end`` gave rank 0 (the first stage) an empty state: accuracy 0.0, a mean nan, logged as
such. Metrics kept in a dict and metrics created after setup were not synced at all (under shm_ddp a count of
48 where one process counts 96).
"""

from __future__ import annotations

import pytest
import torch
from torchmetrics import CatMetric, MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, fit_seeded, layouts, loader, logged_floats, mnist_like


class ComputesByHand(MNISTClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.acc = MulticlassAccuracy(num_classes=10)
        self.train_loss = MeanMetric()
        self.step_mean = MeanMetric(dist_sync_on_step=True)  # syncs inside the (pipelined) step
        self.preds = CatMetric()  # a list state: empty on the stages that run no step
        self.plain = {"seen": SumMetric()}  # not a submodule

    def on_validation_start(self):
        self.late = SumMetric()  # created after setup: so are the next two

    def on_train_start(self):
        self.train_seen = SumMetric()

    def on_test_start(self):
        self.test_seen = SumMetric()

    def on_predict_start(self):
        self.predict_seen = SumMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.train_loss.update(loss.detach(), weight=len(batch[1]))
        self.train_seen.update(torch.tensor(float(len(batch[1]))))
        self.log("step_mean", self.step_mean(loss.detach(), weight=len(batch[1])))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx == self.trainer.num_training_batches - 1:  # before the validation that starts the epoch's end
            self.log("train_seen", self.train_seen.compute())

    def on_train_epoch_end(self):
        self.log("train_loss_by_hand", self.train_loss.compute())
        self.train_loss.reset()

    def test_step(self, batch, batch_idx):
        super().test_step(batch, batch_idx)
        self.test_seen.update(torch.tensor(float(len(batch[1]))))

    def on_test_epoch_end(self):
        self.log("test_seen", self.test_seen.compute())

    def predict_step(self, batch, batch_idx):
        self.predict_seen.update(torch.tensor(float(len(batch[1]))))
        return super().predict_step(batch, batch_idx)

    def on_predict_epoch_end(self):
        self.predicted = float(self.predict_seen.compute())  # predict cannot log: back as a module attribute

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
    t, model = fit_seeded(lambda: ComputesByHand(optimizer="adam"), strategy, devices, batch, ref=ref,
                          samples=GLOBAL_BATCH * 4, validate=True)
    got = logged_floats(t)
    data = loader(mnist_like(GLOBAL_BATCH * 4, seed=1), batch)  # the counts need no order
    t.test(model, data, verbose=False)
    got["test_seen"] = float(t.callback_metrics["test_seen"])
    t.predict(model, data, return_predictions=False)
    return {**got, "predict_seen": model.predicted}


@pytest.fixture(scope="module")
def one_process():
    return _metrics("auto", 1, GLOBAL_BATCH, ref=True)


@pytest.mark.parametrize("name", ["ddp", "tp2", "pp2-1f1b", "dp2xpp2-shard"])
def test_metrics_computed_in_epoch_end_hooks_equal_one_process(one_process, name):
    strategy, devices, dp = layouts(name)[name]
    got = _metrics(strategy(), devices, GLOBAL_BATCH // dp)
    for key in ("preds_n", "dict_seen", "late_seen", "train_seen", "test_seen", "predict_seen"):
        assert one_process[key] == GLOBAL_BATCH * 4, key
    for key in ("acc_by_hand", "train_loss_by_hand", "step_mean", "preds_sum", "preds_n", "dict_seen", "late_seen",
                "train_seen", "test_seen", "predict_seen"):
        assert got[key] == pytest.approx(one_process[key], rel=1e-6), key  # float32 metric states
