"""The MNIST LightningModule: paradigm-agnostic on purpose.

No rank checks, no parallelism code. Every strategy of lightning_shm (and Lightning's own ``ddp``)
trains this module unchanged: data parallel replicates ``net``, FSDP shards it, tensor parallel
rewrites its layers following ``tp_plan`` (data, not code), the pipeline cuts ``net`` into stages.
Three architectures, each one ``nn.Sequential`` from pixels to logits: the reference MLP, a small
CNN (conv / BatchNorm / pooling) and a small transformer over the 28 pixel rows.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from lightning_shm.models.cnn import CNN_TP_PLAN, build_cnn
from lightning_shm.models.mlp import REFERENCE_HIDDEN, build_mlp
from lightning_shm.models.transformer import TRANSFORMER_TP_PLAN, build_transformer

OptimizerName = Literal["sgd", "adam", "adamw"]
Arch = Literal["mlp", "cnn", "transformer"]


class MNISTClassifier(pl.LightningModule):
    """Cross-entropy classifier around one ``nn.Sequential`` (``net``).

    Args:
        arch: "mlp" (the reference network, :func:`build_mlp`), "cnn" (:func:`build_cnn`) or
            "transformer" (:func:`build_transformer`).
        hidden_sizes: widths of the MLP's hidden layers (default: the reference 256, 64).
        channels, cnn_hidden: the CNN's two conv widths and its classifier's hidden width.
        dim, depth, heads: the transformer's width, number of blocks and attention heads.
        optimizer: "sgd" (default), "adam" or "adamw".
        lr: learning rate.
        momentum: SGD momentum.
        weight_decay: weight decay of the optimizer.
    """

    def __init__(self, hidden_sizes: Sequence[int] = REFERENCE_HIDDEN, optimizer: OptimizerName = "sgd",
                 lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 0.0, arch: Arch = "mlp",
                 channels: Sequence[int] = (32, 64), cnn_hidden: int = 128, dim: int = 64, depth: int = 4,
                 heads: int = 4) -> None:
        super().__init__()
        if optimizer not in ("sgd", "adam", "adamw"):
            raise ValueError(f"optimizer must be 'sgd', 'adam' or 'adamw', got {optimizer!r}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if arch not in ("mlp", "cnn", "transformer"):
            raise ValueError(f"arch must be 'mlp', 'cnn' or 'transformer', got {arch!r}")
        self.save_hyperparameters()
        if arch == "mlp":
            self.net = build_mlp(list(hidden_sizes))
        elif arch == "cnn":
            self.net = build_cnn(list(channels), cnn_hidden)
            self.tp_plan = dict(CNN_TP_PLAN)
        else:
            self.net = build_transformer(dim, depth, heads)
            self.tp_plan = dict(TRANSFORMER_TP_PLAN)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.test_acc(logits, y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        params = self.parameters()
        if hp.optimizer == "sgd":
            return torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        if hp.optimizer == "adam":
            return torch.optim.Adam(params, lr=hp.lr, weight_decay=hp.weight_decay)
        return torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay)
