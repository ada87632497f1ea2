"""``shm_fsdp``: fully sharded data parallel (ZeRO-3) over shared memory.

Each rank persistently holds 1/W of every unit's parameters (in shared memory), of their
gradients and of the optimizer state; a unit's full parameters exist only around its forward and
backward. See :mod:`lightning_shm.parallel.fsdp.unit` for the per-unit rhythm.

Lightning order, as in its own FSDPStrategy: the module is sharded in ``setup`` *before*
``configure_optimizers`` runs, so the module's own optimizer (any torch optimizer) sees only the
local shards and its state is sharded too; checkpoints are restored after setup and consolidated
on save.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer

from lightning_shm.parallel.fsdp import ShardedModule, UnitPolicy, find_units
from lightning_shm.strategies.base import ShardedStateStrategy, param_bytes


class SHMFSDPStrategy(ShardedStateStrategy):
    """ZeRO-3 on W CPU processes through shared memory.

    Args:
        unit_policy: None (each parameter-owning child of the model's ``nn.Sequential``), an int
            (merge consecutive Sequential children until a unit has at least this many parameters)
            or a callable ``(name, module) -> bool`` marking unit roots.
        reshard_after_forward: free a unit's full parameters after its forward and gather them
            again for backward (ZeRO-3); False keeps them until the unit's backward (ZeRO-2-like).
        prefetch: gather the next unit on a helper thread while the current one computes. Costs one
            more unit's full parameters; faster only when cores are left over (e.g. devices <
            cores with OMP_NUM_THREADS=1) -- see README "shm_fsdp" for the measurement.
        **kwargs: see :class:`~lightning_shm.strategies.base.SHMStrategyBase`.
    """


    def __init__(self, *args: Any, unit_policy: Union[None, int, Callable[[str, nn.Module], bool]] = None,
                 reshard_after_forward: bool = True, prefetch: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unit_policy = UnitPolicy.parse(unit_policy)
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.sharded: Optional[ShardedModule] = None

    def validate_model(self, module: "pl.LightningModule", trainer: Optional["pl.Trainer"] = None,
                       launch_args: Any = ()) -> None:
        if next(module.parameters(), None) is None:
            return  # layers created in configure_model: checked when the workers shard them
        specs = find_units(module, self.unit_policy)
        if not specs:
            raise ValueError(f"the FSDP unit policy selected no module with parameters in {type(module).__name__}: "
                             "nothing to shard")
        W = self.num_processes
        for spec in specs:
            if spec.numel < W:
                raise ValueError(f"FSDP unit '{spec.name}' has {spec.numel} parameters, fewer than devices={W}; merge "
                                 f"small units (unit_policy=<min parameters>) or use fewer devices")

    def shm_components(self, module: "pl.LightningModule") -> dict[str, int]:
        return {"parameter shards": param_bytes(module)}

    def setup(self, trainer: "pl.Trainer") -> None:
        self.prepare_model(trainer)  # shards are cut from rank 0's weights
        self.sharded = ShardedModule(self.lightning_module, self.group, self.unit_policy, self.reshard_after_forward,
                                     self.prefetch)
        self.state_manager = self.sharded
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # configure_optimizers sees only the local shards
        self.setup_precision_plugin()
        self.install_global_clipping(self.group)
        self.attach_metrics()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.sharded is not None
        self.sharded.begin_step()
        return super().training_step(*args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.group.barrier()  # every shard updated before any rank gathers for the next forward
        return out

    def teardown(self) -> None:
        if self.sharded is not None:
            self.sharded.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        for name, method in (("shm_fsdp", "spawn"), ("shm_fsdp_fork", "fork")):
            strategy_registry.register(name, cls, description=f"shared-memory FSDP (ZeRO-3), start_method={method!r}",
                                       start_method=method, override=True)
