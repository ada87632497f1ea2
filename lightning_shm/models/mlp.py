"""The reference network: one ``nn.Sequential`` from pixels to logits.

Flatten is inside the Sequential, so the Sequential alone *is* the network: pipeline stages are
slices of it and tensor-parallel plans are derived from its Linear layers.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

REFERENCE_HIDDEN = (256, 64)


def build_mlp(hidden_sizes: Sequence[int] = REFERENCE_HIDDEN, in_features: int = 28 * 28,
              num_classes: int = 10, layer_norm: bool = True) -> nn.Sequential:
    """``Flatten, [Linear, LayerNorm, ReLU] * len(hidden_sizes), Linear``.

    With the defaults this is exactly the seed's MNIST MLP (218,698 parameters).
    """
    sizes = list(hidden_sizes)
    if any(not isinstance(h, int) or h < 1 for h in sizes):
        raise ValueError(f"hidden_sizes must be positive ints, got {hidden_sizes!r}")
    if in_features < 1 or num_classes < 1:
        raise ValueError(f"in_features and num_classes must be >= 1, got {in_features}, {num_classes}")
    layers: list[nn.Module] = [nn.Flatten()]
    prev = in_features
    for h in sizes:
        layers.append(nn.Linear(prev, h))
        if layer_norm:
            layers.append(nn.LayerNorm(h))
        layers.append(nn.ReLU())
        prev = h
    layers.append(nn.Linear(prev, num_classes))
    return nn.Sequential(*layers)
