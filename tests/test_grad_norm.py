"""Gradient norms logged from ``on_before_optimizer_step`` equal one process's in every layout.

Lightning's ``grad_norm`` takes each rank's pieces (FSDP rows, tp columns, a stage's layers);
``lightning_shm.grad_norm`` all-reduces them, and Lightning's, where it would be wrong, warns.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch.nn.utils import clip_grad_norm_ as imported_clip_grad_norm_  # as code ported from plain torch does

import lightning_shm
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.clip import grad_norms
from lightning_shm.strategies.grad_norm import whole_param_norm
from tests.helpers import (
    GLOBAL_BATCH,
    LAYOUTS,
    SEED,
    fit_seeded,
    flat_params,
    layouts,
    loader,
    logged_floats,
    mnist_like,
    trainer,
)

NORMS = (2, 1, "inf")


class LogsGradNorms(MNISTClassifier):
    """Logs the norms of every gradient (three norm types) and of the Sequential's, as a submodule, before each
    optimizer step; ``warned`` = 1 if logging them raised a warning."""

    def __init__(self, norm_fn=None, **kw):
        super().__init__(**kw)
        self.norm_fn = norm_fn or lightning_shm.grad_norm

    def on_before_optimizer_step(self, optimizer):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for norm in NORMS:
                self.log_dict(self.norm_fn(self, norm))
                if self.norm_fn is lightning_shm.grad_norm:  # and the weights' own norms
                    self.log_dict(lightning_shm.param_norm(self, norm))
        self.warned = getattr(self, "warned", False) or any("grad_norm" in str(w.message) for w in caught)
        self.log("warned", float(self.warned))  # the last step's value is kept: whether any step warned
        if self.norm_fn is lightning_shm.grad_norm:  # a submodule: through the strategy
            strategy = self.trainer.strategy
            norm_of = strategy.grad_norm if hasattr(strategy, "grad_norm") else lightning_grad_norm
            self.log_dict({f"net/{k}": v for k, v in norm_of(self.net, 2).items()})
            param_of = strategy.param_norm if hasattr(strategy, "param_norm") else whole_param_norm
            self.log_dict({f"net/{k}": v for k, v in param_of(self.net, 2).items()})


def _logged(strategy, devices, batch, ref=False, **kw):
    t, _ = fit_seeded(lambda: LogsGradNorms(optimizer="adam", lr=0.01, **kw), strategy, devices, batch, ref=ref)
    return logged_floats(t)


@pytest.fixture(scope="module")
def one_process():
    return _logged("auto", 1, GLOBAL_BATCH, ref=True)


@pytest.mark.parametrize("name", ["fsdp", "tp2", "pp2-1f1b", "dp2xpp2-shard"])
def test_grad_norms_equal_one_process(one_process, name):
    strategy, devices, dp = layouts(name)[name]
    got = _logged(strategy(), devices, GLOBAL_BATCH // dp)
    keys = [k for k in one_process if k.startswith(("grad_", "net/grad_"))]
    assert len(keys) == 4 * 11  # three norms of 10 parameters and their total; the Sequential's 2-norms too
    assert "grad_2.0_norm/net.1.weight" in keys and "net/grad_2.0_norm/1.weight" in keys
    assert sorted(got) == sorted(one_process)  # every stage's parameters, on rank 0 too
    for k in keys:
        assert got[k] == pytest.approx(one_process[k], rel=1e-12, abs=1e-15), k
    assert got["warned"] == 0.0


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp-copy", "tp2", "pp2-1f1b", "dp2xpp2-shard"])
def test_param_norms_equal_one_process(one_process, name):
    """A weight's norm taken of what a rank holds is of its rows, slice or stage (tp2: 7.257 against one process's
    10.268 for net.1.weight); ``lightning_shm.param_norm`` gives one process's under every layout."""
    strategy, devices, dp = layouts(name)[name]
    got = _logged(strategy(), devices, GLOBAL_BATCH // dp)
    keys = [k for k in one_process if k.startswith(("param_", "net/param_"))]
    assert len(keys) == 4 * 11 and "param_2.0_norm/net.1.weight" in keys and "net/param_2.0_norm/1.weight" in keys
    for k in keys:
        assert got[k] == pytest.approx(one_process[k], rel=1e-12, abs=1e-15), k


@pytest.mark.parametrize("name", ["fsdp", "pp2-1f1b"])
def test_lightning_grad_norm_warns_where_gradients_are_split(name):
    """Its values are this rank's pieces' (under fsdp each rank's half of every weight): said, not silent."""
    strategy, devices, dp = layouts(name)[name]
    got = _logged(strategy(), devices, GLOBAL_BATCH // dp, norm_fn=lightning_grad_norm)
    assert got["warned"] == 1.0


def test_lightning_grad_norm_is_right_and_quiet_under_ddp(one_process):
    strategy, devices, dp = LAYOUTS["ddp"]
    got = _logged(strategy(), devices, GLOBAL_BATCH // dp, norm_fn=lightning_grad_norm)
    assert got["warned"] == 0.0
    for k in [k for k in one_process if k.startswith("grad_")]:
        assert got[k] == pytest.approx(one_process[k], rel=1e-12, abs=1e-15), k


def test_grad_norms_count_replicated_pieces_once_and_skip_absent_gradients():
    """One rank (no group): a replicated piece held by 2 ranks counts half; a gradient-less parameter is left out."""
    a, b, frozen = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 4.0]), torch.tensor([-1.0, 2.0, 0.0])
    copies = lambda p: {id(a): 1, id(b): 2}[id(p)]  # noqa: E731
    named = [("a", a), ("b", b), ("frozen", frozen)]
    two = grad_norms(named, ["a", "b", "frozen"], 2.0, None, copies)
    assert list(two) == ["a", "b"] and two["a"].item() == 5.0
    assert two["b"].item() == pytest.approx((5 / 2) ** 0.5)
    assert grad_norms(named, ["a", "b", "frozen"], float("inf"), None, copies)["b"].item() == 2.0
    assert {k: v.item() for k, v in grad_norms(named, ["b"], 1.0, None, copies).items()} == {"b": 1.5}


def test_grad_norm_outside_a_trainer_is_lightnings():
    net = torch.nn.Linear(2, 1)
    net(torch.ones(1, 2)).sum().backward()
    mine = lightning_shm.grad_norm(net, 2)
    assert mine.keys() == lightning_grad_norm(net, 2).keys()


class NormOfLastLayer(MNISTClassifier):
    """A pipeline stage holds its own layers of ``self.net``, a placeholder for each of the others'."""

    def __init__(self, module_of=lambda model: model.net[-1], **kw):
        super().__init__(**kw)
        self.module_of = module_of

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(self.trainer.strategy.grad_norm(self.module_of(self), 2))


@pytest.mark.parametrize("module_of, match", [
    (lambda model: next(m for m in model.net if len(list(m.parameters())) == 2),  # a Linear: another per stage
     "asked for the norms of different parameters"),
    (lambda model: model.net[-1], "this LayerElsewhere is not part of the trained NormOfLastLayer on rank 0"),
    (lambda model: torch.nn.Linear(2, 2), "this Linear is not part of the trained NormOfLastLayer on rank"),
], ids=["another-layer-per-stage", "another-stage-s-layer", "not-a-submodule"])
def test_modules_the_ranks_do_not_share_are_refused_with_a_message(module_of, match):
    strategy, devices, dp = LAYOUTS["pp2-1f1b"]
    pl.seed_everything(SEED)
    t = trainer(strategy=strategy(), devices=devices, max_epochs=1)
    with pytest.raises(Exception, match=match):
        t.fit(NormOfLastLayer(module_of, optimizer="adam"), loader(mnist_like(GLOBAL_BATCH, seed=1), GLOBAL_BATCH))


class ClipsItself(MNISTClassifier):
    """Clips with torch's own function in its hook, as code ported from plain PyTorch does, and logs the norms."""

    def __init__(self, norm_type=2.0, one_tensor=True, two_step=False, **kw):
        super().__init__(**kw)
        self.norm_type, self.one_tensor, self.two_step = norm_type, one_tensor, two_step

    def on_before_optimizer_step(self, optimizer):
        if self.two_step:  # torch's other form: the norm of the gradients, then scaling by it
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None],
                                                 norm_type=self.norm_type)
            torch.nn.utils.clip_grads_with_norm_(self.parameters(), 0.05, norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05, norm_type=self.norm_type)
        self.log("torch_norm", norm)
        if self.one_tensor:  # (under a pipeline net[1] is on stage 0 only)
            self.log("first_layer_norm", torch.nn.utils.clip_grad_norm_(self.net[1].weight, 1e9))


class ClipsByANameImportedBefore(ClipsItself):
    """Clips with ``clip_grad_norm_`` imported by name when its file was loaded, before any fit."""

    def on_before_optimizer_step(self, optimizer):
        self.log("torch_norm", imported_clip_grad_norm_(self.parameters(), 0.05, norm_type=self.norm_type))


def _clipped(strategy, devices, batch, norm_type, ref=False, one_tensor=True, two_step=False, model_cls=ClipsItself):
    t, model = fit_seeded(lambda: model_cls(norm_type, one_tensor, two_step, optimizer="adam", lr=0.01), strategy,
                          devices, batch, ref=ref, samples=GLOBAL_BATCH * 3)
    return flat_params(model), logged_floats(t)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_torch_clip_grad_norm_called_by_the_module_clips_by_one_process_norm(norm_type):
    """Until 2026-12-03 it clipped each rank's pieces by their own norm: 0.040 off one process under fsdp,
    0.039 under tp2 and pp2 after 4 steps, the returned norm this rank's (1.40 under fsdp for 2.01)."""
    one, one_logged = _clipped("auto", 1, GLOBAL_BATCH, norm_type, ref=True)
    names = ["fsdp", "tp2", "pp2-1f1b"] if norm_type == 2.0 else ["fsdp"]
    for name, (strategy, devices, dp) in layouts(*names).items():
        got, logged = _clipped(strategy(), devices, GLOBAL_BATCH // dp, norm_type, one_tensor=name != "pp2-1f1b")
        assert torch.allclose(got, one, rtol=0, atol=1e-10), (name, (got - one).abs().max())
        assert logged["torch_norm"] == pytest.approx(one_logged["torch_norm"], rel=1e-12), name
        if name == "pp2-1f1b":
            continue
        assert logged["first_layer_norm"] == pytest.approx(one_logged["first_layer_norm"], rel=1e-12), name
    strategy, devices, dp = LAYOUTS["tp2"]  # get_total_norm + clip_grads_with_norm_: the same result
    got, logged = _clipped(strategy(), devices, GLOBAL_BATCH // dp, norm_type, two_step=True)
    assert torch.allclose(got, one, rtol=0, atol=1e-10), (got - one).abs().max()
    assert logged["torch_norm"] == pytest.approx(one_logged["torch_norm"], rel=1e-12)


@pytest.mark.parametrize("name", ["fsdp", "tp2", "pp2-1f1b"])
def test_torch_clip_grad_norm_imported_by_name_before_the_fit_clips_by_one_process_norm(name):
    """Until 2026-12-06 such a name was torch's function, unpatched: 0.037 off one process under shm_fsdp and
    shm_tp (README). It reads the norm through its module's ``_get_total_norm``, which the layout replaces."""
    one, one_logged = _clipped("auto", 1, GLOBAL_BATCH, 2.0, ref=True, model_cls=ClipsByANameImportedBefore)
    strategy, devices, dp = LAYOUTS[name]
    got, logged = _clipped(strategy(), devices, GLOBAL_BATCH // dp, 2.0, model_cls=ClipsByANameImportedBefore)
    assert torch.allclose(got, one, rtol=0, atol=1e-10), (got - one).abs().max()
    assert logged["torch_norm"] == pytest.approx(one_logged["torch_norm"], rel=1e-12)
