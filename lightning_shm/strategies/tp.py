"""``shm_tp``: Megatron-style tensor parallelism (optionally x data parallelism) over shared memory.

``devices = dp x tp``: ranks of a tensor-parallel group split every weight matrix of the model's
``nn.Sequential`` according to a plan (derived automatically, or given as data) and see the same
batch; data-parallel replicas of each shard average their gradients with the shm_ddp reducer over
their dp group. The LightningModule is untouched: its Sequential's children are swapped for
parallel layers in ``setup``. Validate / test / predict run through the sharded model.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from lightning_shm.parallel.ddp import GradReducer
from lightning_shm.parallel.sequential import find_sequential
from lightning_shm.parallel.tp import TensorParallelModule, check_plan, derive_plan
from lightning_shm.parallel.tp.plan import normalise_plan
from lightning_shm.runtime import Group, ParallelGroups, Topology, World
from lightning_shm.strategies.base import ShardedStateStrategy, shm_ddp_bytes


class SHMTensorParallel(ShardedStateStrategy):
    """Tensor parallelism of size ``tensor_parallel_size`` times data parallelism of devices / tp.

    Args:
        tensor_parallel_size: ranks that split each weight matrix; must divide ``devices``.
        plan: ``{module name: "column" | "row" | "replicate"}`` for the Sequential's children;
            default: derived (Linear layers paired column -> row, a leftover Linear replicated).
        sequential: attribute name of the ``nn.Sequential`` to parallelise (default: the first one).
        **kwargs: see :class:`~lightning_shm.strategies.base.SHMStrategyBase`.
    """


    def __init__(self, *args: Any, tensor_parallel_size: int = 2, plan: Optional[Mapping[str, str]] = None,
                 sequential: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
        self.tensor_parallel_size = tensor_parallel_size
        self.plan = dict(plan) if plan is not None else None
        self.sequential = sequential
        self.tp_module: Optional[TensorParallelModule] = None
        self._groups: Optional[ParallelGroups] = None

    # ------------------------------------------------------------------ grid
    def topology(self) -> Topology:
        return Topology.infer(max(self.num_processes, 1), tp=self.tensor_parallel_size)

    def attach_world(self, world: World) -> None:
        super().attach_world(world)
        self._groups = self.topology().groups(world)

    def data_parallel_group(self) -> Optional[Group]:
        return self._groups.dp if self._groups is not None else None

    def validate_model(self, module: "pl.LightningModule", trainer: Optional["pl.Trainer"] = None,
                       launch_args: Any = ()) -> None:
        if next(module.parameters(), None) is None:
            return  # built in configure_model: checked in the workers
        prefix, seq = find_sequential(module, self.sequential)
        plan = normalise_plan(self.plan, seq, prefix) if self.plan is not None else derive_plan(seq, prefix)
        check_plan(seq, plan, prefix, self.tensor_parallel_size)

    def shm_components(self, module: "pl.LightningModule") -> dict[str, int]:
        dp = self.topology().dp
        return {"gradient buckets (dp)": shm_ddp_bytes(module, dp) if dp > 1 else 0}

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self._groups is not None
        self.prepare_model(trainer)  # every slice is cut from rank 0's initial weights
        assert self.model is not None
        self.tp_module = self.state_manager = TensorParallelModule(self.lightning_module, self._groups.tp, self.plan,
                                                                   self.sequential)
        if trainer.state.fn == TrainerFn.FITTING:
            if self._groups.dp.size > 1:
                self._reducer = GradReducer(list(self.model.named_parameters()), self._groups.dp, tag="tp-dp")
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.install_global_clipping(self._groups.tp, replicated=self.tp_module.replicated)
        self.attach_metrics()

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        for name, method in (("shm_tp", "spawn"), ("shm_tp_fork", "fork")):
            strategy_registry.register(name, cls, description=f"shared-memory tensor parallel (tp=2), {method}",
                                       start_method=method, override=True)
