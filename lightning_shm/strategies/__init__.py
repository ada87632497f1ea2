"""Lightning strategies: thin adapters of the parallelism code to the Trainer."""

from lightning_shm.strategies.base import SHMStrategyBase
from lightning_shm.strategies.ddp import SHMDDPStrategy
from lightning_shm.strategies.fsdp import SHMFSDPStrategy
from lightning_shm.strategies.pipeline import SHMPipeline
from lightning_shm.strategies.tp import SHMTensorParallel

__all__ = ["SHMDDPStrategy", "SHMFSDPStrategy", "SHMPipeline", "SHMStrategyBase", "SHMTensorParallel"]
