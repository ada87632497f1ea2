"""One FSDP unit: each of its parameters cut into row blocks (dim 0) across the group, as FSDP2 does.

Why per parameter: the optimizer, and the user's ``configure_optimizers``, see the module's own
parameters -- same names, same order, one tensor per parameter -- each holding this rank's rows.
Parameter groups by name ("no weight decay on biases") or by position (two optimizers over slices
of ``parameters()``) mean what they mean in one process, and an elementwise optimizer (SGD, Adam,
AdamW, ...) updates exactly the values one process would, with its state 1/W per rank.

Two ways to hold the rows (``gather``; a unit of parameters p0, p1, ...; W ranks; rows of p split
like ``even_split``)::

    "view" (default): one tensor in shared memory that every rank maps
        common:             | p0 (all rows) | p1 (all rows) | ...
        module.<p0 name>:   the rank's own rows of p0, an nn.Parameter viewing its slice of common
        full parameters:    common itself -- nothing to copy, nothing to free
    "copy": FSDP's textbook rhythm, each rank's rows in its own region
        shared region of rank j:  | p0 rows of j (padded to p0's largest block) | p1 rows of j | ...
        full flat tensor:         | p0 (all rows) | p1 | ...  -- private, exists only around compute

Why "view" is the default: on one machine the W blocks already are one tensor in memory every rank
can read; a copy into private memory (and its page faults) buys nothing but the textbook's shape --
the wide MLP spent ~10 ms of a 268 ms step gathering in forward and more re-gathering in backward.
Persistent memory is the same (the common tensor is the W blocks, 1/W of it written by each rank);
no full parameters are ever private. Reads stay valid by the rule of :mod:`.sharded`: the blocks
change only between two barriers around every optimizer step and load.

Per training step ("copy"; "view" skips every copy and free)::

    forward pre-hook    gather: copy every rank's blocks (read straight from /dev/shm, no
                        collective: the shards change only in optimizer steps and loads, each
                        followed by a barrier) into a full flat tensor; during the forward each
                        owner module's attribute (``linear.weight``) is a view of it, shadowing
                        the registered block
    forward post-hook   free (reshard_after_forward): the flat tensor's storage is resized to 0;
                        autograd keeps the (now empty) views it saved for backward
    output-grad hook    re-gather into the same storage just before the unit's backward runs (each
                        backward through it: a graph kept with retain_graph=True, differentiated again)
    replay in backward  (non-reentrant activation checkpointing) gather into a new tensor, never freed by
                        the hooks: the views the replay saved hold it until the unit's backward used them
    backward of gather  reduce-scatter (mean) of every parameter's full gradient by rows, all the
                        unit's parameters in one collective: each block's gradient arrives on the
                        block, through autograd; free again

``_GatherUnit`` is the autograd edge between blocks and full tensor. In a pipeline
(:meth:`FSDPUnit.hold`), a unit is gathered once per step instead: it stays gathered over all
microbatches, their gradients add up in one full gradient, reduce-scattered once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lightning_shm.parallel.fsdp.policy import UnitSpec
from lightning_shm.parallel.fsdp.prefetch import Prefetcher
from lightning_shm.parallel.fsdp.rows import RowBlock
from lightning_shm.parallel.outside_reads import WHERE_GRADIENTS_WORK
from lightning_shm.parallel.replaced import accumulate_grad, carry_over
from lightning_shm.runtime import Group, SharedBuffer, even_split
from lightning_shm.runtime.errors import CollectiveMismatchError
from lightning_shm.runtime.ops import barrier_reason, site_of

GATHERS = ("view", "copy")
Stamps = list[tuple[int, int]]  # each full parameter's (version counter, address): see _stamps
_ROWS_WRITTEN = barrier_reason("FSDP: this rank wrote its rows of a parameter in place (not in an optimizer step) and "
                               "waits for every rank to write theirs before reading them; every rank must write its "
                               "rows at the same point")


_NOT_THIS_RANKS = (
    "Under shm_fsdp each rank holds a row block of these parameters, and a unit's gradient is averaged over the "
    "ranks into that block as backward reaches the unit: what came back would be those rows of the mean over every "
    "rank's batch, not the gradient of this rank's batch that one process differentiates again or reads (MAML's "
    f"inner step, a penalty on the gradient's norm, a logged gradient norm). {WHERE_GRADIENTS_WORK}")


def refuse_gradients_of_shards(names: list[str]) -> None:
    """The step asked ``torch.autograd.grad`` for the gradient of some of the rank's blocks (``names``)."""
    raise ValueError(f"training_step takes gradients with respect to parameters ({names[:4]}"
                     f"{' ...' if len(names) > 4 else ''}) itself (torch.autograd.grad). {_NOT_THIS_RANKS}")


def check_gather(gather: str, reshard_after_forward: bool = True, prefetch: bool = False) -> None:
    """The options that shape private copies of the full parameters need ``gather="copy"``: a "view"
    gather makes none (nothing to keep after forward, nothing to prefetch)."""
    if gather not in GATHERS:
        raise ValueError(f"gather must be one of {GATHERS}, got {gather!r}")
    if gather == "view" and (prefetch or not reshard_after_forward):
        raise ValueError(f"prefetch={prefetch} / reshard_after_forward={reshard_after_forward} shape the private "
                         "copies of gather='copy'; gather='view' makes none (the full parameters are the shared "
                         "memory): pass gather='copy' with them")


@dataclass
class Block:
    """One parameter of a unit: where its rows live, and the block this rank holds."""

    name: str
    owners: list[tuple[nn.Module, str]]  # every (module, attribute) holding it (tied weights: several)
    shape: torch.Size
    rows: list[int]  # rows held by each rank
    row_numel: int
    region_offset: int  # start of its block in every rank's shared region (elements)
    full_offset: int  # start in the full flat tensor
    shard: nn.Parameter = field(repr=False, default=None)  # type: ignore[assignment]

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def row_start(self, j: int) -> int:
        return sum(self.rows[:j])


class FullParam(torch.Tensor):
    """A gathered full parameter, what a module's attribute is in its unit's forward (and, under "view", in the
    step): a plain tensor but for ``.data``, which is ``detach()`` -- sharing the version counter, so a write
    through it (``w.data.mul_(m)``) is seen as the in-place change it is; a plain ``.data`` has a counter of its
    own. Ops on it return plain tensors (``__torch_function__`` disabled, as ``nn.Parameter``'s)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, new: torch.Tensor) -> None:  # a plain tensor's: new storage, which the address stamp sees
        torch._C.TensorBase.data.__set__(self, new)  # type: ignore[attr-defined]


class _GatherUnit(torch.autograd.Function):
    """forward: blocks -> each full parameter, a tensor on the unit's full flat storage; backward: each
    full parameter's gradient -> the blocks' gradients (reduce-scatter by rows), or -- while the unit
    is held for a pipeline step -- into its accumulated full gradient, reduce-scattered once when the
    step ends.

    Why one output per parameter, not the flat tensor sliced: the backward of a slice is a zero-filled
    tensor the size of the whole unit with the slice's gradient copied in, one per parameter, then
    summed -- for the wide MLP's Linear(4096, 4096) unit, 104 against 49 ms of backward (one thread,
    batch 128, local script). Each output here gets its own gradient, which the reduce-scatter reads.
    """

    @staticmethod
    def forward(ctx: Any, unit: "FSDPUnit", key: int, full: torch.Tensor,  # type: ignore[override]
                *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit, ctx.key, ctx.full = unit, key, full  # full: freed again after each backward through this edge
        ctx.set_materialize_grads(False)  # a parameter the forward did not use gets None: see reduce_scatter
        params = unit.params_of(full)
        ctx.mark_non_differentiable(*[p for p, b in zip(params, unit.blocks) if not b.shard.requires_grad])
        return tuple(params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        unit: FSDPUnit = ctx.unit
        if torch.is_grad_enabled():  # create_graph=True: a graph of this backward is asked for
            raise RuntimeError(
                f"a backward with create_graph=True reached the parameters of FSDP unit {unit.name!r} "
                "(loss.backward(create_graph=True), for a Hessian-vector product say): the reduce-scatter that "
                "averages their gradient over the ranks into each rank's row block has no derivative here, and the "
                "rows it leaves are not the gradient one process would differentiate again. Data parallelism does not "
                "take such a step as one process: Lightning's ddp and shm_ddp fail on it too (torch's "
                "DistributedDataParallel does not synchronize higher-order gradients). A gradient penalty with "
                "respect to the input (create_graph on the input only) trains under shm_fsdp as one process.")
        nothing = (None, None, None)
        if unit.held is not None:
            unit.accumulate(grads)
            return (*nothing, *[None] * len(unit.blocks))
        # a sparse gradient (nn.Embedding(sparse=True)) is made dense: the shard's gradient is a dense row range
        shard_grads = unit.reduce_scatter([None if g is None else g.to_dense() if g.is_sparse else g.contiguous()
                                           for g in grads])
        unit.pending.pop(ctx.key, None)
        unit.free(ctx.full)  # (a retained graph's next backward re-gathers it: FSDPUnit._post_forward)
        unit.forget_replays()
        return (*nothing, *shard_grads)


class FSDPUnit:
    """Shards ``spec``'s parameters over ``group`` and installs the gather/free hooks.

    ``owners``: for every parameter id, all (module, attribute) pairs that hold it in the model.
    ``across``: applied to each reduced gradient shard (HSDP: the mean with the other nodes' replicas).
    ``gather``: "view" or "copy" (module docstring); ``reshard_after_forward`` and ``prefetcher``
    shape the copies, so they belong to "copy" (``check_gather``).
    """

    def __init__(self, spec: UnitSpec, group: Group, index: int, reshard_after_forward: bool,
                 stats: "MemoryStats", owners: dict[int, list[tuple[nn.Module, str]]],
                 prefetcher: Optional[Prefetcher] = None,
                 across: Optional[Callable[[torch.Tensor], None]] = None, gather: str = "view") -> None:
        check_gather(gather, reshard_after_forward, prefetcher is not None)
        self.name = spec.name
        self.index = index
        self.unit_names: Sequence[str] = ()  # every unit's, by index (set by the state that makes them)
        self.group = group
        self.across = across
        self.reshard_after_forward = reshard_after_forward
        self.stats = stats
        self.prefetcher = prefetcher
        self.next_unit: Optional[FSDPUnit] = None  # neighbours in execution order: whose gather to start early
        self.prev_unit: Optional[FSDPUnit] = None
        # the state's barrier after shards were written (FSDPState.after_shards_written, set by the state), and the
        # version of this unit's blocks it last recorded: blocks written since are met about before a gather
        self.meet: Optional[Callable[[int], None]] = None
        self.synced_version = -1
        _check_unit(spec)
        self.dtype = spec.params[0][3].dtype
        W, r = group.size, group.index
        self.blocks: list[Block] = []
        region = full = 0
        for name, _, _, p in spec.params:
            rows = _sizes(p.shape[0], W)
            b = Block(name, owners[id(p)], p.shape, rows, p.numel() // max(p.shape[0], 1), region, full)
            self.blocks.append(b)
            region += rows[0] * b.row_numel  # the largest block: every rank's region has the same layout
            full += p.numel()
        self.numel = full
        self.region_numel = region
        self.common: Optional[torch.Tensor] = None  # "view": the full parameters, in shared memory
        self.buffer: Optional[SharedBuffer] = None  # "copy": every rank's blocks, one region each
        if gather == "view":
            self.common = group.alloc_common(full, self.dtype, tag=f"fsdp-unit{index}")
        else:
            self.buffer = group.alloc_shared(region, self.dtype, tag=f"fsdp-unit{index}")
        for b, (*_, p) in zip(self.blocks, spec.params):
            mine, first = self._block(r, b), b.row_start(r)
            mine.copy_(p.detach().reshape(-1)[first * b.row_numel:][:mine.numel()])
            b.shard = RowBlock(mine.view(b.rows[r], *b.shape[1:]), requires_grad=p.requires_grad)
            b.shard.of = f"rows {first}:{first + b.rows[r]} of {b.name!r} {tuple(b.shape)}"
            carry_over(p, b.shard)  # the user's gradient hooks see the block's (averaged) gradient
            for owner, attr in b.owners:  # the model now holds the block under the parameter's own name
                owner._parameters[attr] = b.shard
        self._live: Optional[torch.Tensor] = None  # full flat parameters of the current forward
        self._live_params: Sequence[torch.Tensor] = ()  # ... as the modules see them (_set_views)
        self._stamps: Stamps = []  # their version counters and addresses when the forward began
        self._live_grad = False  # ... taken through _GatherUnit (a backward will come)
        self._frozen_inputs: list[torch.Tensor] = []  # a unit without trainable parameters: inputs with a gradient
        # full tensors awaiting their backward, by application. Held strongly here: autograd keeps
        # only views of them (the Python object, and any weakref to it, would die after forward).
        self.pending: dict[int, torch.Tensor] = {}
        self._next_key = 0
        self._prefetched: Optional[tuple[torch.Tensor, int]] = None  # (full tensor being gathered, shard version)
        self.held: Optional[torch.Tensor] = None  # gathered for a whole pipeline step (see hold())
        self._held_grad: Optional[torch.Tensor] = None
        self._held_used: list[bool] = []  # blocks that got a gradient in some microbatch of the held step
        self._depth = 0  # forwards of the unit's runs now open: one nested in another finds it gathered
        self._replay = False  # the open run replays a checkpointed forward inside backward (_post_forward)
        self._replayed_bytes = 0  # gathered for replays: counted in the stats until the unit's backward
        self._step: Optional[tuple[Sequence[torch.Tensor], Stamps]] = None  # an open step's views, stamps
        # gather before the module's own pre-hooks, free after its own hooks: they see the full parameters
        # (torch.nn.utils.weight_norm / spectral_norm compute ``weight`` in a pre-hook). A run: the unit's
        # modules, first to last; and each placement (another holder of a tied weight) alone.
        runs = [(spec.modules[0][1], spec.modules[-1][1])] + [(m, m) for _, m in spec.placements]
        self._handles = [h for first, last in runs
                         for h in (first.register_forward_pre_hook(self._pre_forward, prepend=True),
                                   last.register_forward_hook(self._post_forward))]

    @property
    def trainable(self) -> list[Block]:
        """Blocks whose parameters require gradients (frozen ones get none at all). Read at every use: a
        fine-tuning callback may freeze or unfreeze parameters between steps."""
        return [b for b in self.blocks if b.shard.requires_grad]

    @property
    def shards(self) -> list[nn.Parameter]:
        return [b.shard for b in self.blocks]

    def __deepcopy__(self, memo: dict) -> "FSDPUnit":
        return self  # a process resource (its hooks sit on modules that may be deep-copied)

    def _block(self, member: int, b: Block) -> torch.Tensor:
        """``member``'s rows of ``b``, flat, where they live in shared memory."""
        n = b.rows[member] * b.row_numel
        if self.common is not None:
            lo = b.full_offset + b.row_start(member) * b.row_numel
            return self.common[lo:lo + n]
        assert self.buffer is not None
        return self.buffer.region(member)[b.region_offset:b.region_offset + n]

    def version(self) -> int:
        """Sum of the blocks' version counters: it grows with every in-place write to this rank's rows."""
        return sum(b.shard._version for b in self.blocks)

    def written(self) -> bool:
        """This rank's rows were written in place since the last barrier (``synced_version``)."""
        return self.version() != self.synced_version

    def _meet_if_written(self) -> None:
        """Before reading every rank's blocks: if this rank wrote its own in place since the last barrier -- a hook
        or the step scaling them, as SwAV normalizes its prototypes -- meet the others, who wrote theirs at the same
        point of the same program, so nobody reads a block before its rank has written it."""
        if not self.written():
            return
        assert self.meet is not None, "FSDPState sets meet"
        try:
            self.meet(_ROWS_WRITTEN)
        except CollectiveMismatchError as e:
            raise CollectiveMismatchError(
                f"{e}\nThis rank wrote its rows of FSDP unit '{self.name}' in place since the last barrier and waited "
                "for the others to write theirs before reading them; another rank went on to another collective. "
                "Every rank must write its rows of a parameter at the same point (a change on some ranks only -- "
                "under `if self.global_rank == 0` -- leaves the ranks' rows of one model inconsistent).",
                e.mine, e.theirs, e.peer) from e

    # ------------------------------------------------------------------ gather / free
    def copy_shards_into(self, flat: torch.Tensor) -> None:
        """Every rank's blocks -> the full flat parameters (reads /dev/shm; no collective)."""
        for b in self.blocks:
            for j in range(self.group.size):
                n = b.rows[j] * b.row_numel
                if n:
                    lo = b.full_offset + b.row_start(j) * b.row_numel
                    flat[lo:lo + n].copy_(self._block(j, b))

    def gather_new(self) -> torch.Tensor:
        self._meet_if_written()
        if self.common is not None:
            # A new tensor object on the common storage, not a view of it: autograd must not see the
            # full parameters as a view of the blocks, and gets a version counter of their own.
            return torch.empty(0, dtype=self.dtype).set_(self.common.untyped_storage(),
                                                          self.common.storage_offset(), (self.numel,))
        if self._prefetched is not None:
            full, version = self._prefetched
            self._prefetched = None
            assert self.prefetcher is not None
            self.prefetcher.wait(full)
            if version == self.version():
                return full
            self.free(full)  # the shards changed (optimizer step, load) since it was started
        full = torch.empty(self.numel, dtype=self.dtype)
        self.copy_shards_into(full)
        self.stats.alloc(full)
        return full

    def regather(self, full: torch.Tensor) -> None:
        """Refill a freed full tensor in place. Writes through a storage alias, so the version
        counter that autograd checks on the saved views is untouched."""
        if self.prefetcher is not None:
            self.prefetcher.wait(full)
        view = self._refill_view(full)
        if view is not None:
            self.copy_shards_into(view)

    def _refill_view(self, full: torch.Tensor) -> Optional[torch.Tensor]:
        """Re-allocate a freed full tensor's storage; a storage alias to copy into (None if not freed)."""
        storage = full.untyped_storage()
        if storage.nbytes():
            return None
        storage.resize_(self.numel * full.element_size())
        self.stats.alloc(full)
        return torch.empty(0, dtype=self.dtype).set_(storage, 0, (self.numel,))

    def free(self, full: torch.Tensor) -> None:
        if self.common is None:  # "view": the full parameters are the shared memory itself; keep them
            if self.prefetcher is not None:
                self.prefetcher.wait(full)  # never release memory the helper thread is writing
            storage = full.untyped_storage()
            if storage.nbytes():
                self.stats.release(full)
                storage.resize_(0)
        if self._live is full:
            self._live, self._live_params = None, ()
            self._set_views(None)

    def params_of(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each full parameter as a tensor on ``full``'s storage (not a view: see :class:`_GatherUnit`).
        Sharing the storage, they empty and refill with it when the unit is freed and re-gathered."""
        storage, base = full.untyped_storage(), full.storage_offset()
        params = [torch.empty(0, dtype=self.dtype).set_(storage, base + b.full_offset, b.shape) for b in self.blocks]
        for p in params:  # the class assigned: ``as_subclass`` makes a view, ``_make_subclass`` costs 3.7 us more
            p.__class__ = FullParam
        return params

    def _set_views(self, params: Optional[Sequence[torch.Tensor]]) -> None:
        """During the unit's forward, each owner's attribute is the full parameter: an instance attribute
        shadows the registered block (``named_parameters()`` keeps returning the blocks). None: the block
        again -- or, in an open step, the step's full parameters."""
        if params is None and self._step is not None:
            params = self._step[0]
        for i, b in enumerate(self.blocks):
            for owner, attr in b.owners:
                if params is None:
                    owner.__dict__.pop(attr, None)
                else:
                    owner.__dict__[attr] = params[i]

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter(self, grads: Sequence[Optional[torch.Tensor]],
                       used: Optional[Sequence[bool]] = None) -> list[Optional[torch.Tensor]]:
        """Each trainable parameter's full gradient -> the mean over ranks of this rank's rows: one
        collective for the whole unit (a Linear's weight and bias: one barrier per round, not two).
        ``grads`` has an entry per block; frozen blocks' entries are ignored and get None.

        A parameter this rank's forward did not use (``used``, by default: its gradient is not None)
        contributes zeros; one no rank used gets None, as in one process -- whose optimizer then skips
        it, where a zero gradient would still advance Adam's step count and decay its moments (an
        expert no sample of the batch was routed to). Which ranks used what rides in the same
        collective: W copies of this rank's flags, of which rank j receives the mean of copy j."""
        r, W = self.group.index, self.group.size
        used = [g is not None for g in grads] if used is None else used
        taken = [(i, b, g) for i, (b, g) in enumerate(zip(self.blocks, grads)) if b.shard.requires_grad]
        out: list[Optional[torch.Tensor]] = [None] * len(self.blocks)
        if not taken:
            return out
        flags = torch.tensor([float(used[i]) for i, _, _ in taken], dtype=self.dtype).repeat(W)
        try:
            parts = self.group.reduce_scatter_coalesced(
                [torch.zeros(b.numel, dtype=self.dtype) if g is None else g.reshape(-1) for _, b, g in taken]
                + [flags], "mean", sizes=[[k * b.row_numel for k in b.rows] for _, b, _ in taken] + [[len(taken)] * W],
                across=self.across, site=self.index + 1)
        except CollectiveMismatchError as e:
            raise CollectiveMismatchError(self._out_of_order(e), e.mine, e.theirs, e.peer) from e
        for (i, b, _), part, anywhere in zip(taken, parts, torch.real(parts[-1]).tolist()):  # a complex unit's too
            if anywhere > 0:
                out[i] = part.view(b.rows[r], *b.shape[1:])
        return out

    def _out_of_order(self, e: CollectiveMismatchError) -> str:
        """The runtime's mismatch, said in units: a site is a unit's index + 1 (see :meth:`reduce_scatter`)."""
        theirs = site_of(e.theirs.get("arg", 0)) if e.theirs.get("coll") == e.mine.get("coll") else 0
        if 0 < theirs <= len(self.unit_names):
            said = (f"FSDP units' gradients were reduced in different orders on the ranks (this rank reduced unit "
                    f"'{self.name}'; another unit '{self.unit_names[theirs - 1]}').")
        else:  # not necessarily the units: a collective the other rank made alone (a rank-0-only sync_dist log)
            said = (f"This rank reduced FSDP unit '{self.name}'; another rank entered another collective -- one "
                    "that rank made alone (the notes beside this error say which, where a call is known), or the "
                    "next one after skipping units.")
        return (f"{e}\n{said} Every rank must run every unit's forward and backward in every step, in one order, as "
                "torch's FSDP requires: a unit that some ranks' samples skip -- a unit per expert of a mixture of "
                "experts -- breaks it. Keep such modules in one unit (the default policy takes each child of the "
                "Sequential whole), or use shm_ddp with find_unused_parameters=True.")

    # ------------------------------------------------------------------ a whole step (FSDPState.step_scope)
    def open(self) -> None:
        """Show the full parameters for a whole step (:meth:`FSDPState.step_scope`), until :meth:`close`: what the
        step reads by attribute goes through a gather edge of its own. Made now, it would run its reduce-scatter
        only after every other backward node (autograd runs the newest first), so the layers' forwards keep
        theirs, each released as soon as backward passes the layer; between them the step's views are shown
        again. An edge nothing reads never runs."""
        full = self.gather_new()
        if torch.is_grad_enabled() and self.trainable:
            key, self._next_key = self._next_key, self._next_key + 1
            params = _GatherUnit.apply(self, key, full, *self.shards)
            self.pending[key] = full
        else:
            params = self.params_of(full)
        self._step = (params, _stamps(params))
        self._set_views(params)

    def close(self) -> Optional[tuple[Sequence[torch.Tensor], Stamps]]:
        """End what :meth:`open` began; returns the step's views and their stamps then, for :meth:`check_step`."""
        step, self._step = self._step, None
        self._set_views(None)
        return step

    def check_step(self, step: Optional[tuple[Sequence[torch.Tensor], Stamps]]) -> None:
        """The step (``close``'s return) changed no full parameter in place, else RuntimeError."""
        if step is not None:
            self._check_not_modified(*step, where="the step (through a module's attribute)")

    # ------------------------------------------------------------------ a whole pipeline step
    def hold(self) -> None:
        """Gather now and keep the unit gathered until :meth:`release` (all microbatches of a step). The
        blocks' gradient hooks belong to the step's gradient, so they run in :meth:`release`; the caller
        suspends them meanwhile (autograd would call them with no gradient at every microbatch)."""
        if self.held is None:
            self.held = self.gather_new()

    def accumulate(self, grads: Sequence[torch.Tensor]) -> None:
        """Add each full parameter's gradient of one microbatch to the step's flat full gradient."""
        if self._held_grad is None:
            self._held_grad = torch.zeros(self.numel, dtype=self.dtype)
            self._held_used = [False] * len(self.blocks)
        for i, (b, g) in enumerate(zip(self.blocks, grads)):
            if b.shard.requires_grad and g is not None:
                self._held_grad[b.full_offset:b.full_offset + b.numel].view(b.shape).add_(g)
                self._held_used[i] = True

    def holds(self, tensor: torch.Tensor) -> bool:
        """``tensor`` is one of the held full parameters (a view of the held storage, not a block in it)."""
        held = self.held
        if held is None or tensor.untyped_storage().data_ptr() != held.untyped_storage().data_ptr():
            return False
        return not any(tensor is b.shard for b in self.blocks)  # "view": a block lies in the same storage

    def add_to_held_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> bool:
        """``tensor`` is a view of the held full parameters: add ``grad`` at its place in the step's gradient."""
        if not self.holds(tensor):
            return False
        held = self.held
        if self._held_grad is None:
            self._held_grad = torch.zeros_like(held)
            self._held_used = [False] * len(self.blocks)
        offset = tensor.storage_offset() - held.storage_offset()
        self._held_grad[offset:offset + tensor.numel()].view_as(tensor).add_(grad)
        for i, b in enumerate(self.blocks):
            if b.full_offset < offset + tensor.numel() and offset < b.full_offset + b.numel:
                self._held_used[i] = True
        return True

    def release(self) -> None:
        """End of the step: reduce-scatter the accumulated gradient into the blocks' ``.grad`` (added to
        what is there, as autograd would), free the full tensors."""
        if self._held_grad is not None:
            held_grads = [self._held_grad[b.full_offset:b.full_offset + b.numel] for b in self.blocks]
            for b, g in zip(self.blocks, self.reduce_scatter(held_grads, self._held_used)):
                if g is not None:
                    accumulate_grad(b.shard, g)
            self._held_grad = None
        if self.held is not None:
            self.free(self.held)
            self.held = None
        self._live, self._live_params = None, ()
        self._set_views(None)

    # ------------------------------------------------------------------ prefetch
    def prefetch_gather(self) -> None:
        """Start this unit's forward gather on the helper thread (called from the previous unit)."""
        if self.prefetcher is None or self._prefetched is not None or self.held is not None:
            return
        self._meet_if_written()
        full = torch.empty(self.numel, dtype=self.dtype)
        self.stats.alloc(full)
        self._prefetched = (full, self.version())
        self.prefetcher.submit(full, lambda: self.copy_shards_into(full))

    def prefetch_regather(self) -> None:
        """Start refilling the full tensor of this unit's latest forward (its backward runs next)."""
        if self.prefetcher is None or not self.pending:
            return
        full = self.pending[max(self.pending)]
        view = self._refill_view(full)
        if view is not None:
            self.prefetcher.submit(full, lambda: self.copy_shards_into(view))

    def drop_prefetched(self) -> None:
        if self._prefetched is not None:
            full, _ = self._prefetched
            self._prefetched = None
            self.free(full)

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module: Optional[nn.Module], args: Any) -> None:
        self._depth += 1
        if self._depth > 1:  # a holder called inside another of the unit's runs: its parameters are the full ones
            return
        full = self.held if self.held is not None else self.gather_new()
        # inside a backward: a forward that non-reentrant activation checkpointing replays (see _post_forward)
        self._replay = self.held is None and torch._C._current_graph_task_id() != -1
        grad = torch.is_grad_enabled()
        self._live_grad = grad and bool(self.trainable)
        frozen = grad and not self.trainable and self.held is None and not self._replay  # held: stays gathered
        self._frozen_inputs = [t for t in _tensors(args) if t.requires_grad] if frozen else []
        if self._live_grad:
            key, self._next_key = self._next_key, self._next_key + 1
            params = _GatherUnit.apply(self, key, full, *self.shards)
            if self.held is None and not self._replay:
                self.pending[key] = full
        else:
            params = self.params_of(full)
        self._live, self._live_params = full, params
        self._set_views(params)
        # see _check_not_modified
        self._stamps = _stamps(params)
        if self.next_unit is not None:
            self.next_unit.prefetch_gather()

    def _check_not_modified(self, params: Sequence[torch.Tensor], stamps: Stamps,
                            where: str = "the forward") -> None:
        """A forward must not change the full parameters in place (``nn.Embedding(max_norm=...)`` renormalises
        the rows it looks up): under "view" they are one tensor every rank computes on, and the ranks' changes
        race -- a different model on every run (0.01 and 0.27 off one process after 5 Adam steps); under "copy"
        they are a private copy and the change never reaches the blocks (2.9 off). Nor a step through the
        attribute (``where``), which is the full parameter there: ``w.mul_(0.5)`` by every rank on the shared
        rows would halve some twice. Nor one assigning its ``.data`` (``w.data = w.data * m``): a storage of its own,
        which the next gather replaces with the rows -- the change is lost. Refused when seen (the stamps:
        :func:`_stamps`; a write through ``w.data`` counts: see :class:`FullParam`)."""
        changed = [b.name for b, p, st in zip(self.blocks, params, stamps) if (p._version, p.data_ptr()) != st]
        if changed:
            raise RuntimeError(f"{where} changed parameter(s) {changed} in place or assigned their .data "
                               "(nn.Embedding(max_norm=...) renormalises the rows it looks up): under FSDP the full "
                               "parameters are shared by every rank (gather='view': their changes race) or a private "
                               "copy (gather='copy': the change is lost), so the model would not be one process's. "
                               "Change parameters outside forward, each rank its own rows: in the optimizer step, a "
                               "hook such as on_train_batch_start (where the attributes are the rank's rows) or the "
                               "step through named_parameters(), every rank at the same point -- or use shm_ddp.")

    def _post_forward(self, module: Optional[nn.Module], args: Any, output: Any) -> Any:
        self._depth -= 1
        full, params = self._live, self._live_params
        if self._depth > 0:  # a placement called inside the unit's own run: the run's hooks take care of it
            return output
        if full is not None:
            self._check_not_modified(params, self._stamps)
        if full is not None and self._replay:
            self._end_replay()
            return output
        if full is None or self.held is not None:  # held: stays gathered for the next microbatch
            return output
        # a unit without trainable parameters takes part in backward too when its output carries a
        # gradient (its input does, or a nested unit's parameters): y = x @ W^T -> dx = dy @ W needs W
        through = not self._live_grad and torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(output))
        if self._live_grad or through:
            fired = [False]

            def pre_backward(grad: torch.Tensor) -> torch.Tensor:
                # once per backward through this forward: the first output's gradient, or -- a graph kept with
                # retain_graph=True and differentiated again -- the first one after that backward freed ``full``
                if not fired[0] or self._live is not full:
                    fired[0] = True
                    self.regather(full)
                    # the modules see this forward's full parameters again until the unit's backward
                    # ends (free): activation checkpointing runs their forward once more inside it
                    self._live, self._live_params = full, params
                    self._set_views(params)
                    if self.prev_unit is not None:
                        self.prev_unit.prefetch_regather()
                return grad

            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(pre_backward)
            if through:  # no _GatherUnit backward to free it: the input's gradient, computed after this
                self._free_after_backward(full)  # unit's backward, does (else the next step's drop_pending)
            if self.reshard_after_forward:
                self.free(full)
        else:  # no backward will come (validation, predict): free now
            self.free(full)
        return output

    def _free_after_backward(self, full: torch.Tensor) -> None:
        key, self._next_key = self._next_key, self._next_key + 1
        self.pending[key] = full

        def after_backward(grad: torch.Tensor) -> None:
            self.pending.pop(key, None)
            self.free(full)  # again after a retained graph's next backward

        for t in self._frozen_inputs:
            t.register_hook(after_backward)
        self._frozen_inputs = []

    def _end_replay(self) -> None:
        """Close a replayed run: a forward torch.utils.checkpoint (non-reentrant) recomputes inside backward. The
        tensors it saved -- views of its gather -- are what the original forward's backward nodes now use, so the
        gather must outlive it (freeing it here left them empty: "setStorage: ... out of bounds for storage of size
        0"); those nodes release it as they run, and the original forward's hooks re-gather their own copy. Called
        by the run's post-forward hook, or -- a replay the checkpoint stopped early (by an exception, once it had
        what backward needs), which never reached that hook -- by the unit's backward (:meth:`forget_replays`)."""
        full = self._live
        self._replay, self._depth = False, 0
        if full is not None and self.common is None:  # "copy": a gather of its own, counted in the stats
            self._replayed_bytes += full.untyped_storage().nbytes()
        self._live, self._live_params = None, ()
        self._set_views(None)

    def forget_replays(self) -> None:
        """After the unit's backward (and at a step's start): the replays' gathers leave the stats -- autograd has
        released the views they were saved as (approximately then: the memory goes with the last view)."""
        if self._replay:  # a replay stopped early, before the unit's post-forward hook: over now
            self._end_replay()
        self.stats.live -= self._replayed_bytes
        self._replayed_bytes = 0

    # ------------------------------------------------------------------ clean-up
    def drop_pending(self) -> None:
        """Free full parameters of forwards whose backward never ran (e.g. a skipped step) and any
        prefetched gather not taken."""
        for full in self.pending.values():
            self.free(full)
        self.pending.clear()
        self.forget_replays()
        self._depth = 0  # a forward that raised never closed its run
        self._replay = False
        self.drop_prefetched()
        self._held_grad = None
        if self.held is not None:
            self.free(self.held)
            self.held = None
            self._live, self._live_params = None, ()
            self._set_views(None)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


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


def _sizes(n: int, parts: int) -> list[int]:
    b = even_split(n, parts)
    return [b[i + 1] - b[i] for i in range(parts)]


def _check_unit(spec: UnitSpec) -> None:
    dtypes = {p.dtype for *_, p in spec.params}
    if len(dtypes) != 1:
        raise ValueError(f"FSDP unit '{spec.name}' mixes dtypes {sorted(map(str, dtypes))}; one flat "
                         "parameter needs one dtype")
    scalars = [name for name, _, _, p in spec.params if p.dim() == 0]
    if scalars:
        raise ValueError(f"FSDP shards parameters by rows (dim 0); {scalars} are 0-d: store them with shape (1,)")


def _stamps(params: Sequence[torch.Tensor]) -> Stamps:
    """Each full parameter's version counter (an in-place change) and address (its ``.data`` assigned); none for
    inference tensors, which keep no version counter (evaluation is not checked)."""
    return [] if torch.is_inference_mode_enabled() else [(p._version, p.data_ptr()) for p in params]


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
