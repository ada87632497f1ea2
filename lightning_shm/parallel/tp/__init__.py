from lightning_shm.parallel.tp.layernorm import distributed_layer_norm
from lightning_shm.parallel.tp.layers import ColumnParallelLinear, RowParallelLinear, ShardedLayerNorm
from lightning_shm.parallel.tp.mappings import copy_to_tp, reduce_from_tp
from lightning_shm.parallel.tp.plan import STYLES, apply_plan, check_plan, derive_plan
from lightning_shm.parallel.tp.state import TensorParallelModule

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "STYLES", "ShardedLayerNorm", "TensorParallelModule",
    "apply_plan", "check_plan", "copy_to_tp", "derive_plan", "distributed_layer_norm", "reduce_from_tp",
]
