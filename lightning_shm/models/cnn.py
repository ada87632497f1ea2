"""A small CNN for MNIST, as one ``nn.Sequential`` (conv -> BatchNorm -> ReLU -> pool, twice, then an MLP head).

Nothing in it knows about parallelism. Its tensor-parallel plan is data: the first conv of each
pair splits its output channels (column), the second its input channels (row); the BatchNorm, ReLU
and pooling between them run on the rank's channels unchanged.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn


def build_cnn(channels: Sequence[int] = (32, 64), hidden: int = 128, num_classes: int = 10) -> nn.Sequential:
    """``[Conv2d(3x3), BatchNorm2d, ReLU, MaxPool2d(2)] x 2, Flatten, Linear, ReLU, Linear`` on [B, 1, 28, 28]."""
    c1, c2 = channels
    if min(c1, c2, hidden) < 1:
        raise ValueError(f"channels and hidden must be positive, got {list(channels)}, {hidden}")
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(), nn.MaxPool2d(2),  # [B, c1, 14, 14]
        nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2),  # [B, c2, 7, 7]
        nn.Flatten(), nn.Linear(c2 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
    )


# module paths relative to a LightningModule holding the Sequential as ``net``
CNN_TP_PLAN = {"net.0": "column", "net.4": "row", "net.9": "column", "net.11": "row"}
