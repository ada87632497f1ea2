"""The reference network and the LightningModule around it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_shm.models import MNISTClassifier, build_mlp


def test_reference_network_is_the_seed_mlp():
    net = build_mlp()
    assert isinstance(net, nn.Sequential)
    assert [type(m).__name__ for m in net] == ["Flatten", "Linear", "LayerNorm", "ReLU", "Linear", "LayerNorm",
                                               "ReLU", "Linear"]
    assert sum(p.numel() for p in net.parameters()) == 218_698
    assert net(torch.randn(5, 1, 28, 28)).shape == (5, 10)


def test_widths_are_configurable():
    net = build_mlp([512, 128, 32])
    assert [m.out_features for m in net if isinstance(m, nn.Linear)] == [512, 128, 32, 10]
    with pytest.raises(ValueError, match="hidden_sizes must be positive ints"):
        build_mlp([0])


def test_module_forward_predict_and_optimizers():
    m = MNISTClassifier()
    x = torch.randn(4, 1, 28, 28)
    assert m(x).shape == (4, 10)
    assert m.predict_step((x, torch.zeros(4)), 0).shape == (4,)
    assert isinstance(m.configure_optimizers(), torch.optim.SGD)
    assert isinstance(MNISTClassifier(optimizer="adam").configure_optimizers(), torch.optim.Adam)
    assert isinstance(MNISTClassifier(optimizer="adamw").configure_optimizers(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="optimizer must be 'sgd', 'adam' or 'adamw', got 'rmsprop'"):
        MNISTClassifier(optimizer="rmsprop")
