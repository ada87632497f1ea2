"""``shm_ddp``: data parallel over shared memory, a drop-in for Lightning's ``ddp_spawn`` on one CPU box.

Per step and rank: forward and backward on its 1/W of the global batch; gradients accumulate
straight into shared-memory buckets (``param.grad`` are views); each bucket is averaged by a
zero-copy all-reduce the moment its last gradient lands; the optimizer steps on identical
averaged gradients on every rank. See :mod:`lightning_shm.parallel.ddp.reducer`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_shm.parallel.ddp import GradReducer, broadcast_tensors
from lightning_shm.strategies.base import SHMStrategyBase


class SHMDDPStrategy(SHMStrategyBase):
    """Distributed data parallel on W CPU processes communicating through shared memory.

    Args:
        bucket_cap_mb: gradient bucket size; a bucket is averaged as soon as its gradients are ready.
        find_unused_parameters: allow parameters without gradient in a step (taken as zero);
            otherwise such a step raises naming them.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to all ranks before
            every training forward, as torch DDP does.
        **kwargs: see :class:`~lightning_shm.strategies.base.SHMStrategyBase` (start_method, timeout).
    """


    def __init__(self, *args: Any, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._buffers: list[Tensor] = []

    def setup(self, trainer: "pl.Trainer") -> None:
        self.prepare_model(trainer)  # every replica starts from rank 0's weights
        assert self.model is not None
        if trainer.state.fn == TrainerFn.FITTING:
            self._reducer = GradReducer(list(self.model.named_parameters()), self.group, self.bucket_cap_mb,
                                        self.find_unused_parameters)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.attach_metrics()
        self._buffers = [b for b in self.model.buffers() if b.numel()] if self.broadcast_buffers else []

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._buffers:  # e.g. BatchNorm running statistics: rank 0's, like torch DDP
            broadcast_tensors(self._buffers, self.group)
        return super().training_step(*args, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        for name, method in (("shm_ddp", "spawn"), ("shm_ddp_fork", "fork")):
            strategy_registry.register(name, cls, description=f"shared-memory DDP, start_method={method!r}",
                                       start_method=method, override=True)

