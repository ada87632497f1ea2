"""Parity, the backbone: shm_ddp must train exactly like one process with the global batch.

W ranks x batch b == one process x batch W*b iterating the same permutation (Lightning always
shuffles the training DistributedSampler with seed PL_GLOBAL_SEED), and == Lightning's own
``ddp_spawn`` over gloo on the same module and seed.
"""

from __future__ import annotations

from typing import Callable

import lightning.pytorch as pl
import pytest
import torch

import lightning_shm  # noqa: F401
from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, SEED, CompiledClassifier, SchedClassifier, flat_params, train_mnist


@pytest.fixture(scope="module")
def references():
    return {opt: train_mnist("auto", 1, opt, batch=GLOBAL_BATCH, ref=True) for opt in ("sgd", "adam")}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_w_ranks_equal_one_process_with_global_batch(references, world_size, optimizer):
    got = train_mnist("shm_ddp_fork", world_size, optimizer, batch=GLOBAL_BATCH // world_size)
    ref = references[optimizer]
    pl.seed_everything(SEED)
    assert (got - flat_params(MNISTClassifier()).double()).abs().max() > 1e-3, "training did nothing"
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_lr_scheduler_and_gradient_clipping_see_synced_gradients():
    """Clipping by the global norm is non-linear: clipping unsynced gradients would break parity."""
    kw = dict(model_cls=SchedClassifier, gradient_clip_val=0.05)
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True, **kw)
    got = train_mnist("shm_ddp_fork", 2, "sgd", batch=GLOBAL_BATCH // 2, **kw)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_gradient_accumulation_syncs_on_last_micro_step_only():
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, accumulate=2)
    got = train_mnist("shm_ddp_fork", 2, "adam", batch=GLOBAL_BATCH // 2, accumulate=2)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_equal_to_lightning_ddp_over_gloo():
    """The same module and seed under Lightning's own DDP (gloo): also shows it runs there unchanged. Its
    forked workers (``ddp_fork``) run what spawned ones run, without importing torch and lightning again (13 s
    of the suite)."""
    theirs = train_mnist("ddp_fork", 2, "adam", batch=GLOBAL_BATCH // 2)
    ours = train_mnist("shm_ddp", 2, "adam", batch=GLOBAL_BATCH // 2)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def _record_routed_weights(monkeypatch, path) -> Callable[[], set[str]]:
    """Make every forked rank note the shape of each weight whose gradient GradReducer computes into its
    bucket; returns a reader of the shapes noted."""
    from lightning_shm.parallel.ddp import GradReducer

    write = GradReducer.weight_grad

    def spy(self, param, x, g):
        with open(path, "a") as f:
            f.write("x".join(map(str, param.shape)) + "\n")
        return write(self, param, x, g)

    monkeypatch.setattr(GradReducer, "weight_grad", spy)
    return lambda: set(path.read_text().split()) if path.exists() else set()


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_linear_weight_gradients_written_into_the_buckets_keep_parity(monkeypatch, tmp_path, padded):
    """shm_ddp computes large Linear weight gradients straight into their buckets (GradReducer.route_linears,
    from 2^20 elements); with that limit at 0 every Linear of the MNIST module takes the path in the forked
    workers: parity with one process holds, also over accumulated micro-steps. ``padded``: the input
    gradients of the weights whose rows lie a multiple of 256 bytes apart (the rule's 8 KiB, lowered: the
    MNIST layers' are 3,136, 1,024 and 256 bytes) go through re-strided copies (PaddedWeights)."""
    from lightning_shm.parallel.ddp import GradReducer
    from lightning_shm.parallel.linear_grads import PaddedWeights

    routed = _record_routed_weights(monkeypatch, tmp_path / "taken")
    copied, product = tmp_path / "copied", PaddedWeights.input_grad

    def spy_copy(self, g, w):
        if self.wanted(g, w):
            with open(copied, "a") as f:
                f.write("x".join(map(str, w.shape)) + "\n")
        return product(self, g, w)

    monkeypatch.setattr(GradReducer, "direct_min_numel", 0)
    monkeypatch.setattr(PaddedWeights, "input_grad", spy_copy)
    if padded:
        monkeypatch.setattr(PaddedWeights, "min_numel", 0)
        monkeypatch.setattr(PaddedWeights, "stride_multiple", 256)
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, accumulate=2)
    got = train_mnist("shm_ddp_fork", 2, "adam", batch=GLOBAL_BATCH // 2, accumulate=2)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert routed() == {"256x784", "64x256", "10x64"}
    assert (set(copied.read_text().split()) if copied.exists() else set()) == ({"64x256", "10x64"} if padded else set())


@pytest.mark.parametrize("direct", [False, True], ids=["autograd", "into-buckets"])
def test_a_compiled_model_equals_one_process_uncompiled(monkeypatch, tmp_path, direct):
    """torch.compile'd forward: gradients still reach the buckets (through autograd's accumulation, or
    computed into them by GradReducer.route_linears with its limit at 0)."""
    from lightning_shm.parallel.ddp import GradReducer

    routed = _record_routed_weights(monkeypatch, tmp_path / "taken")
    if direct:
        monkeypatch.setattr(GradReducer, "direct_min_numel", 0)
    ref = train_mnist("auto", 1, "sgd", batch=GLOBAL_BATCH, ref=True)
    got = train_mnist("shm_ddp_fork", 2, "sgd", batch=GLOBAL_BATCH // 2, model_cls=CompiledClassifier)
    pl.seed_everything(SEED)
    assert (got - flat_params(MNISTClassifier()).double()).abs().max() > 1e-3, "training did nothing"
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert routed() == ({"256x784", "64x256", "10x64"} if direct else set())
