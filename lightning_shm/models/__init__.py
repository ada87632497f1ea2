"""The models: plain torch builders (MLP, CNN, transformer) and the MNIST LightningModule that trains any of them.

The LightningModule loads on first use (``from lightning_shm.models import MNISTClassifier``): the builders must
come without Lightning, for the runtime-only pipeline driver (``parallel/pipeline/driver.py``) and its scripts.
"""

from typing import TYPE_CHECKING, Any

from lightning_shm.models.cnn import CNN_TP_PLAN, build_cnn
from lightning_shm.models.mlp import REFERENCE_HIDDEN, build_mlp
from lightning_shm.models.transformer import TRANSFORMER_TP_PLAN, build_transformer

if TYPE_CHECKING:
    from lightning_shm.models.classifier import MNISTClassifier


def __getattr__(name: str) -> Any:
    if name == "MNISTClassifier":
        from lightning_shm.models.classifier import MNISTClassifier

        return MNISTClassifier
    raise AttributeError(f"module 'lightning_shm.models' has no attribute {name!r}")


__all__ = ["CNN_TP_PLAN", "MNISTClassifier", "REFERENCE_HIDDEN", "TRANSFORMER_TP_PLAN", "build_cnn", "build_mlp",
           "build_transformer"]
