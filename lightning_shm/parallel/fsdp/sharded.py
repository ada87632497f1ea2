"""Shard a whole module into FSDP units; consolidate and load full (plain) state dicts.

Checkpoints never contain shards: model state uses the plain module's keys and shapes, optimizer
state looks like a single-process optimizer's over the plain parameters. So a checkpoint written
by shm_fsdp on W ranks loads in a single process, in shm_ddp, or in shm_fsdp on another W.

Optimizer state mapping: a state tensor with the shard's shape (momentum, exp_avg, ...) is sharded
like the parameter -- gathered over the group and cut at the original parameter boundaries; any
other state (Adam's scalar ``step``) is identical on every rank and copied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from lightning_shm.parallel.fsdp.policy import PolicyFn, UnitPolicy, find_units
from lightning_shm.parallel.fsdp.prefetch import Prefetcher
from lightning_shm.parallel.fsdp.unit import FSDPUnit, MemoryStats
from lightning_shm.runtime import Group


class ShardedModule:
    """Owns the units of ``module`` on ``group``. Every rank constructs it with the same arguments.

    ``prefetch=True`` gathers the next unit on a helper thread while the current one computes
    (one more unit's full parameters alive at a time); it pays off only with a core to spare.
    """

    def __init__(self, module: nn.Module, group: Group, policy: Union[None, int, PolicyFn, UnitPolicy] = None,
                 reshard_after_forward: bool = True, prefetch: bool = False) -> None:
        self.module = module
        self.group = group
        self.plain_keys = list(module.state_dict().keys())
        self.plain_param_names = [n for n, _ in module.named_parameters()]
        direct = [n for n, _ in module.named_parameters(recurse=False)]
        if direct:
            raise ValueError(f"parameters {direct} belong directly to {type(module).__name__}; FSDP gathers parameters "
                             "in module forward hooks, so they must live in a submodule")
        specs = find_units(module, UnitPolicy.parse(policy))
        if not specs:
            raise ValueError(f"the FSDP unit policy selected no module with parameters in {type(module).__name__} "
                             f"({len(self.plain_param_names)} parameters): nothing to shard")
        self.stats = MemoryStats()
        self.prefetcher = Prefetcher() if prefetch else None
        self.units = [FSDPUnit(spec, group, i, reshard_after_forward, self.stats, self.prefetcher)
                      for i, spec in enumerate(specs)]
        # units are found in module order, which is the Sequential's execution order; for another
        # order a prefetched gather is merely wasted (used later or dropped), never wrong
        for a, b in zip(self.units, self.units[1:]):
            a.next_unit, b.prev_unit = b, a
        self._unit_of = {id(u.shard): u for u in self.units}
        group.barrier()  # every shard is written before any rank gathers

    def begin_step(self) -> None:
        """Call before each training forward: releases leftovers of a forward without backward."""
        for u in self.units:
            u.drop_pending()

    def close(self) -> None:
        """Stop the prefetch thread (if any) after its copies finished."""
        if self.prefetcher is not None:
            for u in self.units:
                u.drop_pending()
            self.prefetcher.close()

    # ------------------------------------------------------------------ model state
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Any]:
        """Plain keys, full tensors. Reads shards from shared memory: no collective, call between steps."""
        if rank0_only and self.group.index != 0:
            return {}
        current = self.module.state_dict()
        full: dict[str, Any] = {}
        for u in self.units:
            full.update(u.full_params())
        out = OrderedDict()
        for k in self.plain_keys:
            out[k] = full[k] if k in full else current[k]
        for k, v in current.items():  # entries that appeared after sharding (not shard parameters)
            if k not in out and "_fsdp_shard_" not in k:
                out[k] = v
        return out

    def load_full_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        missing = [k for u in self.units for k, *_ in u.layout if k not in state_dict]
        if strict and missing:
            raise KeyError(f"checkpoint lacks parameters {missing[:10]}")
        for u in self.units:
            u.load_full_params({k: state_dict[k] for k, *_ in u.layout if k in state_dict})
        unit_keys = {k for u in self.units for k, *_ in u.layout}
        rest = {k: v for k, v in state_dict.items() if k not in unit_keys}
        result = self.module.load_state_dict(rest, strict=False)
        unexpected = [k for k in result.unexpected_keys]
        if strict and unexpected:
            raise KeyError(f"unexpected keys in checkpoint: {unexpected[:10]}")
        self.group.barrier()  # shards rewritten before anyone gathers

    # ------------------------------------------------------------------ optimizer state
    def _shard_unit(self, p: torch.Tensor) -> FSDPUnit:
        u = self._unit_of.get(id(p))
        if u is None:
            raise ValueError("the optimizer holds a parameter that is not an FSDP shard; configure_optimizers must "
                             "use self.parameters() of the sharded module")
        return u

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Consolidated state in the plain single-process format (collective; full on rank 0)."""
        index = {n: i for i, n in enumerate(self.plain_param_names)}
        state: dict[int, dict[str, Any]] = {}
        groups = []
        for group in optimizer.param_groups:
            ids: list[int] = []
            for p in group["params"]:
                u = self._shard_unit(p)
                st = optimizer.state.get(p, {})
                full, sharded = {}, set()
                for k in sorted(st):
                    v = st[k]
                    if torch.is_tensor(v) and v.shape == p.shape:
                        full[k] = self.group.all_gather(v.detach().contiguous()).reshape(-1)[: u.numel]
                        sharded.add(k)
                    else:
                        full[k] = v
                for name, _, _, shape, o, n in u.layout:
                    ids.append(index[name])
                    if st:  # every plain parameter gets its own tensors: a shared Adam `step` would be
                        # incremented once per parameter per step after loading
                        state[index[name]] = {k: (v[o:o + n].view(shape).clone() if k in sharded
                                                  else v.clone() if torch.is_tensor(v) else v)
                                              for k, v in full.items()}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": sorted(ids)})
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> None:
        """Shard a plain optimizer state dict (ids = positions in the plain parameter order)."""
        saved_groups = full["param_groups"]
        group_of = {i: g for g in saved_groups for i in g["params"]}
        index = {n: i for i, n in enumerate(self.plain_param_names)}
        r = self.group.index
        new_state: dict[int, dict[str, Any]] = {}
        new_groups = []
        pid = 0
        for group in optimizer.param_groups:
            hyper: Optional[dict[str, Any]] = None
            ids = []
            for p in group["params"]:
                u = self._shard_unit(p)
                plain = [index[name] for name, *_ in u.layout]
                if hyper is None:
                    hyper = group_of.get(plain[0])
                per_param = [full["state"].get(i, full["state"].get(str(i))) for i in plain]
                if all(s for s in per_param):
                    st: dict[str, Any] = {}
                    for k, v0 in per_param[0].items():
                        if torch.is_tensor(v0) and v0.dim() > 0:
                            flat = torch.zeros(u.padded_numel, dtype=v0.dtype)
                            for (_, _, _, shape, o, n), s in zip(u.layout, per_param):
                                flat[o:o + n].copy_(s[k].reshape(-1))
                            st[k] = flat[r * u.shard_numel:(r + 1) * u.shard_numel].clone()
                        else:
                            st[k] = v0.clone() if torch.is_tensor(v0) else v0
                    new_state[pid] = st
                ids.append(pid)
                pid += 1
            base = {k: v for k, v in (hyper or {}).items() if k != "params"}
            new_groups.append({**{k: v for k, v in group.items() if k != "params"}, **base, "params": ids})
        optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})

    # ------------------------------------------------------------------ accounting
    def persistent_bytes(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
        """Bytes this rank keeps between steps: shards, their gradients, optimizer state."""
        params = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        grads = sum(u.shard.grad.numel() * u.shard.grad.element_size() for u in self.units
                    if u.shard.grad is not None)
        opt = 0
        if optimizer is not None:
            for st in optimizer.state.values():
                opt += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        return {"params": params, "grads": grads, "optimizer": opt}
