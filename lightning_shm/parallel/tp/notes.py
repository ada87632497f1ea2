"""A note on a shape error a user's forward raises around column layers: a width fixed at construction.

A column layer gives each rank its share of the output features (``sizes[rank]`` of ``sum(sizes)``). An attention
written as torch's Llama is -- ``xq.view(B, T, self.n_heads, self.head_dim)`` with ``n_heads`` stored in
``__init__`` -- then asks for every head on a rank that computed half of them, and torch says only "shape '[24, 28,
4, 8]' is invalid for input of size 10752". torch's own tutorial divides ``n_heads`` by the tp size in its
parallelize function; here the plan is applied for the user, so the note names the module whose forward raised,
its column layers and this rank's widths, and the fix (derive the count from the width the rank holds).
"""

from __future__ import annotations

import re
import traceback
from typing import Optional

from torch import nn

from lightning_shm.parallel.tp.layers import ColumnParallelLinear, _ColumnConv

_RESHAPE = re.compile(r"shape '\[[^\]]*\]' is invalid for input of size \d+")  # view / reshape


def note_local_width(root: Optional[nn.Module], exc: BaseException) -> None:
    """If ``exc`` is torch's view / reshape size error raised in the forward of a module (under ``root``) holding
    column layers whose outputs stay split, add a note saying what this rank holds of them."""
    if root is None or not isinstance(exc, RuntimeError) or not _RESHAPE.search(str(exc)):
        return
    names = {id(m): n for n, m in root.named_modules()}
    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):  # the innermost module first
        module = frame.f_locals.get("self")
        if not isinstance(module, nn.Module) or id(module) not in names:
            continue
        columns = [(n, c) for n, c in module.named_children()
                   if isinstance(c, (ColumnParallelLinear, _ColumnConv)) and not getattr(c, "gather_output", False)]
        if not columns:
            continue
        held = ", ".join(f"{n} {c.sizes[c.group.index]} of {sum(c.sizes)}" for n, c in columns)
        exc.add_note(f"'{names[id(module)]}' ({type(module).__name__}) holds column layers split by tensor "
                     f"parallelism; this rank computes part of their outputs ({held} features). A forward that "
                     "reshapes them with a count fixed at construction -- view(B, T, self.n_heads, self.head_dim) -- "
                     "asks for every head on each rank: derive it from the width the rank holds, view(B, T, -1, "
                     "self.head_dim).")
        return
