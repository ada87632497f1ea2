"""Loading a plain optimizer state (as a single process saves it) into an optimizer over model pieces.

A plain state dict numbers parameters as one process's optimizer does (``plain_ids``: parameter name
-> id). A rank holding slices (TP), shards (FSDP) or stages (pipeline) of the model has its own
optimizer over its own parameters, which still carry their plain names; ``convert(name, key,
value)`` turns a plain state entry into this rank's piece.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn


def load_plain_optimizer_state(optimizer: torch.optim.Optimizer, full: Mapping[str, Any], module: nn.Module,
                               plain_ids: Mapping[str, int], convert: Callable[[str, str, Any], Any]) -> None:
    names = {id(p): n for n, p in module.named_parameters()}
    index = plain_ids
    saved_group = {i: g for g in full["param_groups"] for i in g["params"]}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    pid = 0
    for group in optimizer.param_groups:
        ids, hyper = [], None
        for p in group["params"]:
            name = names[id(p)]
            i = index[name]
            hyper = hyper or saved_group.get(i)
            st = full["state"].get(i, full["state"].get(str(i)))
            if st:
                state[pid] = {k: convert(name, k, v) for k, v in st.items()}
            ids.append(pid)
            pid += 1
        base = {k: v for k, v in (hyper or {}).items() if k != "params"}  # lr etc. as saved
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **base, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
