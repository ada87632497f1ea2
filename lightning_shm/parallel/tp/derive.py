"""Where a plan comes from when the user gives none: derived for the model's ``nn.Sequential`` (Linear and
convolution layers paired column -> row, a small successor gathered instead) and for torch's own transformer
blocks wherever they sit (their forward is known). :func:`plan_for` picks: the strategy's ``plan=``, else the
module's ``tp_plan``, else these."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import nn

from lightning_shm.parallel.sequential import copies_of, find_sequential, held_outside, layers_of, shared_spans
from lightning_shm.parallel.tp.attention import heads_unsupported
from lightning_shm.parallel.tp.kinds import (
    BETWEEN,
    CONVS,
    TCONVS,
    computed_weight,
    layer_kind,
    norm_fits,
    odd_conv,
    own_behaviour,
    qual,
    weight_numel,
)
from lightning_shm.parallel.tp.layers import conv_groups_fit, even_split_sizes
from lightning_shm.parallel.tp.plan import LayerPlan, resolve_plan


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
        q = qual(prefix, name)
        kind = layer_kind(m)
        if kind in TCONVS and odd_conv(m):  # never a pair's layer, nor between a pair's
            pending = None
            continue
        if kind in CONVS and odd_conv(m):  # never a pair's layer; a grouped one may run between a pair's
            between = pending is not None and pending[1] is kind and i not in shared and not (
                computed_weight(m) or own_behaviour(m))
            if not (between and conv_groups_fit(m, even_split_sizes(pending[2].out_channels, tp))):  # type: ignore
                pending = None
            continue
        # split, it would stop sharing its parameters / computing its weight / running its own forward
        whole = i in shared or kind is not None and (computed_weight(m) or own_behaviour(m))
        if kind is nn.Linear and pending is None and weight_numel(m) <= replicate_upto:
            continue
        pair = kind is not None and pending is not None and pending[1] is kind
        gathered = pair and kind is nn.Linear and weight_numel(m) * tp <= weight_numel(pending[2])
        if whole and not gathered:  # it stays whole (a gathered pair keeps it so)
            pending = None
            continue
        if pair:
            if gathered:
                plan[pending[0]] = LayerPlan("column_gathered")
                replicate_upto = weight_numel(pending[2]) // tp
            else:
                plan[pending[0]], plan[q] = LayerPlan("column"), LayerPlan("row")
            pending = None
        elif kind is not None:
            pending = (q, kind, m)
        elif pending is not None and not (isinstance(m, BETWEEN[pending[1]]) and norm_fits(m, pending[2], tp)):
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
        q = qual(prefix, n)
        if all(type(getattr(block, a, None)) is nn.Linear for a in ("linear1", "linear2")):
            plan[qual(q, "linear1")], plan[qual(q, "linear2")] = LayerPlan("column"), LayerPlan("row")
        for a in ("self_attn", "multihead_attn"):
            attn = getattr(block, a, None)
            if type(attn) is nn.MultiheadAttention and not heads_unsupported(attn) and attn.num_heads >= tp:
                plan[qual(q, a)] = LayerPlan("heads")
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
