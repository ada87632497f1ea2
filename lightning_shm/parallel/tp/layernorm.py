"""LayerNorm over a feature dimension that is split across tensor-parallel ranks.

In the reference network a LayerNorm sits between a column- and a row-parallel Linear, so each
rank holds only ``H_r`` of the ``N = sum(H_r)`` features of every sample. Gathering the activation
(what DTensor does) would move ``N`` floats per sample; the statistics need 2.

Forward, per sample (row)::

    rank r:  n_r = H_r,  m_r = mean(x_r),  M2_r = sum((x_r - m_r)^2)      (see below)
    all-gather (m_r, M2_r) over the group                                 [W, 2, rows]
    merge (Chan et al.):  mean = sum(n_r m_r) / N
                          M2   = sum(M2_r) + sum(n_r (m_r - mean)^2)
    y_r = (x_r - mean) / sqrt(M2 / N + eps) * w_r + b_r                   (w, b sharded like x)

Each rank's M2_r is taken around its own mean, and the merge only adds squared differences of
means, so a large common offset (inputs around 1e4) never cancels catastrophically as
``E[x^2] - E[x]^2`` would. Only the per-row statistics are float64 (m_r summed in float64, then
``x_r - m_r`` taken in two float32 steps -- minus m_r rounded, minus the rounding --, so it is accurate
to float32 at any offset); the [rows, H_r] work stays in float32 in a few fused ops (``vecdot``,
``addcmul``): 0.36 ms instead of 0.41-0.45 ms forward + backward on [256, 128] with everything
float64 (single-thread micro-benchmark, collectives stubbed).

Backward, with x_hat the normalised input and g = dy * w (all local)::

    dx_r = rstd * (g_r - mean_N(g) - x_hat_r * mean_N(g * x_hat))

needs the two per-sample sums over *all* features -> one all-reduce of ``[2, rows]``; the weight
and bias gradients are local (they are sharded with the features). No all-reduce is issued when
the input needs no gradient.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.linalg import vecdot

from lightning_shm.runtime import Group


class _DistributedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, group: Group,
                sizes: Sequence[int]) -> torch.Tensor:  # type: ignore[override]
        shape = x.shape
        ct = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32  # compute dtype
        rows = x.reshape(-1, shape[-1]).to(ct)
        m_r = rows.sum(-1, dtype=torch.float64).div_(sizes[group.index])  # float64: exact at any offset
        hi = m_r.to(ct)
        d = rows - hi[:, None]  # x - m_r in two steps: the rounding of m_r to ct is subtracted too
        d.sub_((m_r - hi.double()).to(ct)[:, None])
        stats = group.all_gather(torch.stack([m_r, vecdot(d, d).double()]))  # [W, 2, rows]
        n = torch.tensor(list(sizes), dtype=torch.float64)[:, None]
        total = float(sum(sizes))
        mean = (n * stats[:, 0]).sum(0).div_(total)
        m2 = stats[:, 1].sum(0) + (n * (stats[:, 0] - mean).pow(2)).sum(0)
        rstd = torch.rsqrt(m2.div_(total).add_(eps))
        shift = ((m_r - mean) * rstd).to(ct)[:, None]  # x_hat = (x - m_r) * rstd + (m_r - mean) * rstd
        rstd = rstd.to(ct)[:, None]
        x_hat = torch.addcmul(shift, d, rstd)
        w = weight.to(ct)
        y = torch.addcmul(bias.to(ct), x_hat, w)
        ctx.save_for_backward(x_hat, rstd, w)
        ctx.group, ctx.total, ctx.shape, ctx.wdtype = group, total, shape, weight.dtype
        return y.to(x.dtype).view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_hat, rstd, w = ctx.saved_tensors
        dy_rows = dy.reshape(-1, ctx.shape[-1]).to(x_hat.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            g = dy_rows * w
            sums = ctx.group.all_reduce(torch.stack([g.sum(-1, dtype=torch.float64),
                                                     vecdot(g, x_hat).double()]), "sum")  # [2, rows]
            c = sums.div_(ctx.total).to(x_hat.dtype)
            dx = torch.addcmul(g.sub_(c[0][:, None]), x_hat, c[1][:, None], value=-1).mul_(rstd)
            dx = dx.to(dy.dtype).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            dw = (dy_rows * x_hat).sum(0, dtype=torch.float64).to(ctx.wdtype)
        if ctx.needs_input_grad[2]:
            db = dy_rows.sum(0, dtype=torch.float64).to(ctx.wdtype)
        return dx, dw, db, None, None, None


def distributed_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, group: Group,
                           sizes: Sequence[int]) -> torch.Tensor:
    """LayerNorm of ``x [..., sizes[group.index]]`` over all ``sum(sizes)`` features of the group."""
    if x.shape[-1] != sizes[group.index]:
        raise ValueError(f"input has {x.shape[-1]} features, this rank's shard is {sizes[group.index]} "
                         f"(sizes {list(sizes)})")
    return _DistributedLayerNorm.apply(x, weight, bias, eps, group, list(sizes))
