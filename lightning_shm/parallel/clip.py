"""Gradient clipping by the *global* norm when gradients are split across ranks.

With FSDP each rank holds 1/W of every gradient, with pipelines each stage holds its own layers,
with tensor parallelism weight shards differ while some parameters are replicated. Clipping each
rank's piece by its local norm would scale ranks differently and break the equivalence with one
process. Here every rank computes the sum of squares of the gradient elements it *owns*, the group
all-reduces it, and every rank scales by the same factor.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from lightning_shm.runtime import Group


def global_grad_norm(params: Iterable[torch.Tensor], group: Optional[Group],
                     copies: Callable[[torch.Tensor], int] = lambda p: 1) -> torch.Tensor:
    """L2 norm over the union of all ranks' ``params`` gradients, each element counted once.

    ``copies(p)``: how many ranks of ``group`` hold the same gradient piece as ``p`` (data-parallel
    replicas, tensor-parallel ranks of a replicated layer); its square is divided by that.
    """
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            total += p.grad.detach().double().pow(2).sum() / copies(p)
    if group is not None and group.size > 1:
        group.all_reduce(total, "sum")
    return total.sqrt()


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, group: Optional[Group],
                    copies: Callable[[torch.Tensor], int] = lambda p: 1) -> torch.Tensor:
    """Scale gradients in place so that the global norm is at most ``max_norm``; return the norm.

    Same factor as ``torch.nn.utils.clip_grad_norm_``: ``max_norm / (norm + 1e-6)`` when above.
    """
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, group, copies)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return norm
