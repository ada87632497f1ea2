"""Megatron's conjugate communication operators for tensor parallelism (its ``f`` and ``g``).

Named for what they do forward and backward::

    copy_to_tp(x)       forward: identity          backward: all-reduce(sum)   -- before a column layer
    reduce_from_tp(x)   forward: all-reduce(sum)   backward: identity          -- after a row layer
    gather_from_tp(y)   forward: all-gather(features)  backward: my slice      -- after a gathered column layer
    split_to_tp(y)      forward: my slice              backward: all-gather    -- gather_from_tp's backward

Why: a column-parallel layer gives every rank a slice of the outputs computed from the *whole*
input, so the gradient w.r.t. that input is the sum of every rank's contribution (``f``'s
backward). A row-parallel layer gives every rank a partial sum of the output, which must be summed
forward (``g``); its gradient is already the full output gradient on every rank.

``gather_from_tp`` is Megatron's ``gather_output``: every rank concatenates the members' output
features, ``[..., H_r]`` -> ``[..., sum(H_j)]``, so what follows runs replicated. Its backward needs
no communication: every rank computes the same replicated layers on the same batch, so each holds
the *whole* output gradient and keeps its own features' columns.

``copy_to_tp`` skips its backward all-reduce entirely when the input needs no gradient (e.g. the
pixels entering the first layer): autograd never calls a backward nobody needs. Each backward is
the conjugate operator itself (``f``'s is ``g``, ``g``'s is ``f``, ``gather_from_tp``'s is ``split_to_tp``),
so a double backward (a gradient penalty on the input, ``create_graph=True``) differentiates through
them as through one process's sum and slice -- the raw all-reduce writes with ``out=`` and failed
there, and a plain identity or slice kept only this rank's part of the second-order gradient.
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
        return reduce_from_tp(grad, ctx.group), None  # g: a double backward (a gradient penalty) goes through it


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return group.all_reduce(x.contiguous().clone(), "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return copy_to_tp(grad, ctx.group), None  # f: identity, and its own backward sums (double backward)


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.sizes = group, sizes
        return _gather_features(y, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return split_to_tp(grad, ctx.group, ctx.sizes), None, None


class _SplitToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.sizes = group, sizes
        return _my_features(y, group, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return gather_from_tp(grad, ctx.group, ctx.sizes), None, None


def _my_features(y: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    return y.narrow(-1, sum(sizes[:group.index]), sizes[group.index])


def _gather_features(y: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """``[..., sizes[r]]`` on member r -> ``[..., sum(sizes)]`` on every member, members' features in order."""
    lead = y.shape[:-1]
    if len(set(sizes)) == 1:  # one all-gather [W, ..., H_r], then the members' blocks side by side
        return group.all_gather(y.contiguous()).movedim(0, -2).reshape(*lead, sum(sizes))
    parts = group.all_gather_v(y.reshape(-1))  # uneven split: lengths travel with the data
    return torch.cat([p.view(*lead, n) for p, n in zip(parts, sizes)], dim=-1)


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


def split_to_tp(y: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """This rank's features forward, all-gather backward: ``gather_from_tp``'s backward, itself differentiable."""
    if group.size == 1:
        return y
    if not (torch.is_grad_enabled() and y.requires_grad):
        return _my_features(y, group, sizes)
    return _SplitToTensorParallel.apply(y, group, tuple(sizes))


def gather_from_tp(y: torch.Tensor, group: Group, sizes: tuple[int, ...]) -> torch.Tensor:
    """All-gather of the feature dimension forward, this rank's slice backward (Megatron ``gather_output``)."""
    if group.size == 1:
        return y
    if not (torch.is_grad_enabled() and y.requires_grad):
        return _gather_features(y, group, sizes)
    return _GatherFromTensorParallel.apply(y, group, tuple(sizes))
