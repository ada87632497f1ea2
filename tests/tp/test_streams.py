"""Random draws a model replica's members make apart. The tp group's shared stream is kept one before every
step (``share_stream`` in lightning_shm/parallel/tp/rng.py): draws made outside the model on some members only
-- rank 0 picking samples to log, each member's random augmentations of its own rows under split loading --
must not give the members different dropout masks on the features they all hold. And a loader split over the
members (lightning_shm/parallel/tp/loading.py) must not augment every member's share with the same numbers."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_shm import SHMDDPStrategy, SHMModelParallel, SHMTensorParallel
from lightning_shm.parallel.streams import draws_of, generators_of
from tests.helpers import GLOBAL_BATCH, SEED, flat_params, loader, mnist_like, trainer


class _MnistLike(Dataset):
    """``n`` MNIST-shaped samples (tests/helpers.py); subclasses say what loading one adds."""

    def __init__(self, n: int) -> None:
        self.ds = mnist_like(n, seed=1)

    def __len__(self) -> int:
        return len(self.ds)


class GlobalDraws(_MnistLike):
    """Samples augmented from the default generator, as torchvision's random transforms are: a crop's
    rejection loop drawing a varying number of times, then a flip. Sample 0 is left as it is, so the strategy's
    look at it (tp/loading.py) misses the draws and "auto" splits the loading: each member augments its own rows
    from its stream, which the members' streams then differ by."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.ds[i]
        if i == 0:
            return x, y
        torch.rand(i % 3)
        return (x.flip(-1) if torch.rand(()) < 0.5 else x), y


class DropoutOnReplicatedFeatures(pl.LightningModule):
    """784 -> 32 (column) -> 16 (row) -> dropout -> 10: the dropout acts on features every tp rank holds whole.
    Rank 0 alone draws after each batch (a callback picking images to log). Each rank keeps its masks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 16), nn.Dropout(0.3),
                                 nn.Tanh(), nn.Linear(16, 10))
        self.masks: list[torch.Tensor] = []
        self.net[4].register_forward_hook(lambda m, i, o: self.masks.append(o == 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 0:
            torch.randint(0, 100, (8,))

    def on_train_end(self) -> None:
        out_dir = getattr(self, "out_dir", None)
        if out_dir is not None:
            torch.save(torch.stack(self.masks), out_dir / f"masks{self.global_rank}.pt")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class FetchingItsBatch(DropoutOnReplicatedFeatures):
    """The same, its step fetching the batch itself: the members load (and augment) it inside the step."""

    def training_step(self, dataloader_iter):
        (x, y), _, _ = next(dataloader_iter)
        return F.cross_entropy(self(x.to(self.dtype)), y)


def _fit(strategy, devices: int, batch: int, out_dir=None, fetching: bool = False) -> nn.Module:
    pl.seed_everything(SEED)
    model = FetchingItsBatch() if fetching else DropoutOnReplicatedFeatures()
    model.out_dir = out_dir
    trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true").fit(
        model, loader(GlobalDraws(GLOBAL_BATCH * 3), batch))
    return model


@pytest.mark.parametrize("tp_batch, fetching", [("auto", False), ("broadcast", False), ("auto", True)])
def test_tp_members_drop_the_same_replicated_features_after_draws_apart(tp_batch, fetching, tmp_path):
    # before share_stream: from the first step ("auto" splits the loading, each member augments its own rows)
    # or the second (broadcast: every member loads the whole batch; rank 0's own draw) the masks differed; a step
    # fetching its batch under "auto" loads it after the step's streams were shared, and shares them again
    _fit(SHMTensorParallel(start_method="fork", tensor_parallel_size=2, tp_batch=tp_batch), 2, GLOBAL_BATCH, tmp_path,
         fetching)
    m0, m1 = torch.load(tmp_path / "masks0.pt"), torch.load(tmp_path / "masks1.pt")
    assert m0.shape == (3, GLOBAL_BATCH, 16)
    assert 0.15 < float(m0.double().mean()) < 0.45
    assert torch.equal(m0, m1)


@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2"])
def test_a_replica_loading_on_its_first_member_trains_as_the_data_parallel_ranks_with_their_draws(layout):
    # tp_batch="broadcast": member 0 loads the replica's batch as a data-parallel rank (or one process) does, and
    # every member then draws dropout from its stream -- what shm_ddp's rank computes with, rank 0's draw included
    dp = 2 if layout == "dp2xtp2" else 1
    ref = _fit(SHMDDPStrategy(start_method="fork"), dp, GLOBAL_BATCH // dp)
    got = _fit(SHMModelParallel(start_method="fork", data_parallel_size=dp, tensor_parallel_size=2,
                                tp_batch="broadcast"), 2 * dp, GLOBAL_BATCH // dp)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------- random augmentations at load time
class DrawsAtLoad(_MnistLike):
    """Each sample scaled by ``1 + r``, ``r`` drawn from the default generator after a varying number of other
    draws (a crop's rejection loop); ``r`` is returned too, so a step sees which number each row got."""

    def __getitem__(self, i: int):
        x, y = self.ds[i]
        torch.rand(i % 3)
        r = torch.rand((), dtype=torch.float64)
        return x * (1 + r), y, r


class DrawsFromItsGenerator(DrawsAtLoad):
    """The same, ``r`` drawn from a ``torch.Generator`` the dataset keeps (every member holds a copy of it)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.gen = torch.Generator().manual_seed(5)

    def __getitem__(self, i: int):
        x, y = self.ds[i]
        r = torch.rand((), dtype=torch.float64, generator=self.gen)
        return x * (1 + r), y, r


class KeepsDraws(pl.LightningModule):
    """Saves the ``r`` of every row of every training batch it computes on (``out_dir/draws<rank>.pt``)."""

    def __init__(self, out_dir) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
        self.out_dir, self.draws = out_dir, []

    def training_step(self, batch, batch_idx):
        x, y, r = batch
        self.draws.append(r)
        return F.cross_entropy(self.net(x.to(self.dtype)), y)

    def on_train_end(self) -> None:
        torch.save(torch.stack(self.draws), self.out_dir / f"draws{self.global_rank}.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _draws(strategy, devices: int, out_dir, num_workers: int = 0, dataset=DrawsAtLoad, **kw) -> list[torch.Tensor]:
    """``kw``: the loader's own (persistent_workers) and the Trainer's (max_epochs, use_distributed_sampler)."""
    pl.seed_everything(SEED)
    dl = DataLoader(dataset(GLOBAL_BATCH * 2), batch_size=GLOBAL_BATCH, shuffle=True, num_workers=num_workers,
                    persistent_workers=kw.pop("persistent_workers", False))
    trainer(strategy=strategy, devices=devices, precision="64-true", **{"max_epochs": 1, **kw}).fit(
        KeepsDraws(out_dir), dl)
    return [torch.load(out_dir / f"draws{r}.pt") for r in range(devices)]


@pytest.mark.parametrize("dataset", [DrawsAtLoad, DrawsFromItsGenerator])
def test_auto_loads_a_dataset_drawing_at_load_on_the_first_member_as_one_process(dataset, tmp_path):
    # before: split, each member drew its 12 rows' numbers from the same state -- rows i and i + 12 of every batch
    # scaled alike; now the first look at sample 0 finds the draws and member 0 loads the whole batch
    (ref,) = _draws(SHMDDPStrategy(start_method="fork"), 1, tmp_path, dataset=dataset)
    got = _draws(SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, tmp_path, dataset=dataset)
    assert ref.shape == (2, GLOBAL_BATCH) and len(set(ref.reshape(-1).tolist())) == ref.numel()
    for r in got:
        assert torch.equal(r, ref)


def test_split_refuses_a_dataset_drawing_at_load_in_the_process(tmp_path):
    with pytest.raises(ValueError, match=r"tp_batch='split' cannot split .* draws from random streams "
                                         r"\(torch\) as it loads a sample"):
        _draws(SHMTensorParallel(start_method="fork", tensor_parallel_size=2, tp_batch="split"), 2, tmp_path)


@pytest.mark.parametrize("persistent", [False, True])
def test_each_members_loader_workers_draw_numbers_of_their_own(persistent, tmp_path):
    # every member's worker k was seeded base + k from the same stream: its rows drew member 0's rows' numbers.
    # Over 3 epochs with the loader's own RandomSampler (drawing its order from the default generator): the base
    # seed is drawn where torch draws it -- once with persistent workers -- or the members' orders part
    got = _draws(SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, tmp_path, num_workers=1,
                 persistent_workers=persistent, max_epochs=3, use_distributed_sampler=False)
    assert got[0].shape == (6, GLOBAL_BATCH) and torch.equal(got[0], got[1])  # one gathered batch on both members
    half = GLOBAL_BATCH // 2
    assert len(set(got[0].reshape(-1).tolist())) == got[0].numel()
    assert not torch.equal(got[0][:, :half], got[0][:, half:])


def test_draws_of_names_the_streams_a_call_draws_from_and_puts_them_back():
    import random

    import numpy as np

    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    assert draws_of(lambda: None) == []
    assert draws_of(lambda: (torch.rand(2), np.random.rand())) == ["torch", "numpy"]
    assert draws_of(lambda: random.random()) == ["random"]
    with pytest.raises(KeyError):
        draws_of(lambda: (torch.rand(1), {}[0]))
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()
    # generators an object keeps: torch's, numpy's Generator (PCG64, MT19937) and RandomState
    holder = DrawsFromItsGenerator(2)
    holder.rng, holder.mt = np.random.default_rng(0), np.random.Generator(np.random.MT19937(0))
    holder.legacy, holder.other = np.random.RandomState(0), 3
    kept = generators_of(holder)
    assert [name for name, _, _ in kept] == ["gen", "rng", "mt", "legacy"]
    states = [get() for _, get, _ in kept]
    assert draws_of(lambda: None, kept) == []
    assert draws_of(lambda: (holder[1], holder.mt.random(), holder.legacy.rand()), kept) == ["gen", "mt", "legacy"]
    assert draws_of(lambda: holder.rng.random(), kept) == ["rng"]
    assert torch.equal(holder.gen.get_state(), states[0]) and holder.rng.bit_generator.state == states[1]
    assert (holder.mt.bit_generator.state["state"]["key"] == states[2]["state"]["key"]).all()
    assert (holder.legacy.get_state()[1] == states[3][1]).all()  # each put back


class Indexed(_MnistLike):
    """Each sample with its index, where ``KeepsDraws`` reads a draw."""

    def __getitem__(self, i: int):
        x, y = self.ds[i]
        return x, y, i


class KeepsIndicesDrawingOnRankZero(KeepsDraws):
    """Keeps the sample indices it trains on; rank 0 alone draws as an epoch ends (picking samples to log)."""

    def on_train_epoch_end(self) -> None:
        if self.global_rank == 0:
            torch.randint(0, 100, (8,))


def _indices(strategy, devices: int, out_dir) -> list[torch.Tensor]:
    pl.seed_everything(SEED)
    ds = Indexed(GLOBAL_BATCH * 2)
    sampler = torch.utils.data.WeightedRandomSampler(torch.linspace(0.1, 1.0, len(ds)), len(ds))  # the global stream
    dl = DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=sampler)
    trainer(strategy=strategy, devices=devices, max_epochs=3, precision="64-true").fit(
        KeepsIndicesDrawingOnRankZero(out_dir), dl)
    return [torch.load(out_dir / f"draws{r}.pt") for r in range(devices)]


def test_a_sampler_drawing_from_the_stream_gives_every_member_the_first_members_order(tmp_path):
    # before: rank 0's draw at an epoch's end parted the members' streams, so at the next epoch their samplers drew
    # other orders, and the members' look at their first batches refused the loader ("different first batches")
    (ref,) = _indices(SHMDDPStrategy(start_method="fork"), 1, tmp_path)
    got = _indices(SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, tmp_path)
    assert ref.shape == (6, GLOBAL_BATCH)
    for r in got:
        assert torch.equal(r, ref)


class SamplesInValidation(DropoutOnReplicatedFeatures):
    """Draws in its validation step (sampling from logits, MC dropout) and keeps the draws; rank 0 alone draws
    after each validation batch."""

    def validation_step(self, batch, batch_idx):
        self.masks.append(torch.rand(16) < 0.5)

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        if self.global_rank == 0:
            torch.randint(0, 100, (8,))

    def on_validation_end(self) -> None:
        torch.save(torch.stack(self.masks), self.out_dir / f"val{self.global_rank}.pt")


def test_tp_members_draw_alike_in_evaluation_steps_after_draws_apart(tmp_path):
    # the evaluation steps share member 0's stream as the training steps do (ParallelState.step_scope)
    pl.seed_everything(SEED)
    model = SamplesInValidation()
    model.out_dir = tmp_path
    data = loader(GlobalDraws(GLOBAL_BATCH * 3), GLOBAL_BATCH)
    trainer(strategy=SHMTensorParallel(start_method="fork", tensor_parallel_size=2), devices=2,
            precision="64-true").validate(model, data)
    got = [torch.load(tmp_path / f"val{r}.pt") for r in (0, 1)]
    assert got[0].shape == (3, 16) and 0 < int(got[0].sum()) < got[0].numel() and torch.equal(got[0], got[1])
