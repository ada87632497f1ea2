"""LayerNorm over a feature dimension that is split across tensor-parallel ranks.

In the reference network a LayerNorm sits between a column- and a row-parallel Linear, so each
rank holds only ``H_r`` of the ``N = sum(H_r)`` features of every sample. Gathering the activation
(what DTensor does) would move ``N`` floats per sample; the statistics need 3.

Forward, per sample (row)::

    rank r, [rows, H_r] in the compute dtype (float32 for float32 / bf16 / fp16 input):
        s_r = mean(x_r)   (rounded to the compute dtype: used only as a shift)
        d_r = x_r - s_r,  e_r = mean(d_r),  v_r = mean(d_r^2) - e_r^2   (local mean s_r + e_r, variance v_r)
    all-gather (s_r, e_r, v_r) over the group                         [W, 3, rows], merged in float64:
        m_j = s_j + e_j,  mean = sum(n_j m_j) / N,  var = sum(n_j (v_j + (m_j - mean)^2)) / N   (Chan et al.)
    y_r = (d_r + (m_r - mean) - e_r) * rsqrt(var + eps) * w_r + b_r    (w, b sharded like x)

Why it is accurate at any offset: ``d`` is taken around the rank's own (rounded) mean, so it is
data-scale and ``mean(d^2) - e^2`` cannot cancel (``e`` is only the rounding of ``s``); the large
values ``s_j`` meet each other only in the float64 merge of ``[W, 3, rows]`` numbers. A float32 mean
subtracted directly would be off by its rounding (5e-4 at inputs around 1e4), and ``E[x^2] - E[x]^2``
would cancel catastrophically. The [rows, H_r] work is a few whole-tensor float32 ops, ~3-7 us each
at [256, 128]; no row-broadcast ``addcmul`` (3-4x slower there than ``add_`` then ``mul_``).

Backward, with x_hat the normalised input and g = dy * w (all local)::

    dx_r = rstd * (g_r - mean_N(g) - x_hat_r * mean_N(g * x_hat))

needs the two per-sample sums over *all* features -> one all-reduce of ``[2, rows]``; the weight
and bias gradients are local (they are sharded with the features) and summed over the rows in
float64. No all-reduce is issued when the input needs no gradient.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from torch.autograd.function import once_differentiable
from torch.linalg import vecdot

from lightning_shm.runtime import Group


@functools.lru_cache(maxsize=None)
def _weights(sizes: tuple[int, ...]) -> torch.Tensor:
    """``n_j / N`` per member, float64 (read-only; cached: a tensor built every call costs as much as an op)."""
    return torch.tensor(sizes, dtype=torch.float64) / sum(sizes)


class _DistributedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, group: Group,
                sizes: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        shape, i = x.shape, group.index
        ct = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32  # compute dtype
        rows = x.reshape(-1, shape[-1]).to(ct)
        s = rows.mean(-1)
        d = rows - s[:, None]
        e = d.mean(-1)
        v = torch.addcmul(vecdot(d, d).div_(shape[-1]), e, e, value=-1)
        stats = group.all_gather(torch.stack([s, e, v])).double()  # [W, 3, rows]
        m = stats[:, 0] + stats[:, 1]  # [W, rows]: every member's mean, exact in float64
        wts = _weights(sizes)
        mean = wts @ m
        dm = m.sub_(mean)
        rstd = (wts @ torch.addcmul(stats[:, 2], dm, dm)).add_(eps).rsqrt_().to(ct)
        x_hat = d.add_(dm[i].sub_(stats[i, 1]).to(ct)[:, None]).mul_(rstd[:, None])  # (x - mean) * rstd, in d
        w = weight.to(ct)
        y = torch.addcmul(bias.to(ct), x_hat, w)
        ctx.save_for_backward(x_hat, rstd, w)
        ctx.group, ctx.total, ctx.shape, ctx.wdtype = group, float(sum(sizes)), shape, weight.dtype
        return y.to(x.dtype).view(shape)

    @staticmethod
    @once_differentiable  # its collectives write in place: no double backward (said, not wrong)
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x_hat, rstd, w = ctx.saved_tensors
        dy_rows = dy.reshape(-1, ctx.shape[-1]).to(x_hat.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            g = dy_rows * w
            c = ctx.group.all_reduce(torch.stack([g.sum(-1), vecdot(g, x_hat)]), "sum").div_(ctx.total)  # [2, rows]
            dx = g.sub_(c[0][:, None]).sub_(x_hat * c[1][:, None]).mul_(rstd[:, None])
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
    return _DistributedLayerNorm.apply(x, weight, bias, eps, group, tuple(sizes))
