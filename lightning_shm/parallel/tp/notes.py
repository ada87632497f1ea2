"""A note on a shape error a user's forward raises around column layers: a width fixed at construction.

A column layer gives each rank its share of the output features (``sizes[rank]`` of ``sum(sizes)``). An attention
written as torch's Llama is -- ``xq.view(B, T, self.n_heads, self.head_dim)`` with ``n_heads`` stored in
``__init__`` -- then asks for every head on a rank that computed half of them, and torch says only "shape '[24, 28,
4, 8]' is invalid for input of size 10752". torch's own tutorial divides ``n_heads`` by the tp size in its
parallelize function; here the plan is applied for the user, so the note names the module whose forward raised,
its column layers and this rank's widths, and the fix (derive the count from the width the rank holds).

nanoGPT cuts its fused q, k, v projection at the width it stored, ``self.c_attn(x).split(self.n_embd, dim=2)``: on a
rank holding a third of each part that gives two pieces, and Python says only "not enough values to unpack
(expected 3, got 2)". The note then says to cut the output into its parts (``.chunk(3, dim=2)``).

Grouped-query attention with fewer kv heads than tp ranks gives each rank one kv head and some of its group's q heads
(:class:`~lightning_shm.parallel.tp.layers.KVHeadsLinear`). Hugging Face's ``repeat_kv(k, self.num_key_value_groups)``
repeats it by the count of the whole group, and torch says only "The size of tensor a (2) must match the size of
tensor b (4) at non-singleton dimension 1". The note then says to repeat by ``q.shape[1] // k.shape[1]`` or let
torch's SDPA pair the heads (``enable_gqa=True``).

A tensor with an entry per head -- gpt-oss's attention sinks, ALiBi's slopes, T5's relative position bias -- left out
of the plan stays whole and meets the rank's heads with every head's entries: "Sizes of tensors must match except in
dimension 3", or the size error above. The note names the tensors with as many entries as a column layer's heads and
the plan style that cuts them, ``"per_head"``.
"""

from __future__ import annotations

import re
import traceback
from typing import Optional

from torch import nn

from lightning_shm.parallel.tp.layers import (
    ColumnParallelLinear,
    KVHeadsLinear,
    RowParallelEmbedding,
    RowParallelLinear,
    _ColumnConv,
    _SplitConv,
)

_RESHAPE = re.compile(r"shape '\[[^\]]*\]' is invalid for input of size \d+")  # view / reshape
_UNPACK = re.compile(r"(not enough|too many) values to unpack")  # q, k, v = y.split(stored width)
_HEADS = re.compile(r"size of tensor a \(\d+\) must match the size of tensor b \(\d+\) at non-singleton dimension")
_JOINED = re.compile(r"Sizes of tensors must match except in dimension")  # torch.cat of the rank's and all heads
_SPLIT = (ColumnParallelLinear, RowParallelLinear, KVHeadsLinear, _SplitConv, RowParallelEmbedding)


def note_local_width(root: Optional[nn.Module], exc: BaseException) -> None:
    """If ``exc`` is torch's view / reshape size error, or Python's unpacking one, raised in the forward of a module
    (under ``root``) holding column layers whose outputs stay split, add a note saying what this rank holds of them."""
    reshaped = isinstance(exc, RuntimeError) and _RESHAPE.search(str(exc))
    unpacked = isinstance(exc, ValueError) and _UNPACK.search(str(exc))
    repeated = isinstance(exc, RuntimeError) and _HEADS.search(str(exc))
    joined = isinstance(exc, RuntimeError) and _JOINED.search(str(exc))
    if root is None or not (reshaped or unpacked or repeated or joined):
        return
    names = {id(m): n for n, m in root.named_modules()}
    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):  # the innermost module first
        module = frame.f_locals.get("self")
        if not isinstance(module, nn.Module) or id(module) not in names:
            continue
        columns = [(n, c) for n, c in module.named_children()
                   if isinstance(c, (ColumnParallelLinear, _ColumnConv, KVHeadsLinear))
                   and not getattr(c, "gather_output", False)]
        shared = [n for n, c in columns if isinstance(c, KVHeadsLinear)]
        whole = _whole_per_head(module, columns, names[id(module)]) if repeated or joined else ""
        if not columns or ((repeated or joined) and not (shared or whole)):
            continue
        held = ", ".join(f"{n} {_width(c)}" for n, c in columns)
        if whole:
            exc.add_note(f"'{names[id(module)]}' ({type(module).__name__}) holds column layers split by tensor "
                         f"parallelism (features on this rank: {held}), and {whole} as many entries as a column "
                         "layer's heads, whole on every rank: if it has an entry per head (attention sinks, ALiBi "
                         "slopes, a relative position bias), the rank's heads meet every head's entries. Plan it "
                         "'per_head' ({'style': 'per_head', 'dim': d} for its dim of heads d), so each rank keeps "
                         "its heads' entries.")
            return
        if repeated:
            exc.add_note(f"'{names[id(module)]}' ({type(module).__name__}) is grouped-query attention with fewer kv "
                         f"heads than tp ranks: this rank computes one kv head ({', '.join(shared)}), which other "
                         f"ranks compute too, and some of its group's q heads (features on this rank: {held}). A "
                         "forward that repeats k and v by a count fixed at construction -- repeat_kv(k, "
                         "self.num_key_value_groups) -- repeats them for the whole group: repeat by q.shape[1] // "
                         "k.shape[1], or let scaled_dot_product_attention pair the heads (enable_gqa=True).")
            return
        said = f"'{names[id(module)]}' ({type(module).__name__}) holds column layers split by tensor parallelism; " \
               f"this rank computes part of their outputs ({held} features). "
        if reshaped:
            said += ("A forward that reshapes them with a count fixed at construction -- view(B, T, self.n_heads, "
                     "self.head_dim) -- asks for every head on each rank: derive it from the width the rank holds, "
                     "view(B, T, -1, self.head_dim).")
        else:
            said += ("A forward that cuts a fused projection's output at a width fixed at construction -- q, k, v = "
                     "self.c_attn(x).split(self.n_embd, dim=2) -- cuts the whole width, which no rank holds: cut it "
                     "into its parts, .chunk(3, dim=2), and plan the layer {'style': 'column', 'blocks': 3}.")
        exc.add_note(said)
        return


def _whole_per_head(module: nn.Module, columns: list[tuple[str, nn.Module]], name: str) -> str:
    """"'<path>' (shape [...])" for each tensor of ``module`` outside its split layers with a dimension of as many
    entries as a column layer has heads (its ``head_dim``); "" for none."""
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        return ""
    heads = {c.full_out_features // head_dim for _, c in columns if isinstance(c, ColumnParallelLinear)
             and c.blocks == 1}
    split = [n for n, c in module.named_modules() if isinstance(c, _SPLIT)]
    found = [f"'{name}.{n}' (shape {list(t.shape)})"
             for n, t in [*module.named_parameters(), *module.named_buffers()]
             if not any(n.startswith(f"{s}.") for s in split) and heads & set(t.shape)]
    return ("holds " + ", ".join(found) + " with") if found else ""


def _width(c: nn.Module) -> str:
    """What this rank holds of column layer ``c``'s output features (of each part, for a fused one)."""
    if isinstance(c, KVHeadsLinear):
        return f"{c.out_features} of {c.full_out_features}"
    mine, whole, k = c.sizes[c.group.index], sum(c.sizes), getattr(c, "blocks", 1)
    return f"{mine} of {whole}" if k == 1 else f"{k} x {mine} of {k} x {whole}"
