"""Data-parallel gradient averaging with gradients that live in shared memory.

Data movement in one step (W ranks, one bucket shown)::

    rank r backward:  param.grad is a view of bucket.local (rank r's region of a SharedBuffer).
                      A large nn.Linear's weight gradient is written there by its backward
                      (:meth:`GradReducer.weight_grad`, routed by :meth:`GradReducer.route_linears`);
                      autograd's fresh gradients of the other parameters are copied in once
                      (after zero_grad(set_to_none=True)) or accumulated in place
    last grad of the bucket accumulated (post-accumulate-grad hook):
        group.all_reduce(bucket, "mean")  -> zero-copy path: rank r reads part r of all W regions,
                                             writes the mean into part r of all W regions
    optimizer.step(): reads param.grad (the bucket views), now the mean over ranks

Buckets are filled in reverse registration order (roughly the order backward produces gradients)
and reduced strictly in bucket order, so every rank issues the same collectives in the same
order. ``no_sync()`` (gradient accumulation) skips the reduction; gradients keep accumulating in
the bucket views and are reduced on the last micro-step.

Unused parameters (no gradient in this backward) would leave a bucket incomplete: by default that
is an error naming the parameters; with ``find_unused_parameters=True`` the remaining buckets are
reduced at the end of backward (their unused parts hold zeros, or the accumulated gradient), and a
parameter no rank has a gradient for keeps None, as in one process (one small all-reduce of flags).

Sparse gradients (``nn.Embedding(sparse=True)``) have no bucket: after the buckets, each rank's
(indices, values) are gathered and the average stays sparse, as torch DDP keeps it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import is_lazy

from lightning_shm.parallel.linear_grads import PaddedWeights, SinkLinear, restore_linears, route_linears
from lightning_shm.runtime.group import Group, SharedBuffer


@dataclass
class Bucket:
    buffer: SharedBuffer
    start: int
    end: int
    params: list[nn.Parameter] = field(default_factory=list)
    pending: int = 0

    @property
    def flat(self) -> torch.Tensor:
        return self.buffer.local[self.start:self.end]


class GradReducer:
    """Owns the gradient buckets of ``named_params`` on ``group`` and averages them during backward.

    ``direct_min_numel``: the smallest Linear weight whose gradient :meth:`route_linears` writes
    straight into its bucket region. Below it the custom autograd node's Python costs about what the
    saved copy does.
    """

    direct_min_numel = 1 << 20

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], group: Group,
                 bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False, tag: str = "ddp",
                 hooks: bool = True, sparse: Iterable[nn.Parameter] = ()) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.group = group
        self.find_unused_parameters = find_unused_parameters
        self._sparse_all = set(sparse)
        self._all = list(named_params)
        self._config = (bucket_cap_mb, tag, hooks)
        self._route_candidates: list[nn.Module] = []
        self._build()

    def _build(self) -> None:
        """Buckets, views and hooks for the parameters that require gradients now."""
        bucket_cap_mb, tag, hooks = self._config
        group = self.group
        trainable = [(n, p) for n, p in self._all if p.requires_grad]
        if not trainable:
            raise ValueError("the module has no parameters that require gradients: nothing to train")
        self._names = {p: n for n, p in trainable}
        self._sparse = [p for _, p in trainable if p in self._sparse_all]  # no bucket: see _reduce_sparse
        params = [(n, p) for n, p in trainable if p not in self._sparse_all]
        ordered = list(reversed(params))  # backward produces the last layers' gradients first
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        self._views: dict[nn.Parameter, torch.Tensor] = {}
        cap = int(bucket_cap_mb * 2**20)
        for dtype in sorted({p.dtype for _, p in ordered}, key=str):
            group_params = [p for _, p in ordered if p.dtype == dtype]
            total = sum(p.numel() for p in group_params)
            buf = group.alloc_shared(total, dtype, tag=f"{tag}-grads")
            buf.local.zero_()
            off, bucket = 0, None
            for p in group_params:
                nbytes = p.numel() * p.element_size()
                if bucket is None or (bucket.end - bucket.start) * p.element_size() + nbytes > cap:
                    bucket = Bucket(buf, off, off)
                    self.buckets.append(bucket)
                bucket.params.append(p)
                bucket.end = off + p.numel()
                view = buf.local[off:off + p.numel()].view_as(p)
                self._views[p] = view
                self._bucket_of[p] = bucket
                off += p.numel()
        self._buffers = {b.buffer for b in self.buckets}
        # hooks=False: gradients are produced outside autograd's per-step rhythm (pipeline schedules)
        # and averaged by an explicit synchronize()
        self._index = {p: i for i, (_, p) in enumerate(params)}
        self._params = [p for _, p in params]
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i, p)) for i, (_, p) in
                         enumerate(params)] if hooks else []
        self._sync = True
        self._in_backward = False
        self._synced_since_post = False
        self._next = 0
        self._ready = [False] * len(params)
        self._lent = [False] * len(params)  # bucket region handed to autograd as the gradient, not yet accumulated
        self._routed: list[nn.Module] = []
        self.padded = PaddedWeights()  # routed Linears' input gradients (SinkLinear); cleared after each backward
        self._attach_grads(zero=True)

    def follow_requires_grad(self) -> bool:
        """Rebuild the buckets if the parameters that require gradients changed since they were built (a
        fine-tuning callback unfreezing a backbone: its gradients must be averaged from then on, as a
        frozen one's must no longer be expected). Every rank calls it at the same point; True if rebuilt."""
        if {p for _, p in self._all if p.requires_grad} == set(self._names):
            return False
        self.close()
        self._build()
        self.route_linears(self._route_candidates)
        return True

    def __deepcopy__(self, memo: dict) -> "GradReducer":
        return self  # a process resource: the Linear layers it routes hold it, and they may be deep-copied (SWA)

    # ------------------------------------------------------------------ grads as bucket views
    def _attach_grads(self, zero: bool) -> None:
        if zero:
            for buf in self._buffers:
                buf.local.zero_()
        for p, view in self._views.items():
            p.grad = view.detach()  # an alias: see _adopt

    def _adopt(self, p: nn.Parameter) -> None:
        """Make ``p.grad`` its bucket view. After ``zero_grad(set_to_none=True)`` autograd hands the hook
        a freshly allocated gradient: one copy into the bucket is cheaper than zeroing the bucket
        before backward and accumulating into it (N bytes moved instead of 3N).

        ``p.grad`` is an alias of the reducer's view, never the view itself: a hook assigning
        ``p.grad.data = p.grad.data * s`` gives that tensor object new storage, and on the view itself it
        moved this parameter's gradient out of the bucket for the rest of the run -- each rank stepped with
        its own gradient while the bucket's mean went unread (0.034 off one process after 3 Adam steps).
        On an alias it is seen at the next hook (another address) and copied into the bucket."""
        view = self._views[p]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view.detach()

    # ------------------------------------------------------------------ Linear weight gradients into the buckets
    def route_linears(self, modules: Iterable[nn.Module]) -> None:
        """Compute the weight gradients of the ``nn.Linear`` layers among ``modules`` with at least
        ``direct_min_numel`` weights straight into their bucket regions (:meth:`weight_grad`); the others
        are left alone (no detour on their forward). Undone by :meth:`close`."""
        # the registered parameter, not ``m.weight``: reading a parametrized weight computes it (spectral_norm's
        # power iteration updates its vectors), and a computed weight is not a leaf autograd accumulates into
        modules = list(modules)
        self._route_candidates = modules
        weights = {m: m._parameters.get("weight") for m in modules if isinstance(m, nn.Linear)}
        mods = [m for m, w in weights.items()  # a complex weight's products take conjugates: autograd's F.linear
                if w is not None and w in self._views and w.numel() >= self.direct_min_numel and not w.is_complex()]
        route_linears(mods, _bucket_linear_forward, self)
        self._routed.extend(mods)

    def weight_grad(self, param: nn.Parameter, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``param``'s gradient ``g^T @ x`` for autograd, written into its bucket region when that holds
        nothing yet: ``param.grad`` is None (after ``zero_grad(set_to_none=True)``) and the region is not
        lent to an earlier use of ``param`` in this backward whose sum autograd has not yet accumulated.
        The region goes out as a new view that nothing else references, so AccumulateGrad adopts it as
        ``param.grad`` and the hook finds it in place -- where autograd's own path allocates a fresh
        product that the hook then copies in. Otherwise the fresh product, which autograd adds to
        ``param.grad`` as usual."""
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        i = self._index.get(param)
        if i is None or param.grad is not None or self._lent[i] or g2.dtype != param.dtype:
            return g2.t().mm(x2)
        region = self._views[param].view_as(param)  # a new tensor on the bucket's memory, referenced only here
        torch.mm(g2.t(), x2, out=region)
        self._lent[i] = True
        return region

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the context."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    # ------------------------------------------------------------------ autograd hooks
    def _make_hook(self, i: int, p: nn.Parameter):  # noqa: ANN202 - a closure per parameter: no dict lookups
        view_ptr = self._views[p].data_ptr()
        bucket = self._bucket_of[p]
        size = len(bucket.params)

        def on_grad_ready(param: nn.Parameter) -> None:
            self._lent[i] = False
            g = param.grad
            if g is None or g.data_ptr() != view_ptr:
                self._adopt(param)
            if not self._sync or self._ready[i]:
                return
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._ready[i] = True
            bucket.pending += 1
            if bucket.pending == size:
                self._launch_ready()

        return on_grad_ready

    def _reduce_sparse(self) -> None:
        """At the end of backward, after every bucket (the same order on every rank; with no bucket hook to
        end it, :meth:`post_backward` does), average the sparse gradients as torch DDP does, keeping them
        sparse (``SparseAdam`` needs that):
        every rank's (indices, values) gathered, concatenated uncoalesced -- as one process's gradient over
        the whole batch holds one entry per looked-up row -- and divided by W. A gradient that arrived dense
        (the weight also used densely, e.g. tied to an output layer) is averaged in place."""
        W = self.group.size
        for p in self._sparse:
            g = p.grad
            if g is not None and not g.is_sparse:
                self.group.all_reduce(g, "mean")
                continue
            if g is None:
                g = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long), torch.empty(0, *p.shape[1:],
                                            dtype=p.dtype), p.shape)
            idx, vals = g._indices(), g._values()
            all_idx = self.group.all_gather_v(idx.reshape(-1).contiguous())
            all_vals = self.group.all_gather_v(vals.reshape(-1).contiguous())
            indices = torch.cat([i.view(idx.shape[0], -1) for i in all_idx], dim=1)
            if indices.shape[1] == 0:  # no rank looked a row up: no gradient on any rank, as in one process
                p.grad = None
                continue
            values = torch.cat([v.view(-1, *vals.shape[1:]) for v in all_vals]).div_(W)
            p.grad = torch.sparse_coo_tensor(indices, values, p.shape)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.pending < len(b.params):
                return
            self.group.all_reduce(b.flat, "mean")
            self._next += 1

    def _used_here(self) -> torch.Tensor:
        """1 for each parameter with a gradient since ``zero_grad`` on this rank (read before any is adopted)."""
        return torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32)

    def _unused_everywhere(self, used: torch.Tensor) -> list[nn.Parameter]:
        """The parameters no rank has a gradient for: they get None after the average, as in one process --
        whose optimizer then skips them, where a zero gradient would still advance Adam's step count and
        decay its moments (an expert no sample of the batch was routed to). One small all-reduce, as torch
        DDP's ``find_unused_parameters`` makes; collective, after every bucket's (a rank that used every
        parameter reduced its buckets during backward, one that did not reduces the rest at its end)."""
        self.group.all_reduce(used, "max")
        return [p for p, u in zip(self._params, used.tolist()) if not u]

    def _finish_backward(self) -> None:
        try:
            used = self._used_here() if self.find_unused_parameters else None
            if self._next < len(self.buckets):
                unused = [p for b in self.buckets[self._next:] for p in b.params if not self._ready[self._index[p]]]
                # frozen since the step began (LightningModule.toggle_optimizer in a GAN's step): no gradient is
                # due, on any rank -- they run the same program; what their regions hold is averaged with the rest
                # (a gradient accumulated before the freeze, without sync: the mean, as one process has the sum)
                missing = [p for p in unused if p.requires_grad]
                if missing and not self.find_unused_parameters:
                    names = [self._names[p] for p in missing]
                    raise RuntimeError(
                        f"{len(names)} parameter(s) received no gradient in this backward pass: {names[:10]}"
                        f"{' ...' if len(names) > 10 else ''}. Every rank must produce a gradient for every "
                        "trainable parameter, or pass find_unused_parameters=True to the strategy (a rank "
                        "without one contributes zero), or freeze them with requires_grad_(False) before the "
                        "backward.")
                for p in missing:  # contributes zero (or what earlier micro-steps accumulated)
                    self._adopt(p)
                for b in self.buckets[self._next:]:
                    self.group.all_reduce(b.flat, "mean")
            if used is not None:
                for p in self._unused_everywhere(used):
                    p.grad = None
            self._reduce_sparse()
        finally:
            self._reset()

    def _reset(self) -> None:
        self.padded.clear()
        self._synced_since_post = True
        self._in_backward = False
        self._next = 0
        self._ready = [False] * len(self._ready)
        self._lent = [False] * len(self._lent)
        for b in self.buckets:
            b.pending = 0

    def post_backward(self) -> None:
        """Called after ``loss.backward()``: a backward that produced no gradient at all still syncs."""
        if self._sync and not self._synced_since_post:
            self._in_backward = True
            self._finish_backward()
        self._synced_since_post = False

    def synchronize(self) -> None:
        """Average every bucket now, whatever produced the gradients (used after a pipeline schedule,
        whose zero-bubble weight passes write ``param.grad`` outside autograd's hooks). A parameter without a
        gradient on every rank keeps none, as in one process."""
        used = self._used_here()
        for p in self._views:
            self._adopt(p)
        for b in self.buckets:
            self.group.all_reduce(b.flat, "mean")
        for p in self._unused_everywhere(used):
            p.grad = None
        self._reduce_sparse()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Remove hooks and move gradients out of shared memory (the segments go away with the run)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        restore_linears(self._routed)
        self._routed.clear()
        self.padded.clear()
        for p, v in self._views.items():
            if p.grad is not None and p.grad.data_ptr() == v.data_ptr():
                p.grad = p.grad.clone()
        for buf in self._buffers:
            self.group.release_shared(buf)

    @property
    def numel(self) -> int:
        return sum(b.end - b.start for b in self.buckets)


def sparse_grad_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters autograd gives sparse gradients: weights of ``nn.Embedding`` / ``nn.EmbeddingBag``
    built with ``sparse=True``."""
    found = [m._parameters.get("weight") for m in module.modules()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    return [p for p in found if isinstance(p, nn.Parameter)]


def _bucket_linear_forward(module: nn.Linear, reducer: GradReducer, x: torch.Tensor) -> torch.Tensor:
    w = module.weight
    if torch.is_grad_enabled() and w.requires_grad and x.dtype == w.dtype and not torch.is_autocast_enabled("cpu"):
        return SinkLinear.apply(x, w, module.bias, reducer, w)
    return F.linear(x, w, module.bias)


def refuse_lazy(module: nn.Module) -> None:
    """ValueError naming the parameters and buffers of torch's lazy modules (``nn.LazyLinear``,
    ``nn.LazyConv2d``, ...) that have no shape yet: they take it at their first forward, and every layout
    needs it before the first step -- to make the ranks' weights equal (:func:`broadcast_module_state`), lay
    out gradient buckets, shards, tp slices and pipeline stages. Torch's DistributedDataParallel refuses them
    too ("Run a dummy forward pass")."""
    lazy = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if is_lazy(t)]
    if not lazy:
        return
    owners = list(dict.fromkeys(n.rpartition(".")[0] for n in lazy))
    shown = ", ".join(f"{o or 'the module itself'} ({type(module.get_submodule(o)).__name__})" for o in owners[:6])
    shown += f" and {len(owners) - 6} more" if len(owners) > 6 else ""
    raise ValueError(f"{type(module).__name__} holds layers whose tensors have no shape yet -- {shown}: torch's lazy "
                     "modules take their shapes at the first forward, and the ranks lay out and share every weight "
                     "by shape before the first step. Run one forward on an input shaped like a batch's where the "
                     "model is built (before fit, or at the end of configure_model); torch's DistributedDataParallel "
                     "asks the same.")


def broadcast_module_state(module: nn.Module, group: Group, src_member: int = 0) -> None:
    """Make every rank's parameters and buffers equal to member ``src_member``'s.

    Explicit on purpose: pickling the model to spawned workers, ``fork``, and weights created in
    ``configure_model`` with different RNG states must all end up identical. Lazy modules built in
    ``configure_model`` are refused here, where the workers first need shapes.
    """
    refuse_lazy(module)
    broadcast_tensors(list(module.parameters()) + list(module.buffers()), group, src_member)


def broadcast_tensors(tensors: Sequence[torch.Tensor], group: Group, src_member: int = 0) -> None:
    """In-place broadcast of ``tensors`` from member ``src_member``: one collective per dtype, not per tensor."""
    tensors = [t for t in tensors if t.numel()]
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        group.broadcast(flat, src_member)
        if group.index != src_member:
            off = 0
            with torch.no_grad():
                for t in same:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()
