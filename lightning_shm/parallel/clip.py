"""Gradient norms and clipping by the *global* norm when gradients are split across ranks.

With FSDP each rank holds 1/W of every gradient, with pipelines each stage holds its own layers,
with tensor parallelism weight shards differ while some parameters are replicated. Clipping each
rank's piece by its local norm would scale ranks differently and break the equivalence with one
process. Here every rank computes the sum of squares of the gradient elements it *owns*, the group
all-reduces it, and every rank scales by the same factor. :func:`grad_norms` does the same per
parameter, so each parameter's norm is the one a single process would log.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from lightning_shm.runtime import Group


def global_grad_norm(params: Iterable[torch.Tensor], group: Optional[Group],
                     copies: Callable[[torch.Tensor], int] = lambda p: 1, norm_type: float = 2.0) -> torch.Tensor:
    """``norm_type``-norm (float64) over the union of all ranks' ``params`` gradients, each element counted once.

    ``copies(p)``: how many ranks of ``group`` hold the same gradient piece as ``p`` (data-parallel
    replicas, tensor-parallel ranks of a replicated layer); its ``|g|^p`` sum is divided by that (the
    max of ``inf`` needs no such care).
    """
    return _global_norm([(p.grad, copies(p)) for p in params if p.grad is not None], group, norm_type)


def _global_norm(pieces: Sequence[tuple[torch.Tensor, int]], group: Optional[Group], norm_type: float) -> torch.Tensor:
    """The norm over every rank's ``(piece, ranks holding it)`` pairs (collective over ``group``)."""
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float64)
    for t, n in pieces:
        if t.numel():
            g = t.detach().abs().double()  # |z| of a complex gradient (double() would drop its imaginary part)
            total = torch.maximum(total, g.max()) if inf else total + g.pow(norm_type).sum() / n
    if group is not None and group.size > 1:
        group.all_reduce(total, "max" if inf else "sum")
    return total if inf else total.pow(1.0 / norm_type)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, group: Optional[Group],
                    copies: Callable[[torch.Tensor], int] = lambda p: 1, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so that the global norm is at most ``max_norm``; return the norm.

    Same factor as ``torch.nn.utils.clip_grad_norm_``: ``max_norm / (norm + 1e-6)`` when above.
    """
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, group, copies, norm_type)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return norm


@contextlib.contextmanager
def torch_clipping_over(group: Group, copies: Callable[[torch.Tensor], int],
                        params: Callable[[], Iterable[torch.Tensor]]) -> Iterator[None]:
    """Inside, torch's gradient norm -- ``torch.nn.utils.get_total_norm``, and the one ``clip_grad_norm_`` takes
    (what a module calls itself, in ``on_before_optimizer_step`` or a manual step) -- is the norm over every
    rank's pieces, as in one process; it was each rank's own, so each clipped differently (0.04 off one process
    after 4 steps under shm_fsdp, tp2 and pp2). ``clip_grad_norm_`` reads the norm through its module's
    ``_get_total_norm`` at each call, so replacing that covers every name it is called by, also one imported
    before the fit (``from torch.nn.utils import clip_grad_norm_``: until that was replaced, 0.018-0.020 off one
    process after 3 Adam steps under shm_fsdp, tp2 and pp2); torch then scales by it as in one process. A
    gradient of one of ``params()`` counts as its parameter's piece; tensors the layout does not know count as
    held by every rank. Collective: every rank calls them where one does, as each rank runs the same hooks.
    ``get_total_norm`` itself imported before the fit keeps torch's."""
    utils, clip_module = torch.nn.utils, torch.nn.utils.clip_grad
    original = clip_module._get_total_norm, getattr(utils, "get_total_norm", None)

    def total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> torch.Tensor:
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        owners = {id(p.grad): p for p in params() if p.grad is not None}
        norm = _global_norm([(t, copies(owners[id(t)]) if id(t) in owners else group.size) for t in ts], group,
                            float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               "by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return norm.to(ts[0].dtype.to_real()) if ts else norm  # torch's: real for complex gradients too

    clip_module._get_total_norm = total_norm  # type: ignore[assignment]
    if original[1] is not None:
        utils.get_total_norm = total_norm  # type: ignore[assignment]
    try:
        yield
    finally:
        clip_module._get_total_norm = original[0]  # type: ignore[assignment]
        if original[1] is not None:
            utils.get_total_norm = original[1]


def grad_norms(named: Iterable[tuple[str, torch.Tensor]], names: Sequence[str], norm_type: float,
               group: Optional[Group], copies: Callable[[torch.Tensor], int] = lambda p: 1,
               of: Callable[[torch.Tensor], Optional[torch.Tensor]] = lambda p: p.grad) -> dict[str, torch.Tensor]:
    """Each parameter's gradient ``norm_type``-norm over all ranks' pieces: one process's ``p.grad.norm()`` (with
    ``of=lambda p: p``, the parameter's own norm: one process's ``p.norm()``).

    ``names`` are the plain module's parameter names, the same list in the same order on every rank;
    ``named`` this rank's ``(name, parameter)`` pairs -- a pipeline stage holds some of the names, an
    FSDP or tp rank pieces of them. One all-reduce of a float64 ``[2 * len(names)]`` vector:
    ``[sum |g|^p / copies(p) per name | 1 where this rank has the gradient]`` (for ``inf``: the max of
    ``|g|`` and the flags, reduced by max). Returns ``{name: norm}`` in ``names`` order for the names some
    rank has a gradient of, in that gradient's dtype (the first one this rank holds, else the default).
    Two more entries, ``[h, -h]`` with ``h`` a checksum of ``names``, find ranks that asked for different
    parameters of the same count (each pipeline stage passing its own first Linear).
    """
    index = {n: i for i, n in enumerate(names)}
    inf = math.isinf(norm_type)
    h = float(zlib.crc32("\n".join(names).encode()))
    check = torch.tensor([h, -h], dtype=torch.float64)
    vec = torch.zeros(2 * len(names), dtype=torch.float64)
    dtype = None
    for name, p in named:
        g = of(p)
        if g is None or name not in index:
            continue
        dtype = dtype or g.dtype.to_real()
        g = (g.coalesce().values() if g.is_sparse else g).detach().abs().double()
        i = index[name]
        if inf:
            vec[i] = g.max() if g.numel() else 0.0
        else:
            vec[i] = (g.square() if norm_type == 2 else g.pow(norm_type)).sum() / copies(p)
        vec[len(names) + i] = 1.0
    if group is not None and group.size > 1:
        both = group.all_reduce(torch.cat([check, vec]), "max" if inf else "sum")
        if not torch.equal(both[:2], check if inf else check * group.size):
            raise ValueError(f"grad_norm: the ranks asked for the norms of different parameters (rank "
                             f"{group.global_rank}: {list(names)[:3]}{'...' if len(names) > 3 else ''}); pass the same "
                             "module on every rank")
        vec = both[2:]
    dtype = dtype or torch.get_default_dtype()
    root = vec[:len(names)] if inf else vec[:len(names)].pow(1.0 / norm_type)
    return {n: root[i].to(dtype) for i, n in enumerate(names) if vec[len(names) + i] > 0}
