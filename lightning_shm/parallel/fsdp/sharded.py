"""Shard a whole module into FSDP units over a group; the rules that keep every rank's reads valid.

Rule: every rank reads every rank's shards without a collective -- when it gathers (``gather="copy"``)
or all through its forward and backward (``"view"``: the full parameters are the shards). So shards may
only change between two barriers: one before (nobody is still reading the old values -- another
rank may be in a forward without gradients, or a prefetch, while this one has moved on) and one
after (nobody gathers before every rank has written). The changes are the optimizer's step and
loading a checkpoint (or an averaged model): :meth:`FSDPState.watch` puts both barriers around
every ``optimizer.step()`` (fused optimizers included); :meth:`before_shards_written` and
:meth:`after_shards_written` are the barriers for everything else that writes them.

A user's own write of the rank's rows in place (``named_parameters()`` gives them; SwAV normalizes its
prototypes at the top of the step): the strategy calls :meth:`before_shards_written` before each training
batch's hooks, and a unit about to gather blocks this rank wrote since the last barrier meets the others first
(:meth:`FSDPUnit.written`) -- every rank writes its rows at the same point of the same program::

    rank 0:  | barrier | w0 *= 0.9 | meet | forward reads w0, w1 |
    rank 1:  | barrier | ...... w1 *= 0.9 | meet | forward reads w0, w1 |

The version counters say what was written, so a batch that writes nothing pays one barrier, not one per unit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Collection, Iterator, Optional, Union

import torch
from torch import nn

from lightning_shm.parallel.fsdp.policy import PolicyFn, UnitPolicy, find_units, kept_whole, split_off_other_dtypes
from lightning_shm.parallel.fsdp.prefetch import Prefetcher
from lightning_shm.parallel.fsdp.unit import FSDPUnit, MemoryStats, check_gather, refuse_gradients_of_shards
from lightning_shm.parallel.outside_reads import differentiations
from lightning_shm.parallel.placement import Placement, Split
from lightning_shm.runtime import Group


class FSDPState:
    """Owns the units of ``module`` on ``group``. Every rank constructs it with the same arguments.

    ``gather``: "view" (default) -- the full parameters are one shared tensor every rank maps, each
    rank's rows a slice of it -- or "copy", FSDP's textbook gather into private memory around each
    unit's compute (see :mod:`.unit`). With "copy", ``reshard_after_forward=False`` keeps a unit's
    copy from its forward to its backward, and ``prefetch=True`` gathers the next unit on a helper
    thread while the current one computes (one more unit's full parameters alive at a time; it pays
    off only with a core to spare).
    """

    def __init__(self, module: nn.Module, group: Group, policy: Union[None, int, PolicyFn, UnitPolicy] = None,
                 reshard_after_forward: bool = True, prefetch: bool = False,
                 layers: Optional[list[tuple[str, nn.Module]]] = None,
                 across: Optional[Callable[[torch.Tensor], None]] = None, gather: str = "view",
                 tied: Optional[set[int]] = None, sliced: Collection[str] = ()) -> None:
        check_gather(gather, reshard_after_forward, prefetch)
        self.module = module
        self.group = group
        self.across = across
        specs = find_units(module, UnitPolicy.parse(policy), layers, tied)
        # whole on every rank, gradients averaged
        self.replicated = {**kept_whole(module, tied), **split_off_other_dtypes(specs)}
        self._averaging: dict[int, Any] = {}  # id -> hook handle, for those requiring gradients
        self._follow_requires_grad()
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for m in module.modules():
            for attr, p in m._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((m, attr))
        self.stats = MemoryStats()
        self.prefetcher = Prefetcher() if prefetch else None
        self.units = [FSDPUnit(spec, group, i, reshard_after_forward, self.stats, owners, self.prefetcher, across,
                               gather) for i, spec in enumerate(specs)]
        # units are found in module order, which is the Sequential's execution order; for another
        # order a prefetched gather is merely wasted (used later or dropped), never wrong
        for a, b in zip(self.units, self.units[1:]):
            a.next_unit, b.prev_unit = b, a
        for u in self.units:
            u.unit_names = [v.name for v in self.units]
            u.meet = self.after_shards_written
        # what step_scope shows: every unit under "view", but those holding a tensor-parallel slice (``sliced``:
        # names), whose read in the step must stay visible to the check that refuses such reads
        self._step_units = [u for u in self.units if not any(b.name in sliced for b in u.blocks)] \
            if gather == "view" else []
        self._shards = {id(b.shard) for u in self.units for b in u.blocks}
        self._shard_names = {id(b.shard): b.name for u in self.units for b in u.blocks}
        self._watched: list[Any] = []
        self.after_shards_written()

    # ------------------------------------------------------------------ the rule
    def before_shards_written(self) -> None:
        """Every rank has stopped reading the current shards (a barrier): now they may be written."""
        for u in self.units:
            u.drop_prefetched()  # a gather in flight reads every rank's shards
        self.group.barrier()

    def after_shards_written(self, why: int = 0) -> None:
        """Every rank has written its shards: nobody gathers before all have (a barrier; ``why``: its reason's code)."""
        self.group.barrier(why=why)
        for u in self.units:
            u.synced_version = u.version()

    def watch(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Put every step of these optimizers (those updating shards) between the two barriers."""
        for opt in optimizers:
            if any(id(p) in self._shards for g in opt.param_groups for p in g["params"]):
                self._watched.append(opt.register_step_pre_hook(lambda *_: self.before_shards_written()))
                self._watched.append(opt.register_step_post_hook(lambda *_: self.after_shards_written()))

    # ------------------------------------------------------------------ state
    def _follow_requires_grad(self) -> None:
        """Average the gradient of every replicated parameter that requires one now (a fine-tuning callback
        may unfreeze some between steps; a hook cannot sit on a tensor without gradient)."""
        for p in self.replicated.values():
            if p.requires_grad and id(p) not in self._averaging:
                self._averaging[id(p)] = p.register_post_accumulate_grad_hook(self._average)

    def _average(self, param: torch.Tensor) -> None:
        """A replicated parameter's gradient, as it accumulates: the mean over the group (and the other
        nodes). Linear, so averaging again after a later microbatch's accumulation is still the mean."""
        assert param.grad is not None
        self.group.all_reduce(param.grad, "mean", across=self.across)

    def placements(self, base: Optional[dict[str, Placement]] = None) -> dict[str, Placement]:
        """Each sharded entry's placement: ``base`` (e.g. a tensor-parallel slice) cut once more by rows;
        each replicated one's: ``base`` held by every rank of the group."""
        base = base or {}
        names: dict[int, list[str]] = {}
        for n, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        out = {}
        for u in self.units:
            for b in u.blocks:
                split = Split(self.group, 0, tuple(b.rows))
                for n in names.get(id(b.shard), []):
                    out[n] = base.get(n, Placement()).then(split)
        for p in self.replicated.values():
            for n in names.get(id(p), []):
                out[n] = base.get(n, Placement()).replicated(self.group.size)
        return out

    def shards(self) -> Iterator[nn.Parameter]:
        for u in self.units:
            yield from u.shards

    # ------------------------------------------------------------------ steps
    def begin_step(self) -> None:
        """Call before each forward pass of the model: releases leftovers of a forward without backward
        (or a held step whose gradients were never taken). Shards written since the last barrier (a hook, a callback
        such as StochasticWeightAveraging copying its average in) are met about at their unit's next gather."""
        for u in self.units:
            u.drop_pending()
        self._follow_requires_grad()

    @contextlib.contextmanager
    def step_scope(self) -> Iterator[None]:
        """Around a step (``gather="view"``): every unit shows its full parameters for the whole step, so what the
        step reads by attribute itself -- a tied head's ``F.linear(h, self.wte.weight)``, a weight's norm in the
        loss -- is the full parameter its layers compute with, and its gradient goes back through the unit's
        reduce-scatter (:meth:`FSDPUnit.open`; the layers' forwards gather and reduce-scatter as before). Free
        under "view": the full parameters are the shared rows; under "copy" it would keep the whole model's
        private copy for the step, so it does nothing there (``parameters()`` stays the rank's rows in both:
        the optimizer's, and a penalty over them is refused). Under both, a gradient the step asks
        ``torch.autograd.grad`` for with respect to the rank's rows is refused before it is taken
        (:func:`.unit.refuse_gradients_of_shards`: the rows of every rank's mean, not this rank's gradient; under
        "copy" the gather it freed was also gone for the step's own backward)."""
        steps = []
        for u in self._step_units:
            u.open()
        try:
            with differentiations(self._shard_names, refuse=refuse_gradients_of_shards):
                yield
        finally:
            steps = [(u, u.close()) for u in self._step_units]
        for u, step in steps:  # once every unit shows its rows again (not after a failed step: its error stands)
            u.check_step(step)

    def hold(self) -> None:
        """Pipelines: from now on each unit, once gathered, stays gathered for every microbatch of the step."""
        for u in self.units:
            u.hold()

    def release(self) -> None:
        """End of a pipeline step: one reduce-scatter per parameter of the summed gradient; free."""
        for u in self.units:
            u.release()

    def holds(self, tensor: torch.Tensor) -> bool:
        """``tensor`` is one of a held unit's full parameters: :meth:`grad_sink` takes its gradient."""
        return any(u.holds(tensor) for u in self.units)

    def grad_sink(self, tensor: torch.Tensor, grad: torch.Tensor) -> bool:
        """Add ``grad`` to the held unit's gradient if ``tensor`` is one of its full parameters (a
        zero-bubble pipeline computes weight gradients outside autograd); False if it is none of ours."""
        for u in self.units:
            if u.add_to_held_grad(tensor, grad):
                return True
        return False

    def close(self) -> None:
        """Stop the prefetch thread (if any) after its copies finished; stop watching optimizers and
        averaging gradients."""
        for h in self._watched + list(self._averaging.values()):
            h.remove()
        self._watched.clear()
        self._averaging.clear()
        for u in self.units:
            u.drop_pending()
        if self.prefetcher is not None:
            self.prefetcher.close()

    # ------------------------------------------------------------------ accounting
    def persistent_bytes(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
        """Bytes this rank keeps between steps: shards, their gradients, optimizer state."""
        shards = list(self.shards())
        params = sum(p.numel() * p.element_size() for p in shards)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in shards if p.grad is not None)
        opt = 0
        if optimizer is not None:
            for st in optimizer.state.values():
                opt += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        return {"params": params, "grads": grads, "optimizer": opt}

