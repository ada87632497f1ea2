"""How many features (channels, heads' features, vocabulary rows) each rank holds of a planned layer: evenly, on
whole heads (``head_dim``), by the kv groups of grouped-query attention, by an embedding's vocabulary.
:class:`LayerSplit` is the answer :func:`~.check.check_plan` gives for every module it splits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from torch import nn

from lightning_shm.parallel.tp.attention import heads_unsupported
from lightning_shm.parallel.tp.kinds import SPLITTABLE
from lightning_shm.parallel.tp.layers import even_split_sizes
from lightning_shm.parallel.tp.plan import LayerPlan


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
    if not isinstance(layer, SPLITTABLE):
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
    head_dim = head_dim_for(lp, parent) if lp.style in ("column", "row") else None
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


def head_dim_for(lp: LayerPlan, parent: Optional[nn.Module]) -> Optional[int]:
    """The head size a column or row Linear splits on: the plan's, else its module's int ``head_dim``."""
    if lp.head_dim is None and isinstance(getattr(parent, "head_dim", None), int):
        return parent.head_dim  # type: ignore[union-attr]
    return lp.head_dim


def kv_group_splits(mods: Mapping[str, nn.Module], plan: Mapping[str, LayerPlan], tp: int, root: nn.Module
                    ) -> dict[str, LayerSplit]:
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
                  group's kv head (:class:`~.layers.KVHeadsLinear`)

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
        head_dim = head_dim_for(lp, parent)
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
    """Rows per rank of an embedding split by its vocabulary (:class:`~.layers.RowParallelEmbedding`)."""
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
