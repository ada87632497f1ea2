"""One FSDP unit: its parameters flattened, padded and sharded across the group.

Layout (unit of N elements, W ranks, S = ceil(N / W))::

    flat [N_pad = S*W]:  | p0.weight | p0.bias | ... | padding |
    rank r persistently owns flat[r*S:(r+1)*S]  -- its shard, the only parameter the optimizer sees.
    Shards live in a SharedBuffer: rank r's shard is region r; every rank can read every shard.

Per training step::

    forward pre-hook    gather: copy the W shards (read straight from shared memory, no
                        collective: shards only change in optimizer.step, which is followed by a
                        barrier) into a private full tensor; module.weight etc. become views of it
    forward post-hook   free (reshard_after_forward): the full tensor's storage is resized to 0;
                        autograd keeps the (now empty) views it saved for backward
    output-grad hook    re-gather into the same storage just before the unit's backward runs
    backward of gather  reduce-scatter (mean) of the full gradient; the shard gets its 1/W slice;
                        free the full parameters again

With a :class:`~lightning_shm.parallel.fsdp.prefetch.Prefetcher`, unit k's pre-forward also starts
unit k+1's gather on a helper thread, and unit k's pre-backward starts unit k-1's re-gather.

``_GatherShards`` is the autograd edge between shard and full tensor: its forward is the gather,
its backward the reduce-scatter, so the optimizer's gradient arrives on the shard without any
hook on the gradient path.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from lightning_shm.parallel.fsdp.policy import UnitSpec
from lightning_shm.parallel.fsdp.prefetch import Prefetcher
from lightning_shm.runtime import Group, SharedBuffer


class _GatherShards(torch.autograd.Function):
    """forward: shard -> full flat parameters (gather); backward: full grad -> shard grad (reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: "FSDPUnit", key: int) -> torch.Tensor:  # type: ignore[override]
        ctx.unit, ctx.key = unit, key
        return unit.gather_new()

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        unit: FSDPUnit = ctx.unit
        grad_shard = unit.group.reduce_scatter(grad_full.contiguous(), "mean")
        full = unit.pending.pop(ctx.key, None)
        if full is not None:
            unit.free(full)
        return grad_shard, None, None


class FSDPUnit:
    """Shards ``spec``'s parameters over ``group`` and installs the gather/free hooks."""

    def __init__(self, spec: UnitSpec, group: Group, index: int, reshard_after_forward: bool,
                 stats: "MemoryStats", prefetcher: Optional[Prefetcher] = None) -> None:
        self.name = spec.name
        self.prefetcher = prefetcher
        # neighbours in execution order (set by ShardedModule): whose gather to start early
        self.next_unit: Optional[FSDPUnit] = None
        self.prev_unit: Optional[FSDPUnit] = None
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.stats = stats
        dtypes = {p.dtype for *_, p in spec.params}
        if len(dtypes) != 1:
            raise ValueError(f"FSDP unit '{spec.name}' mixes dtypes {sorted(map(str, dtypes))}; one flat "
                             "parameter needs one dtype")
        grads = {p.requires_grad for *_, p in spec.params}
        if len(grads) != 1:
            raise ValueError(f"FSDP unit '{spec.name}' mixes trainable and frozen parameters; put them in "
                             "separate units (unit policy)")
        self.dtype = dtypes.pop()
        self.numel = spec.numel
        W = group.size
        if self.numel < W:
            raise ValueError(f"FSDP unit '{spec.name}' has {self.numel} parameters, fewer than the {W} ranks it "
                             "would be sharded over; merge it with its neighbours (min_unit_params) or use fewer "
                             "devices")
        self.shard_numel = math.ceil(self.numel / W)
        self.padded_numel = self.shard_numel * W
        # where each original parameter lives in the flat vector
        self.layout: list[tuple[str, nn.Module, str, torch.Size, int, int]] = []
        off = 0
        for full_name, owner, attr, p in spec.params:
            self.layout.append((full_name, owner, attr, p.shape, off, p.numel()))
            off += p.numel()
        flat = torch.zeros(self.padded_numel, dtype=self.dtype)
        with torch.no_grad():
            for (*_, shape, o, n), (*__, p) in zip(self.layout, spec.params):
                flat[o:o + n].copy_(p.detach().reshape(-1))
        self.buffer: SharedBuffer = group.alloc_shared(self.shard_numel, self.dtype, tag=f"fsdp-unit{index}")
        r = group.index
        self.buffer.local.copy_(flat[r * self.shard_numel:(r + 1) * self.shard_numel])
        self.shard = nn.Parameter(self.buffer.local, requires_grad=spec.params[0][3].requires_grad)
        # the module tree now holds the shard instead of the original parameters
        for _, owner, attr, *_ in self.layout:
            del owner._parameters[attr]
            object.__setattr__(owner, attr, _EMPTY(self.dtype))
        spec.modules[0][1].register_parameter(f"_fsdp_shard_{index}", self.shard)
        self._live: Optional[torch.Tensor] = None  # full parameters of the current forward
        # full tensors awaiting their backward, by application. Held strongly here: autograd keeps
        # only views of them (the Python object, and any weakref to it, would die after forward).
        self.pending: dict[int, torch.Tensor] = {}
        self._next_key = 0
        # a full tensor being gathered ahead by the prefetcher, and the shard version it reads
        self._prefetched: Optional[tuple[torch.Tensor, int]] = None
        self._handles = [spec.modules[0][1].register_forward_pre_hook(self._pre_forward)]
        self._handles.append(spec.modules[-1][1].register_forward_hook(self._post_forward))

    # ------------------------------------------------------------------ gather / free
    def _copy_shards_into(self, flat: torch.Tensor) -> None:
        S = self.shard_numel
        for j in range(self.group.size):
            flat[j * S:(j + 1) * S].copy_(self.buffer.region(j))

    def gather_new(self) -> torch.Tensor:
        if self._prefetched is not None:
            full, version = self._prefetched
            self._prefetched = None
            assert self.prefetcher is not None
            self.prefetcher.wait(full)
            if version == self.shard._version:
                return full
            self.free(full)  # the shards changed (optimizer step, load) since it was started
        full = torch.empty(self.padded_numel, dtype=self.dtype)
        self._copy_shards_into(full)
        self.stats.alloc(full)
        return full

    def regather(self, full: torch.Tensor) -> None:
        """Refill a freed full tensor in place. Writes through a storage alias, so the version
        counter that autograd checks on the saved views is untouched."""
        if self.prefetcher is not None:
            self.prefetcher.wait(full)
        view = self._refill_view(full)
        if view is not None:
            self._copy_shards_into(view)

    def _refill_view(self, full: torch.Tensor) -> Optional[torch.Tensor]:
        """Re-allocate a freed full tensor's storage; a storage alias to copy into (None if not freed)."""
        storage = full.untyped_storage()
        if storage.nbytes():
            return None
        storage.resize_(self.padded_numel * full.element_size())
        self.stats.alloc(full)
        return torch.empty(0, dtype=self.dtype).set_(storage, 0, (self.padded_numel,))

    # ------------------------------------------------------------------ prefetch
    def prefetch_gather(self) -> None:
        """Start this unit's forward gather on the helper thread (called from the previous unit)."""
        if self.prefetcher is None or self._prefetched is not None:
            return
        full = torch.empty(self.padded_numel, dtype=self.dtype)
        self.stats.alloc(full)
        self._prefetched = (full, self.shard._version)
        self.prefetcher.submit(full, lambda: self._copy_shards_into(full))

    def prefetch_regather(self) -> None:
        """Start refilling the full tensor of this unit's latest forward (its backward runs next)."""
        if self.prefetcher is None or not self.pending:
            return
        full = self.pending[max(self.pending)]
        view = self._refill_view(full)
        if view is not None:
            self.prefetcher.submit(full, lambda: self._copy_shards_into(view))

    def drop_prefetched(self) -> None:
        if self._prefetched is not None:
            full, _ = self._prefetched
            self._prefetched = None
            self.free(full)

    def free(self, full: torch.Tensor) -> None:
        if self.prefetcher is not None:
            self.prefetcher.wait(full)  # never release memory the helper thread is writing
        storage = full.untyped_storage()
        if storage.nbytes():
            self.stats.release(full)
            storage.resize_(0)
        if self._live is full:
            self._live = None
            self._set_views(None)

    def _set_views(self, full: Optional[torch.Tensor]) -> None:
        for _, owner, attr, shape, o, n in self.layout:
            object.__setattr__(owner, attr, _EMPTY(self.dtype) if full is None else full[o:o + n].view(shape))

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and self.shard.requires_grad:
            key, self._next_key = self._next_key, self._next_key + 1
            full = _GatherShards.apply(self.shard, self, key)
            self.pending[key] = full
        else:
            full = self.gather_new()
        self._live = full
        self._set_views(full)
        if self.next_unit is not None:
            self.next_unit.prefetch_gather()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        full = self._live
        if full is None:
            return output
        if full.requires_grad:
            fired = [False]

            def pre_backward(grad: torch.Tensor) -> torch.Tensor:
                if not fired[0]:
                    fired[0] = True
                    self.regather(full)
                    if self.prev_unit is not None:
                        self.prev_unit.prefetch_regather()
                return grad

            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(pre_backward)
            if self.reshard_after_forward:
                self.free(full)
        else:  # no backward will come (validation, predict): free now
            self.free(full)
        return output

    # ------------------------------------------------------------------ state
    def full_flat(self) -> torch.Tensor:
        """The unit's unsharded flat parameters (reads every shard; call between steps)."""
        flat = torch.empty(self.padded_numel, dtype=self.dtype)
        self._copy_shards_into(flat)
        return flat[: self.numel]

    def full_params(self) -> dict[str, torch.Tensor]:
        flat = self.full_flat()
        return {name: flat[o:o + n].view(shape).clone() for name, _, _, shape, o, n in self.layout}

    def load_full_params(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write this rank's shard from unsharded tensors keyed by plain parameter names."""
        flat = torch.zeros(self.padded_numel, dtype=self.dtype)
        for name, _, _, shape, o, n in self.layout:
            t = tensors[name]
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(shape)}")
            flat[o:o + n].copy_(t.reshape(-1))
        r, S = self.group.index, self.shard_numel
        with torch.no_grad():
            self.shard.copy_(flat[r * S:(r + 1) * S])

    def drop_pending(self) -> None:
        """Free full parameters of forwards whose backward never ran (e.g. a skipped step) and any
        prefetched gather not taken."""
        for full in self.pending.values():
            self.free(full)
        self.pending.clear()
        self.drop_prefetched()


class MemoryStats:
    """Bytes of unsharded parameters alive right now, and the peak since the last reset."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def alloc(self, t: torch.Tensor) -> None:
        self.live += t.untyped_storage().nbytes()
        self.peak = max(self.peak, self.live)

    def release(self, t: torch.Tensor) -> None:
        self.live -= t.untyped_storage().nbytes()

    def reset_peak(self) -> None:
        self.peak = self.live


def _EMPTY(dtype: torch.dtype) -> torch.Tensor:
    """What a sharded parameter attribute holds outside its unit's forward."""
    return torch.empty(0, dtype=dtype)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
