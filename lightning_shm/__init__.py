"""lightning_shm: Lightning strategies that train one model on N CPU processes through shared memory.

Importing the package makes the strategy names ("shm_ddp", ...) known to Lightning, so
``Trainer(strategy="shm_ddp", accelerator="cpu", devices=4)`` works. It does so without importing Lightning:
the runtime (:mod:`lightning_shm.runtime`) and the parallel layer (:mod:`lightning_shm.parallel`) know nothing
of Lightning, and a process that uses only them should not load it. The strategies register themselves when
their module loads (:mod:`lightning_shm.strategies`), and that module loads as soon as ``lightning.pytorch``
has (:mod:`._after_import`). The names below load on first use (``from lightning_shm import SHMDDPStrategy``).
"""

import importlib
from typing import TYPE_CHECKING, Any

from lightning_shm._after_import import after_import

if TYPE_CHECKING:  # what the names below are, for type checkers and editors
    from lightning_shm.models import MNISTClassifier, build_mlp
    from lightning_shm.strategies import (
        SHMDDPStrategy,
        SHMFSDPStrategy,
        SHMModelParallel,
        SHMPipeline,
        SHMStrategyBase,
        SHMTensorParallel,
        grad_norm,
        param_norm,
    )

__version__ = "0.1.0"

__all__ = [
    "MNISTClassifier", "SHMDDPStrategy", "SHMFSDPStrategy", "SHMModelParallel", "SHMPipeline", "SHMStrategyBase",
    "SHMTensorParallel", "build_mlp", "grad_norm", "param_norm",
]
_MODELS = ("MNISTClassifier", "build_mlp")  # the rest come from lightning_shm.strategies


def __getattr__(name: str) -> Any:
    if name in __all__:
        module = "lightning_shm.models" if name in _MODELS else "lightning_shm.strategies"
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'lightning_shm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


after_import("lightning.pytorch", lambda: importlib.import_module("lightning_shm.strategies"))
