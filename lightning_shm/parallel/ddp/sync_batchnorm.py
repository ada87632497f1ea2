"""SyncBatchNorm over a shared-memory group: batch statistics of the global batch, on CPU.

torch's own ``SyncBatchNorm`` refuses CPU modules ("SyncBatchNorm layers only work with GPU
modules"), so Lightning's CPU strategies cannot synchronise BatchNorm at all. Here, per channel
(training mode; the data-parallel ranks each hold a part of the batch)::

    forward   rank r: count n_r, mean m_r, M2_r = sum((x - m_r)^2)         [3, C] in float64
              all-gather over the group, Chan merge: mean, var = M2 / N   (as one process computes
              them on the global batch; M2 never forms E[x^2] - E[x]^2)
              y = (x - mean) / sqrt(var + eps) * w + b
              running stats: momentum update with the unbiased global variance M2 / (N - 1)
    backward  all-reduce of two per-channel sums over the global batch,   [2, C]
                  sum(dy), sum(dy * x_hat)
              dx = w * rstd * (dy - sum(dy) / N - x_hat * sum(dy * x_hat) / N)
              dw, db: local sums; the data-parallel gradient average adds them up, as for any weight

Each rank's loss is the mean over its own samples and the data-parallel average divides by W
again, exactly as torch's DDP + SyncBatchNorm do, so the result equals one process on the global
batch. Evaluation uses the running statistics, with no communication.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.utils import parametrize

from lightning_shm.parallel.replaced import carry_over_module
from lightning_shm.runtime import Group


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                bn: "SyncBatchNorm") -> torch.Tensor:  # type: ignore[override]
        C = x.shape[1]
        xc = x.transpose(0, 1).reshape(C, -1)  # [C, n]: this rank's samples of each channel
        n_local = xc.shape[1]
        local = xc.double()
        mean_r = local.mean(1)
        m2_r = (local - mean_r[:, None]).pow(2).sum(1)
        stats = bn.group.all_gather(torch.stack([torch.full_like(mean_r, n_local), mean_r, m2_r]))  # [W, 3, C]
        n = stats[:, 0]
        total = n.sum(0)
        mean = (n * stats[:, 1]).sum(0) / total
        m2 = stats[:, 2].sum(0) + (n * (stats[:, 1] - mean).pow(2)).sum(0)
        var = m2 / total
        bn.update_running_stats(mean, m2 / (total - 1).clamp(min=1))
        rstd = torch.rsqrt(var + bn.eps)
        shape = (1, C) + (1,) * (x.dim() - 2)
        x_hat = ((x.double() - mean.view(shape)) * rstd.view(shape)).to(x.dtype)
        y = x_hat if weight is None else x_hat * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x_hat, rstd.to(x.dtype), weight)
        ctx.group, ctx.total = bn.group, float(total[0])
        return y

    @staticmethod
    @once_differentiable  # its collectives write in place: no double backward (said, not wrong)
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_hat, rstd, weight = ctx.saved_tensors
        C = dy.shape[1]
        shape = (1, C) + (1,) * (dy.dim() - 2)
        dims = [0] + list(range(2, dy.dim()))
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * x_hat).sum(dims)
        dx = None
        if ctx.needs_input_grad[0]:
            sums = ctx.group.all_reduce(torch.stack([sum_dy, sum_dy_xhat]).double(), "sum").to(dy.dtype)
            g = rstd if weight is None else rstd * weight
            dx = g.view(shape) * (dy - (sums[0] / ctx.total).view(shape) - x_hat * (sums[1] / ctx.total).view(shape))
        dw = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        db = sum_dy if ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm (any number of spatial dims) whose training statistics span ``group``'s global batch."""

    def __init__(self, num_features: int, group: Group, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.group = group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input (got {x.dim()}-D)")

    def update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        if not (self.training and self.track_running_stats):
            return
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
            self.running_var.mul_(1 - m).add_(unbiased_var.to(self.running_var.dtype), alpha=m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if self.training or not self.track_running_stats:
            return _SyncBatchNormFn.apply(x, self.weight, self.bias, self)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group={list(self.group.ranks)}"


def _carry_parametrizations(old: nn.Module, new: nn.Module) -> None:
    """``old``'s parametrizations (a weight kept positive through softplus, say) on ``new`` too, with the same
    trained originals: the copy above gave ``new`` the computed values as plain tensors, so the constraint would
    stop applying and the checkpoint's ``parametrizations.weight.original`` go missing."""
    if not parametrize.is_parametrized(old):
        return
    for name, chain in old.parametrizations.items():
        for fn in chain:
            parametrize.register_parametrization(new, name, fn, unsafe=True)
        mine = new.parametrizations[name]
        with torch.no_grad():
            for key, t in [*chain.named_parameters(recurse=False), *chain.named_buffers(recurse=False)]:
                getattr(mine, key).copy_(t)
                getattr(mine, key).requires_grad_(t.requires_grad)


def convert_sync_batchnorm(module: nn.Module, group: Group,
                           kinds: tuple[type, ...] = (nn.modules.batchnorm._BatchNorm,),
                           _done: Optional[dict[int, nn.Module]] = None) -> nn.Module:
    """Replace every BatchNorm in ``module`` (in place; returns it, or its replacement when it is one)
    by a :class:`SyncBatchNorm` over ``group`` holding the same parameters and buffers. A BatchNorm
    placed at several positions (a shared layer) becomes one SyncBatchNorm at all of them: children
    are walked by position (``named_children()`` would list it once and leave the others plain).
    ``kinds``: the BatchNorm classes to replace (``(nn.SyncBatchNorm,)``: those the user converted with torch)."""
    done: dict[int, nn.Module] = {} if _done is None else _done
    if id(module) in done:
        return done[id(module)]
    if isinstance(module, kinds) and isinstance(module, nn.modules.batchnorm._BatchNorm) \
            and not isinstance(module, SyncBatchNorm):
        new = SyncBatchNorm(module.num_features, group, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
        dtype = next((t.dtype for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()), None)
        if dtype is not None:  # the precision plugin converted the model before (64-true, bf16-true)
            new.to(dtype=dtype)
        with torch.no_grad():
            for name in ("weight", "bias"):
                if getattr(module, name) is not None:
                    getattr(new, name).copy_(getattr(module, name))
                    getattr(new, name).requires_grad_(getattr(module, name).requires_grad)
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                if getattr(module, name) is not None:
                    getattr(new, name).copy_(getattr(module, name))
        _carry_parametrizations(module, new)
        new.train(module.training)
        carry_over_module(module, new)  # the model's hooks on the layer (state-dict ones too) and its attributes
        done[id(module)] = new
        return new
    done[id(module)] = module
    for name, child in list(module._modules.items()):
        if child is not None:
            new = convert_sync_batchnorm(child, group, kinds, done)
            if new is not child:
                setattr(module, name, new)
    return module
