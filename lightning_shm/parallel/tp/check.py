"""A resolved plan checked on the whole model before any worker starts: every module's split
(:class:`~.sizes.LayerSplit`), or a ValueError naming the module and the sizes -- a tied tensor its holders
would cut apart, a fused projection that must say its blocks, what runs between a column and a row layer."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from torch import nn

from lightning_shm.parallel.sequential import layers_of, parameter_holders
from lightning_shm.parallel.tp.kinds import (
    BETWEEN,
    CONVS,
    NORMS,
    SPLITTABLE,
    TCONVS,
    ancestors,
    computed_weight,
    features_of,
    layer_kind,
    odd_conv,
    own_behaviour,
    own_tensor,
    plain_kind,
    qual,
    split_layer,
)
from lightning_shm.parallel.tp.layers import ColumnParallelLinear, conv_groups_fit, groups_fit
from lightning_shm.parallel.tp.plan import LayerPlan
from lightning_shm.parallel.tp.sizes import LayerSplit, head_dim_for, kv_group_splits, split_sizes


def check_plan(module: nn.Module, plan: Mapping[str, LayerPlan], tp: int) -> dict[str, LayerSplit]:
    """Validate ``plan`` for ``tp`` ranks on the whole model; returns how each module is split.

    Raises ValueError naming the module and the sizes. Computed on the plain model (a pipeline then
    applies the part its stage holds)."""
    mods = dict(module.named_modules())
    holders = parameter_holders(module)
    out: dict[str, LayerSplit] = {}
    ties: dict[str, list[str]] = {}  # a split layer's tensor -> the other names it is held under
    grouped = kv_group_splits(mods, plan, tp, module)  # grouped-query attention's layers
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
        reader = next((a for a in ancestors(name) if isinstance(mods.get(a), nn.MultiheadAttention)), None)
        if reader is not None:
            raise ValueError(f"'{name}' ({lp.style}) is part of nn.MultiheadAttention '{reader}', whose forward reads "
                             "its weights itself (F.multi_head_attention_forward), never calling the layer: a split "
                             "layer's collectives would not run. Leave it replicated, or write the attention with "
                             "nn.Linear projections that its forward calls.")
        own = own_behaviour(mods[name])
        if own:
            raise ValueError(f"'{name}' ({lp.style}): {own}, and a tensor-parallel layer computes the plain "
                             f"{plain_kind(mods[name]).__name__}'s forward over a piece of weight and bias only. "
                             "Leave the layer replicated.")
        odd = odd_conv(mods[name])
        if odd:
            between = ("" if isinstance(mods[name], TCONVS) else " (a grouped one with as many output as input "
                       "channels runs split between a column and a row layer, on whole groups)")
            raise ValueError(f"'{name}' ({lp.style}) is a {type(mods[name]).__name__} with {odd}: a column or row "
                             f"layer splits a plain convolution's channels. Leave it replicated{between}")
        how = computed_weight(mods[name]) if isinstance(mods[name], (*SPLITTABLE, nn.Embedding)) else None
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
    both layers then hold each rank's one piece (:func:`~.apply.apply_plan`). Else ValueError: the other holder would
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
    heads of k x head_dim features, where ``blocks: k`` would mix the heads' parts as silently; laid out per kv group
    (Falcon: a group's q heads, then its k and v; with 2 q heads per kv head the output is 2 x o's input), a rank's
    groups are one run, ``blocks: 1`` on whole groups, its row layer on their q heads."""
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
                             "the heads' parts, and the shapes would still fit). If it views kv groups first, each "
                             "group's q heads then its k and v (view(B, T, -1, q heads per kv head + 2, head_dim) -- "
                             "Falcon), a rank's whole groups are one run: plan it {'style': 'column', 'blocks': 1, "
                             "'head_dim': (q heads per kv head + 2) * head_dim} and the row layer {'style': 'row', "
                             "'head_dim': q heads per kv head * head_dim}. Any other output of one part: "
                             "{'style': 'column', 'blocks': 1}")


def _split_dim(m: nn.Module, split: LayerSplit, entry: str) -> Optional[int]:
    """The dimension the tensor-parallel layer replacing ``m`` cuts its ``entry`` along (None: held whole)."""
    if split.role == "column_gathered":
        return ColumnParallelLinear.split_dims.get(entry)
    layer = split_layer(split.role, m)
    return layer.split_dims.get(entry) if layer is not None else None


def _between(name: str, mods: Mapping[str, nn.Module], splits: Mapping[str, LayerSplit]) -> LayerSplit:
    """A module planned "between": split like its sibling column layer of as many output features."""
    m = mods[name]
    found = features_of(m)
    if found is None:
        raise ValueError(f"'{name}' ({type(m).__name__}) is planned 'between', which only a LayerNorm over one "
                         "dimension, a BatchNorm, InstanceNorm, GroupNorm or grouped convolution can be")
    n, kinds = found
    parent = name.rpartition(".")[0]
    columns = [c for c, sp in splits.items() if sp.role == "column" and c.rpartition(".")[0] == parent
               and sum(sp.sizes) == n and layer_kind(mods[c]) in kinds]
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
    t = own_tensor(mods[owner_name] if owner_name else root, entry)
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
        head_dim = head_dim_for(plan[c], mods[parent] if parent else root) or 1
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
    own = computed_weight(m) or own_behaviour(m) if isinstance(m, (nn.LayerNorm, *CONVS)) else ""
    if own:
        raise ValueError(f"'{q}' {where}, so it would run split, but {own}: end the pair before it")
    if isinstance(m, nn.GroupNorm) and not groups_fit(m, sizes):
        raise ValueError(f"GroupNorm '{q}' ({m.num_groups} groups of {m.num_channels // m.num_groups} channels) "
                         f"{where}, which split the channels as {list(sizes)}: a group would span two ranks. Give it "
                         "a number of groups that tp divides, or end the pair before it")
    if isinstance(m, CONVS) and not conv_groups_fit(m, sizes):
        raise ValueError(f"grouped {type(m).__name__} '{q}' ({m.in_channels} -> {m.out_channels} channels, "
                         f"groups={m.groups}) "
                         f"{where}, which split the channels as {list(sizes)}: it runs there only on whole groups "
                         "and as many output as input channels. End the pair before it")


def _check_sequential(seq: nn.Sequential, prefix: str, splits: Mapping[str, LayerSplit]) -> dict[str, LayerSplit]:
    """Pairs inside a Sequential: what runs between them, and the norms there to split."""
    region: Optional[tuple[str, type]] = None  # (column layer, its kind) while inside a pair
    norms: dict[str, LayerSplit] = {}
    for name, m in layers_of(seq):
        q = qual(prefix, name)
        role = splits[q].role if q in splits else "replicate"
        if role == "column":
            if region is not None:
                raise ValueError(f"column layer '{q}' starts before column layer '{region[0]}' met its row layer")
            if splits[q].blocks > 1:
                raise ValueError(f"column layer '{q}' is planned with blocks={splits[q].blocks}, for an output the "
                                 "module's forward cuts into parts; in an nn.Sequential the next layer takes it whole. "
                                 "Plan it without blocks")
            region = (q, layer_kind(m))  # type: ignore[assignment]
        elif role == "row" and isinstance(m, nn.Embedding):  # takes ids, gives whole rows: no pair
            if region is not None:
                raise ValueError(f"embedding '{q}' sits between column layer '{region[0]}' and its row layer")
        elif role == "row":
            if region is None:
                raise ValueError(f"row layer '{q}' has no column layer before it in its nn.Sequential (a row layer "
                                 "takes the split features a column layer produces)")
            if layer_kind(m) is not region[1]:
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
            if isinstance(m, CONVS) and m.groups > 1 and region[1] is layer_kind(m):
                _check_runs_split(q, m, region[0], sizes)
                norms[q] = LayerSplit("between", sizes)
                continue
            if layer_kind(m) is not None:
                raise ValueError(f"{type(m).__name__} '{q}' sits between column layer '{region[0]}' and its row "
                                 "layer: mark it 'row' or end the pair before it")
            if not isinstance(m, BETWEEN[region[1]]):
                raise ValueError(f"'{q}' ({type(m).__name__}) cannot run on features split by column layer "
                                 f"'{region[0]}'; only {', '.join(t.__name__ for t in BETWEEN[region[1]][:3])}, "
                                 "elementwise and pooling modules can")
            _check_runs_split(q, m, region[0], sizes)
            if isinstance(m, NORMS):
                norms[q] = LayerSplit("between", sizes)
    if region is not None:
        raise ValueError(f"column layer '{region[0]}' is not followed by a row layer in its nn.Sequential")
    return norms
