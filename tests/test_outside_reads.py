"""A loss term the step computes on parameters directly, where a rank holds pieces of them (shm_fsdp, shm_tp)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, train_mnist


class MeanSquarePenalty(MNISTClassifier):
    """The mean square of every parameter, added to the loss in the step (not the optimizer's weight decay)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-2 * sum(p.pow(2).mean() for p in self.parameters())


class OneWeightNorm(MNISTClassifier):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-2 * self.net[1].weight.abs().mean()


@pytest.mark.parametrize("layout", ["fsdp", "fsdp-copy", "tp2"])
@pytest.mark.parametrize("model_cls", [MeanSquarePenalty, OneWeightNorm])
def test_a_loss_reading_pieces_of_parameters_is_refused(layout, model_cls):
    """It was computed on the rank's row block or slice, another loss on every rank: 0.029 off one process after
    4 Adam steps under shm_fsdp (the penalty), 0.015 under shm_fsdp and tp2 (one weight's norm)."""
    strategy, devices, dp = LAYOUTS[layout]
    with pytest.raises(ValueError, match=r"training_step's loss reads parameters itself \(\[.*'net.1.weight'"):
        train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=model_cls)


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
    written the way many GPT implementations write it): on a rank's 5 of 10 rows the loss fails inside torch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[:7](x)
        return nn.functional.cross_entropy(nn.functional.linear(h, self.net[7].weight, self.net[7].bias), y)


class FailsAfterItsForward(MNISTClassifier):
    def training_step(self, batch, batch_idx):
        self(batch[0])
        assert self.net[7].weight.shape[1] == 64  # a property, not a computation
        raise RuntimeError("boom after a forward")


@pytest.mark.parametrize("layout", ["fsdp", "fsdp-copy"])
def test_a_step_failing_after_computing_with_pieces_says_which_and_why(layout):
    """Such a failure used to end in torch's "Target 9 is out of bounds" alone (a GPT's F.linear(h,
    self.wte.weight): "Expected input batch_size (72) to match target batch_size (144)")."""
    strategy, devices, dp = LAYOUTS[layout]
    with pytest.raises(ValueError, match=r"(?s)IndexError: Target \d is out of bounds.*training_step computed with "
                                         r"\['net.7.weight', 'net.7.bias'\] outside the forward of the modules"):
        train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=HeadReadInTheStep)


@pytest.mark.parametrize("layout", ["fsdp", "tp2"])
def test_a_step_failing_for_another_reason_keeps_its_error(layout):
    """Its layers computed with their pieces inside their own forward (tp's slices; FSDP's gather), the step read
    a shape: no reads to name."""
    strategy, devices, dp = LAYOUTS[layout]
    with pytest.raises(RuntimeError, match="boom after a forward") as info:
        train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=FailsAfterItsForward)
    assert "training_step computed with" not in str(info.value)
