"""lightning_shm: Lightning strategies that train one model on N CPU processes through shared memory.

Importing the package registers the strategy names ("shm_ddp", ...) with Lightning, so
``Trainer(strategy="shm_ddp", accelerator="cpu", devices=4)`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_shm.models import MNISTClassifier, build_mlp
from lightning_shm.strategies import (
    SHMDDPStrategy,
    SHMFSDPStrategy,
    SHMModelParallel,
    SHMPipeline,
    SHMStrategyBase,
    SHMTensorParallel,
    grad_norm,
    register_all,
)

__version__ = "0.1.0"

register_all(StrategyRegistry)

__all__ = [
    "MNISTClassifier", "SHMDDPStrategy", "SHMFSDPStrategy", "SHMModelParallel", "SHMPipeline", "SHMStrategyBase",
    "SHMTensorParallel", "build_mlp", "grad_norm",
]
