"""Small builders shared by the strategy tests: synthetic MNIST-shaped data, trainers, references."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_shm import SHMDDPStrategy, SHMFSDPStrategy, SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
             num_sanity_val_steps=0, accelerator="cpu")


def mnist_like(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


class PerRankDraws(torch.utils.data.Dataset):
    """``ds`` with each sample transformed by draws from a generator seeded by (global rank, index) -- what
    loader workers seeded by ``seed_everything(workers=True)`` (seed, worker id *and* global rank) draw for
    random augmentations. One process draws rank 0's."""

    def __init__(self, ds: torch.utils.data.Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from lightning.pytorch.utilities import rank_zero_only

        x, y = self.ds[i]
        return self.draw(x, y, torch.Generator().manual_seed(1000 * rank_zero_only.rank + i))

    def draw(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class KeepsWarnings:
    """A LightningModule mixin: the warnings raised in this process (a worker: rank 0 is where the strategies warn)
    from ``on_train_start`` to ``on_train_end``, in ``self._caught``, for the module to log what it saw."""

    def on_train_start(self) -> None:
        self._recording = warnings.catch_warnings(record=True)
        self._caught = self._recording.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self) -> None:
        self._recording.__exit__(None, None, None)

class MeanOverTokens(torch.nn.Module):
    """``[B, T, D] -> [B, D]``: the pooling between a token model's layers and its classifier head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


class InBatchNegatives(pl.LightningModule):
    """A SimCLR-style loss: each row's positive is its other view among the rows every data-parallel rank gathers
    with ``self.all_gather(..., sync_grads=True)``; the other rows are its negatives (logged as ``negatives``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.LayerNorm(32),
                                       torch.nn.ReLU(), torch.nn.Linear(32, 16))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        views = torch.nn.functional.normalize(self.net(torch.cat([x + 0.1 * torch.sin(37 * x), x.flip(-1)])), dim=1)
        anchors, positives = views.chunk(2)
        keys = self.all_gather(positives, sync_grads=True).reshape(-1, positives.shape[-1])  # data-parallel ranks'
        rank = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"rank": 0}
        labels = torch.arange(len(anchors)) + rank["rank"] * len(anchors)
        self.log("negatives", float(len(keys) - 1), reduce_fx="max")
        return torch.nn.functional.cross_entropy(anchors @ keys.T / 0.1, labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class SeenCount(nn.Module):
    """Counts the samples it sees in training, in a buffer updated in place (as a running statistic is); centres
    its input on a running mean it *reassigns* (as a custom normaliser may); and after a warm-up of 12 samples
    shifts it by a buffer it moves in place -- one the first checkpointed forward sees unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("shift", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if self.seen > 12:
                self.shift.mul_(0.5).add_(x.detach().mean())
            self.seen += x.shape[0]
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean()
        return x - self.mean - self.shift


def small_cnn_with_buffers(**kw: Any) -> MNISTClassifier:
    """A small CNN whose forward updates buffers every way a replay must not repeat: :class:`SeenCount` first, a
    spectral_norm on the first convolution (its power iteration), BatchNorm's running statistics."""
    model = MNISTClassifier(arch="cnn", channels=(4, 8), cnn_hidden=16, **kw)
    model.net.insert(0, SeenCount())
    nn.utils.parametrizations.spectral_norm(model.net[1])
    return model


def loader(ds: TensorDataset, batch_size: int, shuffle: bool = True) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle)


def reference_loader(ds: TensorDataset, global_batch: int, seed: int) -> DataLoader:
    """The permutation Lightning's DistributedSampler uses, consumed by one process in global batches.

    Rank r of W takes indices[r::W]; its i-th batch of b holds indices[(i*b + j)*W + r], so the union
    over ranks of step i is indices[i*W*b:(i+1)*W*b] -- one global batch of the single process.
    """
    return DataLoader(ds, batch_size=global_batch,
                      sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=seed))


def trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(**{**QUIET, **kwargs})


def fit_seeded(make_model: Callable[[], pl.LightningModule], strategy: Any, devices: int, batch: int, *,
               ref: bool = False, samples: int = 0, validate: bool = False, ckpt_path: Optional[str] = None,
               **trainer_kw: Any) -> tuple[pl.Trainer, pl.LightningModule]:
    """One seeded float64 fit of ``make_model()`` on ``samples`` synthetic samples (default 2 global batches) in
    batches of ``batch`` per data-parallel rank (``ref``: one process in the distributed sampler's order); with
    ``validate`` the same loader validates; ``ckpt_path``: resumed from there. Returns the trainer and the model,
    for what a test reads of them."""
    pl.seed_everything(SEED)
    model = make_model()
    ds = mnist_like(samples or GLOBAL_BATCH * 2, seed=1)
    dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
    t = trainer(**{"strategy": strategy, "devices": devices, "max_epochs": 1, "precision": "64-true", **trainer_kw})
    t.fit(model, dl, dl if validate else None, ckpt_path=ckpt_path)
    return t, model


def logged_floats(t: pl.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in t.callback_metrics.items()}


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# ---------------------------------------------------------------------- parity runs
SEED = 7
GLOBAL_BATCH = 24
STEPS = 5
# Adam divides by sqrt(v): for a gradient that is ~0 by cancellation, float32 rounding differences
# between "mean of 24" and "mean of W means" flip its update (seen: 1 of 218,698 weights off by 5e-5).
# That is arithmetic, not an algorithm difference, so Adam parity runs in float64 where any real
# mismatch (wrong averaging, missed sync, other samples) still shows up orders of magnitude above 1e-5.
PRECISION = {"sgd": "32-true", "adam": "64-true"}


def train_mnist(strategy: Any, devices: int, optimizer: str, *, batch: int, model_cls: Any = None, ref: bool = False,
                accumulate: int = 1, samples: Optional[int] = None, buffers: bool = False,
                data: Optional[Callable[[TensorDataset], Any]] = None, **kw: Any) -> torch.Tensor:
    """Train the MNIST module on GLOBAL_BATCH * STEPS synthetic samples (or ``samples``); return its flat weights
    (float64), followed by its buffers (BatchNorm statistics) with ``buffers=True``.

    ``ref=True`` makes one process iterate the distributed sampler's permutation in batches of ``batch``;
    ``data`` wraps the synthetic dataset (e.g. an augmentation).
    """
    pl.seed_everything(SEED)
    model = (model_cls or MNISTClassifier)(optimizer=optimizer, lr=0.01 if optimizer != "sgd" else 0.1)
    ds = mnist_like(samples or GLOBAL_BATCH * STEPS * accumulate, seed=1)
    ds = data(ds) if data is not None else ds
    dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
    t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision=PRECISION[optimizer],
                accumulate_grad_batches=accumulate, **kw)
    t.fit(model, dl)
    flat = flat_params(model).double()
    if buffers:
        flat = torch.cat([flat] + [b.detach().double().reshape(-1) for b in model.buffers()])
    return flat


# Layouts a parity test runs a model under: name -> (strategy factory, devices, data-parallel ranks).
# Each rank's batch is the global batch divided by the data-parallel ranks.
LAYOUTS: dict[str, tuple[Callable[[], Any], int, int]] = {
    "ddp": (lambda: SHMDDPStrategy(start_method="fork"), 2, 2),
    "fsdp": (lambda: SHMFSDPStrategy(start_method="fork"), 2, 2),
    "fsdp-copy": (lambda: SHMFSDPStrategy(start_method="fork", gather="copy"), 2, 2),
    "tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1),
    "pp2-1f1b": (lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4), 2, 1),
    "pp2-zero-bubble": (lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4,
                                            schedule="zero_bubble"), 2, 1),
    "dp2xpp2-shard": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, pipeline_parallel_size=2,
                                               data_parallel="shard", microbatches=2), 4, 2),
}


def layouts(*names: str) -> dict[str, tuple[Callable[[], Any], int, int]]:
    return {n: LAYOUTS[n] for n in names}


class SchedClassifier(MNISTClassifier):
    """The MNIST module plus an LR schedule, so schedulers are part of the parity checks."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


class StepsEveryOptimizer(MNISTClassifier):
    """Manual optimization: one loss, every optimizer of ``configure_optimizers`` zeroed and stepped on it (the
    way two optimizers over parts of a model -- Muon beside AdamW, SparseAdam beside Adam -- are driven)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        return loss


class CompiledClassifier(MNISTClassifier):
    """The MNIST module with its Sequential compiled (dynamo traces it; the eager backend runs the graph)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = torch.compile(self.net, backend="eager")


# ---------------------------------------------------------------------- checkpoint / resume runs
def fit_adam64(strategy: Any, devices: int, epochs: int, batch: int, ds: TensorDataset, *, ckpt_dir: Any = None,
               ckpt_path: Any = None, monitor: Optional[str] = None) -> tuple[torch.Tensor, Optional[str]]:
    """Adam in float64 from seed 1: the runs the checkpoint tests compare (uninterrupted vs. resumed).

    ``ckpt_dir`` saves a checkpoint (``monitor``: on that validation value, with EarlyStopping
    watching it too); returns the trained weights and the checkpoint path.
    """
    pl.seed_everything(1)
    model = MNISTClassifier(optimizer="adam", lr=1e-3)
    callbacks: list[Any] = []
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, monitor=monitor))
        if monitor:
            callbacks.append(EarlyStopping(monitor, patience=5))
    val = DataLoader(ds, batch_size=batch) if monitor else None
    t = trainer(strategy=strategy, devices=devices, max_epochs=epochs, enable_checkpointing=bool(callbacks),
                callbacks=callbacks, precision="64-true", limit_val_batches=1 if monitor else 0)
    t.fit(model, loader(ds, batch), val, ckpt_path=ckpt_path)
    return flat_params(model).double(), (callbacks[0].best_model_path if callbacks else None)


def check_plain_checkpoint(path: str) -> tuple[dict[str, Any], MNISTClassifier, torch.optim.Adam]:
    """A checkpoint of a sharded strategy must look like one process wrote it: plain keys and shapes,
    an optimizer state a plain Adam loads, ``load_from_checkpoint`` in a single process."""
    ckpt = torch.load(path, weights_only=False)
    plain = MNISTClassifier()
    assert list(ckpt["state_dict"]) == list(plain.state_dict())
    assert all(ckpt["state_dict"][k].shape == v.shape for k, v in plain.state_dict().items())
    adam = torch.optim.Adam(plain.parameters(), lr=1e-3)
    adam.load_state_dict(ckpt["optimizer_states"][0])
    single = MNISTClassifier.load_from_checkpoint(path)
    torch.testing.assert_close(single.state_dict()["net.1.weight"], ckpt["state_dict"]["net.1.weight"].float())
    return ckpt, plain, adam
