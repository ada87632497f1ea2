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
from tests.helpers import SEED, SeenCount, flat_params, loader, mnist_like, small_cnn_with_buffers, trainer


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


class ConvBlock(nn.Sequential):
    """Convolution, BatchNorm, ReLU, pooling: recomputed as one."""


class LargeDrift(nn.Module):
    """A buffer over ``replay_buffers.SMALL_BYTES`` (80 KB in float64) moved in place by every training forward and
    read by it: kept for a replay only once a forward was seen to move it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(10_000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.table.mul_(0.5).add_(x.detach().mean())
        return x + self.table[0]


class BufferedCNN(MNISTClassifier):
    """:func:`small_cnn_with_buffers` in two blocks, the first holding its sample counter (counted, reassigned,
    moved after a warm-up) and spectral_norm's convolution (its power-iteration vectors), the second a large
    buffer; both BatchNorm's statistics. Tensor parallelism splits the head."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam", lr=0.01)
        layers = small_cnn_with_buffers().net
        self.net = nn.Sequential(ConvBlock(*layers[:5]), ConvBlock(LargeDrift(), *layers[5:9]), *layers[9:])
        self.tp_plan = {"net.3": "column", "net.5": "row"}


BUFFER_RUNS = {
    **{name: RUNS[name] for name in ("ddp", "fsdp", "tp2", "pp2-zero-bubble", "dp2xpp2-shard")},
    "ddp-sync-batchnorm": (lambda **kw: SHMDDPStrategy(start_method="fork", **kw), 2, 2),
}


@pytest.mark.parametrize("name", list(BUFFER_RUNS))
def test_a_replay_leaves_the_buffers_as_the_forward_made_them(name):
    """A replay ran each BatchNorm a second time in training mode: under every layout the running statistics moved
    towards each batch twice (0.27 apart from the unchecked run's after two steps under shm_ddp, a probe's figure) and
    ``num_batches_tracked`` counted double; the counter counted each sample twice, the reassigned mean moved twice
    and the replay centred its input on the moved one, and spectral_norm's replay rebuilt the weight from an
    advanced vector. A pipeline's own chunk replay kept them; an instance's did not. Now both run on stand-ins
    holding the values the forward started from: weights and buffers equal the unchecked run's exactly."""
    make, devices, dp = BUFFER_RUNS[name]
    sync = {"sync_batchnorm": True} if name == "ddp-sync-batchnorm" else {}

    def fit(**kw: Any) -> BufferedCNN:
        pl.seed_everything(SEED)
        model = BufferedCNN()
        trainer(strategy=make(**kw), devices=devices, max_epochs=1, precision="64-true", **sync).fit(
            model, loader(mnist_like(72, seed=1), 24 // dp))  # three steps: the third moves the shift
        return model

    plain, replayed = fit(), fit(activation_checkpointing={ConvBlock})
    assert int(plain.net[0][0].seen) > 12 and float(plain.net[0][0].shift) != 0  # the warm-up passed: the shift moved
    for (key, want), got in zip(plain.state_dict().items(), replayed.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


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


def test_a_block_applied_twice_replays_each_call_from_its_own_start():
    """One process, no strategy: a block applied twice in a forward, holding a sample counter (whose reassigned
    mean centres the input) and a BatchNorm. Its second call moves both before backward replays the first; each
    replay starts from what its own call found, and the module keeps what the two calls made of its buffers."""
    from lightning_shm.parallel.checkpointing import checkpoint_instances

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = ConvBlock(SeenCount(), nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Tanh())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(self.block(x))

    def run(checkpointed: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Twice().double()
        undo = checkpoint_instances(model, (ConvBlock,)) if checkpointed else None
        for _ in range(2):
            model(torch.randn(16, 8, dtype=torch.float64)).square().sum().backward()
        if undo is not None:
            undo()
        return {**model.state_dict(), **{f"{k}.grad": p.grad for k, p in model.named_parameters()}}

    plain, replayed = run(False), run(True)
    assert int(plain["block.2.num_batches_tracked"]) == 4 and int(plain["block.0.seen"]) == 64
    for key, want in plain.items():
        torch.testing.assert_close(replayed[key], want, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


class HostDraw(nn.Module):
    """A layer drawing from Python's ``random`` or numpy's global stream in forward (a random scale, or a LayerDrop
    deciding whether to run at all, ``random.random() < 0.5``, as some LayerDrop implementations decide), or noise
    from a ``torch.Generator`` of its own. From step ``start`` on (a drop probability ramped up from 0): a forward
    that drew nothing at first draws later."""

    def __init__(self, n: int, how: str, start: int = 0) -> None:
        super().__init__()
        self.lin, self.how, self.start, self.on = nn.Linear(n, n), how, start, start == 0
        self.gen = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        if not self.on:
            return torch.tanh(self.lin(x))
        if self.how == "layerdrop":
            return x if random.random() < 0.5 else x + torch.tanh(self.lin(x))
        if self.how == "generator":
            return torch.tanh(self.lin(x + 0.5 * torch.randn(x.shape, generator=self.gen, dtype=x.dtype)))
        r = random.random() if self.how == "random" else float(np.random.rand())
        return torch.tanh(self.lin(x)) * (0.5 + r)


class HostDrawing(MNISTClassifier):
    def __init__(self) -> None:
        super().__init__(optimizer="adam", lr=0.01)
        # a pipeline's first stage (split at 5) holds only layers that draw from a later step on
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), HostDraw(16, "random", start=1),
                                 HostDraw(16, "numpy", start=2), HostDraw(16, "generator", start=1),
                                 HostDraw(16, "random"), HostDraw(16, "layerdrop"), HostDraw(16, "numpy"),
                                 HostDraw(16, "layerdrop", start=1), HostDraw(16, "generator"), nn.Linear(16, 10))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for m in self.modules():
            if isinstance(m, HostDraw):
                m.on = self.global_step >= m.start


@pytest.mark.parametrize("name", ["ddp", "pp2-1f1b-chunks", "pp2-zero-bubble"])
def test_a_replay_draws_from_python_numpy_and_held_generators_as_its_forward_did(name):
    """Torch's checkpoint keeps torch's default stream only: the replay of a forward drawing from Python's or
    numpy's stream, or from a generator a layer holds, drew other numbers -- a gradient of another computation
    (0.074 off the unchecked run under pp2's chunk replays after 2 epochs), and a LayerDrop that decided otherwise
    made torch fail ("A different number of tensors was saved"). Now each replay runs from the streams its
    forward found, and leaves them as they were."""
    make, devices, batch, recompute = {
        "ddp": (lambda **kw: SHMDDPStrategy(start_method="fork", find_unused_parameters=True, **kw), 2, 12,
                {HostDraw}),
        "pp2-1f1b-chunks": (lambda **kw: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4,
                                                     split_points=[5], **kw), 2, 24, True),
        "pp2-zero-bubble": (lambda **kw: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4,
                                                     split_points=[5], schedule="zero_bubble", **kw), 2, 24,
                            {HostDraw}),
    }[name]

    def fit(**kw: Any) -> torch.Tensor:
        pl.seed_everything(SEED)
        model = HostDrawing()
        trainer(strategy=make(**kw), devices=devices, max_epochs=2, precision="64-true").fit(
            model, loader(mnist_like(48, seed=1), batch))
        return flat_params(model)

    torch.testing.assert_close(fit(activation_checkpointing=recompute), fit(), rtol=0, atol=0)


def test_the_streams_go_on_as_if_nothing_were_replayed():
    """One process, no strategy: after four steps the next draw of Python's and numpy's streams and of a layer's
    generator is the unchecked run's (a replay drawing again moved them), and so are each step's gradients -- also
    of layers that start drawing at a later step (until 2026-12-07 only a first forward that drew was watched:
    0.48 off the unchecked gradients for Python's stream, 0.17 for numpy's and a generator's)."""
    import random

    import numpy as np

    from lightning_shm.parallel.checkpointing import checkpoint_instances

    def run(checkpointed: bool) -> tuple[torch.Tensor, float, float]:
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        model = nn.Sequential(HostDraw(8, "random"), HostDraw(8, "numpy"), HostDraw(8, "layerdrop"),
                              HostDraw(8, "generator"), HostDraw(8, "random", 2), HostDraw(8, "numpy", 2),
                              HostDraw(8, "generator", 3), nn.Linear(8, 2))
        if checkpointed:
            checkpoint_instances(model, (HostDraw,))
        grads = []
        for step in range(4):
            for m in model[4:7]:
                m.on = step >= m.start
            model.zero_grad()
            model(torch.randn(5, 8)).square().sum().backward()
            grads += [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        return torch.cat(grads), random.random(), float(np.random.rand()), float(torch.rand(1, generator=model[6].gen))

    (plain, *next_plain), (replayed, *next_replayed) = run(False), run(True)
    torch.testing.assert_close(replayed, plain, rtol=0, atol=0)
    assert next_replayed == next_plain
