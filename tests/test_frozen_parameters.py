"""Fine-tuning: some parameters frozen (``requires_grad=False``) under every strategy.

A frozen parameter gets no gradient and never changes; the others train as in one process. FSDP
units may mix both (a LayerNorm with a frozen bias; BitFit trains only the biases): a unit reduces
and stores gradients for its trainable parameters only, and autograd computes none for the frozen
ones.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_shm import SHMFSDPStrategy, SHMModelParallel, SHMPipeline
from lightning_shm.models import MNISTClassifier
from lightning_shm.parallel.ddp import GradReducer
from lightning_shm.parallel.fsdp import FSDPState
from lightning_shm.parallel.pipeline.split import plan_chunks
from lightning_shm.runtime import launch
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, flat_params, layouts, train_mnist


class FrozenParts(MNISTClassifier):
    """The second Linear frozen whole, the first LayerNorm's bias frozen (its weight trains)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net[4].requires_grad_(False)
        self.net[2].bias.requires_grad_(False)


class BitFit(MNISTClassifier):
    """Only the biases train (BitFit): every unit of FSDP holds frozen and trainable parameters."""

    def __init__(self, **kw):
        super().__init__(**kw)
        for name, p in self.named_parameters():
            p.requires_grad_(name.endswith("bias"))


class _TrainableThenFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm = nn.Linear(784, 16), nn.LayerNorm(16)
        self.norm.requires_grad_(False)

    def forward(self, x):
        return self.norm(self.a(x))


class FrozenAroundTrainable(MNISTClassifier):
    """``net.1`` holds a frozen LayerNorm after a trainable Linear. As its own FSDP unit, with the Linear a
    nested unit, it has nothing trainable and an input without gradient -- yet its output carries one
    (the Linear's), and the LayerNorm's backward needs its weight."""

    unit_policy = staticmethod(lambda name, m: name in ("net.1", "net.1.a", "net.3"))

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Flatten(), _TrainableThenFrozen(), nn.ReLU(), nn.Linear(16, 10))


MODELS = {"frozen-parts": FrozenParts, "bitfit": BitFit}
RUNS = layouts("ddp", "fsdp", "fsdp-copy", "tp2", "pp2-zero-bubble", "dp2xpp2-shard")


@pytest.fixture(scope="module")
def references():
    return {name: train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=cls)
            for name, cls in MODELS.items()}


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("model", list(MODELS))
def test_frozen_parameters_stay_and_the_rest_trains_as_in_one_process(references, model, run):
    strategy, devices, dp = RUNS[run]
    got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=MODELS[model])
    torch.testing.assert_close(got, references[model], rtol=0, atol=1e-5)


@pytest.mark.parametrize("gather", ["view", "copy"])
def test_a_unit_with_nothing_trainable_around_a_trainable_nested_unit_equals_one_process(gather):
    strategy = SHMFSDPStrategy(start_method="fork", gather=gather, unit_policy=FrozenAroundTrainable.unit_policy)
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=FrozenAroundTrainable)
    got = train_mnist(strategy, 2, "adam", batch=GLOBAL_BATCH // 2, model_cls=FrozenAroundTrainable)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def _unit_step(world, model_cls, gather):
    torch.manual_seed(0)
    model = model_cls()
    sharded = FSDPState(model, world.group(), gather=gather)
    seen = {}

    def record(m, args):  # after the unit's own pre-hook: the full parameters the layer computes with
        seen.update(weight=m.weight.requires_grad, bias=m.bias.requires_grad)

    hook = model.net[1].register_forward_pre_hook(record)
    loss = nn.functional.cross_entropy(model(torch.randn(8, 1, 28, 28)), torch.zeros(8, dtype=torch.long))
    hook.remove()
    loss.backward()
    grads = {n: p.grad is not None for n, p in model.named_parameters()}
    live = sharded.stats.live  # full parameters still allocated after backward
    sharded.close()
    return seen, grads, live


@pytest.mark.parametrize("gather", ["view", "copy"])
def test_a_mixed_unit_computes_and_reduces_gradients_of_its_trainable_parameters_only(gather):
    for seen, grads, live in launch(_unit_step, 2, BitFit, gather, start_method="fork"):
        assert seen == {"weight": False, "bias": True}  # autograd computes no weight gradient at all
        assert grads == {n: n.endswith("bias") for n in grads}
        assert live == 0


def test_a_frozen_unit_is_gathered_again_for_the_input_gradient_and_freed_after_it():
    """gather="copy" frees a unit's full parameters after its forward; a frozen Linear between trainable
    layers still needs its weight in backward (for the gradient of its input)."""
    for seen, grads, live in launch(_unit_step, 2, FrozenParts, "copy", start_method="fork"):
        assert grads["net.1.weight"] and not grads["net.4.weight"] and not grads["net.2.bias"]
        assert live == 0


# ---------------------------------------------------------------------- a frozen backbone in a pipeline
class FrozenBackbone(MNISTClassifier):
    """Layers 0-6 frozen; the optimizer is built over the trainable parameters only (the fine-tuning idiom)."""

    def __init__(self, **kw):
        super().__init__(hidden_sizes=(64, 64, 64), **kw)
        for m in list(self.net)[:7]:
            m.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)


class FrozenBackboneAllParams(FrozenBackbone):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_the_planner_gives_every_stage_a_trainable_layer_when_it_can():
    seq = FrozenBackbone().net
    for balance in ("params", "time"):
        starts, _ = plan_chunks(seq, 2, stages=2, sample=torch.randn(8, 1, 28, 28) if balance == "time" else None)
        assert starts[1] >= 8  # layers 7 (Linear) and 8 (LayerNorm) are trainable, 10 (Linear) too
        assert any(p.requires_grad for m in list(seq)[starts[1]:] for p in m.parameters())
        assert any(p.requires_grad for m in list(seq)[:starts[1]] for p in m.parameters())


@pytest.mark.parametrize("model_cls, kw", [
    (FrozenBackbone, {}),  # the planner's cut: a trainable layer on each stage
    (FrozenBackboneAllParams, {"split_points": [7]}),  # stage 0 all frozen: its optimizer holds frozen parameters
], ids=["planned-cut", "frozen-stage"])
@pytest.mark.parametrize("dp", [1, 2])
def test_a_frozen_backbone_pipelined_equals_one_process(model_cls, kw, dp):
    strategy = SHMModelParallel(start_method="fork", data_parallel_size=dp, pipeline_parallel_size=2, microbatches=2,
                                **kw)
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=model_cls)
    got = train_mnist(strategy, 2 * dp, "adam", batch=GLOBAL_BATCH // dp, model_cls=model_cls)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_an_optimizer_over_no_parameters_on_a_frozen_stage_is_explained():
    strategy = SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=2, split_points=[7])
    with pytest.raises(ValueError, match=r"pipeline rank 0 holds layers \[\(0, 7\)\] \(start, end\) of the "
                                         r"nn.Sequential, none of them trainable, and configure_optimizers failed on "
                                         r"them: optimizer got an empty parameter list"):
        train_mnist(strategy, 2, "adam", batch=GLOBAL_BATCH, model_cls=FrozenBackbone)


# ---------------------------------------------------------------------- frozen, then unfrozen by a callback
class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor(1.2))  # 0-d: FSDP keeps it whole


class _Backbone(MNISTClassifier):
    """Lightning's BackboneFinetuning freezes ``backbone`` before training and unfreezes it at epoch 1,
    adding a parameter group; the backbone is found by indexing the Sequential (a stage holds some of it)
    and holds a gain applied outside the Sequential (each pipeline stage holds a copy)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gain = _Gain()

    def forward(self, x):
        return self.net(x * self.gain.g)

    @property
    def backbone(self):
        return nn.ModuleList([self.net[1], self.net[2], self.gain])

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp2", "pp2-1f1b", "dp2xpp2-shard"])
def test_a_backbone_unfrozen_during_training_trains_as_in_one_process(tmp_path, layout):
    """Before: shm_ddp and Lightning's own ddp never averaged the unfrozen backbone's gradients (0.059 off
    one process: each replica trained its own), FSDP units kept the trainable set of setup (0.032 off),
    pipelines failed (``self.net[1]`` on a stage; then one stage's extra parameter group)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint

    from tests.helpers import SEED, flat_params, loader, mnist_like, reference_loader, trainer

    def run(strategy, devices, batch, ref):
        pl.seed_everything(SEED)
        model = _Backbone(optimizer="adam")
        ds = mnist_like(GLOBAL_BATCH * 2, seed=1)
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5,
                                        should_align=False, verbose=False)
        ckpt = ModelCheckpoint(dirpath=tmp_path / ("ref" if ref else layout))  # written by the workers
        t = trainer(strategy=strategy, devices=devices, max_epochs=3, precision="64-true", enable_checkpointing=True,
                    callbacks=[finetuning, ckpt])
        t.fit(model, reference_loader(ds, batch, SEED) if ref else loader(ds, batch))
        return flat_params(model), torch.load(ckpt.best_model_path, weights_only=False)["optimizer_states"][0]

    strategy, devices, dp = layouts(layout)[layout]
    ref, ref_opt = run("auto", 1, GLOBAL_BATCH, True)
    got, opt = run(strategy(), devices, GLOBAL_BATCH // dp, False)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in ref_opt["param_groups"]]
    assert [g["lr"] for g in opt["param_groups"]] == pytest.approx([g["lr"] for g in ref_opt["param_groups"]])


class TogglingGAN(pl.LightningModule):
    """Lightning's GAN recipe: manual optimization, each optimizer's step between ``toggle_optimizer`` (which sets
    ``requires_grad=False`` on every parameter the other optimizer owns) and ``untoggle_optimizer``. The generator's
    input is drawn from the batch, so one process and the ranks see the same noise."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.G = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 784))
        self.D = nn.Sequential(nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x = batch[0].flatten(1).to(self.dtype)
        z = x[:, :16] * 0.5 + x[:, 300:316]
        real, fake = torch.ones(len(x), 1, dtype=x.dtype), torch.zeros(len(x), 1, dtype=x.dtype)
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)  # the discriminator is frozen: its backward gives it no gradient
        g_loss = F.binary_cross_entropy_with_logits(self.D(self.G(z)), real)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = (F.binary_cross_entropy_with_logits(self.D(x), real)
                  + F.binary_cross_entropy_with_logits(self.D(self.G(z).detach()), fake)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return torch.optim.Adam(self.G.parameters(), 1e-2), torch.optim.Adam(self.D.parameters(), 1e-2)


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_a_gan_toggling_its_optimizers_trains_as_one_process(layout):
    """Until 2026-12-04 shm_ddp stopped at the generator's backward: "4 parameter(s) received no gradient
    ['D.2.bias', ...]" -- its buckets hold every parameter trainable when the step began, and the message's own
    advice (freeze them) was what the step had done. Lightning's ddp refuses it too (it asks for
    find_unused_parameters=True); here no flag is needed: a parameter frozen on every rank owes no gradient."""
    strategy, devices, dp = LAYOUTS[layout]
    _, ref = fit_seeded(TogglingGAN, "auto", 1, GLOBAL_BATCH, ref=True, samples=GLOBAL_BATCH * 3)
    _, got = fit_seeded(TogglingGAN, strategy(), devices, GLOBAL_BATCH // dp, samples=GLOBAL_BATCH * 3)
    torch.testing.assert_close(flat_params(got), flat_params(ref), rtol=0, atol=1e-12)


def _frozen_within_an_accumulation(world):
    """Gradient accumulation over two micro-steps: the first without sync (each rank's own gradients stay in the
    buckets), then the second layer frozen for the second, synced one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    reducer = GradReducer(list(model.named_parameters()), world.group())
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(world.rank))
    with reducer.no_sync():
        model(x).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    model[1].requires_grad_(False)
    model[1].bias.grad = None  # as zero_grad(set_to_none=True) of an optimizer over it would leave it
    model(x).pow(2).sum().backward()
    reducer.post_backward()
    return local, [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_a_parameter_frozen_within_an_accumulation_gets_the_mean_of_what_it_accumulated():
    """As in one process, the frozen layer's weight gradient is what the first micro-step gave it -- here the mean
    over the ranks of theirs --, its bias, whose gradient was set to None, keeps None (a zero gradient would still
    move Adam), and the first layer's is the mean of both micro-steps; every rank holds the same."""
    results = launch(_frozen_within_an_accumulation, 3, start_method="fork")
    mean = sum(local[2] for local, _ in results) / 3
    for _, synced in results:
        torch.testing.assert_close(synced[2], mean, rtol=1e-6, atol=1e-6)
        assert synced[3] is None
    for _, synced in results[1:]:
        for a, b in zip(synced[:3], results[0][1][:3]):
            assert torch.equal(a, b)
    assert not torch.equal(results[0][0][0], results[1][0][0])  # the ranks' own gradients differed
