"""A tensor-parallel module and its full (plain) state: consolidation for checkpoints, slicing on load.

Every parameter of a parallel layer is either split along one dimension (``split_dims``) or
replicated. Consolidation gathers the split ones over the tp group (uneven sizes allowed) and
concatenates along that dimension; optimizer state tensors shaped like their parameter are treated
the same way, scalar ones (Adam's ``step``) are copied. The result uses the plain module's keys,
so a single process, shm_ddp or shm_tp with another size can load it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import nn

from lightning_shm.parallel.optim_state import load_plain_optimizer_state
from lightning_shm.parallel.sequential import find_sequential
from lightning_shm.parallel.tp.plan import apply_plan, derive_plan, normalise_plan
from lightning_shm.runtime import Group


class TensorParallelModule:
    """Applies a plan to ``module``'s Sequential on ``group`` (the tp group) and tracks the splits."""

    def __init__(self, module: nn.Module, group: Group, plan: Optional[Mapping[str, str]] = None,
                 sequential: Optional[str] = None) -> None:
        self.module, self.group = module, group
        prefix, seq = find_sequential(module, sequential)
        self.plan = normalise_plan(plan, seq, prefix) if plan is not None else derive_plan(seq, prefix)
        self.parallel = apply_plan(seq, self.plan, prefix, group)
        # parameter name -> (split dim, sizes) for split parameters; absent = replicated
        self.splits: dict[str, tuple[int, list[int]]] = {}
        for qname, mod in self.parallel.items():
            for pname, dim in mod.split_dims.items():
                if dim is not None and getattr(mod, pname, None) is not None:
                    self.splits[f"{qname}.{pname}"] = (dim, mod.sizes)
        self.param_names = [n for n, _ in module.named_parameters()]
        self.replicated = [p for n, p in module.named_parameters() if n not in self.splits]

    # ------------------------------------------------------------------ gather / slice
    def _gather(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        moved = t.detach().movedim(dim, 0).contiguous()
        parts = self.group.all_gather_v(moved.reshape(-1))
        rest = tuple(moved.shape[1:])
        full = torch.cat([p.view(s, *rest) for p, s in zip(parts, sizes)], dim=0)
        return full.movedim(0, dim).contiguous()

    def _slice(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        lo = sum(sizes[: self.group.index])
        return t.narrow(dim, lo, sizes[self.group.index]).clone()

    # ------------------------------------------------------------------ model state
    def full_state_dict(self) -> dict[str, Any]:
        """Collective over the tp group; every member returns the full dict."""
        out = {}
        for k, v in self.module.state_dict().items():
            out[k] = self._gather(v, *self.splits[k]) if k in self.splits else v
        return out

    def load_full_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        local = {k: (self._slice(v, *self.splits[k]) if k in self.splits else v) for k, v in state_dict.items()}
        self.module.load_state_dict(local, strict=strict)

    # ------------------------------------------------------------------ optimizer state
    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        index = {n: i for i, n in enumerate(self.param_names)}
        state, groups = {}, []
        for group in optimizer.param_groups:
            ids = []
            for p in group["params"]:
                name = names[id(p)]
                ids.append(index[name])
                st = optimizer.state.get(p, {})
                full = {}
                for k in sorted(st):
                    v = st[k]
                    if name in self.splits and torch.is_tensor(v) and v.shape == p.shape:
                        full[k] = self._gather(v, *self.splits[name])
                    else:
                        full[k] = v.clone() if torch.is_tensor(v) else v
                if st:
                    state[index[name]] = full
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> None:
        """``full`` uses ids = positions in the plain parameter order (what a plain optimizer saves)."""

        def convert(name: str, key: str, v: Any) -> Any:
            if name in self.splits and torch.is_tensor(v) and v.dim() > 0:
                return self._slice(v, *self.splits[name])
            return v.clone() if torch.is_tensor(v) else v

        load_plain_optimizer_state(optimizer, full, self.module, self.param_names, convert)

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())
