"""Gradients the step takes itself with respect to parameters (``torch.autograd.grad`` over them): MAML's inner
step, a penalty on the gradient's norm, a logged gradient norm, a Hessian-vector product.

shm_ddp gives each rank the gradient of its own batch (as Lightning's ddp), so per-task steps train as one
process; tp2 gives each rank its slice of the gradient of the whole batch, right where the gradient is used inside
the layers; shm_fsdp (a row block of the mean over every rank's batch) and pipelines (the schedule's gradients)
cannot give what the step asks for, and say so before it is taken."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from lightning_shm import SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, flat_params

TASK = 4  # samples per task: 2 to adapt on (support), 2 to score the adapted weights on (query)


class InnerStep(MNISTClassifier):
    """Per task, the gradient of the support loss with respect to every trainable parameter (``create_graph``),
    then ``use``: "maml" -- the query loss of the weights one SGD step along it (``functional_call``: the gradient
    goes inside the layers); "norm" -- the query loss plus the gradient's norm; "logged" -- the plain loss with the
    gradient's norm logged (no graph). ``ranks``: one process joins the rows each of that many ranks would get
    (the sampler interleaves them), so that its tasks are the ranks' tasks."""

    def __init__(self, use: str = "maml", ranks: int = 1, **kw):
        super().__init__(optimizer="adam", lr=0.01, **kw)
        self.use, self.ranks = use, ranks

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.ranks > 1:
            x, y = (torch.cat([t[r::self.ranks] for r in range(self.ranks)]) for t in (x, y))
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        if self.use == "logged":
            loss = F.cross_entropy(self(x), y)
            grads = torch.autograd.grad(loss, params, retain_graph=True)
            self.log("grad_norm", torch.sqrt(sum(g.pow(2).sum() for g in grads)))
            return loss
        losses = []
        for t in range(0, x.shape[0], TASK):
            xs, ys, xq, yq = x[t:t + 2], y[t:t + 2], x[t + 2:t + TASK], y[t + 2:t + TASK]
            grads = torch.autograd.grad(F.cross_entropy(self(xs), ys), params, create_graph=True)
            if self.use == "maml":
                fast = {n: p - 0.1 * g for (n, p), g in zip(named, grads)}
                losses.append(F.cross_entropy(functional_call(self, fast, (xq,)), yq))
            else:
                losses.append(F.cross_entropy(self(xq), yq) + 0.1 * torch.sqrt(sum(g.pow(2).sum() for g in grads)))
        return torch.stack(losses).mean()


class HessianVectorStep(MNISTClassifier):
    """Manual optimization: ``backward(create_graph=True)``, then the Hessian times a vector of ones added to the
    gradient (``torch.autograd.grad`` of the gradients)."""

    def __init__(self, **kw):
        super().__init__(optimizer="adam", lr=0.01, **kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.manual_backward(loss, create_graph=True)
        params = [p for p in self.parameters() if p.requires_grad]
        hv = torch.autograd.grad([p.grad for p in params], params, grad_outputs=[torch.ones_like(p) for p in params])
        for p, h in zip(params, hv):
            p.grad = p.grad.detach() + 0.01 * h
        opt.step()
        return loss


def tp2():
    return SHMTensorParallel(start_method="fork", tensor_parallel_size=2)


@pytest.mark.parametrize("layout", ["ddp", "tp2"])
def test_maml_inner_steps_train_as_one_process(layout):
    """Second-order MAML over tasks of 4 samples: shm_ddp's ranks adapt on their own tasks; tp2's ranks each adapt
    their slice of every task's weights (an elementwise step, then the layers' own collectives)."""
    strategy, devices, dp = LAYOUTS[layout]
    _, ref = fit_seeded(partial(InnerStep, "maml", ranks=dp), "auto", 1, GLOBAL_BATCH, ref=True)
    _, got = fit_seeded(partial(InnerStep, "maml"), strategy(), devices, GLOBAL_BATCH // dp)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-10)


def test_a_penalty_on_the_norm_of_a_gradient_slice_is_refused_under_tp():
    """Each tp rank's norm was its slice's: 0.04 off one process after 2 Adam steps, silently (measured before
    the check; MAML's use of the same gradients, above, is right)."""
    with pytest.raises(ValueError, match=r"training_step's loss reads gradients it took itself with respect to "
                                         r"parameters \(\['net.1.weight', 'net.1.bias'\]"):
        fit_seeded(partial(InnerStep, "norm"), tp2(), 2, GLOBAL_BATCH)


@pytest.mark.parametrize("layout", ["fsdp", "fsdp-copy"])
@pytest.mark.parametrize("use", ["maml", "logged"])
def test_shm_fsdp_refuses_gradients_of_its_rows(layout, use):
    """Before: torch's "add(): functions with out=... arguments don't support automatic differentiation" inside
    the reduce-scatter (MAML); the logged norm, without a graph, was the rows' (0.95 below one process's), and
    under gather="copy" the step's own backward then failed ("setStorage: ... out of bounds for storage of size
    0": the gradient had freed the unit's gathered copy)."""
    strategy, devices, dp = LAYOUTS[layout]
    with pytest.raises(ValueError, match=r"training_step takes gradients with respect to parameters "
                                         r"\(\['net.1.weight', .*Under shm_fsdp each rank holds a row block"):
        fit_seeded(partial(InnerStep, use), strategy(), devices, GLOBAL_BATCH // dp)


def test_a_hessian_vector_product_trains_as_one_process_under_tp_and_is_refused_under_shm_fsdp():
    _, ref = fit_seeded(HessianVectorStep, "auto", 1, GLOBAL_BATCH, ref=True)
    _, got = fit_seeded(HessianVectorStep, tp2(), 2, GLOBAL_BATCH)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-10)
    strategy, devices, dp = LAYOUTS["fsdp"]
    with pytest.raises(RuntimeError, match=r"a backward with create_graph=True reached the parameters of FSDP unit"):
        fit_seeded(HessianVectorStep, strategy(), devices, GLOBAL_BATCH // dp)


@pytest.mark.parametrize("layout", ["pp2-1f1b", "pp2-zero-bubble", "dp2xpp2-shard"])
def test_pipelines_refuse_gradients_of_the_stage_layers(layout):
    """Before: "the step called the pipelined nn.Sequential a second time" (1F1B: advice to join inputs), an
    AssertionError "deferred weight gradient outside a B action" (zero-bubble), torch's "appears to not have
    been used in the graph" with a note about the input (dp2 x pp2)."""
    strategy, devices, dp = LAYOUTS[layout]
    with pytest.raises(ValueError, match=r"training_step takes gradients with respect to parameters of the "
                                         r"pipelined nn.Sequential \(\['net.\d.weight'"):
        fit_seeded(partial(InnerStep, "maml"), strategy(), devices, GLOBAL_BATCH // dp)
