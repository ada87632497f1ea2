"""Small builders shared by the strategy tests: synthetic MNIST-shaped data, trainers, references."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
             num_sanity_val_steps=0, accelerator="cpu")


def mnist_like(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


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


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])
