"""A checked plan applied on a worker: each split module replaced in place by its tensor-parallel layer (the rank's
piece), tied tensors cut once, "per_head" tensors cut to the rank's heads, "on_heads" gradients summed over the tp
ranks by a hook."""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import torch
from torch import nn

from lightning_shm.parallel.placement import Split
from lightning_shm.parallel.replaced import carry_over, carry_over_module
from lightning_shm.parallel.tp.attention import HeadParallelMultiheadAttention
from lightning_shm.parallel.tp.hooks import whole_tensors_for_hooks
from lightning_shm.parallel.tp.inputs import fingerprint
from lightning_shm.parallel.tp.kinds import ANY_CONV, CONVS, ancestors, features_of, own_tensor, split_layer
from lightning_shm.parallel.tp.layers import (
    ColumnParallelLinear,
    KVHeadsLinear,
    RowParallelLinear,
    ShardedLayerNorm,
    sliced_batchnorm,
    sliced_grouped_conv,
    sliced_groupnorm,
)
from lightning_shm.parallel.tp.reductions import watch_split_reductions
from lightning_shm.parallel.tp.rng import SplitRegionRandom
from lightning_shm.parallel.tp.sizes import LayerSplit
from lightning_shm.runtime import Group


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
            dim = 1 if isinstance(layer, (*ANY_CONV, nn.modules.batchnorm._NormBase, nn.GroupNorm)) else -1
            whole_tensors_for_hooks(layer, group, sp.sizes, dim, inputs_split=sp.role != "column",
                                    output_split=sp.role != "row", blocks=sp.blocks)  # (before a copy takes them)
        if sp.role == "heads":
            new = HeadParallelMultiheadAttention(layer, group, sp.sizes, random=random)
        elif sp.role == "kv_heads":
            new = KVHeadsLinear(layer, group, sp.starts[group.index], sp.sizes[group.index], random=random)
        elif sp.role == "between":
            new = (ShardedLayerNorm(layer, group, sp.sizes) if isinstance(layer, nn.LayerNorm)
                   else sliced_groupnorm(layer, group, sp.sizes) if isinstance(layer, nn.GroupNorm)
                   else sliced_grouped_conv(layer, group, sp.sizes) if isinstance(layer, CONVS)
                   else sliced_batchnorm(layer, group, sp.sizes))
        else:
            if sp.role == "column_gathered":
                new = ColumnParallelLinear(layer, group, sp.sizes, gather_output=True)
            elif sp.role == "row_split_input":
                new = RowParallelLinear(layer, group, sp.sizes, split_input=True)
            elif sp.blocks > 1:
                new = ColumnParallelLinear(layer, group, sp.sizes, random=random, blocks=sp.blocks)
            else:
                new = split_layer(sp.role, layer)(layer, group, sp.sizes, random=random)  # type: ignore[misc]
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
    watch_split_reductions(local, {n: sp.sizes for n, sp in splits.items() if sp.role == "column" and n in replaced},
                           replaced)
    for name in {a for n in replaced for a in ancestors(n)}:
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
    full = None if owner is None else own_tensor(owner, entry)
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
            continue  # inside a Sequential the order is known: check_plan splits or refuses
        n = sum(sp.sizes)
        for name, m in local.items():
            found = features_of(m)
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
