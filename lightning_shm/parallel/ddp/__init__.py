from lightning_shm.parallel.ddp.reducer import (
    Bucket,
    GradReducer,
    broadcast_module_state,
    broadcast_tensors,
    refuse_lazy,
    sparse_grad_parameters,
)
from lightning_shm.parallel.ddp.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["Bucket", "GradReducer", "SyncBatchNorm", "broadcast_module_state", "broadcast_tensors",
           "convert_sync_batchnorm", "refuse_lazy", "sparse_grad_parameters"]
