"""Tensor-parallel layers, each built from the full (unsharded) layer of rank 0's initialisation.

Which rank holds which slice (tp=2, Linear(784, 256) -> LayerNorm(256) -> ReLU -> Linear(256, 64))::

    ColumnParallelLinear   W [256, 784]: rank 0 rows 0..127, rank 1 rows 128..255; bias split alike
                           in: x [B, 784] on both ranks           out: y_r [B, 128]
    ShardedLayerNorm       w, b [256]: rank 0 0..127, rank 1 128..255 (sharded with the features)
    ReLU                   elementwise, runs on the shard unchanged
    RowParallelLinear      W [64, 256]: rank 0 columns 0..127, rank 1 columns 128..255; bias [64] replicated
                           in: y_r [B, 128]      partial [B, 64] --all-reduce--> out [B, 64] on both

Uneven splits are allowed: with N features and tp ranks the first N % tp ranks get one more.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shm.parallel.tp.layernorm import distributed_layer_norm
from lightning_shm.parallel.tp.mappings import copy_to_tp, reduce_from_tp
from lightning_shm.runtime import Group, even_split


def _slice(t: Optional[torch.Tensor], dim: int, sizes: list[int], index: int) -> Optional[nn.Parameter]:
    if t is None:
        return None
    lo = sum(sizes[:index])
    return nn.Parameter(t.detach().narrow(dim, lo, sizes[index]).clone(), requires_grad=t.requires_grad)


class ColumnParallelLinear(nn.Module):
    """Output features split across the group; input replicated. Output stays sharded."""

    split_dims = {"weight": 0, "bias": 0}

    def __init__(self, full: nn.Linear, group: Group) -> None:
        super().__init__()
        self.group = group
        self.in_features, self.full_out_features = full.in_features, full.out_features
        self.sizes = even_split_sizes(full.out_features, group.size)
        self.out_features = self.sizes[group.index]
        self.weight = _slice(full.weight, 0, self.sizes, group.index)
        self.bias = _slice(full.bias, 0, self.sizes, group.index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} of {self.full_out_features}, tp={self.group.size}"


class RowParallelLinear(nn.Module):
    """Input features split across the group; partial outputs summed by an all-reduce; bias replicated."""

    split_dims = {"weight": 1, "bias": None}

    def __init__(self, full: nn.Linear, group: Group) -> None:
        super().__init__()
        self.group = group
        self.full_in_features, self.out_features = full.in_features, full.out_features
        self.sizes = even_split_sizes(full.in_features, group.size)
        self.in_features = self.sizes[group.index]
        self.weight = _slice(full.weight, 1, self.sizes, group.index)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features} of {self.full_in_features}, out={self.out_features}, tp={self.group.size}"


class ShardedLayerNorm(nn.Module):
    """LayerNorm whose normalised features are split like the preceding column layer's outputs."""

    split_dims = {"weight": 0, "bias": 0}

    def __init__(self, full: nn.LayerNorm, group: Group, sizes: list[int]) -> None:
        super().__init__()
        if len(full.normalized_shape) != 1 or not full.elementwise_affine or full.bias is None:
            raise ValueError(f"only LayerNorm over one dimension with weight and bias can be sharded, got {full}")
        if full.normalized_shape[0] != sum(sizes):
            raise ValueError(f"LayerNorm over {full.normalized_shape[0]} features follows a column layer with "
                             f"{sum(sizes)} outputs")
        self.group, self.sizes, self.eps = group, list(sizes), full.eps
        self.weight = _slice(full.weight, 0, self.sizes, group.index)
        self.bias = _slice(full.bias, 0, self.sizes, group.index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return distributed_layer_norm(x, self.weight, self.bias, self.eps, self.group, self.sizes)

    def extra_repr(self) -> str:
        return f"{self.sizes[self.group.index]} of {sum(self.sizes)} features, eps={self.eps}, tp={self.group.size}"


def even_split_sizes(n: int, parts: int) -> list[int]:
    b = even_split(n, parts)
    return [b[i + 1] - b[i] for i in range(parts)]
