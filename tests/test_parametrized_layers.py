"""Layers whose weight is computed from other parameters at each use -- weight_norm and spectral_norm,
as parametrizations and as the older pre-hooks -- trained under every strategy against one process.

Why they need care: reading ``layer.weight`` runs the computation (spectral_norm's power iteration
updates its vectors, so an extra read outside the forward changes the model), the result is not a leaf
(a weight gradient taken outside autograd never reaches the parameters it came from), and the older
hooks compute it in a forward pre-hook (FSDP must have gathered before them).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from lightning_shm import SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.pipeline.split import layer_costs_by_time
from lightning_shm.parallel.tp import derive_plan
from tests.helpers import GLOBAL_BATCH, layouts, mnist_like, train_mnist, trainer


def _old_style(fn, module: nn.Module) -> nn.Module:
    with warnings.catch_warnings():  # torch.nn.utils.weight_norm is deprecated, and still in users' code
        warnings.simplefilter("ignore", FutureWarning)
        return fn(module)


class WeightNormed(MNISTClassifier):
    """Parametrized middle Linear: zero-bubble takes plain Linear weights' gradients outside autograd."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net[4] = parametrizations.weight_norm(self.net[4])


class SpectralNormed(MNISTClassifier):
    """Parametrized first Linear: its ``_u``/``_v`` buffers advance at every read of the weight."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net[1] = parametrizations.spectral_norm(self.net[1])


class HookNormed(MNISTClassifier):
    """The older hooks: ``weight`` is a plain attribute computed by a forward pre-hook (the model's
    dtype reaches it only in the next forward)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net[4] = _old_style(torch.nn.utils.weight_norm, self.net[4])
        self.net[7] = _old_style(torch.nn.utils.spectral_norm, self.net[7])


class HookWeightNormed(MNISTClassifier):
    """The first Linear too: the pipeline planner's timing sample takes its dtype from the Sequential's
    first Linear (it had read the stale float32 ``weight`` of a float64 model)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        for i in (1, 4):
            self.net[i] = _old_style(torch.nn.utils.weight_norm, self.net[i])


# spectral_norm takes one power iteration per forward: a pipeline's microbatches take M (as for BatchNorm)
RUNS = [(WeightNormed, n) for n in ("ddp", "fsdp-copy", "tp2", "pp2-zero-bubble", "dp2xpp2-shard")] \
    + [(SpectralNormed, n) for n in ("ddp", "fsdp", "tp2")] \
    + [(HookNormed, n) for n in ("ddp", "fsdp", "tp2")] \
    + [(HookWeightNormed, n) for n in ("pp2-1f1b", "pp2-zero-bubble")]


@pytest.fixture(scope="module")
def references():
    return {cls: train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=cls, buffers=True)
            for cls in (WeightNormed, SpectralNormed, HookNormed, HookWeightNormed)}


@pytest.mark.parametrize("model_cls, layout", RUNS, ids=[f"{c.__name__}-{n}" for c, n in RUNS])
def test_computed_weights_train_as_in_one_process(references, model_cls, layout):
    strategy, devices, dp = layouts(layout)[layout]
    got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=model_cls, buffers=True)
    torch.testing.assert_close(got, references[model_cls], rtol=0, atol=1e-9)


def test_tensor_parallelism_keeps_a_computed_weight_whole():
    plain, normed = MNISTClassifier(), SpectralNormed()
    assert {k: v.style for k, v in derive_plan(plain.net, 2, "net").items()} == {"net.1": "column_gathered"}
    # net.1 stays whole; the next Linear is gathered instead (the one after it is small)
    assert {k: v.style for k, v in derive_plan(normed.net, 2, "net").items()} == {"net.4": "column_gathered"}
    u = normed.net[1].parametrizations.weight[0]._u.clone()
    derive_plan(normed.net, 2, "net")
    assert torch.equal(normed.net[1].parametrizations.weight[0]._u, u)  # sized without computing the weight


@pytest.mark.parametrize("model_cls, plan, shown", [
    (SpectralNormed, {"net.1": "column", "net.4": "row"}, "'net.1' (column) computes its weight from other parameters "
                                                          "(parametrized by _SpectralNorm)"),
    (HookNormed, {"net.4": "column_gathered"}, "'net.4' (column_gathered) computes its weight from other parameters "
                                               "(computed from its parameters ['bias', 'weight_g', 'weight_v']"),
])
def test_a_plan_splitting_a_computed_weight_is_refused_before_launch(no_worker_starts, model_cls, plan, shown):
    with pytest.raises(ValueError, match=r"cannot run on a piece of it") as err:
        trainer(strategy=SHMTensorParallel(start_method="fork", tensor_parallel_size=2, plan=plan), devices=2,
                max_epochs=1).fit(model_cls(), torch.utils.data.DataLoader(mnist_like(8), batch_size=4))
    assert shown in str(err.value)


def test_timing_layers_for_the_pipeline_planner_leaves_the_model_as_it_was():
    """The planner times the model's own layers: BatchNorm statistics, spectral_norm's vectors, the random
    stream and gradients must come out unchanged (they once took 6 batches of the random sample)."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5),
                        parametrizations.spectral_norm(nn.Linear(16, 4)))
    sample = torch.randn(32, 8)
    state = {k: v.clone() for k, v in seq.state_dict().items()}
    rng = torch.get_rng_state()
    costs = layer_costs_by_time(seq, sample)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    for k, v in seq.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in seq.parameters())
