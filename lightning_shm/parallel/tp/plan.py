"""Tensor-parallel plans: data saying how each layer of an ``nn.Sequential`` is split.

A plan maps module names to ``"column" | "row" | "replicate"``. Derived automatically: Linear
layers are paired column -> row, everything between a pair runs on the sharded features
(LayerNorm becomes a :class:`ShardedLayerNorm`, elementwise modules run unchanged), a Linear left
without a partner stays replicated. For the reference MLP::

    net.1 Linear(784,256)  column     net.2 LayerNorm(256)  sharded     net.3 ReLU  on shards
    net.4 Linear(256,64)   row        net.5 LayerNorm(64)   replicated  net.6 ReLU
    net.7 Linear(64,10)    replicate

A user plan is validated the same way: a column layer must be followed by its row layer with only
LayerNorm / elementwise modules in between; every rank needs at least one feature.
"""

from __future__ import annotations

from typing import Mapping, Optional

from torch import nn

from lightning_shm.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, ShardedLayerNorm
from lightning_shm.runtime import Group

STYLES = ("column", "row", "replicate")
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Identity, nn.Softplus,
               nn.Mish, nn.Hardswish, nn.Hardtanh, nn.ReLU6)


def _qual(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def derive_plan(seq: nn.Sequential, prefix: str = "") -> dict[str, str]:
    plan: dict[str, str] = {}
    pending: Optional[str] = None
    for name, m in seq.named_children():
        q = _qual(prefix, name)
        if isinstance(m, nn.Linear):
            if pending is None:
                pending = q
            else:
                plan[pending], plan[q] = "column", "row"
                pending = None
        elif pending is not None and not isinstance(m, (nn.LayerNorm, *ELEMENTWISE)):
            plan[pending] = "replicate"  # cannot carry sharded features across this module
            pending = None
    if pending is not None:
        plan[pending] = "replicate"
    return plan


def normalise_plan(plan: Mapping[str, str], seq: nn.Sequential, prefix: str) -> dict[str, str]:
    names = {_qual(prefix, n) for n, _ in seq.named_children()}
    out = {}
    for key, style in plan.items():
        q = key if key in names else _qual(prefix, key)
        if q not in names:
            raise ValueError(f"plan names module '{key}', which is not a child of the Sequential '{prefix}' "
                             f"(children: {sorted(names)})")
        if style not in STYLES:
            raise ValueError(f"plan style for '{key}' must be one of {STYLES}, got {style!r}")
        out[q] = style
    return out


def check_plan(seq: nn.Sequential, plan: Mapping[str, str], prefix: str, tp: int) -> None:
    """Raise ValueError naming the module and sizes if ``plan`` cannot run with ``tp`` ranks."""
    region: Optional[tuple[str, int]] = None  # (column layer, sharded features) while inside a pair
    for name, m in seq.named_children():
        q = _qual(prefix, name)
        style = plan.get(q, "replicate")
        if style in ("column", "row") and not isinstance(m, nn.Linear):
            raise ValueError(f"'{q}' is a {type(m).__name__}; only nn.Linear can be '{style}'")
        if style == "column":
            if region is not None:
                raise ValueError(f"column layer '{q}' starts before column layer '{region[0]}' met its row layer")
            if m.out_features < tp:
                raise ValueError(f"column layer '{q}' has {m.out_features} output features, fewer than tp={tp}")
            region = (q, m.out_features)
        elif style == "row":
            if region is None:
                raise ValueError(f"row layer '{q}' has no column layer before it")
            if m.in_features != region[1]:
                raise ValueError(f"row layer '{q}' takes {m.in_features} features but column layer '{region[0]}' "
                                 f"produces {region[1]}")
            region = None
        elif region is not None:
            if isinstance(m, nn.Linear):
                raise ValueError(f"Linear '{q}' sits between column layer '{region[0]}' and its row layer: "
                                 "mark it 'row' or end the pair before it")
            if not isinstance(m, (nn.LayerNorm, *ELEMENTWISE)):
                raise ValueError(f"'{q}' ({type(m).__name__}) cannot run on features sharded by column layer "
                                 f"'{region[0]}'; only LayerNorm and elementwise modules can")
    if region is not None:
        raise ValueError(f"column layer '{region[0]}' is not followed by a row layer")


def apply_plan(seq: nn.Sequential, plan: Mapping[str, str], prefix: str, group: Group) -> dict[str, nn.Module]:
    """Replace the Sequential's children in place; returns the new parallel modules by qualified name."""
    check_plan(seq, plan, prefix, group.size)
    replaced: dict[str, nn.Module] = {}
    sizes: Optional[list[int]] = None
    for name, m in list(seq.named_children()):
        q = _qual(prefix, name)
        style = plan.get(q, "replicate")
        new: Optional[nn.Module] = None
        if style == "column":
            new = ColumnParallelLinear(m, group)
            sizes = new.sizes
        elif style == "row":
            new = RowParallelLinear(m, group)
            sizes = None
        elif sizes is not None and isinstance(m, nn.LayerNorm):
            new = ShardedLayerNorm(m, group, sizes)
        if new is not None:
            setattr(seq, name, new)
            replaced[q] = new
    return replaced
