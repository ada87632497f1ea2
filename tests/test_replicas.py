"""The ranks' copies of a whole parameter stay equal, and a step that parts them is told so once
(:mod:`lightning_shm.parallel.replicas`): DP-SGD's per-sample gradients set as ``p.grad`` without an average.
Per-sample gradients (``torch.func``) run under shm_ddp only; elsewhere torch's error says why."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, KeepsWarnings, fit_seeded, flat_params

PARTED = "after the first optimizer step the ranks' copies of"


class RecordsWarnings(KeepsWarnings, MNISTClassifier):
    """Logs ``parted`` = 1 once the strategy warned that the ranks' copies differ (recorded in the worker)."""

    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("parted", float(any(PARTED in str(w.message) for w in self._caught)))
        return loss

    def step(self, batch):
        return super().training_step(batch, 0)


class PerSampleClipped(RecordsWarnings):
    """DP-SGD's update without noise: per-sample gradients (``torch.func``), each clipped to norm 1, their mean
    set as ``p.grad`` by hand -- averaged over the ranks only with ``reduce``."""

    def __init__(self, reduce: bool):
        super().__init__(optimizer="sgd", lr=0.1)
        self.reduce, self.automatic_optimization = reduce, False

    def step(self, batch):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        params = {n: p.detach() for n, p in self.named_parameters()}

        def loss_of(ps, xi, yi):
            return F.cross_entropy(functional_call(self, ps, (xi[None],)), yi[None])

        per_sample = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))
        scale = norms.reciprocal().clamp(max=1.0)
        for n, p in self.named_parameters():
            p.grad = (per_sample[n] * scale.view(-1, *[1] * (p.dim()))).mean(0)
            if self.reduce:
                p.grad = self.trainer.strategy.reduce(p.grad, reduce_op="mean")
        opt.step()
        return F.cross_entropy(self(x), y).detach()


@pytest.mark.parametrize("reduce", [False, True])
def test_gradients_set_by_hand_part_the_ranks_unless_averaged_and_the_strategy_says_so(reduce):
    """Unaveraged, each rank stepped with its own batch's gradient: rank 0's weights 2.0e-3 off one process after 2
    steps, as under Lightning's ddp, and nothing said so; averaged with ``strategy.reduce``, as one process."""
    _, ref = fit_seeded(partial(PerSampleClipped, True), "auto", 1, GLOBAL_BATCH, ref=True)
    strategy, devices, dp = LAYOUTS["ddp"]
    t, got = fit_seeded(partial(PerSampleClipped, reduce), strategy(), devices, GLOBAL_BATCH // dp)
    assert float(t.callback_metrics["parted"]) == float(not reduce)
    diff = float((flat_params(got) - flat_params(ref)).abs().max())
    assert diff < 1e-12 if reduce else diff > 1e-4


class WithTemperature(RecordsWarnings):
    """A learnable logit temperature on the module itself (0-d: whole under every layout, shm_fsdp's too);
    ``part``: rank 1 nudges it after the first step, as a per-rank write would."""

    def __init__(self, part: bool):
        super().__init__(optimizer="adam", lr=0.01)
        self.temperature, self.part = torch.nn.Parameter(torch.ones(())), part

    def forward(self, x):
        return super().forward(x) / self.temperature

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.part and batch_idx == 0 and self.global_rank == 1:
            with torch.no_grad():
                self.temperature.add_(1e-3)


@pytest.mark.parametrize("part", [False, True], ids=["plain", "one-rank-writes"])
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp2"])
def test_the_check_compares_what_every_layout_holds_whole(layout, part):
    """Adam, float64: a plain fit parts nothing; a write on one rank to the temperature -- a parameter shm_ddp,
    shm_fsdp (a 0-d one) and tp (not split) all hold whole -- is found under each."""
    strategy, devices, dp = LAYOUTS[layout]
    t, _ = fit_seeded(partial(WithTemperature, part), strategy(), devices, GLOBAL_BATCH // dp)
    assert float(t.callback_metrics["parted"]) == float(part)


class PerSampleNormLogged(MNISTClassifier):
    """Automatic optimization; logs the mean per-sample gradient norm (``torch.func``)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        params = {n: p.detach() for n, p in self.named_parameters()}

        def loss_of(ps, xi, yi):
            return F.cross_entropy(functional_call(self, ps, (xi[None],)), yi[None])

        per_sample = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
        self.log("per_sample_norm", torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values())).mean())
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("layout, model", [("tp2", partial(PerSampleClipped, True)),
                                           ("fsdp-copy", partial(PerSampleNormLogged, optimizer="sgd")),
                                           ("pp2-1f1b", partial(PerSampleNormLogged, optimizer="sgd"))])
def test_torch_func_over_split_layers_says_to_use_shm_ddp(layout, model):
    """torch's own errors named our autograd Functions' missing ``setup_context``, a "TensorWrapper" storage, or
    "an internal functorch error"; each now carries the note (shm_ddp trains the DP-SGD step, above)."""
    strategy, devices, dp = LAYOUTS[layout]
    with pytest.raises(Exception) as raised:
        fit_seeded(model, strategy(), devices, GLOBAL_BATCH // dp)
    assert any("torch.func transforms (vmap, grad: per-sample gradients, DP-SGD) cannot run through this layout"
               in n for n in getattr(raised.value, "__notes__", []))
