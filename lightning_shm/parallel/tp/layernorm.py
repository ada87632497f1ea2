"""LayerNorm over a feature dimension that is split across tensor-parallel ranks.

In the reference network a LayerNorm sits between a column- and a row-parallel Linear, so each
rank holds only ``H_r`` of the ``N = sum(H_r)`` features of every sample. Gathering the activation
(what DTensor does) would move ``N`` floats per sample; the statistics need 2.

Forward, per sample (row)::

    rank r:  n_r = H_r,  m_r = mean(x_r),  M2_r = sum((x_r - m_r)^2)      (float64)
    all-gather (m_r, M2_r) over the group                                 [W, 2, rows]
    merge (Chan et al.):  mean = sum(n_r m_r) / N
                          M2   = sum(M2_r) + sum(n_r (m_r - mean)^2)
    y_r = (x_r - mean) / sqrt(M2 / N + eps) * w_r + b_r                   (w, b sharded like x)

Each rank's M2_r is taken around its own mean, and the merge only adds squared differences of
means, so a large common offset (inputs around 1e4) never cancels catastrophically as
``E[x^2] - E[x]^2`` would.

Backward, with x_hat the normalised input and g = dy * w (all local)::

    dx_r = rstd * (g_r - mean_N(g) - x_hat_r * mean_N(g * x_hat))

needs the two per-sample sums over *all* features -> one all-reduce of ``[2, rows]``; the weight
and bias gradients are local (they are sharded with the features). No all-reduce is issued when
the input needs no gradient.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_shm.runtime import Group


class _DistributedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, group: Group,
                sizes: Sequence[int]) -> torch.Tensor:  # type: ignore[override]
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).double()
        m_r = rows.mean(dim=-1)
        m2_r = (rows - m_r[:, None]).pow(2).sum(dim=-1)
        stats = group.all_gather(torch.stack([m_r, m2_r]))  # [W, 2, rows]
        n = torch.tensor(list(sizes), dtype=torch.float64)[:, None]
        total = float(sum(sizes))
        mean = (n * stats[:, 0]).sum(0) / total
        m2 = stats[:, 1].sum(0) + (n * (stats[:, 0] - mean).pow(2)).sum(0)
        rstd = torch.rsqrt(m2 / total + eps)
        x_hat = (rows - mean[:, None]) * rstd[:, None]
        y = x_hat * weight.double() + bias.double()
        ctx.save_for_backward(x_hat, rstd, weight)
        ctx.group, ctx.total, ctx.shape = group, total, shape
        return y.to(x.dtype).view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_hat, rstd, weight = ctx.saved_tensors
        dy_rows = dy.reshape(-1, ctx.shape[-1]).double()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            g = dy_rows * weight.double()
            sums = ctx.group.all_reduce(torch.stack([g.sum(-1), (g * x_hat).sum(-1)]), "sum")  # [2, rows]
            dx = rstd[:, None] * (g - sums[0][:, None] / ctx.total - x_hat * sums[1][:, None] / ctx.total)
            dx = dx.to(dy.dtype).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            dw = (dy_rows * x_hat).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            db = dy_rows.sum(0).to(weight.dtype)
        return dx, dw, db, None, None, None


def distributed_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, group: Group,
                           sizes: Sequence[int]) -> torch.Tensor:
    """LayerNorm of ``x [..., sizes[group.index]]`` over all ``sum(sizes)`` features of the group."""
    if x.shape[-1] != sizes[group.index]:
        raise ValueError(f"input has {x.shape[-1]} features, this rank's shard is {sizes[group.index]} "
                         f"(sizes {list(sizes)})")
    return _DistributedLayerNorm.apply(x, weight, bias, eps, group, list(sizes))
