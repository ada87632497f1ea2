"""``nn.Linear`` subclasses that compute something else -- a scaled Linear, a LoRA adapter over a Linear -- trained
under every layout against one process.

shm_ddp's reducer and the pipeline engine run large plain Linear layers through their own forward (the weight
gradient written straight into its destination); tensor parallelism replaces a plain Linear by its split
version. Until 2026-12-03 both took any ``isinstance(m, nn.Linear)``, so the subclass's own forward was
silently replaced by ``F.linear``: 0.088 (scaled) and 0.049 (LoRA) off one process under every pipeline
schedule and tp2; LoRA under tp2 failed after training (its adapter parameters were gone).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_shm import SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.ddp.reducer import GradReducer
from lightning_shm.parallel.pipeline.engine import PipelineEngine
from lightning_shm.parallel.tp.kinds import own_behaviour
from tests.helpers import GLOBAL_BATCH, LAYOUTS, train_mnist


class Scaled(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight * 0.5, self.bias) + 0.1


class LoRA(nn.Linear):
    def __init__(self, i, o, r=4):
        super().__init__(i, o)
        self.a = nn.Parameter(torch.randn(r, i) * 0.01)
        self.b = nn.Parameter(torch.randn(o, r) * 0.01)

    def forward(self, x):
        return super().forward(x) + x @ self.a.t() @ self.b.t()


def _with(cls):
    class Model(MNISTClassifier):
        def __init__(self, **kw):
            super().__init__(**kw)
            new = cls(784, 256)
            with torch.no_grad():
                new.weight.copy_(self.net[1].weight)
                new.bias.copy_(self.net[1].bias)
            self.net[1] = new

    return Model


SUBLAYOUTS = {**{n: LAYOUTS[n] for n in ("ddp", "fsdp", "pp2-1f1b", "pp2-zero-bubble", "dp2xpp2-shard")},
              "tp2": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, 1)}


@pytest.fixture
def route_every_linear(monkeypatch):
    """The reducer and the engine route Linear weights from 2^20 elements; the test's 784 x 256 is below."""
    monkeypatch.setattr(GradReducer, "direct_min_numel", 1)
    monkeypatch.setattr(PipelineEngine, "in_place_min_numel", 1)


@pytest.mark.parametrize("cls", [Scaled, LoRA])
def test_a_linear_subclass_keeps_its_own_forward_under_every_layout(route_every_linear, cls):
    model = _with(cls)
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=model)
    assert (ref[:10] - train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True)[:10]).abs().max() > 1e-3
    for name, (strategy, devices, dp) in SUBLAYOUTS.items():
        got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=model)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-9, msg=lambda m: f"{name}: {m}")


def test_a_plan_splitting_a_linear_subclass_is_refused_before_any_worker_starts():
    strategy = SHMTensorParallel(start_method="fork", tensor_parallel_size=2, plan={"net.1": "column", "net.4": "row"})
    with pytest.raises(ValueError, match=r"'net.1' \(column\): its class Scaled has a forward of its own.*Leave the "
                                         "layer replicated"):
        train_mnist(strategy, 2, "sgd", batch=GLOBAL_BATCH, model_cls=_with(Scaled))
    strategy = SHMTensorParallel(start_method="fork", tensor_parallel_size=2, plan={"net.1": "column", "net.4": "row"})
    with pytest.raises(ValueError, match=r"'net.1' \(column\): its class LoRA has a forward of its own"):
        train_mnist(strategy, 2, "sgd", batch=GLOBAL_BATCH, model_cls=_with(LoRA))


def test_what_a_subclass_adds_is_named_and_a_plain_or_computed_weight_layer_adds_nothing():
    class Gated(nn.Linear):  # the plain forward, and a parameter the tensor-parallel layer would drop
        def __init__(self, i, o):
            super().__init__(i, o)
            self.gate = nn.Parameter(torch.ones(o))

    assert own_behaviour(Gated(4, 4)) == "it holds ['gate'] besides weight and bias"
    assert own_behaviour(LoRA(4, 4)) == "its class LoRA has a forward of its own"
    assert own_behaviour(nn.Linear(4, 4)) == own_behaviour(nn.Conv2d(2, 2, 3)) == own_behaviour(nn.LayerNorm(4)) == ""
    assert own_behaviour(torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))) == ""  # refused as computed


def test_a_layernorm_subclass_with_its_own_forward_is_not_split_between_a_pair():
    from lightning_shm.parallel.tp import check_plan, resolve_plan

    class RMSLike(nn.LayerNorm):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class Holder(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), norm, nn.Linear(8, 4))

    plan = {"net.0": "column", "net.2": "row"}
    assert "net.1" in check_plan(Holder(nn.LayerNorm(8)), resolve_plan(Holder(nn.LayerNorm(8)), plan), 2)
    model = Holder(RMSLike(8))
    with pytest.raises(ValueError, match="'net.1' sits between column layer 'net.0' and its row layer, so it would "
                                         "run split, but its class RMSLike has a forward of its own"):
        check_plan(model, resolve_plan(model, plan), 2)
