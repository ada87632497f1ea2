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
  they attend with; with fewer kv heads than ranks each rank computes its group's kv head (:func:`_kv_groups`).
* ``"on_heads"``: a module with whole parameters that the forward runs on the rank's heads (split features):
  qk-norm's ``LayerNorm(head_dim)`` / ``RMSNorm(head_dim)`` on q and k after the column layers (Qwen3, OLMo 2,
  timm's ``qk_norm``). Each rank's gradient then comes from its heads only; it is summed over the tp group
  (the gradient's hook), so every rank steps the whole one, as one process. One whose gradient is the same on
  every rank (it runs on whole features) is stopped at its first backward (:func:`_summed_on_heads`).
* ``"per_head"`` on a parameter or buffer path (``{"style": "per_head", "dim": 1}`` for another dim than 0): a tensor
  with an entry per attention head that the forward applies to the rank's heads -- gpt-oss's attention sinks
  ``[H]``, ALiBi's slopes ``[H]``, T5's relative position bias ``nn.Embedding(buckets, H).weight`` (dim 1): cut as
  the column layer of as many heads beside it splits its heads (:func:`_per_head`).
* ``{"style": "column", "blocks": 3}``: a Linear whose output the module's forward cuts into 3 equal parts -- a
  fused q, k, v projection (nanoGPT's ``c_attn``, timm's ``qkv``), a fused gate and up projection (``blocks: 2``):
  each rank holds its slice of each part (on whole heads with a ``head_dim``). A column Linear with k times the
  output features of every row layer beside it must say its blocks (``1`` if its output is one part after all).

Where the plan comes from, first found wins: the strategy's ``plan=``; else the module's ``tp_plan``
attribute; else it is derived for the model's ``nn.Sequential`` (Linear layers paired column -> row,
convolutions likewise -- each with one of its own dimensions --, a leftover replicated; a Linear whose
successor is small is gathered instead, see :func:`derive_plan`) and for torch's own transformer blocks wherever
the model holds them (:func:`torch_blocks_plan`).

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
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_shm.parallel.placement import Split
from lightning_shm.parallel.replaced import carry_over, carry_over_module
from lightning_shm.parallel.sequential import (
    copies_of,
    find_sequential,
    held_outside,
    layers_of,
    parameter_holders,
    shared_spans,
)
from lightning_shm.parallel.tp.attention import HeadParallelMultiheadAttention, heads_unsupported
from lightning_shm.parallel.tp.hooks import whole_tensors_for_hooks
from lightning_shm.parallel.tp.inputs import fingerprint
from lightning_shm.parallel.tp.layers import (
    COLUMN_CONV,
    ROW_CONV,
    ColumnParallelLinear,
    KVHeadsLinear,
    RowParallelEmbedding,
    RowParallelLinear,
    ShardedLayerNorm,
    conv_groups_fit,
    even_split_sizes,
    groups_fit,
    sliced_batchnorm,
    sliced_grouped_conv,
    sliced_groupnorm,
)
from lightning_shm.parallel.tp.rng import SplitRegionRandom
from lightning_shm.runtime import Group

STYLES = ("column", "row", "replicate", "column_gathered", "row_split_input", "between", "heads", "on_heads",
          "per_head")
# Hugging Face's tp_plan words, of Transformers 4 and 5 ("local_*": the same split, on plain tensors)
HF_STYLES = {"colwise": "column", "rowwise": "row", "colwise_rep": "column_gathered",
             "colwise_gather_output": "column_gathered", "rowwise_rep": "row_split_input",
             "rowwise_split_input": "row_split_input", "embedding_rowwise": "row", "local_colwise": "column",
             "local_rowwise": "row", "replicated_with_grad_allreduce": "on_heads"}
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Identity, nn.Softplus,
               nn.Mish, nn.Hardswish, nn.Hardtanh, nn.ReLU6, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TCONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)  # a decoder's upsampling
_ANY_CONV = (*_CONVS, *_TCONVS)
# what may run on split features between a column and a row layer of each kind
_BETWEEN = {
    nn.Linear: (nn.LayerNorm, nn.BatchNorm1d, nn.SyncBatchNorm, *ELEMENTWISE),
    nn.Conv1d: (nn.BatchNorm1d, nn.SyncBatchNorm, nn.GroupNorm, nn.InstanceNorm1d, *ELEMENTWISE,
                nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d),
    nn.Conv2d: (nn.BatchNorm2d, nn.SyncBatchNorm, nn.GroupNorm, nn.InstanceNorm2d, *ELEMENTWISE,
                nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d),
    nn.Conv3d: (nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm, nn.InstanceNorm3d, *ELEMENTWISE,
                nn.MaxPool3d, nn.AvgPool3d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d),
}
_BETWEEN.update({t: _BETWEEN[c] for c, t in zip(_CONVS, _TCONVS)})  # the same norms and pools after a transposed one
# norms between a column and a row layer, run on the rank's features (LayerNorm: distributed; the others sliced)
_NORMS = (nn.LayerNorm, nn.modules.batchnorm._NormBase, nn.GroupNorm)
_SPLITTABLE = (nn.Linear, *_CONVS, *_TCONVS)
_SPLIT_LAYERS = {("column", nn.Linear): ColumnParallelLinear, ("row", nn.Linear): RowParallelLinear,
                 ("row_split_input", nn.Linear): RowParallelLinear,
                 ("row", nn.Embedding): RowParallelEmbedding,
                 **{("column", k): c for k, c in COLUMN_CONV.items()}, **{("row", k): c for k, c in ROW_CONV.items()}}


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


def derive_plan(seq: nn.Sequential, tp: int, prefix: str = "", tied: frozenset[int] = frozenset()
                ) -> dict[str, LayerPlan]:
    """Pair the Sequential's Linear (Conv1d / Conv2d / Conv3d) children column -> row, each with one of its kind;
    a leftover stays replicated. torch's own transformer blocks in it, at any depth, are split as
    :func:`torch_blocks_plan` says. A child holding a parameter of ``tied`` (ids the model also holds outside
    ``seq``: tied to another module, or the child kept under a second name) or another child's stays whole: split,
    they would stop sharing.

    Except when the second Linear of a pair holds at most ``1/tp`` of the first's weights: then the
    first is ``"column_gathered"``, and it and every later Linear that small stay replicated (a
    larger one starts a new pair). Replicating such a layer costs each rank no more than its share
    of the split one, and it saves the pair's collectives and the split LayerNorm between them --
    small ops whose fixed cost and synchronisation dominate a small model's step. Measured on the
    reference MLP (784-256-64-10, tp=2): runtime only (``bench_strategies.py --tables tp_layers``,
    three runs) 0.79-0.82x of the ceiling's step gathered against 0.57-0.63x paired; through
    Lightning, whose per-step costs dilute it, 0.66-0.93x against 0.66-0.78x (four runs). Gathering
    the second Linear (16,384 weights) too gave 0.89x against 0.93x for the first alone.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    plan: dict[str, LayerPlan] = {}
    pending: Optional[tuple[str, type, nn.Module]] = None  # a layer waiting for its partner
    replicate_upto = -1  # after a gathered Linear: Linear layers with at most this many weights stay whole
    layers = layers_of(seq)
    shared = {i for span in shared_spans(layers) for i in span.positions}
    shared |= {i for i, (_, m) in enumerate(layers) if any(id(p) in tied for p in m.parameters())}
    for i, (name, m) in enumerate(layers):
        q = _qual(prefix, name)
        kind = _kind(m)
        if kind in _TCONVS and _odd_conv(m):  # never a pair's layer, nor between a pair's
            pending = None
            continue
        if kind in _CONVS and _odd_conv(m):  # never a pair's layer; a grouped one may run between a pair's
            between = pending is not None and pending[1] is kind and i not in shared and not (
                computed_weight(m) or own_behaviour(m))
            if not (between and conv_groups_fit(m, even_split_sizes(pending[2].out_channels, tp))):  # type: ignore
                pending = None
            continue
        # split, it would stop sharing its parameters / computing its weight / running its own forward
        whole = i in shared or kind is not None and (computed_weight(m) or own_behaviour(m))
        if kind is nn.Linear and pending is None and _numel(m) <= replicate_upto:
            continue
        pair = kind is not None and pending is not None and pending[1] is kind
        gathered = pair and kind is nn.Linear and _numel(m) * tp <= _numel(pending[2])
        if whole and not gathered:  # it stays whole (a gathered pair keeps it so)
            pending = None
            continue
        if pair:
            if gathered:
                plan[pending[0]] = LayerPlan("column_gathered")
                replicate_upto = _numel(pending[2]) // tp
            else:
                plan[pending[0]], plan[q] = LayerPlan("column"), LayerPlan("row")
            pending = None
        elif kind is not None:
            pending = (q, kind, m)
        elif pending is not None and not (isinstance(m, _BETWEEN[pending[1]]) and _fits(m, pending[2], tp)):
            pending = None  # cannot carry split features across this module (a transformer block among them)
    plan.update(torch_blocks_plan(seq, tp, prefix, tied))
    return plan


# torch's transformer blocks and the methods their forward runs: a subclass that keeps them is planned as they are
_TORCH_BLOCKS = {nn.TransformerEncoderLayer: ("forward", "_sa_block", "_ff_block"),
                 nn.TransformerDecoderLayer: ("forward", "_sa_block", "_mha_block", "_ff_block")}


def torch_blocks_plan(root: nn.Module, tp: int, prefix: str = "", tied: frozenset[int] = frozenset()
                      ) -> dict[str, LayerPlan]:
    """The plan for each of torch's own transformer blocks under ``root``, wherever it sits: an
    ``nn.TransformerEncoderLayer`` or ``nn.TransformerDecoderLayer`` (alone, in torch's ``nn.TransformerEncoder`` /
    ``nn.TransformerDecoder`` stacks or ``nn.Transformer``, in a user's module) whose class runs torch's forward.
    Why anywhere, where a user's layers pair only inside a Sequential: such a block's forward is known -- its
    feed-forward pair ``linear1`` -> activation -> dropout -> ``linear2`` runs inside it (column -> row) and each
    attention (``self_attn``, a decoder's cross-attention ``multihead_attn``) takes whole inputs and gives a whole
    output (``"heads"``, when it has at least tp heads) -- so the block's output is whole on every rank, whatever
    runs around it. A block with a parameter in ``tied`` or also held by a module outside it (the block placed
    twice, a layer of it tied elsewhere) stays whole: split, the holders would stop sharing."""
    holders: dict[int, list[str]] = {}  # parameter id -> the paths of the modules holding it
    for n, m in root.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), []).append(n)
    plan: dict[str, LayerPlan] = {}
    for n, block in root.named_modules():  # a module placed twice: at its first path
        base = next((b for b in _TORCH_BLOCKS if isinstance(block, b)), None)
        if base is None or any(getattr(type(block), f) is not getattr(base, f) for f in _TORCH_BLOCKS[base]):
            continue
        inside = f"{n}." if n else ""
        if any(id(p) in tied or any(h != n and not h.startswith(inside) for h in holders[id(p)])
               for p in block.parameters()):
            continue
        q = _qual(prefix, n)
        if all(type(getattr(block, a, None)) is nn.Linear for a in ("linear1", "linear2")):
            plan[_qual(q, "linear1")], plan[_qual(q, "linear2")] = LayerPlan("column"), LayerPlan("row")
        for a in ("self_attn", "multihead_attn"):
            attn = getattr(block, a, None)
            if type(attn) is nn.MultiheadAttention and not heads_unsupported(attn) and attn.num_heads >= tp:
                plan[_qual(q, a)] = LayerPlan("heads")
    return plan


def plan_for(module: nn.Module, plan: Optional[Mapping[str, Any]], tp: int, sequential: Optional[str] = None
             ) -> dict[str, LayerPlan]:
    """The resolved plan: the given one, else the module's ``tp_plan``, else derived: for its Sequential, and for
    torch's transformer blocks wherever they sit (a model without a Sequential may have only those)."""
    if plan is not None:
        return resolve_plan(module, plan)
    own = getattr(module, "tp_plan", None)
    if isinstance(own, Mapping):
        return resolve_plan(module, own)
    blocks = torch_blocks_plan(module, tp)
    try:
        prefix, seq = find_sequential(module, sequential)
    except ValueError:
        if sequential is None and blocks:
            return blocks
        raise
    # a layer whose parameters the module also holds under another name stays whole (check_plan refuses it split)
    plan = derive_plan(seq, tp, prefix, frozenset(held_outside(module, seq)))
    for name, copy in copies_of(module, prefix):  # an EMA teacher is split alike, so the two pair piece with piece
        plan.update(derive_plan(copy, tp, name, frozenset(held_outside(module, copy))))
    return {**plan, **blocks}


def split_sizes(name: str, layer: nn.Module, lp: LayerPlan, tp: int, parent: Optional[nn.Module]) -> list[int]:
    """Features (channels) per rank of a column or row layer; whole heads when a head_dim applies; an embedding's
    vocabulary rows."""
    if isinstance(layer, nn.Embedding):
        return _vocabulary_sizes(name, layer, lp, tp)
    if isinstance(layer, nn.MultiheadAttention) or lp.style == "heads":
        return _head_sizes(name, layer, lp, tp)
    if lp.style == "row_split_input" and not isinstance(layer, nn.Linear):
        raise ValueError(f"'{name}' is a {type(layer).__name__}; only nn.Linear (and an nn.Embedding, as 'row') can be "
                         "'row_split_input'")
    if not isinstance(layer, _SPLITTABLE):
        raise ValueError(f"'{name}' is a {type(layer).__name__}; only nn.Linear, nn.Conv1d / Conv2d / Conv3d and "
                         f"nn.ConvTranspose1d / 2d / 3d can "
                         f"be '{lp.style}' (and an nn.Embedding 'row')")
    if lp.style == "column_gathered" and not isinstance(layer, nn.Linear):
        raise ValueError(f"'{name}' is a {type(layer).__name__}; only nn.Linear can be 'column_gathered'")
    blocks = lp.blocks or 1
    if blocks > 1 and not isinstance(layer, nn.Linear):
        raise ValueError(f"'{name}' is a {type(layer).__name__} planned with blocks={blocks}; only an nn.Linear "
                         "(a fused projection) takes blocks")
    if lp.style in ("column", "column_gathered"):
        n = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
        what = "output features" if isinstance(layer, nn.Linear) else "output channels"
        if n % blocks:
            raise ValueError(f"column layer '{name}' has {n} {what}, not {blocks} equal blocks")
        n //= blocks
        what += f" in each of {blocks} blocks" if blocks > 1 else ""
    else:
        n = layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels
        what = "input features" if isinstance(layer, nn.Linear) else "input channels"
    # whole heads where the split features meet the attention's code; a gathered output or a whole input never does
    head_dim = _head_dim(lp, parent) if lp.style in ("column", "row") else None
    if head_dim:
        if n % head_dim:
            raise ValueError(f"{lp.style} layer '{name}' has {n} {what}, not a multiple of head_dim={head_dim}")
        heads = n // head_dim
        if heads < tp:
            raise ValueError(f"{lp.style} layer '{name}' has {heads} heads of {head_dim} ({n} {what}), fewer than "
                             f"tp={tp}: every rank needs a whole head")
        return [h * head_dim for h in even_split_sizes(heads, tp)]
    if n < tp:
        raise ValueError(f"{lp.style} layer '{name}' has {n} {what}, fewer than tp={tp}")
    return even_split_sizes(n, tp)


def _head_dim(lp: LayerPlan, parent: Optional[nn.Module]) -> Optional[int]:
    """The head size a column or row Linear splits on: the plan's, else its module's int ``head_dim``."""
    if lp.head_dim is None and isinstance(getattr(parent, "head_dim", None), int):
        return parent.head_dim  # type: ignore[union-attr]
    return lp.head_dim


def _kv_groups(mods: Mapping[str, nn.Module], plan: Mapping[str, LayerPlan], tp: int, root: nn.Module
               ) -> dict[str, "LayerSplit"]:
    """Grouped-query attention: q (and o) have ``H`` heads, k and v ``G``, and q head ``h`` attends with kv head
    ``h // (H / G)``: the heads form G groups. A rank must hold the kv heads its q heads attend with. Split evenly
    on their own they need not: H=12, G=3 at tp=2 gives q 6 + 6 heads and kv 2 + 1, and torch's SDPA with
    ``enable_gqa=True`` pairs rank 0's q heads 0-5 with its kv heads 0-1 three by three (one process: four by four)
    -- silently otherwise than one process; a stored ``n_rep`` fails on a shape. So the Linears one module holds
    that split on heads of one size, ``H`` and ``G`` heads with G dividing H, are split by groups (each rank
    ``H / G`` q heads per kv head, o's input as q's)::

        G >= tp   whole groups per rank: kv heads G split evenly       H=12, G=3, tp=2: kv 2 + 1, q 8 + 4
        G <  tp   the ranks shared out among the groups, each group's  H=14, G=2, tp=4: kv head 0 on ranks 0, 1,
                  q heads among its ranks; each rank computes its      kv head 1 on ranks 2, 3; q 4 + 3 + 4 + 3
                  group's kv head (:class:`KVHeadsLinear`)

    Gathered q, k and v (OLMo 2's plan) give whole outputs: no groups to keep, an even split. q split with k or v
    gathered would meet the rank's q heads with every kv head: refused.

    Returns how each such layer is split (the same pieces as the even split where tp divides G); layers of other
    modules are not here."""
    groups: dict[tuple[str, int], dict[str, int]] = {}  # (module, head_dim) -> {layer: heads}
    for name, lp in plan.items():
        if lp.style not in ("column", "column_gathered", "row") or (lp.blocks or 1) > 1:
            continue
        m, parent_name = mods[name], name.rpartition(".")[0]
        parent = mods[parent_name] if parent_name else root
        if not isinstance(m, nn.Linear) or isinstance(parent, nn.Sequential):
            continue
        head_dim = _head_dim(lp, parent)
        n = m.in_features if lp.style == "row" else m.out_features
        if head_dim and n % head_dim == 0:
            groups.setdefault((parent_name, head_dim), {})[name] = n // head_dim
    out: dict[str, LayerSplit] = {}
    for (_, head_dim), heads in groups.items():
        kv = min(heads.values())
        if kv == max(heads.values()) or any(h % kv or (h == kv and plan[n].style == "row") for n, h in heads.items()):
            continue  # not grouped-query attention: q, k, v and o of one count (beside a wider MLP) take o's
        gathered = [n for n in heads if plan[n].style == "column_gathered"]
        split = [n for n in heads if plan[n].style == "column"]
        if gathered and split:
            raise ValueError(f"{gathered} {'is' if len(gathered) == 1 else 'are'} 'column_gathered' beside 'column' "
                             f"layer(s) {split} of grouped-query attention ({max(heads.values())} q heads, {kv} kv "
                             "heads): a rank's q heads would meet every kv head, not those they attend with. Plan q, "
                             "k and v alike: all 'column' (split by kv groups, o 'row') or all 'column_gathered' (o "
                             "'row_split_input')")
        if gathered:
            continue  # whole outputs: an even split
        if kv >= tp:  # whole groups per rank
            for name, h in heads.items():
                sizes = tuple(h // kv * g * head_dim for g in even_split_sizes(kv, tp))
                out[name] = LayerSplit(plan[name].style, sizes)
            continue
        ranks = even_split_sizes(tp, kv)  # ranks sharing each kv head
        group_of = [g for g, r in enumerate(ranks) for _ in range(r)]  # each rank's kv head
        for name, h in heads.items():
            per, style = h // kv, plan[name].style  # this layer's heads per kv group
            if per == 1 and style == "column":
                out[name] = LayerSplit("kv_heads", (head_dim,) * tp, starts=tuple(g * head_dim for g in group_of))
            elif per < max(ranks):
                what = ("its kv heads, whose layer must be 'column'" if per == 1 else
                        f"{per} heads per kv head, fewer than the {max(ranks)} ranks sharing one")
                raise ValueError(f"{style} layer '{name}' has {h} heads of {head_dim} beside layers with {kv} (kv "
                                 f"heads of grouped-query attention) at tp={tp}: each kv head is shared by "
                                 f"{max(ranks)} ranks, each holding some of its group's q heads, but '{name}' has "
                                 f"{what}. Use a tp size of at most {kv * per if per > 1 else kv}")
            else:
                out[name] = LayerSplit(style, tuple(s * head_dim for r in ranks for s in even_split_sizes(per, r)))
    return out


def _head_sizes(name: str, layer: nn.Module, lp: LayerPlan, tp: int) -> list[int]:
    """Features per rank of an ``nn.MultiheadAttention`` split by whole heads
    (:class:`~lightning_shm.parallel.tp.attention.HeadParallelMultiheadAttention`)."""
    if not isinstance(layer, nn.MultiheadAttention):
        raise ValueError(f"'{name}' is a {type(layer).__name__}; only an nn.MultiheadAttention can be 'heads' (an "
                         "attention of your own splits its q, k and v projections 'column' and its output 'row', "
                         "on whole heads: head_dim)")
    if lp.style != "heads":
        raise ValueError(f"'{name}' is an nn.MultiheadAttention planned '{lp.style}': it splits by its heads -- plan "
                         "it 'heads'")
    why = heads_unsupported(layer)
    if why:
        raise ValueError(f"'{name}' (heads) is an nn.MultiheadAttention with {why}: not split here. Leave it "
                         "replicated")
    if layer.num_heads < tp:
        raise ValueError(f"'{name}' (heads) has {layer.num_heads} heads, fewer than tp={tp}: every rank needs a head")
    return [h * layer.head_dim for h in even_split_sizes(layer.num_heads, tp)]


def _vocabulary_sizes(name: str, layer: nn.Embedding, lp: LayerPlan, tp: int) -> list[int]:
    """Rows per rank of an embedding split by its vocabulary (:class:`RowParallelEmbedding`)."""
    if lp.style != "row":
        raise ValueError(f"'{name}' is an nn.Embedding planned '{lp.style}': an embedding splits its vocabulary, the "
                         "rows of its table -- plan it 'row' (torch's RowwiseParallel(input_layouts=Replicate()))")
    odd = {"max_norm": (layer.max_norm, "renormalises the rows it looks up in place"),
           "scale_grad_by_freq": (layer.scale_grad_by_freq, "scales by how often each id occurs in the batch"),
           "sparse": (layer.sparse, "gives sparse gradients")}
    said = [f"{k}={v!r} ({why})" for k, (v, why) in odd.items() if v]
    if said:
        raise ValueError(f"'{name}' (row) is an nn.Embedding with {', '.join(said)}: a rank looks up only the ids "
                         "its rows hold. Leave it replicated")
    if layer.num_embeddings < tp:
        raise ValueError(f"row layer '{name}' has {layer.num_embeddings} embeddings, fewer than tp={tp}")
    return even_split_sizes(layer.num_embeddings, tp)


@dataclass(frozen=True)
class LayerSplit:
    """How one module is split: ``role`` "column" / "row" / "column_gathered" / "row_split_input" (a planned layer) or
    "between" (a norm, or a grouped convolution, running on split features between a column and a row layer);
    features per rank."""

    role: str
    sizes: tuple[int, ...]
    blocks: int = 1  # a fused column layer: sizes of each of its parts
    starts: tuple[int, ...] = ()  # "kv_heads": where each rank's rows begin (ranks sharing a kv head alike)
    dim: int = 0  # "per_head": the tensor's dimension cut


def check_plan(module: nn.Module, plan: Mapping[str, LayerPlan], tp: int) -> dict[str, LayerSplit]:
    """Validate ``plan`` for ``tp`` ranks on the whole model; returns how each module is split.

    Raises ValueError naming the module and the sizes. Computed on the plain model (a pipeline then
    applies the part its stage holds)."""
    mods = dict(module.named_modules())
    holders = parameter_holders(module)
    out: dict[str, LayerSplit] = {}
    ties: dict[str, list[str]] = {}  # a split layer's tensor -> the other names it is held under
    grouped = _kv_groups(mods, plan, tp, module)  # grouped-query attention's layers
    for name, lp in plan.items():
        if lp.style in ("replicate", "between", "per_head"):  # once the column layers' sizes are known
            continue
        if lp.style == "on_heads":
            if not any(p.requires_grad for p in mods[name].parameters(recurse=False)):
                raise ValueError(f"'{name}' ({type(mods[name]).__name__}) is planned 'on_heads', which sums its "
                                 "parameters' gradients over the tp ranks, but it holds no trainable parameter of its "
                                 "own: leave it out of the plan")
            out[name] = LayerSplit("on_heads", ())
            continue
        for pname, p in mods[name].named_parameters(prefix=name):
            others = [h for h, _ in holders[id(p)] if h != pname and not h.startswith(f"{name}.")]
            if others:
                ties[pname] = others  # checked once every layer's split is known
        reader = next((a for a in _ancestors(name) if isinstance(mods.get(a), nn.MultiheadAttention)), None)
        if reader is not None:
            raise ValueError(f"'{name}' ({lp.style}) is part of nn.MultiheadAttention '{reader}', whose forward reads "
                             "its weights itself (F.multi_head_attention_forward), never calling the layer: a split "
                             "layer's collectives would not run. Leave it replicated, or write the attention with "
                             "nn.Linear projections that its forward calls.")
        own = own_behaviour(mods[name])
        if own:
            raise ValueError(f"'{name}' ({lp.style}): {own}, and a tensor-parallel layer computes the plain "
                             f"{_plain(mods[name]).__name__}'s forward over a piece of weight and bias only. "
                             "Leave the layer replicated.")
        odd = _odd_conv(mods[name])
        if odd:
            between = ("" if isinstance(mods[name], _TCONVS) else " (a grouped one with as many output as input "
                       "channels runs split between a column and a row layer, on whole groups)")
            raise ValueError(f"'{name}' ({lp.style}) is a {type(mods[name]).__name__} with {odd}: a column or row "
                             f"layer splits a plain convolution's channels. Leave it replicated{between}")
        how = computed_weight(mods[name]) if isinstance(mods[name], (*_SPLITTABLE, nn.Embedding)) else None
        if how:
            raise ValueError(f"'{name}' ({lp.style}) computes its weight from other parameters ({how}): the "
                             "computation (a norm over the whole weight) cannot run on a piece of it. Leave the "
                             "layer replicated.")
        parent = mods.get(name.rpartition(".")[0]) if "." in name else module
        out[name] = grouped[name] if name in grouped else \
            LayerSplit(lp.style, tuple(split_sizes(name, mods[name], lp, tp, parent)), lp.blocks or 1)
        if out[name].role == "kv_heads" and mods[name]._forward_hooks:
            raise ValueError(f"'{name}' computes a kv head that several tp ranks compute alike (grouped-query "
                             f"attention with fewer kv heads than tp={tp}), and it has forward hooks: they would see "
                             "this rank's kv head, and a loss they add would count once per rank computing it. Remove "
                             "the hooks or use a tp size of at most its kv heads")
    for pname, others in ties.items():
        _check_tie(pname, others, mods, out)
    _check_fused(mods, plan, out)
    for name in [n for n, lp in plan.items() if lp.style == "between"]:
        out[name] = _between(name, mods, out)
    for name in [n for n, lp in plan.items() if lp.style == "per_head"]:
        out[name] = _per_head(name, plan, module, mods, out)
    for prefix, seq in [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Sequential)]:
        out.update(_check_sequential(seq, prefix, out))
    return out


def _check_tie(pname: str, others: Sequence[str], mods: Mapping[str, nn.Module],
               splits: Mapping[str, LayerSplit]) -> None:
    """A split layer's tensor that another module holds too (a language model's output layer tied to its
    embedding) is split with it only when that module cuts it alike -- the same dimension, the same pieces:
    both layers then hold each rank's one piece (:func:`apply_plan`). Else ValueError: the other holder would
    train the whole tensor apart from the pieces."""
    name, entry = pname.rsplit(".", 1)
    for other in others:
        oname, oentry = other.rsplit(".", 1)
        dims = [_split_dim(mods[n], splits[n], e) if n in splits else None for n, e in ((name, entry), (oname, oentry))]
        if dims[0] is None or dims[0] != dims[1] or splits[name].sizes != splits[oname].sizes:  # equal: blocks too
            raise ValueError(f"'{name}' ({splits[name].role}) holds '{pname}', which is also '{other}': splitting "
                             "the layer gives each rank a piece of its own, and the other holder would keep training "
                             "the whole tensor apart from it. Leave the layer replicated, untie the weights, or plan "
                             "the other holder to cut the tensor alike (an embedding 'row' and its tied output layer "
                             "'column_gathered')")


def _check_fused(mods: Mapping[str, nn.Module], plan: Mapping[str, LayerPlan], splits: Mapping[str, LayerSplit]
                 ) -> None:
    """A column Linear planned without blocks whose output features are k >= 2 times the input features of a row
    Linear beside it (a child of the same module) and equal to no such row layer's: its module's forward most
    likely cuts its output into k parts (a fused q, k, v projection beside its output projection: 3E against E).
    A contiguous slice would give rank 0 all of q and half of k, silently -- with ``reshape(B, T, 3, -1,
    head_dim)`` the shapes still fit. So it must say its blocks -- and the layout decides them: q | k | v side by
    side takes ``blocks: k``; laid out per head (GPT-NeoX), a rank's heads are one run, ``blocks: 1`` on whole
    heads of k x head_dim features, where ``blocks: k`` would mix the heads' parts as silently."""
    for name, sp in splits.items():
        col = mods[name]
        if sp.role != "column" or plan[name].blocks is not None or not isinstance(col, nn.Linear):
            continue
        parent = name.rpartition(".")[0]
        rows = {r: mods[r].in_features for r, rp in splits.items() if rp.role == "row" and r.rpartition(".")[0] ==
                parent and isinstance(mods[r], nn.Linear)}
        n = col.out_features
        fused = {r: n // f for r, f in rows.items() if n % f == 0 and n // f >= 2}
        if fused and n not in rows.values():
            r, k = next(iter(fused.items()))
            raise ValueError(f"column layer '{name}' gives {n} output features, {k} x the {rows[r]} that row layer "
                             f"'{r}' beside it takes. If its module's forward cuts the whole output into {k} parts "
                             f"side by side (q | k | v: .chunk({k}, -1) on the output itself, reshape(B, T, {k}, -1, "
                             "head_dim) -- nanoGPT, timm; a fused gate and up projection), plan it {'style': "
                             f"'column', 'blocks': {k}}} so that each rank holds its slice of each part -- a "
                             "contiguous slice would give rank 0 the first part and some of the second. If it views "
                             f"the heads first, each head's parts together (view(B, T, -1, {k} * head_dim), then cut "
                             "-- GPT-NeoX / Pythia, BLOOM), a rank's whole heads are one contiguous run: plan it "
                             f"{{'style': 'column', 'blocks': 1, 'head_dim': {k} * head_dim}} (blocks {k} would mix "
                             "the heads' parts, and the shapes would still fit). Any other output of one part: "
                             "{'style': 'column', 'blocks': 1}")


def _split_dim(m: nn.Module, split: LayerSplit, entry: str) -> Optional[int]:
    """The dimension the tensor-parallel layer replacing ``m`` cuts its ``entry`` along (None: held whole)."""
    if split.role == "column_gathered":
        return ColumnParallelLinear.split_dims.get(entry)
    layer = _split_layer(split.role, m)
    return layer.split_dims.get(entry) if layer is not None else None


def _split_layer(role: str, m: nn.Module) -> Optional[type]:
    """The tensor-parallel class that replaces ``m`` planned ``role`` ("column" / "row"); None for none."""
    return _SPLIT_LAYERS.get((role, nn.Embedding if isinstance(m, nn.Embedding) else _kind(m)))  # type: ignore


def _features(m: nn.Module) -> Optional[tuple[int, tuple[type, ...]]]:
    """(features it runs on, the layer kinds whose split output it can take) of a module that may run between a
    column and a row layer; None for any other."""
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
        return m.normalized_shape[0], (nn.Linear,)
    if isinstance(m, nn.GroupNorm):
        return m.num_channels, _ANY_CONV
    if isinstance(m, _CONVS) and m.groups > 1:
        return m.in_channels, (_kind(m),)  # type: ignore[return-value]
    if isinstance(m, nn.modules.batchnorm._NormBase):
        return m.num_features, tuple(k for k, fit in _BETWEEN.items() if isinstance(m, fit)) or _ANY_CONV
    return None


def _between(name: str, mods: Mapping[str, nn.Module], splits: Mapping[str, LayerSplit]) -> LayerSplit:
    """A module planned "between": split like its sibling column layer of as many output features."""
    m = mods[name]
    found = _features(m)
    if found is None:
        raise ValueError(f"'{name}' ({type(m).__name__}) is planned 'between', which only a LayerNorm over one "
                         "dimension, a BatchNorm, InstanceNorm, GroupNorm or grouped convolution can be")
    n, kinds = found
    parent = name.rpartition(".")[0]
    columns = [c for c, sp in splits.items() if sp.role == "column" and c.rpartition(".")[0] == parent
               and sum(sp.sizes) == n and _kind(mods[c]) in kinds]
    if len(columns) != 1:
        raise ValueError(f"'{name}' ({type(m).__name__}, {n} features) is planned 'between', so it runs on a column "
                         f"layer's split output: its module '{parent or '<root>'}' must hold exactly one column layer "
                         f"with {n} output features, found {columns or 'none'}")
    sizes = splits[columns[0]].sizes
    _check_runs_split(name, m, columns[0], sizes)
    return LayerSplit("between", sizes)


def _per_head(name: str, plan: Mapping[str, LayerPlan], root: nn.Module, mods: Mapping[str, nn.Module],
              splits: Mapping[str, LayerSplit]) -> LayerSplit:
    """A tensor with an entry per attention head along ``dim``, which the forward applies to the heads the rank
    holds -- gpt-oss's attention sinks ``[H]``, ALiBi's slopes ``[H]``, T5's relative position bias table
    ``[buckets, H]`` (``dim`` 1), Swin V2's ``logit_scale`` ``[H, 1, 1]``: cut as the column layer of as many heads
    beside it (a child of the tensor's module or of that module's parent) splits its heads. Whole, it would meet
    the rank's heads with every head's entries (a shape error, or where one head is left, a broadcast over all of
    them)."""
    owner_name, _, entry = name.rpartition(".")
    t = _own_tensor(mods[owner_name] if owner_name else root, entry)
    assert t is not None  # resolve_plan found it
    dim = plan[name].dim or 0
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"'{name}' (per_head) has shape {list(t.shape)}: no dimension {dim}")
    n = t.shape[dim]
    near = [owner_name, owner_name.rpartition(".")[0]] if owner_name else [""]
    found = []
    for c, sp in splits.items():
        parent = c.rpartition(".")[0]
        if sp.role not in ("column", "kv_heads") or sp.blocks > 1 or parent not in near:
            continue
        head_dim = _head_dim(plan[c], mods[parent] if parent else root) or 1
        features = sum(sp.sizes) if sp.role == "column" else mods[c].out_features  # type: ignore[union-attr]
        found.append((c, features // head_dim, features))
        if sp.role == "column" and n == features // head_dim:
            return LayerSplit("per_head", tuple(f // head_dim for f in sp.sizes), dim=dim)
        if sp.role == "kv_heads" and n == features // head_dim:
            raise ValueError(f"'{name}' (per_head) has {n} entries along dim {dim}, one per kv head of '{c}', which "
                             "several tp ranks compute alike (fewer kv heads than ranks): not split here. Use a tp "
                             f"size of at most {n}, or leave the tensor out of the plan")
    raise ValueError(f"'{name}' (per_head) has {n} entries along dim {dim} (shape {list(t.shape)}), but no column "
                     f"layer beside it has {n} heads to split them as: "
                     + (", ".join(f"'{c}' {h} heads ({f} features)" for c, h, f in found) or "none is planned")
                     + ". Give the dim of heads, or plan the attention's q, k, v 'column' on whole heads")


def _check_runs_split(q: str, m: nn.Module, column: str, sizes: Sequence[int]) -> None:
    """A norm or grouped convolution running on ``column``'s output split as ``sizes``: ValueError if it cannot --
    a behaviour of its own a split copy would drop, a GroupNorm's group or a grouped conv's group across two
    ranks, a grouped conv changing its channel count."""
    where = f"sits between column layer '{column}' and its row layer"
    own = computed_weight(m) or own_behaviour(m) if isinstance(m, (nn.LayerNorm, *_CONVS)) else ""
    if own:
        raise ValueError(f"'{q}' {where}, so it would run split, but {own}: end the pair before it")
    if isinstance(m, nn.GroupNorm) and not groups_fit(m, sizes):
        raise ValueError(f"GroupNorm '{q}' ({m.num_groups} groups of {m.num_channels // m.num_groups} channels) "
                         f"{where}, which split the channels as {list(sizes)}: a group would span two ranks. Give it "
                         "a number of groups that tp divides, or end the pair before it")
    if isinstance(m, _CONVS) and not conv_groups_fit(m, sizes):
        raise ValueError(f"grouped {type(m).__name__} '{q}' ({m.in_channels} -> {m.out_channels} channels, "
                         f"groups={m.groups}) "
                         f"{where}, which split the channels as {list(sizes)}: it runs there only on whole groups "
                         "and as many output as input channels. End the pair before it")


def _check_sequential(seq: nn.Sequential, prefix: str, splits: Mapping[str, LayerSplit]) -> dict[str, LayerSplit]:
    """Pairs inside a Sequential: what runs between them, and the norms there to split."""
    region: Optional[tuple[str, type]] = None  # (column layer, its kind) while inside a pair
    norms: dict[str, LayerSplit] = {}
    for name, m in layers_of(seq):
        q = _qual(prefix, name)
        role = splits[q].role if q in splits else "replicate"
        if role == "column":
            if region is not None:
                raise ValueError(f"column layer '{q}' starts before column layer '{region[0]}' met its row layer")
            if splits[q].blocks > 1:
                raise ValueError(f"column layer '{q}' is planned with blocks={splits[q].blocks}, for an output the "
                                 "module's forward cuts into parts; in an nn.Sequential the next layer takes it whole. "
                                 "Plan it without blocks")
            region = (q, _kind(m))  # type: ignore[assignment]
        elif role == "row" and isinstance(m, nn.Embedding):  # takes ids, gives whole rows: no pair
            if region is not None:
                raise ValueError(f"embedding '{q}' sits between column layer '{region[0]}' and its row layer")
        elif role == "row":
            if region is None:
                raise ValueError(f"row layer '{q}' has no column layer before it in its nn.Sequential (a row layer "
                                 "takes the split features a column layer produces)")
            if _kind(m) is not region[1]:
                raise ValueError(f"row layer '{q}' ({type(m).__name__}) cannot follow column layer '{region[0]}' "
                                 f"({region[1].__name__})")
            if splits[q].sizes != splits[region[0]].sizes:
                raise ValueError(f"row layer '{q}' splits its inputs as {list(splits[q].sizes)} but column layer "
                                 f"'{region[0]}' produces {list(splits[region[0]].sizes)}")
            region = None
        elif role in ("column_gathered", "row_split_input") and region is not None:
            raise ValueError(f"'{role}' layer '{q}' sits between column layer '{region[0]}' and its row "
                             "layer: it needs the whole input features")
        elif region is not None:
            sizes = splits[region[0]].sizes
            if isinstance(m, _CONVS) and m.groups > 1 and region[1] is _kind(m):
                _check_runs_split(q, m, region[0], sizes)
                norms[q] = LayerSplit("between", sizes)
                continue
            if _kind(m) is not None:
                raise ValueError(f"{type(m).__name__} '{q}' sits between column layer '{region[0]}' and its row "
                                 "layer: mark it 'row' or end the pair before it")
            if not isinstance(m, _BETWEEN[region[1]]):
                raise ValueError(f"'{q}' ({type(m).__name__}) cannot run on features split by column layer "
                                 f"'{region[0]}'; only {', '.join(t.__name__ for t in _BETWEEN[region[1]][:3])}, "
                                 "elementwise and pooling modules can")
            _check_runs_split(q, m, region[0], sizes)
            if isinstance(m, _NORMS):
                norms[q] = LayerSplit("between", sizes)
    if region is not None:
        raise ValueError(f"column layer '{region[0]}' is not followed by a row layer in its nn.Sequential")
    return norms


def apply_plan(module: nn.Module, splits: Mapping[str, LayerSplit], group: Group,
               pieces: Optional[dict[int, nn.Parameter]] = None,
               cut: Optional[dict[str, Split]] = None) -> dict[str, nn.Module]:
    """Replace the split modules that ``module`` holds (a pipeline stage holds some) in place; returns
    the new modules by qualified name. Every new module lists ``split_dims`` and ``sizes``. ``pieces`` gets each
    split parameter's piece by the whole one's id: a tied tensor is cut once, and every layer holding it holds
    the piece (and what kept the whole one -- a pipeline's tie across stages -- finds the piece there). ``cut`` gets
    the split of each "per_head" tensor held in the state dict, by its qualified name."""
    local = dict(module.named_modules())
    replaced: dict[str, nn.Module] = {}
    pieces = {} if pieces is None else pieces
    cut = {} if cut is None else cut
    random = SplitRegionRandom(group.index)  # shared by the column and row layers: see its module
    for name, sp in splits.items():
        if sp.role == "per_head":
            _cut_per_head(name, sp, local, group, cut)
            continue
        layer = local.get(name)
        if layer is None:
            continue
        if sp.role in ("on_heads", "kv_heads"):  # kept whole: each rank's gradient, from its heads, summed
            for p in layer.parameters(recurse=False):
                p.register_hook(functools.partial(_summed_on_heads, name, group, [True]) if sp.role == "on_heads"
                                else functools.partial(_summed_over_tp, group))
            if sp.role == "on_heads":
                continue
        # the user's forward hooks see whole tensors, as in one process (an embedding's ids and rows are whole)
        if sp.role not in ("column_gathered", "row_split_input", "heads", "kv_heads") and not isinstance(layer,
                                                                                                    nn.Embedding):
            dim = 1 if isinstance(layer, (*_ANY_CONV, nn.modules.batchnorm._NormBase, nn.GroupNorm)) else -1
            whole_tensors_for_hooks(layer, group, sp.sizes, dim, inputs_split=sp.role != "column",
                                    output_split=sp.role != "row", blocks=sp.blocks)  # (before a copy takes them)
        if sp.role == "heads":
            new = HeadParallelMultiheadAttention(layer, group, sp.sizes, random=random)
        elif sp.role == "kv_heads":
            new = KVHeadsLinear(layer, group, sp.starts[group.index], sp.sizes[group.index], random=random)
        elif sp.role == "between":
            new = (ShardedLayerNorm(layer, group, sp.sizes) if isinstance(layer, nn.LayerNorm)
                   else sliced_groupnorm(layer, group, sp.sizes) if isinstance(layer, nn.GroupNorm)
                   else sliced_grouped_conv(layer, group, sp.sizes) if isinstance(layer, _CONVS)
                   else sliced_batchnorm(layer, group, sp.sizes))
        else:
            if sp.role == "column_gathered":
                new = ColumnParallelLinear(layer, group, sp.sizes, gather_output=True)
            elif sp.role == "row_split_input":
                new = RowParallelLinear(layer, group, sp.sizes, split_input=True)
            elif sp.blocks > 1:
                new = ColumnParallelLinear(layer, group, sp.sizes, random=random, blocks=sp.blocks)
            else:
                new = _split_layer(sp.role, layer)(layer, group, sp.sizes, random=random)  # type: ignore[misc]
        for entry in getattr(new, "split_dims", {}):
            full, piece = getattr(layer, entry, None), getattr(new, entry, None)
            if isinstance(full, nn.Parameter) and isinstance(piece, nn.Parameter):
                setattr(new, entry, pieces.setdefault(id(full), piece))
        carry_over_module(layer, new)  # the user's hooks on the layer run on its tensor-parallel version
        replaced[name] = new
        if sp.role == "heads":  # its output projection: a row layer of its own (placements, ties)
            replaced[f"{name}.out_proj"] = new.out_proj
            new.out_proj.weight = pieces.setdefault(id(layer.out_proj.weight), new.out_proj.weight)
    _say_when_split_features_reach(local, splits)
    for name, new in replaced.items():
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, new)
    for name in {a for n in replaced for a in _ancestors(n)}:
        layer = local.get(name)
        if isinstance(layer, nn.TransformerEncoderLayer):
            # its inference fast path reads linear1 / linear2's weights itself -- this rank's pieces, without
            # the row layer's all-reduce; torch takes it only for a layer without forward hooks
            layer.register_forward_pre_hook(_no_fast_path)
    return replaced


def _cut_per_head(name: str, sp: LayerSplit, local: Mapping[str, nn.Module], group: Group,
                  cut: dict[str, Split]) -> None:
    """Replace a "per_head" tensor by the rank's heads' entries (a parameter by a parameter of its own)."""
    owner_name, _, entry = name.rpartition(".")
    owner = local.get(owner_name)
    full = None if owner is None else _own_tensor(owner, entry)
    if owner is None or full is None:  # another pipeline stage holds it
        return
    split = Split(group, sp.dim % full.dim(), sp.sizes)
    if isinstance(full, nn.Parameter):
        piece = nn.Parameter(split.cut(full.detach()), requires_grad=full.requires_grad)
        carry_over(full, piece)
        owner._parameters[entry] = piece
        cut[name] = split
    else:
        owner._buffers[entry] = split.cut(full)
        if entry not in owner._non_persistent_buffers_set:
            cut[name] = split


def _own_tensor(owner: nn.Module, entry: str) -> Optional[torch.Tensor]:
    """``owner``'s own parameter or buffer ``entry`` (None: it holds none by that name)."""
    return owner._parameters.get(entry, owner._buffers.get(entry))


def _no_fast_path(module: nn.Module, args: Any) -> None:
    return None


def _summed_over_tp(group: Group, grad: torch.Tensor) -> torch.Tensor:
    """An "on_heads" or "kv_heads" parameter's gradient from this rank's heads, summed with the other tp ranks' (a
    hook on the parameter: it runs wherever its gradient is taken, a pipeline's and FSDP's included)."""
    return group.all_reduce(grad.contiguous().clone(), "sum")


def _summed_on_heads(name: str, group: Group, first: list[bool], grad: torch.Tensor) -> torch.Tensor:
    """An "on_heads" parameter's gradient, summed over the tp ranks (:func:`_summed_over_tp`) -- right when each
    rank's gradient comes from its heads alone: qk-norm after the column layers, or on a kv head several ranks
    compute alike (each rank's part from its q heads). A module running on whole features before a column layer
    (Hugging Face plans an MLA down projection and its norm ``"replicated_with_grad_allreduce"``) already holds one
    process's gradient on every rank -- the column layer sums its input's --, and the sum would count it tp times,
    silently. So the ranks compare a fingerprint of the gradient (:func:`~.inputs.fingerprint` and its absolute
    sum, all-gathered) until one is nonzero -- inside a block gated by a zero-initialised scale (ReZero, DiT's
    adaLN-Zero) the first are zero on every rank, which says nothing --: the same nonzero gradient on every rank
    stops the fit, naming the module. Its input would not tell: a k-norm on the one kv head of multi-query attention
    has the same input on every rank, and a gradient from the rank's q heads."""
    if first[0] and group.size > 1:
        mark = torch.cat([fingerprint([grad]), grad.detach().abs().sum(dtype=torch.float64).reshape(1)])
        marks = group.all_gather(mark)
        first[0] = not float(marks[:, -1].max()) > 0  # decided alike on every rank: from what they all gathered
        if not first[0] and bool((marks == marks[0]).all()):
            raise ValueError(f"'{name}' is planned 'on_heads' (Hugging Face: 'replicated_with_grad_allreduce'), which "
                             "sums its gradients over the tp ranks, but every tp rank got the same gradient: it runs "
                             "on whole features (before a column layer), each rank holds one process's gradient "
                             f"already, and the sum would count it {group.size} times. Leave it out of the plan (it "
                             "is replicated)")
    return _summed_over_tp(group, grad)


def _say_when_split_features_reach(local: Mapping[str, nn.Module], splits: Mapping[str, LayerSplit]) -> None:
    """A norm beside a column layer in a block's own forward, not planned 'between': if the forward runs it on
    the column layer's output, it gets this rank's features, and torch fails with "running_mean should contain
    16 elements not 8". A pre-hook on each such module raises instead, saying what to plan -- only when the
    input has the rank's share of the features, so a norm that runs elsewhere (before the column layer, on as
    many features) is left alone."""
    for col, sp in splits.items():
        parent = col.rpartition(".")[0]
        if sp.role != "column" or isinstance(local.get(parent), nn.Sequential):
            continue  # inside a Sequential the order is known: _check_sequential splits or refuses
        n = sum(sp.sizes)
        for name, m in local.items():
            found = _features(m)
            if name.rpartition(".")[0] != parent or name in splits or found is None or found[0] != n:
                continue
            if isinstance(m, nn.modules.instancenorm._InstanceNorm) and not (m.affine or m.track_running_stats):
                continue  # holds nothing per channel: runs on any share of the channels, as one process would

            def check(module: nn.Module, args: Any, name: str = name, col: str = col, n: int = n,
                      sizes: tuple[int, ...] = sp.sizes, dim: int = -1 if isinstance(m, nn.LayerNorm) else 1) -> None:
                x = args[0] if args and hasattr(args[0], "shape") else None
                if x is not None and x.dim() > 1 and x.shape[dim] < n:
                    raise ValueError(f"{type(module).__name__} '{name}' got {x.shape[dim]} of its {n} features: its "
                                     f"block's forward runs it on the output of column layer '{col}', which tensor "
                                     f"parallelism splits {list(sizes)}. Plan it {{'{name}': 'between'}} (it then "
                                     f"runs on the rank's features), or leave '{col}' replicated")

            m.register_forward_pre_hook(check)


def _ancestors(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b", "a", ""]`` (the model itself last)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def computed_weight(m: nn.Module) -> str:
    """Why ``m.weight`` is not a registered parameter but computed at each use (empty if it is one):
    a parametrization (``torch.nn.utils.parametrizations.weight_norm`` / ``spectral_norm``) or a
    pre-hook over other parameters (the older ``torch.nn.utils.weight_norm`` / ``spectral_norm``).
    Found without reading ``m.weight``, which would run the computation (a spectral_norm's power
    iteration updates its vectors)."""
    if m._parameters.get("weight") is not None:
        return ""
    if parametrize.is_parametrized(m, "weight"):
        return "parametrized by " + ", ".join(type(p).__name__ for p in m.parametrizations["weight"])
    return f"computed from its parameters {sorted(m._parameters)} by a pre-hook"


def _numel(m: nn.Module) -> int:
    """A Linear's or convolution's weight elements, from its shape (``m.weight`` may be computed when read)."""
    if isinstance(m, nn.Linear):
        return m.in_features * m.out_features
    return m.out_channels * m.in_channels // m.groups * math.prod(m.kernel_size)


def _plain(m: nn.Module) -> Optional[type]:
    return next((t for t in (*_SPLITTABLE, nn.LayerNorm, nn.Embedding) if isinstance(m, t)), None)


def own_behaviour(m: nn.Module) -> str:
    """What ``m``'s class adds to the plain Linear / Conv1d-3d / LayerNorm / Embedding it derives from ('' if
    nothing): its own forward (a scaled or LoRA Linear), or parameters and modules besides weight and bias. A
    tensor-parallel layer replaces the module and would silently drop it. A computed weight is
    :func:`computed_weight`'s."""
    plain = _plain(m)
    if plain is None or computed_weight(m):
        return ""
    if type(m).forward is not plain.forward:
        return f"its class {type(m).__name__} has a forward of its own"
    extra = sorted(set(m._parameters) - {"weight", "bias"}) + sorted(m._modules)
    return f"it holds {extra} besides weight and bias" if extra else ""


def _odd_conv(m: nn.Module) -> str:
    """Why a convolution cannot be a column or row layer ('' if it can): groups, or a padding other than zeros."""
    if not isinstance(m, _ANY_CONV):
        return ""
    if m.groups != 1:
        return f"groups={m.groups}"
    return "" if m.padding_mode == "zeros" else f"padding_mode={m.padding_mode!r}"


def _fits(m: nn.Module, column: nn.Module, tp: int) -> bool:
    """A GroupNorm after a column convolution of a derived plan (split evenly) keeps whole groups on every rank."""
    return not isinstance(m, nn.GroupNorm) or groups_fit(m, even_split_sizes(column.out_channels, tp))


def _kind(m: nn.Module) -> Optional[type]:
    return next((k for k in _SPLITTABLE if isinstance(m, k)), None)


def _qual(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
