"""Torch's lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ``nn.LazyBatchNorm2d``) under the strategies.

A lazy parameter has no shape until the module's first forward, and every layout needs the shapes before
the first step: rank 0's weights are broadcast by shape, buckets, shards, tp slices and stages are laid
out from them. Before, the main process failed inside the shared-memory estimate with torch's "Attempted
to use an uninitialized parameter in <method 'numel'>" (tp: "Can't access the shape of an uninitialized
parameter"), naming no layer. Now the model is refused naming the tensors and what to do -- as torch's
DistributedDataParallel refuses it -- and a model run once before fit trains as one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, fit_seeded, flat_params, layouts, loader, mnist_like, trainer

_PATTERN = (r"holds layers whose tensors have no shape yet -- net\.0 \(LazyConv2d\), net\.1 \(LazyBatchNorm2d\), "
            r"net\.4 \(LazyLinear\), net\.6 \(LazyLinear\): .* Run one forward")


def _lazy_net() -> nn.Sequential:
    return nn.Sequential(nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(), nn.LazyLinear(16),
                         nn.ReLU(), nn.LazyLinear(10))


class LazyCNN(MNISTClassifier):
    def __init__(self, run_once: bool = False, **kw):
        super().__init__(**kw)
        self.net = _lazy_net()
        if run_once:  # what the refusal asks for: the layers take their shapes here, before fit
            self.net(torch.zeros(2, 1, 28, 28))


class BuiltLazyInConfigureModel(MNISTClassifier):
    def configure_model(self):
        self.net = _lazy_net()


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp2", "pp2-1f1b"])
def test_lazy_layers_are_refused_before_any_worker_starts(no_worker_starts, name):
    strategy, devices, _ = layouts(name)[name]
    with pytest.raises(ValueError, match=_PATTERN):
        trainer(strategy=strategy(), devices=devices, max_steps=1).fit(LazyCNN(), loader(mnist_like(8), 4))


def test_lazy_layers_built_in_configure_model_are_refused_in_the_workers():
    strategy, devices, _ = layouts("ddp")["ddp"]
    with pytest.raises(ValueError, match=_PATTERN):
        trainer(strategy=strategy(), devices=devices, max_steps=1).fit(BuiltLazyInConfigureModel(),
                                                                       loader(mnist_like(8), 4))


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp2"])  # a pipeline's BatchNorm sees microbatches (README, Limits)
def test_lazy_layers_run_once_before_fit_train_as_one_process(name):
    def make() -> LazyCNN:
        return LazyCNN(run_once=True, optimizer="sgd", lr=0.1)

    _, reference = fit_seeded(make, "auto", 1, GLOBAL_BATCH, ref=True)
    strategy, devices, dp = layouts(name)[name]
    _, model = fit_seeded(make, strategy(), devices, GLOBAL_BATCH // dp, sync_batchnorm=True)  # one process's BN
    assert torch.allclose(flat_params(model), flat_params(reference), rtol=0, atol=1e-10)
