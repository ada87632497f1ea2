"""Gradient clipping by the *global* norm when gradients are split across ranks.

With FSDP each rank holds 1/W of every gradient, with pipelines each stage holds its own layers,
with tensor parallelism weight shards differ while some parameters are replicated. Clipping each
rank's piece by its local norm would scale ranks differently and break the equivalence with one
process. Here every rank computes the sum of squares of the gradient elements it *owns*, the group
all-reduces it, and every rank scales by the same factor.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from lightning_shm.runtime import Group


def global_grad_norm(params: Iterable[torch.Tensor], group: Optional[Group],
                     replicated: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """L2 norm over the union of all ranks' ``params`` gradients.

    ``replicated`` parameters hold the same gradient on every rank of ``group``: they are counted
    once (divided by the group size) instead of W times.
    """
    rep = {id(p) for p in replicated}
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            sq = p.grad.detach().double().pow(2).sum()
            total += sq / group.size if (group is not None and id(p) in rep) else sq
    if group is not None and group.size > 1:
        group.all_reduce(total, "sum")
    return total.sqrt()


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, group: Optional[Group],
                    replicated: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Scale gradients in place so that the global norm is at most ``max_norm``; return the norm.

    Same factor as ``torch.nn.utils.clip_grad_norm_``: ``max_norm / (norm + 1e-6)`` when above.
    """
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, group, replicated)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return norm
