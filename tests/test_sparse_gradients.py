"""``nn.Embedding(sparse=True)``: autograd gives its weight a sparse gradient.

shm_ddp keeps it sparse, averaged as torch DDP does (every rank's rows gathered, divided by W), so
``SparseAdam`` runs as in one process; shm_fsdp reduces it into a dense row shard. Before, shm_ddp failed
with "Cannot access data pointer of Tensor that doesn't have storage" and shm_fsdp with "unsupported
memory format option Contiguous".
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_shm import SHMDDPStrategy, SHMModelParallel
from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, StepsEveryOptimizer, loader, mnist_like, train_mnist, trainer


class Tokens(nn.Module):
    """Pixels -> 16 tokens per image in [0, 16): enough for an embedding to look rows up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.flatten(1)[:, ::49] * 3).long().clamp(0, 15)


class Mean(nn.Module):
    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return e.mean(1)


class SparseEmbedding(MNISTClassifier):
    """Sparse embedding -> mean -> MLP; SGD with momentum (which takes sparse gradients)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(Tokens(), nn.Embedding(16, 32, sparse=True), Mean(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 10))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class TiedSparseEmbedding(SparseEmbedding):
    """The embedding's weight also used densely (as an output layer's): its gradient arrives dense."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(Tokens(), nn.Embedding(16, 32, sparse=True), Mean(), nn.Linear(32, 32), nn.Tanh(),
                                 nn.Linear(32, 16, bias=False))
        self.net[5].weight = self.net[1].weight


class OnlySparseTrains(SparseEmbedding):
    """The MLP frozen: no bucket hook ends the backward, the reducer's post_backward does."""

    def __init__(self, **kw):
        super().__init__(**kw)
        for layer in self.net[3:]:
            layer.requires_grad_(False)


class EmbeddingOnEvenSteps(SparseEmbedding):
    """The embedding takes part in every other step only: on the others one process's gradient is None, and
    SGD's momentum leaves it alone; an empty sparse gradient instead would move it by momentum."""

    def forward(self, x):
        e = self.net[1](self.net[0](x))
        if self.trainer.global_step % 2:
            e = torch.ones_like(e).detach()
        return self.net[5](self.net[4](self.net[3](self.net[2](e))))


class SparseAdamEmbedding(StepsEveryOptimizer, SparseEmbedding):
    """SparseAdam on the embedding beside Adam, the usual recipe (two optimizers: manual optimization)."""

    def configure_optimizers(self):
        emb = self.net[1].weight
        rest = [p for p in self.parameters() if p is not emb]
        return torch.optim.SparseAdam([emb], lr=0.05), torch.optim.Adam(rest, lr=0.01)


DP2_PP2 = (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, pipeline_parallel_size=2,
                                    microbatches=2), 4, 2)  # the pipeline's explicit synchronize()


@pytest.mark.parametrize("model_cls, layout, accumulate", [
    (SparseEmbedding, LAYOUTS["ddp"], 1),
    (SparseEmbedding, LAYOUTS["ddp"], 2),  # sparse gradients accumulated over micro-steps, then reduced
    (SparseEmbedding, LAYOUTS["fsdp"], 1),
    (SparseEmbedding, DP2_PP2, 1),
    (SparseEmbedding, LAYOUTS["dp2xpp2-shard"], 1),  # FSDP units held for the pipeline step
    (TiedSparseEmbedding, LAYOUTS["ddp"], 1),
    (OnlySparseTrains, LAYOUTS["ddp"], 1),
    (EmbeddingOnEvenSteps, LAYOUTS["ddp"], 1),
    (SparseAdamEmbedding, LAYOUTS["ddp"], 1),
], ids=["ddp", "ddp-accumulate", "fsdp", "dp2xpp2", "dp2xpp2-shard", "ddp-tied", "ddp-only-sparse",
                                    "ddp-embedding-on-even-steps", "ddp-sparseadam"])
def test_sparse_embedding_gradients_train_as_one_process(model_cls, layout, accumulate):
    strategy, devices, dp = layout
    ref = train_mnist("auto", 1, "adam", batch=GLOBAL_BATCH, ref=True, model_cls=model_cls, accumulate=accumulate)
    got = train_mnist(strategy(), devices, "adam", batch=GLOBAL_BATCH // dp, model_cls=model_cls,
                      accumulate=accumulate)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-9)


def test_sparse_adam_is_refused_where_the_embedding_is_sharded():
    with pytest.raises(ValueError, match=r"SparseAdam takes sparse gradients only, but each rank holds pieces of "
                                         r"1 parameter \(e.g. 'net.1.weight'\)"):
        train_mnist(LAYOUTS["fsdp"][0](), 2, "adam", batch=GLOBAL_BATCH // 2, model_cls=SparseAdamEmbedding)


def test_ddp_hands_the_optimizer_a_sparse_gradient():
    """What SparseAdam relies on, checked directly: the averaged gradient is still sparse on every rank."""
    seen = []

    class Spy(SparseEmbedding):
        def on_before_optimizer_step(self, optimizer):
            seen.append(self.net[1].weight.grad.is_sparse)
            self.log("grad_sparse", float(all(seen)), reduce_fx="min", sync_dist=True)

    t = trainer(strategy=SHMDDPStrategy(start_method="fork"), devices=2, max_epochs=1)
    t.fit(Spy(), loader(mnist_like(GLOBAL_BATCH * 2, seed=1), GLOBAL_BATCH // 2))
    assert float(t.callback_metrics["grad_sparse"]) == 1.0
