from lightning_shm.models.classifier import MNISTClassifier
from lightning_shm.models.mlp import REFERENCE_HIDDEN, build_mlp

__all__ = ["MNISTClassifier", "REFERENCE_HIDDEN", "build_mlp"]
