"""What Lightning and torchmetrics need from a process group, implemented on a runtime Group.

* :func:`reduce` -- ``Strategy.reduce`` (``self.log(..., sync_dist=True)``, EarlyStopping votes).
* :func:`all_gather` -- ``LightningModule.all_gather``: stacked like Lightning's, differentiable
  with ``sync_grads=True`` (backward sums the gathered gradients and keeps this rank's slice).
* :class:`MetricSync` -- torchmetrics only syncs when ``torch.distributed`` is initialised; we set
  ``dist_sync_fn`` and ``distributed_available_fn`` on every Metric so their states are gathered
  over shared memory instead, with unequal shapes handled like ``gather_all_tensors``. Every Metric:
  submodules, and those a module keeps in a dict, list or tuple (torchmetrics cannot find those
  either, but with ``torch.distributed`` up they would sync).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_shm.runtime import Group, ReduceOp
from lightning_shm.runtime.ops import barrier_reason

_LAST_STAGE_STATES = barrier_reason("a metric's states gathered on the last stage, for every stage")


def reduce(group: Group, tensor: Any, reduce_op: Any = "mean") -> Any:
    """Reduced copy of ``tensor`` (non-tensors pass through). ``mean`` of integers gives a float."""
    if not isinstance(tensor, Tensor):
        return tensor
    op = ReduceOp.parse(reduce_op if reduce_op is not None else "mean")
    out = tensor.detach().clone().contiguous()
    if out.dtype == torch.bool:
        out = out.to(torch.int64)
    if op == ReduceOp.MEAN and not out.is_floating_point():
        return group.all_reduce(out, "sum") / group.size
    return group.all_reduce(out, op)


class _AllGatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Group) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return group.all_gather(tensor.detach().contiguous())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        g = ctx.group.all_reduce(grad.contiguous().clone(), "sum")
        return g[ctx.group.index], None


def all_gather(group: Group, tensor: Tensor, sync_grads: bool = False) -> Tensor:
    """``[W, *tensor.shape]`` (a 0-d tensor gives ``[W]``), member order."""
    if sync_grads:
        return _AllGatherGrad.apply(tensor, group)
    return group.all_gather(tensor.detach().contiguous())


def gather_all_tensors(group: Group, result: Tensor) -> list[Tensor]:
    """One tensor per member; shapes may differ (same ndim), like torchmetrics' ``gather_all_tensors``."""
    local = result.detach().contiguous()
    if local.dtype == torch.bool:
        return [t.to(torch.bool) for t in gather_all_tensors(group, local.to(torch.uint8))]
    shapes = group.all_gather(torch.tensor(local.shape, dtype=torch.int64))
    if bool((shapes == shapes[0]).all()):
        parts = list(group.all_gather(local).unbind(0))
    else:
        flat = group.all_gather_v(local.reshape(-1))
        parts = [f.view(tuple(s.tolist())) for f, s in zip(flat, shapes)]
    parts[group.index] = result  # keep the local autograd graph, as torchmetrics does
    return parts


class MetricSync:
    """``dist_sync_fn`` for torchmetrics, bound to a group. Not picklable by design (see ``__reduce__``).

    Under a pipeline (``stages``: this rank's pp group, ``last``: the last stage's member index) the
    steps -- and so a metric's ``update`` -- run on the last stage only: a ``compute()`` outside a step
    (an epoch-end hook, on every rank) gathers over the data-parallel group, and the last stage's
    gathered states are broadcast over the pp group, so every stage computes the last stage's value
    (the other stages' states are empty). Inside a step (``in_step()``: a ``dist_sync_on_step``, on the
    last stage only) the data-parallel gather alone."""

    def __init__(self, group: Group, stages: Optional[Group] = None, last: int = 0,
                 in_step: Callable[[], bool] = lambda: False) -> None:
        self.group = group
        self.stages = stages if stages is not None and stages.size > 1 else None
        self.last, self.in_step = last, in_step

    def __call__(self, result: Tensor, group: Optional[Any] = None) -> list[Tensor]:
        g = group if isinstance(group, Group) else self.group
        parts = gather_all_tensors(g, result)
        if self.stages is None or isinstance(group, Group) or self.in_step():
            return parts
        mine = self.stages.index == self.last
        theirs = self.stages.broadcast_object([p.detach() for p in parts] if mine else None,
                                              src_member=self.last, why=_LAST_STAGE_STATES)
        return parts if mine else theirs

    def __deepcopy__(self, memo: dict) -> "MetricSync":
        return self  # metrics get deep-copied (e.g. MetricCollection); the group is a process resource

    def __reduce__(self) -> Any:
        return (_no_sync, ())  # a pickled module must not carry a live process group


def _no_sync() -> None:
    return None


def _always_distributed() -> bool:
    return True


def attach_metric_sync(module: nn.Module, sync: MetricSync) -> list[tuple[Any, Any, Any]]:
    """Route every torchmetrics Metric of ``module`` not routed yet through ``sync``. Returns what to restore."""
    saved = []
    for m in metrics_of(module):
        if not isinstance(m.dist_sync_fn, MetricSync):
            saved.append((m, m.dist_sync_fn, m.distributed_available_fn))
            m.dist_sync_fn = sync
            m.distributed_available_fn = _always_distributed
    return saved


def metrics_of(module: nn.Module) -> Iterator[Any]:
    """The Metrics of ``module``: submodules, and those its modules keep in dicts, lists or tuples (depth 3)."""
    from torchmetrics import Metric

    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> Iterator[Any]:
        if isinstance(obj, Metric):
            if id(obj) not in seen:
                seen.add(id(obj))
                yield obj
        elif depth and isinstance(obj, dict):
            for v in obj.values():
                yield from walk(v, depth - 1)
        elif depth and isinstance(obj, (list, tuple)):
            for v in obj:
                yield from walk(v, depth - 1)

    for m in module.modules():
        yield from walk(m, 0)
        for name, value in vars(m).items():
            if isinstance(value, (dict, list, tuple)) and not name.startswith("_"):
                yield from walk(value, 3)


def detach_metric_sync(saved: list[tuple[Any, Any, Any]]) -> None:
    for m, fn, avail in saved:
        m.dist_sync_fn = fn
        m.distributed_available_fn = avail
