from lightning_shm.models.classifier import MNISTClassifier
from lightning_shm.models.cnn import CNN_TP_PLAN, build_cnn
from lightning_shm.models.mlp import REFERENCE_HIDDEN, build_mlp
from lightning_shm.models.transformer import TRANSFORMER_TP_PLAN, build_transformer

__all__ = ["CNN_TP_PLAN", "MNISTClassifier", "REFERENCE_HIDDEN", "TRANSFORMER_TP_PLAN", "build_cnn", "build_mlp",
           "build_transformer"]
