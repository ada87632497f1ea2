"""A pipeline runs the user's step once per microbatch, on a piece of the batch it was given: each piece
must be that batch with fewer samples, in the same structure.

Until 2026-12-03 a namedtuple batch failed under every pipeline layout ("NT.__new__() missing 1 required
positional argument"), a dataclass batch was refused ("cannot split a batch without tensors") and a
collated list of per-sample strings went whole into every microbatch (a loss weighted by it failed on
mismatched sizes). Single-process, shm_ddp, shm_fsdp and shm_tp ran all three.
"""

from __future__ import annotations

import dataclasses
from collections import UserDict, defaultdict, namedtuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_shm import SHMPipeline
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.pipeline import split_batch
from tests.helpers import GLOBAL_BATCH, SEED, flat_params, mnist_like, trainer

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    names: list
    scale: float = 1.0


class Encoding(UserDict):
    """A Mapping that is not a dict, as a tokenizer's ``BatchEncoding`` is."""


def test_each_structure_is_cut_along_its_batch_dimension_and_kept():
    x, y = torch.arange(14.0).reshape(7, 2), torch.arange(7)
    sizes = [len(p) for p in torch.tensor_split(y, 3)]  # [3, 2, 2]
    names = [f"s{i}" for i in range(7)]
    mask = torch.ones(2, 2)  # no batch dimension: every microbatch gets it whole
    ragged = [torch.zeros(i + 1) for i in range(7)]  # one tensor per sample, of varying length

    parts = split_batch(Pair(x, y), 3)
    assert [type(p) for p in parts] == [Pair] * 3 and [len(p.y) for p in parts] == sizes
    assert torch.equal(torch.cat([p.x for p in parts]), x) and parts[1].x.data_ptr() == x[3:].data_ptr()  # views

    parts = split_batch(Batch(x, names, 0.5), 3)
    assert [type(p) for p in parts] == [Batch] * 3 and [p.scale for p in parts] == [0.5] * 3
    assert sum((p.names for p in parts), []) == names and [len(p.names) for p in parts] == sizes

    d = defaultdict(list, {"x": x, "name": names, "mask": mask, "ragged": ragged, "fields": [x, y], "n": 7})
    parts = split_batch(d, 3)
    assert all(type(p) is defaultdict and p.default_factory is list for p in parts)
    assert [p["name"] for p in parts] == [names[:3], names[3:5], names[5:]]
    assert all(p["mask"] is mask and p["n"] == 7 for p in parts)
    assert [len(p["ragged"]) for p in parts] == sizes and parts[2]["ragged"][1] is ragged[6]
    assert [[len(f) for f in p["fields"]] for p in parts] == [[s, s] for s in sizes]  # a list of the batch's fields

    # default_collate's list for a tuple sample (x, y, name), here with as many fields as samples
    parts = split_batch([x[:3], y[:3], names[:3]], 3)
    assert [[len(f) for f in p] for p in parts] == [[1, 1, 1]] * 3 and parts[2][2] == ["s2"]

    parts = split_batch(Encoding(input_ids=x.long(), attention_mask=torch.ones(7, 2)), 2)
    assert [type(p) for p in parts] == [Encoding] * 2 and [len(p["input_ids"]) for p in parts] == [4, 3]


class _OwnBatch:
    """A batch class of the user's (a graph library's, a hand-written one): tensors in attributes, ``to()``."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def to(self, device):
        return _OwnBatch(self.x.to(device), self.y.to(device))


def test_a_batch_without_a_batch_dimension_is_named():
    with pytest.raises(ValueError, match=r"the dict holds no tensor with a batch dimension"):
        split_batch({"name": ["a", "b"], "n": torch.tensor(2)}, 2)
    # its tensors are attributes nothing walks: said so, with what to return instead (until 2026-12-07: "cannot
    # split a batch without tensors")
    with pytest.raises(ValueError, match=r"the _OwnBatch is not a structure the pipeline walks .*dataclass"):
        split_batch(_OwnBatch(torch.ones(4, 2), torch.ones(4)), 2)


Named = namedtuple("Named", ["x", "y", "name"])


class _NamedSamples(Dataset):
    """Samples as namedtuples with a name: collated into ``Named(x [B, 1, 28, 28], y [B], name [B strings])``."""

    def __init__(self, n: int) -> None:
        self.base = mnist_like(n, seed=1)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Named:
        return Named(*self.base[i], f"img_{i}")


class _WeighsByName(MNISTClassifier):
    def training_step(self, batch: Named, batch_idx: int) -> torch.Tensor:
        weight = torch.tensor([2.0 if int(n[4:]) % 3 else 1.0 for n in batch.name], dtype=batch.x.dtype)
        return (F.cross_entropy(self(batch.x), batch.y, reduction="none") * weight).mean()


def _fit(strategy, devices: int, shuffle: bool) -> torch.Tensor:
    pl.seed_everything(SEED)
    model, ds = _WeighsByName(optimizer="adam", lr=0.01), _NamedSamples(GLOBAL_BATCH * 3)
    sampler = None if shuffle else DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true")
    t.fit(model, DataLoader(ds, batch_size=GLOBAL_BATCH, shuffle=shuffle, sampler=sampler))
    return flat_params(model)


def test_a_namedtuple_batch_with_per_sample_names_trains_as_in_one_process():
    one = _fit("auto", 1, shuffle=False)
    ours = _fit(SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4), 2, shuffle=True)
    assert torch.allclose(ours, one, rtol=0, atol=1e-10), (ours - one).abs().max()
