"""Optimizers that read across elements (:mod:`lightning_shm.parallel.optimizers`): exact where the
layout gives each rank what they read, refused where it does not."""

from __future__ import annotations

import pytest
import torch

from lightning_shm import SHMDDPStrategy, SHMFSDPStrategy, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, StepsEveryOptimizer, train_mnist


class WithLBFGS(MNISTClassifier):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=4, history_size=5)


class WithLBFGSLineSearch(MNISTClassifier):
    """LBFGS deciding from the loss too: the strong-Wolfe line search compares the closure's losses. Each rank's
    own loss gave each replica its own step size until 2026-12-06 (0.49 off one process after these 5 steps;
    with max_iter=15 the ranks ran their closures different numbers of times and failed)."""

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=1, max_iter=4, history_size=5, line_search_fn="strong_wolfe")


class StepsLBFGSByHand(WithLBFGSLineSearch):
    """The same under manual optimization: the step hands ``opt.step`` its own closure."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)


class WithAdafactor(MNISTClassifier):
    def configure_optimizers(self):
        return torch.optim.Adafactor(self.parameters(), lr=0.01)


class WithMuon(StepsEveryOptimizer):
    """Muon on the weight matrices (it takes 2-D parameters only), AdamW on the rest, as it is used."""

    def configure_optimizers(self):
        mats = [p for p in self.parameters() if p.ndim == 2]
        rest = [p for p in self.parameters() if p.ndim != 2]
        return torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=0.01)


@pytest.mark.parametrize("model_cls, strategy, devices, dp", [
    (WithLBFGS, lambda: SHMDDPStrategy(start_method="fork"), 2, 2),  # its closure runs forward + backward 4 times
    (WithLBFGSLineSearch, lambda: SHMDDPStrategy(start_method="fork"), 2, 2),  # and reads the replicas' mean loss
    (StepsLBFGSByHand, lambda: SHMDDPStrategy(start_method="fork"), 2, 2),
    (WithAdafactor, lambda: SHMDDPStrategy(start_method="fork"), 2, 2),
    (WithAdafactor, lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4), 2, 1),
    (WithMuon, lambda: SHMDDPStrategy(start_method="fork"), 2, 2),
], ids=["lbfgs-ddp", "lbfgs-line-search-ddp", "lbfgs-by-hand-ddp", "adafactor-ddp", "adafactor-pipeline",
        "muon-ddp"])
def test_where_each_rank_holds_what_the_optimizer_reads_it_equals_one_process(model_cls, strategy, devices, dp):
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=model_cls)
    got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=model_cls)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


@pytest.mark.parametrize("model_cls, strategy, match", [
    (WithLBFGS, lambda: SHMFSDPStrategy(start_method="fork"),
     r"LBFGS computes each update from every parameter at once .* each rank holds 10 parameters in pieces "
     r"\(e.g. 'net.1.weight'\)"),
    (WithLBFGS, lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4),
     r"LBFGS .* each rank holds the layers of 1 of 2 stages"),
    (WithLBFGS, lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2),
     r"LBFGS .* each rank holds 2 parameters in pieces \(e.g. 'net.1.weight'\)"),
    (WithAdafactor, lambda: SHMFSDPStrategy(start_method="fork"),
     r"Adafactor computes each update from statistics of the whole tensor, but each rank holds pieces of 10 "
     r"parameters"),
    (WithAdafactor, lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2),
     r"Adafactor .* pieces of 2 parameters \(e.g. 'net.1.weight'\)"),
    (WithMuon, lambda: SHMFSDPStrategy(start_method="fork"),  # its 3 weight matrices, not AdamW's biases
     r"Muon computes each update from statistics of the whole tensor, but each rank holds pieces of 3 parameters "
     r"\(e.g. 'net.1.weight'\)"),
    (WithMuon, lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2),
     r"Muon .* pieces of 1 parameter \(e.g. 'net.1.weight'\)"),
], ids=["lbfgs-fsdp", "lbfgs-pipeline", "lbfgs-tp", "adafactor-fsdp", "adafactor-tp", "muon-fsdp", "muon-tp"])
def test_where_a_rank_holds_less_the_optimizer_is_refused(model_cls, strategy, match):
    with pytest.raises(ValueError, match=match):
        train_mnist(strategy(), 2, "adam", batch=GLOBAL_BATCH, model_cls=model_cls)
