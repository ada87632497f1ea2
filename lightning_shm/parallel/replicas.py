"""Whether the ranks' copies of a parameter are still the same tensor: data parallelism's promise.

Every rank holding a parameter whole (shm_ddp: all of them; shm_fsdp: those kept whole; tensor parallelism:
those it does not split) steps it with the same averaged gradient, so the copies stay bitwise equal: the
all-reduce leaves the same bits on every rank. A gradient nobody averaged -- set outside backward
(``p.grad = ...``: DP-SGD's clipped per-sample gradients from ``torch.func``, gradients combined from
``torch.autograd.grad``) or changed on one rank -- parts the copies, and each rank trains its own model from
then on, silently (Lightning's ddp does the same; its checkpoint is rank 0's). Checked once, after the first
optimizer step: two float64 sums per parameter, one max and one min over the group::

    rank r:   s_r = [sum(p0), sum(p0^2), sum(p1), ...]     (float64)
    all:      max_r s_r  !=  min_r s_r   -> that parameter's copies differ
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def parted(named: Sequence[tuple[str, torch.Tensor]], group: Any) -> list[str]:
    """Names of the ``named`` parameters whose copies differ across ``group`` (a collective: every member
    passes the same names, in the same order)."""
    if not named:
        return []
    sums = []
    for _, p in named:
        t = p.detach()
        t = (torch.view_as_real(t) if t.is_complex() else t).double().nan_to_num()  # NaN != NaN: not a parting
        sums += [t.sum(), t.pow(2).sum()]
    hi = torch.stack(sums)
    lo = hi.clone()
    group.all_reduce(hi, "max")
    group.all_reduce(lo, "min")
    differ = (hi != lo).view(-1, 2).any(1).tolist()
    return [n for (n, _), d in zip(named, differ) if d]
