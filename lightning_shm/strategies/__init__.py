"""Lightning strategies: thin adapters of the parallelism code to the Trainer.

One strategy, :class:`SHMModelParallel` (dp x tp x pp), and four presets of it; every name is
registered once per start method (``shm_ddp``: forkserver, ``shm_ddp_spawn``, ``shm_ddp_fork``), when this
module loads -- which ``import lightning_shm`` arranges for as soon as ``lightning.pytorch`` is imported.
"""

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_shm.strategies.base import SHMStrategyBase
from lightning_shm.strategies.ddp import SHMDDPStrategy
from lightning_shm.strategies.fsdp import SHMFSDPStrategy
from lightning_shm.strategies.grad_norm import grad_norm, param_norm
from lightning_shm.strategies.model_parallel import SHMModelParallel
from lightning_shm.strategies.pipeline import SHMPipeline
from lightning_shm.strategies.tp import SHMTensorParallel

REGISTRY = (
    ("shm_ddp", SHMDDPStrategy, "shared-memory DDP"),
    ("shm_fsdp", SHMFSDPStrategy, "shared-memory FSDP (ZeRO-3)"),
    ("shm_tp", SHMTensorParallel, "shared-memory tensor parallel (tp=2)"),
    ("shm_pipeline", SHMPipeline, "shared-memory pipeline parallel (P=2, 1F1B)"),
    ("shm_model_parallel", SHMModelParallel, "shared-memory dp x tp x pp (dp only unless sizes are given)"),
)


def register_all(strategy_registry: Any) -> None:
    for name, cls, description in REGISTRY:
        for suffix, method in (("", "forkserver"), ("_spawn", "spawn"), ("_fork", "fork")):
            strategy_registry.register(name + suffix, cls, description=f"{description}, start_method={method!r}",
                                       start_method=method, override=True)


register_all(StrategyRegistry)

__all__ = ["REGISTRY", "SHMDDPStrategy", "SHMFSDPStrategy", "SHMModelParallel", "SHMPipeline", "SHMStrategyBase",
           "SHMTensorParallel", "grad_norm", "param_norm", "register_all"]
