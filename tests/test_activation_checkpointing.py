"""Activation checkpointing by module class (``activation_checkpointing={Block}``) under every layout.

What must hold: the run equals the same layout without checkpointing exactly -- dropout included, the replay
drawing the masks its forward drew --, the selected modules really run again in backward, and the instances get
their own ``forward`` back at teardown. The refusals come before any worker starts.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_shm import SHMDDPStrategy, SHMFSDPStrategy, SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.models.transformer import Block
from tests.helpers import SEED, flat_params, loader, mnist_like, trainer


class DroppedBlock(nn.Module):
    """A transformer block followed by dropout; counts its forwards (a replay in backward is one more)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block, self.drop = block, nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        DroppedBlock.calls += 1
        return self.drop(self.block(x))

    calls = 0


class Transformer(MNISTClassifier):
    def __init__(self) -> None:
        super().__init__(arch="transformer", dim=16, depth=4, heads=2, optimizer="adam", lr=0.01)
        for i, m in enumerate(self.net):
            if isinstance(m, Block):
                self.net[i] = DroppedBlock(m)
        self.tp_plan = {k.replace("net.*.", "net.*.block."): v for k, v in self.tp_plan.items()}

    def on_train_start(self) -> None:
        DroppedBlock.calls = 0

    def on_train_end(self) -> None:
        self.forwards = DroppedBlock.calls  # training forwards on this rank (rank 0's come back)

    def on_fit_end(self) -> None:  # after the strategy's teardown, in the worker
        self.own_forward_left = sum("forward" in vars(m) for m in self.modules())


RUNS: dict[str, tuple[Callable[..., Any], int, int]] = {
    "ddp": (lambda **kw: SHMDDPStrategy(start_method="fork", **kw), 2, 2),
    "fsdp": (lambda **kw: SHMFSDPStrategy(start_method="fork", **kw), 2, 2),
    "fsdp-copy-linear-units": (lambda **kw: SHMFSDPStrategy(start_method="fork", gather="copy",
                                                            unit_policy={nn.Linear}, **kw), 2, 2),
    "tp2": (lambda **kw: SHMTensorParallel(start_method="fork", tensor_parallel_size=2, **kw), 2, 1),
    "pp2-zero-bubble": (lambda **kw: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4,
                                                 schedule="zero_bubble", **kw), 2, 1),
    "dp2xpp2-shard": (lambda **kw: SHMModelParallel(start_method="fork", data_parallel_size=2,
                                                    pipeline_parallel_size=2, data_parallel="shard", microbatches=2,
                                                    **kw), 4, 2),
}


def _fit(strategy: Any, devices: int, batch: int) -> Transformer:
    pl.seed_everything(SEED)
    model = Transformer()
    trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true").fit(
        model, loader(mnist_like(48, seed=1), batch))
    return model


@pytest.mark.parametrize("name", list(RUNS))
def test_recomputed_instances_train_as_the_same_layout_without_checkpointing(name):
    make, devices, dp = RUNS[name]
    plain = _fit(make(), devices, 24 // dp)
    recomputed = _fit(make(activation_checkpointing={DroppedBlock}), devices, 24 // dp)
    assert (flat_params(plain) - flat_params(Transformer())).abs().max() > 1e-3, "training did nothing"
    torch.testing.assert_close(flat_params(recomputed), flat_params(plain), rtol=0, atol=0)
    assert recomputed.forwards > plain.forwards > 0  # the replays in backward
    assert recomputed.own_forward_left == 0


def test_a_class_living_on_one_pipeline_stage_is_recomputed_there():
    """The stage holding no instance (the embedding is the first stage's) trains on; the run equals the unchecked one.
    Until the check moved to the whole model (before launch) the second stage refused: "holds no instance"."""
    from lightning_shm.models.transformer import RowEmbedding

    make = RUNS["pp2-zero-bubble"][0]
    plain, recomputed = _fit(make(), 2, 24), _fit(make(activation_checkpointing={RowEmbedding}), 2, 24)
    torch.testing.assert_close(flat_params(recomputed), flat_params(plain), rtol=0, atol=0)


def test_refusals_before_any_worker_starts(no_worker_starts):
    for cls in (SHMDDPStrategy, SHMFSDPStrategy, SHMTensorParallel):  # a pipeline's chunks: True needs one
        with pytest.raises(ValueError, match=r"needs pipeline_parallel_size > 1, got 1; .* activation_checkpointing="
                                             r"\{Block\}"):
            cls(activation_checkpointing=True)
    with pytest.raises(ValueError, match="must be True .*, False or a set of nn.Module classes .*, got 'blocks'"):
        SHMFSDPStrategy(activation_checkpointing="blocks")
    with pytest.raises(ValueError, match=r"activation_checkpointing=\{Block\}: MNISTClassifier holds no instance"):
        trainer(strategy=SHMFSDPStrategy(start_method="fork", activation_checkpointing={Block}), devices=2,
                max_epochs=1).fit(MNISTClassifier(), loader(mnist_like(8), 4))


def _replayed_units(world, gather: str, checkpointed: bool) -> tuple[float, int, list]:
    """FSDP alone (no Lightning): units per Linear, two of them inside a block recomputed in backward."""
    from lightning_shm.parallel.checkpointing import checkpoint_instances
    from lightning_shm.parallel.fsdp import FSDPState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(784, 64), nn.Tanh(), nn.Linear(64, 64)),
                          nn.Linear(64, 10))
    sharded = FSDPState(model, world.group(), {nn.Linear}, gather=gather)
    if checkpointed:
        checkpoint_instances(model[1], (nn.Sequential,))  # the inner block, holding two units
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(world.rank))
    model(x).square().mean().backward()
    return sharded.stats.live, sharded.stats.peak, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("gather", ["copy", "view"])
def test_a_replay_inside_backward_keeps_the_fsdp_stats_balanced(gather):
    """A replay gathers the units again ("copy": memory of its own, freed by autograd, not the hooks), and torch
    stops it early -- inside the block's second unit, never reaching its post-forward hook -- once it has what
    backward needs: the same gradients as without checkpointing, and nothing counted as live once backward is done
    (16,640 bytes of the second unit were, before the unit's backward closed such a replay)."""
    from lightning_shm.runtime import launch

    plain = launch(_replayed_units, 2, gather, False, start_method="fork")
    replayed = launch(_replayed_units, 2, gather, True, start_method="fork")
    for (live, _, grads), (live_plain, _, grads_plain) in zip(replayed, plain):
        assert live == live_plain == 0
        for g, g_plain in zip(grads, grads_plain):
            torch.testing.assert_close(g, g_plain, rtol=0, atol=0)
