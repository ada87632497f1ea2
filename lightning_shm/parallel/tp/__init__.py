from lightning_shm.parallel.tp.apply import apply_plan
from lightning_shm.parallel.tp.check import check_plan
from lightning_shm.parallel.tp.derive import derive_plan, plan_for
from lightning_shm.parallel.tp.layernorm import distributed_layer_norm
from lightning_shm.parallel.tp.layers import (
    ColumnParallelConv1d,
    ColumnParallelConv2d,
    ColumnParallelConv3d,
    ColumnParallelLinear,
    RowParallelConv1d,
    RowParallelConv2d,
    RowParallelConv3d,
    RowParallelEmbedding,
    RowParallelLinear,
    ShardedLayerNorm,
    sliced_batchnorm,
    sliced_grouped_conv,
    sliced_groupnorm,
)
from lightning_shm.parallel.tp.mappings import copy_to_tp, reduce_from_tp
from lightning_shm.parallel.tp.plan import STYLES, LayerPlan, resolve_plan
from lightning_shm.parallel.tp.sizes import LayerSplit
from lightning_shm.parallel.tp.state import TensorParallelState

__all__ = [
    "ColumnParallelConv1d", "ColumnParallelConv2d", "ColumnParallelConv3d", "ColumnParallelLinear", "LayerPlan",
    "LayerSplit", "RowParallelConv1d", "RowParallelConv2d", "RowParallelConv3d", "RowParallelEmbedding",
    "RowParallelLinear", "STYLES", "ShardedLayerNorm", "TensorParallelState", "apply_plan", "check_plan", "copy_to_tp",
    "derive_plan", "distributed_layer_norm", "plan_for", "reduce_from_tp", "resolve_plan", "sliced_batchnorm",
    "sliced_grouped_conv", "sliced_groupnorm",
]
