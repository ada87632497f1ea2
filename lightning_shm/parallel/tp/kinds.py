"""Which modules tensor parallelism splits, and what may run on split features between a column and a row layer.

The plan's derivation (:mod:`.derive`), its checks (:mod:`.check`) and its application (:mod:`.apply`) ask the
same questions of a module: its kind (a Linear, a convolution), whether its class adds something a split copy
would drop (:func:`own_behaviour`), whether its weight is computed from other parameters (:func:`computed_weight`),
which norms, elementwise modules and pools can run on a column layer's split output (``BETWEEN``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_shm.parallel.tp.layers import (
    COLUMN_CONV,
    ROW_CONV,
    ColumnParallelLinear,
    RowParallelEmbedding,
    RowParallelLinear,
    even_split_sizes,
    groups_fit,
)

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Identity, nn.Softplus,
               nn.Mish, nn.Hardswish, nn.Hardtanh, nn.ReLU6, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TCONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)  # a decoder's upsampling
ANY_CONV = (*CONVS, *TCONVS)

# what may run on split features between a column and a row layer of each kind
BETWEEN = {
    nn.Linear: (nn.LayerNorm, nn.BatchNorm1d, nn.SyncBatchNorm, *ELEMENTWISE),
    nn.Conv1d: (nn.BatchNorm1d, nn.SyncBatchNorm, nn.GroupNorm, nn.InstanceNorm1d, *ELEMENTWISE,
                nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d),
    nn.Conv2d: (nn.BatchNorm2d, nn.SyncBatchNorm, nn.GroupNorm, nn.InstanceNorm2d, *ELEMENTWISE,
                nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d),
    nn.Conv3d: (nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm, nn.InstanceNorm3d, *ELEMENTWISE,
                nn.MaxPool3d, nn.AvgPool3d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d),
}
BETWEEN.update({t: BETWEEN[c] for c, t in zip(CONVS, TCONVS)})  # the same norms and pools after a transposed one
# norms between a column and a row layer, run on the rank's features (LayerNorm: distributed; the others sliced)
NORMS = (nn.LayerNorm, nn.modules.batchnorm._NormBase, nn.GroupNorm)
SPLITTABLE = (nn.Linear, *CONVS, *TCONVS)
SPLIT_LAYERS = {("column", nn.Linear): ColumnParallelLinear, ("row", nn.Linear): RowParallelLinear,
                ("row_split_input", nn.Linear): RowParallelLinear,
                ("row", nn.Embedding): RowParallelEmbedding,
                **{("column", k): c for k, c in COLUMN_CONV.items()}, **{("row", k): c for k, c in ROW_CONV.items()}}


def layer_kind(m: nn.Module) -> Optional[type]:
    return next((k for k in SPLITTABLE if isinstance(m, k)), None)


def plain_kind(m: nn.Module) -> Optional[type]:
    return next((t for t in (*SPLITTABLE, nn.LayerNorm, nn.Embedding) if isinstance(m, t)), None)


def split_layer(role: str, m: nn.Module) -> Optional[type]:
    """The tensor-parallel class that replaces ``m`` planned ``role`` ("column" / "row"); None for none."""
    return SPLIT_LAYERS.get((role, nn.Embedding if isinstance(m, nn.Embedding) else layer_kind(m)))  # type: ignore


def features_of(m: nn.Module) -> Optional[tuple[int, tuple[type, ...]]]:
    """(features it runs on, the layer kinds whose split output it can take) of a module that may run between a
    column and a row layer; None for any other."""
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
        return m.normalized_shape[0], (nn.Linear,)
    if isinstance(m, nn.GroupNorm):
        return m.num_channels, ANY_CONV
    if isinstance(m, CONVS) and m.groups > 1:
        return m.in_channels, (layer_kind(m),)  # type: ignore[return-value]
    if isinstance(m, nn.modules.batchnorm._NormBase):
        return m.num_features, tuple(k for k, fit in BETWEEN.items() if isinstance(m, fit)) or ANY_CONV
    return None


def weight_numel(m: nn.Module) -> int:
    """A Linear's or convolution's weight elements, from its shape (``m.weight`` may be computed when read)."""
    if isinstance(m, nn.Linear):
        return m.in_features * m.out_features
    return m.out_channels * m.in_channels // m.groups * math.prod(m.kernel_size)


def norm_fits(m: nn.Module, column: nn.Module, tp: int) -> bool:
    """A GroupNorm after a column convolution of a derived plan (split evenly) keeps whole groups on every rank."""
    return not isinstance(m, nn.GroupNorm) or groups_fit(m, even_split_sizes(column.out_channels, tp))


def odd_conv(m: nn.Module) -> str:
    """Why a convolution cannot be a column or row layer ('' if it can): groups, or a padding other than zeros."""
    if not isinstance(m, ANY_CONV):
        return ""
    if m.groups != 1:
        return f"groups={m.groups}"
    return "" if m.padding_mode == "zeros" else f"padding_mode={m.padding_mode!r}"


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


def own_behaviour(m: nn.Module) -> str:
    """What ``m``'s class adds to the plain Linear / Conv1d-3d / LayerNorm / Embedding it derives from ('' if
    nothing): its own forward (a scaled or LoRA Linear), or parameters and modules besides weight and bias. A
    tensor-parallel layer replaces the module and would silently drop it. A computed weight is
    :func:`computed_weight`'s."""
    plain = plain_kind(m)
    if plain is None or computed_weight(m):
        return ""
    if type(m).forward is not plain.forward:
        return f"its class {type(m).__name__} has a forward of its own"
    extra = sorted(set(m._parameters) - {"weight", "bias"}) + sorted(m._modules)
    return f"it holds {extra} besides weight and bias" if extra else ""


def own_tensor(owner: nn.Module, entry: str) -> Optional[torch.Tensor]:
    """``owner``'s own parameter or buffer ``entry`` (None: it holds none by that name)."""
    return owner._parameters.get(entry, owner._buffers.get(entry))


def ancestors(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["a.b", "a", ""]`` (the model itself last)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def qual(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
