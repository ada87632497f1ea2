"""End to end: the sample trains the reference MLP to >= 90% on the official MNIST test split."""

from __future__ import annotations

import lightning.pytorch as pl

from datamodules import MNISTDataModule
from lightning_shm.models import MNISTClassifier
from tests.helpers import trainer


def test_single_process_reaches_90_percent_on_official_test_split(mnist_dir):
    pl.seed_everything(42)
    dm = MNISTDataModule(data_dir=str(mnist_dir), batch_size=64)
    model = MNISTClassifier()
    t = trainer(devices=1, max_epochs=8)
    t.fit(model, dm)
    result = t.test(model, dm, verbose=False)[0]
    assert dm.test_set is not None and len(dm.test_set) == 10_000
    assert result["test_acc"] >= 0.90, result


def test_shm_ddp_reaches_90_percent_on_official_test_split(mnist_dir):
    pl.seed_everything(42)
    dm = MNISTDataModule(data_dir=str(mnist_dir), batch_size=32)
    model = MNISTClassifier()
    t = trainer(strategy="shm_ddp_fork", devices=2, max_epochs=8)
    t.fit(model, dm)
    result = t.test(model, dm, verbose=False)[0]
    assert result["test_acc"] >= 0.90, result
