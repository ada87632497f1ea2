"""Megatron's conjugate communication operators for tensor parallelism (its ``f`` and ``g``).

Named for what they do forward and backward::

    copy_to_tp(x)       forward: identity          backward: all-reduce(sum)   -- before a column layer
    reduce_from_tp(x)   forward: all-reduce(sum)   backward: identity          -- after a row layer

Why: a column-parallel layer gives every rank a slice of the outputs computed from the *whole*
input, so the gradient w.r.t. that input is the sum of every rank's contribution (``f``'s
backward). A row-parallel layer gives every rank a partial sum of the output, which must be summed
forward (``g``); its gradient is already the full output gradient on every rank.

``copy_to_tp`` skips its backward all-reduce entirely when the input needs no gradient (e.g. the
pixels entering the first layer): autograd never calls a backward nobody needs.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_shm.runtime import Group


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return ctx.group.all_reduce(grad.contiguous().clone(), "sum"), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:  # type: ignore[override]
        return group.all_reduce(x.contiguous().clone(), "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron ``f``)."""
    if group.size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward, identity backward (Megatron ``g``)."""
    if group.size == 1:
        return x
    if not (torch.is_grad_enabled() and x.requires_grad):
        return group.all_reduce(x.contiguous().clone(), "sum")
    return _ReduceFromTensorParallel.apply(x, group)
