"""Parity, the backbone: shm_ddp must train exactly like one process with the global batch.

W ranks x batch b == one process x batch W*b iterating the same permutation (Lightning always
shuffles the training DistributedSampler with seed PL_GLOBAL_SEED), and == Lightning's own
``ddp_spawn`` over gloo on the same module and seed.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import lightning_shm  # noqa: F401
from lightning_shm.models import MNISTClassifier
from tests.helpers import flat_params, loader, mnist_like, reference_loader, trainer

SEED = 7
GLOBAL_BATCH = 24
STEPS = 5
# Adam divides by sqrt(v): for a gradient that is ~0 by cancellation, float32 rounding differences
# between "mean of 24" and "mean of W means" flip its update (seen: 1 of 218,698 weights off by 5e-5).
# That is arithmetic, not an algorithm difference, so Adam parity runs in float64 where any real
# mismatch (wrong averaging, missed sync, other samples) still shows up orders of magnitude above 1e-5.
PRECISION = {"sgd": "32-true", "adam": "64-true"}


class SchedClassifier(MNISTClassifier):
    """The MNIST module plus an LR schedule, so schedulers are part of the parity check."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def _train(strategy, devices, optimizer, *, batch, model_cls=MNISTClassifier, ref=False, **kw):
    pl.seed_everything(SEED)
    model = model_cls(optimizer=optimizer, lr=0.01 if optimizer != "sgd" else 0.1)
    ds = mnist_like(GLOBAL_BATCH * STEPS * kw.pop("accumulate", 1), seed=1)
    dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
    t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision=PRECISION[optimizer], **kw)
    t.fit(model, dl)
    return flat_params(model).double()  # 64-true trains a float64 copy; the main-process model stays float32


@pytest.fixture(scope="module")
def references():
    return {opt: _train("auto", 1, opt, batch=GLOBAL_BATCH, ref=True) for opt in ("sgd", "adam")}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_w_ranks_equal_one_process_with_global_batch(references, world_size, optimizer):
    got = _train("shm_ddp_fork", world_size, optimizer, batch=GLOBAL_BATCH // world_size)
    ref = references[optimizer]
    pl.seed_everything(SEED)
    assert (got - flat_params(MNISTClassifier()).double()).abs().max() > 1e-3, "training did nothing"
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_lr_scheduler_and_gradient_clipping_see_synced_gradients():
    """Clipping by the global norm is non-linear: clipping unsynced gradients would break parity."""
    kw = dict(model_cls=SchedClassifier, gradient_clip_val=0.05)
    ref = _train("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, **kw)
    got = _train("shm_ddp_fork", 2, "sgd", batch=GLOBAL_BATCH // 2, **kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_gradient_accumulation_syncs_on_last_micro_step_only():
    ref = _train("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, accumulate=2, accumulate_grad_batches=2)
    got = _train("shm_ddp_fork", 2, "adam", batch=GLOBAL_BATCH // 2, accumulate=2, accumulate_grad_batches=2)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_equal_to_lightning_ddp_spawn_over_gloo():
    """The same module and seed under Lightning's own DDP (gloo): also shows it runs there unchanged."""
    theirs = _train("ddp_spawn", 2, "adam", batch=GLOBAL_BATCH // 2)
    ours = _train("shm_ddp", 2, "adam", batch=GLOBAL_BATCH // 2)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
