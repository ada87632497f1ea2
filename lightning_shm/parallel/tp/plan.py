"""Tensor-parallel plans: which layers are split how, as data keyed by qualified module name.

A plan maps module paths relative to the LightningModule -- each path component matched shell-style, ``*``
a whole one (as Hugging Face models declare their ``tp_plan``), ``layer*`` or ``[0-3]`` a part of one (as torch's
``parallelize_module`` matches its plans) -- to a style::

    {"net.*.attn.q": "column", "net.*.attn.k": "column", "net.*.attn.v": "column",
     "net.*.attn.o": "row", "net.*.mlp.fc1": "column", "net.*.mlp.fc2": "row"}

* ``"column"``: ``Linear`` / ``Conv1d`` / ``Conv2d`` / ``Conv3d`` (or ``ConvTranspose1d`` / ``2d`` / ``3d``) output
  features (channels) split; input replicated.
* ``"column_gathered"``: a ``Linear`` split like ``"column"`` whose outputs are all-gathered, so
  everything after it runs replicated on the whole features (Megatron's ``gather_output``; Hugging
  Face's ``"colwise_rep"``). One collective forward, none backward, no row layer needed.
* ``"row"``: input features (channels) split; partial outputs all-reduced; bias added once. On an
  ``nn.Embedding``: its vocabulary split (the table's rows; Megatron's vocab-parallel embedding), ids in, whole
  rows out -- no column layer before it.
* ``"row_split_input"``: a ``Linear`` split like ``"row"`` whose input every rank holds whole -- after a
  ``"column_gathered"`` layer, or replicated code: it takes the rank's features of it itself (Megatron's
  ``input_is_parallel=False``; Hugging Face's ``"rowwise_split_input"`` / ``"rowwise_rep"``, torch's
  ``RowwiseParallel(input_layouts=Replicate())``). Phi-3 plans its fused projections so: ``qkv_proj`` (q, k and
  v of unequal widths) and ``gate_up_proj`` gathered, ``o_proj`` and ``down_proj`` splitting their whole input.
* ``"replicate"``: every rank holds the whole layer (the default for anything not planned).
* ``"heads"``: torch's ``nn.MultiheadAttention`` split by its heads, input and output whole
  (:mod:`~lightning_shm.parallel.tp.attention`).
* ``"between"``: a norm (LayerNorm, BatchNorm, InstanceNorm, GroupNorm) or a grouped convolution that a block's own
  ``forward`` runs on a column layer's output before the row layer -- a ResNet block's ``bn1`` between ``conv1``
  and ``conv2``. It runs on the rank's features, as between a pair inside a Sequential (found there without
  being planned); its column layer is the sibling column layer with as many output features.
* ``{"style": "column", "head_dim": 16}``: split on whole attention heads (multiples of 16). Without
  it, a layer whose parent module has an int ``head_dim`` attribute is split on that. Grouped-query attention (k
  and v with fewer heads than q, a number dividing q's) is split by kv groups, a rank's q heads with the kv heads
  they attend with; with fewer kv heads than ranks each rank computes its group's kv head
  (:func:`.sizes.kv_group_splits`).
* ``"on_heads"``: a module with whole parameters that the forward runs on the rank's heads (split features):
  qk-norm's ``LayerNorm(head_dim)`` / ``RMSNorm(head_dim)`` on q and k after the column layers (Qwen3, OLMo 2,
  timm's ``qk_norm``). Each rank's gradient then comes from its heads only; it is summed over the tp group
  (the gradient's hook), so every rank steps the whole one, as one process. One whose gradient is the same on
  every rank (it runs on whole features) is stopped at its first backward (:mod:`.apply`).
* ``"per_head"`` on a parameter or buffer path (``{"style": "per_head", "dim": 1}`` for another dim than 0): a tensor
  with an entry per attention head that the forward applies to the rank's heads -- gpt-oss's attention sinks
  ``[H]``, ALiBi's slopes ``[H]``, T5's relative position bias ``nn.Embedding(buckets, H).weight`` (dim 1): cut as
  the column layer of as many heads beside it splits its heads (:mod:`.check`).
* ``{"style": "column", "blocks": 3}``: a Linear whose output the module's forward cuts into 3 equal parts -- a
  fused q, k, v projection (nanoGPT's ``c_attn``, timm's ``qkv``), a fused gate and up projection (``blocks: 2``):
  each rank holds its slice of each part (on whole heads with a ``head_dim``). A column Linear with k times the
  output features of every row layer beside it must say its blocks (``1`` if its output is one part after all).

Where the plan comes from, first found wins: the strategy's ``plan=``; else the module's ``tp_plan``
attribute; else it is derived for the model's ``nn.Sequential`` (Linear layers paired column -> row,
convolutions likewise -- each with one of its own dimensions --, a leftover replicated; a Linear whose
successor is small is gathered instead, see :func:`.derive.derive_plan`) and for torch's own transformer blocks
wherever the model holds them (:func:`.derive.torch_blocks_plan`).

Inside an ``nn.Sequential``, the children between a column layer and the row layer after it run on
the split features: a LayerNorm becomes a distributed LayerNorm, a BatchNorm or InstanceNorm is sliced per
channel, a GroupNorm per group and a grouped convolution (a depthwise conv) per group of channels (when every rank's
channels are whole groups), elementwise modules, pooling and dropout run unchanged; anything else there is
refused. Attention
code (q/k/v column, o row inside a module with its own ``forward``) runs unchanged on the local heads
as long as it derives the number of heads from the projection's width (``q.view(B, T, -1,
self.head_dim)``), not from a stored ``n_heads``.

Every bad plan raises ``ValueError`` naming the pattern or module and the sizes, before any worker
starts.

A plan's way, one file each: this one reads the words (:func:`parse_plan`, :func:`resolve_plan`: patterns to
module paths); :mod:`.derive` makes a plan where none is given; :mod:`.sizes` works out each rank's features
(whole heads, kv groups, vocabulary rows); :mod:`.check` validates the plan on the whole model, before any worker
starts; :mod:`.apply` swaps the modules on a worker; :mod:`.kinds` says which modules split and what runs between.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Mapping, Optional

from torch import nn

STYLES = ("column", "row", "replicate", "column_gathered", "row_split_input", "between", "heads", "on_heads",
          "per_head")
# Hugging Face's tp_plan words, of Transformers 4 and 5 ("local_*": the same split, on plain tensors)
HF_STYLES = {"colwise": "column", "rowwise": "row", "colwise_rep": "column_gathered",
             "colwise_gather_output": "column_gathered", "rowwise_rep": "row_split_input",
             "rowwise_split_input": "row_split_input", "embedding_rowwise": "row", "local_colwise": "column",
             "local_rowwise": "row", "replicated_with_grad_allreduce": "on_heads"}


@dataclass(frozen=True)
class LayerPlan:
    """One module's (a "per_head" tensor's) entry of a resolved plan: its style and what qualifies it."""

    style: str
    head_dim: Optional[int] = None
    blocks: Optional[int] = None  # a fused column layer's parts (None: not said, 1)
    dim: Optional[int] = None  # a "per_head" tensor's dimension of heads (None: 0)

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"a plan style must be one of {STYLES}, got {self.style!r}")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 1):
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        if self.blocks is not None and (not isinstance(self.blocks, int) or self.blocks < 1):
            raise ValueError(f"blocks must be a positive int, got {self.blocks!r}")
        if (self.blocks or 1) > 1 and self.style != "column":
            raise ValueError(f"blocks apply to a 'column' layer (its output cut into parts by the module's forward), "
                             f"got style {self.style!r}")
        if self.dim is not None and (self.style != "per_head" or not isinstance(self.dim, int)):
            raise ValueError(f"dim is the dimension of heads of a 'per_head' tensor (an int), got {self.dim!r} with "
                             f"style {self.style!r}")


_KEYS = {"style", "head_dim", "blocks", "dim"}  # of a plan entry given as a dict


def parse_plan(plan: Mapping[str, Any]) -> dict[str, LayerPlan]:
    """``{pattern: "column" | {"style": ..., "head_dim": ..., "blocks": ...} | ColwiseParallel() | ...}`` ->
    ``{pattern: LayerPlan}``."""
    out = {}
    for pattern, value in plan.items():
        try:
            if isinstance(value, LayerPlan):
                out[pattern] = value
            elif isinstance(value, str):
                out[pattern] = LayerPlan(HF_STYLES.get(value, value))
            elif isinstance(value, Mapping) and set(value) <= _KEYS and "style" in value:
                out[pattern] = LayerPlan(HF_STYLES.get(value["style"], value["style"]), value.get("head_dim"),
                                         blocks=value.get("blocks"), dim=value.get("dim"))
            elif (torch_plan := _torch_style(value)) is not None:
                out[pattern] = torch_plan
            else:
                raise ValueError(f"expected a style or {{'style': ..., 'head_dim': ..., 'blocks': ..., 'dim': ...}}, "
                                 f"got {value!r}")
        except ValueError as e:
            raise ValueError(f"plan entry '{pattern}': {e}") from None
    return out


def _torch_style(value: Any) -> Optional[LayerPlan]:
    """What torch's ``ColwiseParallel`` / ``RowwiseParallel`` say as ``parallelize_module`` plans use them (a
    module written for Lightning's ``ModelParallelStrategy`` keeps its plan); None for anything else. Only their
    default layouts, a column's gathered output and a row layer's whole input (an embedding's, as torch's
    tutorials plan it) have a counterpart: sequence parallelism (``Shard(1)``) and ``DTensor`` outputs
    (``use_local_output=False``) are refused by name."""
    style_mod = sys.modules.get("torch.distributed.tensor.parallel.style")
    if style_mod is None or not isinstance(value, style_mod.ParallelStyle):
        return None
    from torch.distributed.tensor import Replicate, Shard

    layouts = (getattr(value, "input_layouts", None), getattr(value, "output_layouts", None))
    local = getattr(value, "use_local_output", False)
    if type(value) is style_mod.ColwiseParallel and local and layouts == ((Replicate(),), (Shard(-1),)):
        return LayerPlan("column")
    if type(value) is style_mod.ColwiseParallel and local and layouts == ((Replicate(),), (Replicate(),)):
        return LayerPlan("column_gathered")
    if type(value) is style_mod.RowwiseParallel and local and layouts == ((Shard(-1),), (Replicate(),)):
        return LayerPlan("row")
    if type(value) is style_mod.RowwiseParallel and local and layouts == ((Replicate(),), (Replicate(),)):
        return LayerPlan("row_split_input")  # an embedding's ids are whole either way: "row" (resolve_plan)
    raise ValueError(f"{value!r} has no counterpart here: ColwiseParallel() is 'column', ColwiseParallel("
                     "output_layouts=Replicate()) 'column_gathered', RowwiseParallel() 'row', RowwiseParallel("
                     "input_layouts=Replicate()) 'row_split_input' (an embedding's: 'row') (their default layouts, "
                     "use_local_output=True); sequence parallelism (Shard(1) layouts), SequenceParallel and "
                     "PrepareModuleInput / Output have none")


def _matches(pattern: list[str], name: str) -> bool:
    """Each component of the path against the pattern's, shell-style (``*``, ``layer*``, ``[0-3]``), as torch's
    ``parallelize_module`` matches its plans' keys."""
    parts = name.split(".")
    return len(parts) == len(pattern) and all(fnmatchcase(q, p) for p, q in zip(pattern, parts))


def resolve_plan(module: nn.Module, plan: Mapping[str, Any]) -> dict[str, LayerPlan]:
    """Expand the patterns of ``plan`` over ``module``'s submodules -- a "per_head" one over its parameters and
    buffers: ``{qualified name: LayerPlan}``."""
    mods = {n: m for n, m in module.named_modules() if n}
    names = list(mods)
    tensors = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    out: dict[str, tuple[str, LayerPlan]] = {}
    for pattern, given in parse_plan(plan).items():
        within = tensors if given.style == "per_head" else names
        hits = [n for n in within if _matches(pattern.split("."), n)]
        if not hits:
            what = "parameter or buffer" if given.style == "per_head" else "module"
            near = [n for n in within if n.count(".") == pattern.count(".")][:8]
            held = [n for n in (names if given.style == "per_head" else tensors) if _matches(pattern.split("."), n)]
            why = (f"; it names the module(s) {held[:4]}: 'per_head' names a tensor, e.g. '{held[0]}.weight'" if held
                   and given.style == "per_head" else f"; it names the tensor(s) {held[:4]}, which only 'per_head' "
                   "takes" if held else "")
            raise ValueError(f"plan pattern '{pattern}' matches no {what} of {type(module).__name__} "
                             f"({what}s at that depth: {near}){why}")
        for n in hits:  # an embedding's input (its ids) is whole either way: "row" and "row_split_input" agree there
            lp = LayerPlan("row") if given.style == "row_split_input" and isinstance(mods[n], nn.Embedding) else given
            if n in out and out[n][1] != lp:
                raise ValueError(f"module '{n}' is matched by plan patterns '{out[n][0]}' ({out[n][1].style}) and "
                                 f"'{pattern}' ({lp.style})")
            out[n] = (pattern, lp)
    return {n: lp for n, (_, lp) in out.items()}
