"""Complex parameters (a Fourier neural operator's mode weights, complex ``nn.Linear``) under every strategy.

Torch's DistributedDataParallel trains them (it reduces complex gradients as pairs of reals); here every
layout failed at its first collective: "dtype torch.complex128 is not supported by the shared-memory
collectives". The collectives now carry complex tensors (sums and means; max / min are refused: no order),
and what sat on top assumed real gradients: the global gradient norm cast a complex gradient to float64,
dropping its imaginary part (3.2e-4 off one process after 6 clipped Adam steps under shm_fsdp, tp2 and the
pipelines), FSDP's "used" flags travelled in the unit's complex dtype and were compared with 0, the weight
gradients that shm_ddp and the pipelines take outside autograd (``SinkLinear``: ``g^T x``) missed the
conjugate a complex product's gradient takes (0.04 off under zero-bubble), and a checkpointed stage's complex
output crossed to the next stage without requiring a gradient (0.076 off: the first stage never trained).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_shm
from lightning_shm import SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.ddp import GradReducer
from tests.helpers import GLOBAL_BATCH, fit_seeded, layouts, logged_floats


class Spectrum(nn.Module):
    """[B, 1, 28, 28] -> the rows' real FFT, complex [B, 15, 28]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x.flatten(1, 2), dim=1)


class ModeWeights(nn.Module):
    """A complex weight per (mode, column), as a Fourier layer keeps one per retained mode."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(15, 28, dtype=torch.complex128) * 0.3)
        self.b = nn.Parameter(torch.randn(28, dtype=torch.float64) * 0.1)  # a real bias: one unit, two dtypes

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.w + self.b


class Back(nn.Module):
    """complex [B, 15, 28] -> real [B, 784]"""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(z, n=28, dim=1).flatten(1)


class FourierNet(MNISTClassifier):
    """Complex activations cross from layer 1 to 2 (a pipeline cut there hands a complex tensor on);
    layers 2 and 3 are a complex Linear pair that tensor parallelism splits. Logs its gradient norms; with
    ``clips_itself`` it clips them with torch's ``clip_grad_norm_`` (else the Trainer's ``gradient_clip_val``)."""

    def __init__(self, clips_itself: bool = False, **kw):
        super().__init__(**kw)
        self.clips_itself = clips_itself
        self.net = nn.Sequential(Spectrum(), ModeWeights(), nn.Linear(28, 32, dtype=torch.complex128),
                                 nn.Linear(32, 28, dtype=torch.complex128), Back(), nn.Linear(784, 10))

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(lightning_shm.grad_norm(self, 2))
        if self.clips_itself:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)


def _real(module: nn.Module) -> torch.Tensor:
    return torch.cat([torch.view_as_real(p.detach()).reshape(-1) if p.is_complex() else p.detach().reshape(-1)
                      for p in module.parameters()])


_PIPELINE = {"split_points": [2], "pipeline_parallel_size": 2, "microbatches": 4, "start_method": "fork"}
_LAYOUTS = {
    **layouts("ddp", "fsdp", "dp2xpp2-shard"),
    "tp2-complex-pair": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2,
                                                   plan={"net.2": "column", "net.3": "row"}), 2, 1),
    "pp2-zero-bubble": (lambda: SHMPipeline(schedule="zero_bubble", **_PIPELINE), 2, 1),
    "pp2-checkpointed": (lambda: SHMPipeline(activation_checkpointing=True, **_PIPELINE), 2, 1),
}


def _fit(strategy, devices, batch, clips_itself, ref=False):
    clip = {} if clips_itself else {"gradient_clip_val": 0.5}
    return fit_seeded(lambda: FourierNet(clips_itself, optimizer="adam", lr=0.01), strategy, devices, batch, ref=ref,
                      samples=GLOBAL_BATCH * 3, **clip)


@pytest.fixture(scope="module")
def references():
    return {clips: (_real(m), logged_floats(t)) for clips in (False, True)
            for t, m in [_fit("auto", 1, GLOBAL_BATCH, clips, ref=True)]}


@pytest.mark.parametrize("clips_itself", [False, True], ids=["gradient_clip_val", "torch_clip_grad_norm_"])
@pytest.mark.parametrize("name", sorted(_LAYOUTS))
def test_complex_parameters_train_as_one_process(references, name, clips_itself, monkeypatch):
    monkeypatch.setattr(GradReducer, "direct_min_numel", 1)  # shm_ddp takes every Linear's gradient itself
    strategy, devices, dp = _LAYOUTS[name]
    t, model = _fit(strategy(), devices, GLOBAL_BATCH // dp, clips_itself)
    weights, norms = references[clips_itself]
    assert norms["grad_2.0_norm_total"] > 0.5  # the clipping scaled the steps
    assert torch.allclose(_real(model), weights, rtol=0, atol=1e-12)
    got = logged_floats(t)
    assert {k: got[k] for k in norms} == pytest.approx(norms, rel=1e-12, abs=1e-14)
