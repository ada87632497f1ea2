from lightning_shm.parallel.ddp.reducer import Bucket, GradReducer, broadcast_module_state, broadcast_tensors

__all__ = ["Bucket", "GradReducer", "broadcast_module_state", "broadcast_tensors"]
