"""``shm_ddp``: data parallel over shared memory, a drop-in for Lightning's ``ddp_spawn`` on one CPU box.

Per step and rank: forward and backward on its 1/W of the global batch; gradients accumulate
straight into shared-memory buckets (``param.grad`` are views); each bucket is averaged by a
zero-copy all-reduce the moment its last gradient lands; the optimizer steps on identical
averaged gradients on every rank. See :mod:`lightning_shm.parallel.ddp.reducer`. A preset of
:class:`~lightning_shm.strategies.model_parallel.SHMModelParallel` (dp replicate).
"""

from __future__ import annotations

from typing import Any

from lightning_shm.strategies.model_parallel import SHMModelParallel


class SHMDDPStrategy(SHMModelParallel):
    """Distributed data parallel on W CPU processes communicating through shared memory.

    Args:
        bucket_cap_mb: gradient bucket size; a bucket is averaged as soon as its gradients are ready.
        find_unused_parameters: allow parameters without gradient in a step (a rank without one
            contributes zero; one without one on every rank keeps None, as in one process);
            otherwise such a step raises naming them.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to all ranks before
            every training step and at the start of evaluation, as torch DDP does.
        **kwargs: see :class:`~lightning_shm.strategies.base.SHMStrategyBase` (start_method, timeout).
    """

    def __init__(self, *args: Any, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, data_parallel="replicate", bucket_cap_mb=bucket_cap_mb,
                         find_unused_parameters=find_unused_parameters, broadcast_buffers=broadcast_buffers, **kwargs)
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
