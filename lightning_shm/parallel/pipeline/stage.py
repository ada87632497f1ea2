"""A pipeline rank's share of the model, and its full (plain) state for checkpoints.

:class:`PipelineStage` replaces the model's ``nn.Sequential`` on every rank. It holds only this
rank's layers, registered under their original names (``net.1.weight`` stays ``net.1.weight``),
so the rank's state dict is a subset of the plain one and the optimizer sees only local parameters.

The model's own step code still calls ``self.net(x)``; what that call does depends on the engine:

* ``capture`` (first chunk): raise :class:`CapturedInput` carrying ``x`` -- the engine learns the
  Sequential's input without knowing how the step builds it from the batch;
* ``last`` (last chunk): ignore ``x`` and return ``chunk(activation received from the previous
  stage)``, so the step computes its loss and logs as usual.

Called outside the schedule it raises: one stage cannot compute the whole model.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from lightning_shm.parallel.optim_state import load_plain_optimizer_state
from lightning_shm.runtime import Group


class CapturedInput(BaseException):
    """Carries the Sequential's input out of the user's step (BaseException: user ``except Exception`` can't eat it)."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__("pipeline input captured")
        self.x = x


class PipelineStage(nn.Module):
    """The layers of ``seq`` in this rank's chunks. ``starts`` are the V chunk start indices."""

    def __init__(self, seq: nn.Sequential, starts: Sequence[int], chunk_ids: Sequence[int]) -> None:
        super().__init__()
        children = list(seq.named_children())
        bounds = list(starts) + [len(children)]
        chunks: dict[int, nn.Sequential] = {}
        for c in chunk_ids:
            named = children[bounds[c]:bounds[c + 1]]
            for name, module in named:
                self.add_module(name, module)
            chunks[c] = nn.Sequential(OrderedDict(named))
        object.__setattr__(self, "chunks", chunks)  # not registered: no duplicate parameter names
        object.__setattr__(self, "layer_ranges", {c: (bounds[c], bounds[c + 1]) for c in chunk_ids})
        self.mode: Optional[tuple[str, Any]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            raise RuntimeError("this module is one stage of a pipeline (shm_pipeline); it only runs inside the "
                               "pipeline schedule -- call the LightningModule's step through the Trainer")
        kind, payload = self.mode
        if kind == "capture":
            raise CapturedInput(x)
        activation, chunk = payload
        return chunk(activation)


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Cut every tensor with a leading batch dimension into ``parts`` microbatches (uneven allowed)."""
    size = batch_size(batch)
    if size is None:
        raise ValueError("cannot split a batch without tensors into microbatches")

    def cut(obj: Any) -> list[Any]:
        if isinstance(obj, torch.Tensor) and obj.dim() > 0 and obj.shape[0] == size:
            return list(torch.tensor_split(obj, parts))
        if isinstance(obj, (list, tuple)):
            cols = [cut(o) for o in obj]
            return [type(obj)(c[i] for c in cols) if isinstance(obj, tuple) else [c[i] for c in cols]
                    for i in range(parts)]
        if isinstance(obj, dict):
            cols = {k: cut(v) for k, v in obj.items()}
            return [{k: cols[k][i] for k in obj} for i in range(parts)]
        return [obj] * parts

    return cut(batch)


def batch_size(batch: Any) -> Optional[int]:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for item in items:
        n = batch_size(item)
        if n is not None:
            return n
    return None


class PipelineState:
    """Consolidates / distributes the plain state of a module split across the pp group."""

    def __init__(self, module: nn.Module, group: Group, plain_keys: list[str], plain_params: list[str]) -> None:
        self.module, self.group = module, group
        self.plain_keys, self.plain_params = plain_keys, plain_params

    def full_state_dict(self) -> dict[str, Any]:
        """Collective over the pp group: the union of every stage's tensors, in plain key order."""
        pieces = self.group.all_gather_object(self.module.state_dict())
        merged: dict[str, Any] = {}
        for piece in pieces:
            merged.update(piece)
        out = OrderedDict((k, merged[k]) for k in self.plain_keys if k in merged)
        out.update((k, v) for k, v in merged.items() if k not in out)
        return out

    def load_full_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        local = set(self.module.state_dict())
        missing = sorted(local - set(state_dict))
        if strict and missing:
            raise KeyError(f"checkpoint lacks {missing[:10]}")
        self.module.load_state_dict({k: v for k, v in state_dict.items() if k in local}, strict=strict)

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        index = {n: i for i, n in enumerate(self.plain_params)}
        local_state, local_groups = {}, []
        for group in optimizer.param_groups:
            ids = [index[names[id(p)]] for p in group["params"]]
            for p, i in zip(group["params"], ids):
                st = optimizer.state.get(p)
                if st:
                    local_state[i] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
            local_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        pieces = self.group.all_gather_object((local_state, local_groups))
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        for st, grps in pieces:
            state.update(st)
            for gi, g in enumerate(grps):
                if gi == len(groups):
                    groups.append({**g, "params": []})
                groups[gi]["params"] = sorted(groups[gi]["params"] + g["params"])
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> None:
        load_plain_optimizer_state(optimizer, full, self.module, self.plain_params,
                                   lambda name, key, v: v.clone() if torch.is_tensor(v) else v)
