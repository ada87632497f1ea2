"""A loss term the step computes on parameters directly, where a rank holds pieces of them (shm_fsdp, shm_tp)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_shm import SHMModelParallel
from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, KeepsWarnings, fit_seeded, flat_params, train_mnist


class MeanSquarePenalty(MNISTClassifier):
    """The mean square of every parameter, added to the loss in the step (not the optimizer's weight decay)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-2 * sum(p.pow(2).mean() for p in self.parameters())


class OneWeightNorm(MNISTClassifier):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-2 * self.net[1].weight.abs().mean()


DP2XTP2_SHARD = (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, tensor_parallel_size=2,
                                          data_parallel="shard"), 4, 2)
RUNS = {**LAYOUTS, "dp2xtp2-shard": DP2XTP2_SHARD}


@pytest.mark.parametrize("layout, model_cls", [
    ("fsdp", MeanSquarePenalty), ("fsdp-copy", MeanSquarePenalty), ("tp2", MeanSquarePenalty),
    ("fsdp-copy", OneWeightNorm), ("tp2", OneWeightNorm), ("dp2xtp2-shard", OneWeightNorm)])
def test_a_loss_reading_pieces_of_parameters_is_refused(layout, model_cls):
    """It was computed on the rank's row block or slice, another loss on every rank: 0.029 off one process after
    4 Adam steps under shm_fsdp (the penalty), 0.015 under shm_fsdp and tp2 (one weight's norm). ``parameters()``
    gives the rank's rows under every FSDP gather; by attribute the step reads them under "copy", a tp slice
    under tp (net.1 is split by the derived plan, then cut into rows by FSDP under dp x tp sharded)."""
    strategy, devices, dp = RUNS[layout]
    with pytest.raises(ValueError, match=r"training_step's loss reads parameters itself \(\[.*'net.1.weight'") as e:
        train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=model_cls)
    assert "as modules" not in str(e.value)  # its layers ran as modules: no word of calling their forward


def test_where_every_rank_holds_whole_parameters_the_same_loss_trains_as_one_process():
    strategy, devices, dp = LAYOUTS["ddp"]
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=MeanSquarePenalty)
    got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=MeanSquarePenalty)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


class _CallsItsLayerFunctionally(torch.nn.Module):
    """A head whose forward reads its child's parameters directly, never calling the child (as a tied or
    weight-shared projection does): FSDP gathers the head as one unit, so inside its forward they are whole."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(256, 10)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.proj.weight, self.proj.bias)


class FunctionalHead(MNISTClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                       _CallsItsLayerFunctionally())


def test_a_read_inside_the_forward_of_the_unit_that_gathers_it_is_not_refused():
    strategy, devices, dp = LAYOUTS["fsdp"]
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=FunctionalHead)
    got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=FunctionalHead)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


class HeadReadInTheStep(MNISTClassifier):
    """The output layer applied by the step as ``F.linear(h, self.net[7].weight)`` (a head tied to an embedding,
    written the way many GPT implementations write it), in training and in validation."""

    def _loss(self, batch):
        x, y = batch
        head = self.net[7]
        return nn.functional.cross_entropy(nn.functional.linear(self.net[:7](x), head.weight, head.bias), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)


class FirstLayerReadInTheStep(MNISTClassifier):
    """The first Linear applied by the step as ``F.linear``: on a rank's rows (FSDP "copy") or tp's slice (the
    derived plan splits net.1) its output is too narrow for the LayerNorm after it -- torch fails inside."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = nn.functional.linear(x.flatten(1), self.net[1].weight, self.net[1].bias)
        return nn.functional.cross_entropy(self.net[2:](h), y)


class FailsAfterItsForward(MNISTClassifier):
    def training_step(self, batch, batch_idx):
        self(batch[0])
        assert self.net[7].weight.shape[1] == 64  # a property, not a computation
        raise RuntimeError("boom after a forward")


@pytest.mark.parametrize("layout, model_cls", [("fsdp", HeadReadInTheStep), ("fsdp", OneWeightNorm),
                                               ("fsdp", FirstLayerReadInTheStep), ("dp2xtp2-shard", HeadReadInTheStep)])
def test_under_view_fsdp_the_step_reads_whole_parameters_by_attribute(layout, model_cls):
    """Every unit is open for the whole step (``FSDPState.step_scope``): ``self.net[7].weight`` is the full
    parameter there as in its layer's forward, and its gradient goes back through the unit's reduce-scatter --
    a tied head's ``F.linear(h, self.wte.weight)`` trains as in one process (before 2026-12-04 it failed: "Target 9
    is out of bounds" on a rank's 5 of 10 rows), a weight's norm in the loss too (was refused), validation as well.
    Under dp x tp sharded the same holds for a layer tp leaves whole (net.7)."""
    strategy, devices, dp = RUNS[layout]
    ref = fit_seeded(model_cls, "auto", 1, GLOBAL_BATCH, ref=True, validate=True)
    got = fit_seeded(model_cls, strategy(), devices, GLOBAL_BATCH // dp, validate=True)
    torch.testing.assert_close(flat_params(got[1]), flat_params(ref[1]), rtol=0, atol=1e-9)
    if model_cls is HeadReadInTheStep:
        assert float(got[0].callback_metrics["val_loss"]) == pytest.approx(float(ref[0].callback_metrics["val_loss"]),
                                                                           abs=1e-9)


@pytest.mark.parametrize("layout", ["fsdp-copy", "tp2", "dp2xtp2-shard"])
def test_a_step_failing_after_computing_with_pieces_says_which_and_why(layout):
    """Such a failure used to end in torch's error alone (here "Given normalized_shape=[256], expected input with
    shape [*, 256], but got input of size[24, 128]"; a GPT's F.linear(h, self.wte.weight) under gather="copy":
    "Expected input batch_size (72) to match target batch_size (144)")."""
    strategy, devices, dp = RUNS[layout]
    with pytest.raises(ValueError, match=r"(?s)RuntimeError: Given normalized_shape.*training_step computed with "
                                         r"\['net.1.weight', 'net.1.bias'\] outside the forward of the modules"):
        train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=FirstLayerReadInTheStep)


@pytest.mark.parametrize("layout", ["fsdp", "tp2"])
def test_a_step_failing_for_another_reason_keeps_its_error(layout):
    """Its layers computed with their pieces inside their own forward (tp's slices; FSDP's gather), the step read
    a shape: no reads to name."""
    strategy, devices, dp = LAYOUTS[layout]
    with pytest.raises(RuntimeError, match="boom after a forward") as info:
        train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=FailsAfterItsForward)
    assert "training_step computed with" not in str(info.value)


class CallsForwardDirectly(MNISTClassifier):
    """Runs its layers by calling their ``forward`` itself: no module hooks run (FSDP gathers in them, tensor
    parallelism's layers hand on their slices in them)."""

    def forward(self, x):
        for layer in self.net:
            x = layer.forward(x)
        return x


@pytest.mark.parametrize("layout, said", [
    ("fsdp-copy", r"It called the forward of \['net.1', 'net.2'\] itself \(layer.forward\(x\)\), which runs none of "
                  r"the hooks the layout gathers or splits the parameters in: call the module, layer\(x\)"),
    ("tp2", r"The step never called \['net.1'\] as modules: if it runs their forward itself \(layer.forward\(x\)\)"),
    ("pp2-1f1b", r"layer 2 of the pipelined nn.Sequential is held by another pipeline stage: a pipeline cuts the "
                 r"Sequential between stages and runs it as one call"),
])
def test_a_step_running_its_layers_forward_itself_is_told_to_call_them(layout, said):
    """The messages said only that the step read parameters outside their layers' forward -- which it had called
    -- (and to use the optimizer's weight_decay), or that a layer was on another stage. Under FSDP's "view"
    gather the step's parameters are whole, and it trains (tests above)."""
    strategy, devices, dp = RUNS[layout]
    with pytest.raises((ValueError, RuntimeError), match=said):
        train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=CallsForwardDirectly)


class LogsWeightNorms(KeepsWarnings, MNISTClassifier):
    """Logs, from its step, the first Linear's weight norm (by attribute) and the sum of squares over
    ``self.parameters()`` -- diagnostics, not loss terms -- and after each batch, per name, whether the strategy
    said in this worker (rank 0) that the value is of pieces."""

    def training_step(self, batch, batch_idx):
        self.log("w_attr", self.net[1].weight.norm())
        self.log("w_all", sum(p.pow(2).sum() for p in self.parameters()))
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        said = [str(w.message) for w in self._caught if "training_step logged" in str(w.message)]
        self.log("said", float(len(said)))
        for name in ("w_attr", "w_all"):
            self.log(f"said_{name}", float(any(f"'{name}'" in m.split(" computed from")[0] for m in said)))


@pytest.mark.parametrize("layout, wrong", [("ddp", []), ("fsdp", ["w_all"]), ("fsdp-copy", ["w_attr", "w_all"]),
                                           ("tp2", ["w_attr", "w_all"])])
def test_values_logged_from_pieces_of_parameters_are_said_to_be_the_pieces(layout, wrong):
    """Logged silently before (one process: 10.268 and 452.25; shm_fsdp's rows: 225.76 over parameters(),
    "copy" 7.257 by attribute, tp2 7.257 and 399.41). Training is right, so it is said (once), not refused; the
    values logged where every rank reads whole parameters are one process's."""
    strategy, devices, dp = RUNS[layout]
    ref = fit_seeded(LogsWeightNorms, "auto", 1, GLOBAL_BATCH, ref=True)[0].callback_metrics
    got = fit_seeded(LogsWeightNorms, strategy(), devices, GLOBAL_BATCH // dp)[0].callback_metrics
    assert float(got["said"]) == (1.0 if wrong else 0.0)
    for name in ("w_attr", "w_all"):
        assert float(got[f"said_{name}"]) == float(name in wrong)
        same = float(got[name]) == pytest.approx(float(ref[name]), rel=1e-12)
        assert same == (name not in wrong), (name, float(got[name]), float(ref[name]))
