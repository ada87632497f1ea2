"""Parameters a step does not use: a mixture of experts' top-1 routing leaves experts without samples; a head
outside a pipeline's Sequential is used every other step, a decoder only by ``predict_step``.

One process gives such a parameter no gradient (None), and its optimizer skips it: Adam neither counts
the step nor decays its moments. A data-parallel rank whose samples skip an expert contributes zeros to
the average; an expert no rank used keeps None, as in one process -- until 2026-12-03 it got zeros, and
Adam's step count ran ahead for it (0.0042 off one process and off Lightning's ``ddp`` with
``find_unused_parameters=True`` after 4 steps, under shm_ddp, shm_fsdp and dp x pp). Under a pipeline the
parameters outside its Sequential are summed over the stages: one no stage used got zeros there, and AdamW
decayed it (the decoder 0.0010 off, the auxiliary head 0.0051, after 4 steps).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_shm  # noqa: F401
from lightning_shm import SHMDDPStrategy, SHMFSDPStrategy, SHMModelParallel, SHMPipeline
from lightning_shm.runtime.errors import CollectiveMismatchError
from tests.helpers import GLOBAL_BATCH, SEED, fit_seeded, flat_params


class TopOneExperts(nn.Module):
    """Each sample through the expert its router scores highest, scaled by that score."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = F.softmax(self.router(x), -1)
        choice = p.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().squeeze(1)
            if len(rows):
                out = out.index_put((rows,), expert(x[rows]) * p[rows, i:i + 1])
        return out


class MixtureOfExperts(pl.LightningModule):
    """Records, per step, which parameters had no gradient (read on the main process after one process's fit)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), TopOneExperts(64, 6), nn.ReLU(),
                                 nn.Linear(64, 10))
        self.without_grad: list[set[str]] = []

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def on_before_optimizer_step(self, optimizer):
        self.without_grad.append({n for n, p in self.named_parameters() if p.grad is None})

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


LAYOUTS = {
    "ddp": (lambda: SHMDDPStrategy(start_method="fork", find_unused_parameters=True), 2, 2),
    "fsdp": (lambda: SHMFSDPStrategy(start_method="fork"), 2, 2),
    "fsdp-copy": (lambda: SHMFSDPStrategy(start_method="fork", gather="copy"), 2, 2),
    "dp2xpp2": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, pipeline_parallel_size=2,
                                         microbatches=2), 4, 2),
    "dp2xpp2-shard": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, pipeline_parallel_size=2,
                                               data_parallel="shard", microbatches=2), 4, 2),
    # zero_bubble: the engine adds the Linear layers' weight gradients into the held units itself
    "dp2xpp2-shard-zero-bubble": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2,
                                                           pipeline_parallel_size=2, data_parallel="shard",
                                                           microbatches=2, schedule="zero_bubble"), 4, 2),
}


@pytest.fixture(scope="module")
def one_process():
    _, model = fit_seeded(MixtureOfExperts, "auto", 1, GLOBAL_BATCH, ref=True, samples=GLOBAL_BATCH * 4)
    # the case this file is about: an expert without a gradient in one step, with one in a later step
    later = [n for i, missing in enumerate(model.without_grad) for n in missing
             if any(n not in after for after in model.without_grad[i + 1:])]
    assert any(n.startswith("net.3.experts.") for n in later), model.without_grad
    return flat_params(model)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_expert_no_rank_routed_to_is_skipped_by_the_optimizer_as_in_one_process(one_process, layout):
    make, devices, dp = LAYOUTS[layout]
    _, model = fit_seeded(MixtureOfExperts, make(), devices, GLOBAL_BATCH // dp, samples=GLOBAL_BATCH * 4)
    torch.testing.assert_close(flat_params(model), one_process, rtol=0, atol=1e-10)


class OutsideHeads(pl.LightningModule):
    """Heads outside the Sequential: ``aux`` adds a loss every other step, ``decoder`` only ``predict_step`` uses."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.head, self.aux, self.decoder = nn.Linear(16, 10), nn.Linear(16, 10), nn.Linear(16, 784)

    def training_step(self, batch, batch_idx):
        h = self.net(batch[0])
        loss = F.cross_entropy(self.head(h), batch[1])
        return loss + 0.5 * F.cross_entropy(self.aux(h), batch[1]) if batch_idx % 2 else loss

    def predict_step(self, batch, batch_idx):
        return self.decoder(self.net(batch[0]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


@pytest.mark.parametrize("layout", ["ddp", "dp2xpp2", "dp2xpp2-shard", "dp2xpp2-shard-zero-bubble", "pp2"])
def test_a_head_no_stage_used_is_skipped_by_the_optimizer_as_in_one_process(layout):
    _, one = fit_seeded(OutsideHeads, "auto", 1, GLOBAL_BATCH, ref=True, samples=GLOBAL_BATCH * 4)
    make, devices, dp = LAYOUTS[layout] if layout != "pp2" else (
        lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4), 2, 1)
    _, model = fit_seeded(OutsideHeads, make(), devices, GLOBAL_BATCH // dp, samples=GLOBAL_BATCH * 4)
    torch.testing.assert_close(flat_params(model), flat_params(one), rtol=0, atol=1e-10)
    pl.seed_everything(SEED)
    untrained = OutsideHeads().decoder.weight.detach()
    assert torch.equal(model.decoder.weight.detach().to(untrained.dtype), untrained)  # never stepped, never decayed


def test_a_unit_per_expert_that_ranks_skip_differently_is_refused_naming_the_units():
    """FSDP units must run on every rank in one order. Before 2026-12-03 units of equal sizes reduced in different
    orders exchanged their gradients silently; the run failed only when the checkpoint gathered Adam's states."""
    per_expert = SHMFSDPStrategy(start_method="fork", unit_policy=lambda name, m: name.startswith("net.3.experts."))
    with pytest.raises(CollectiveMismatchError, match=r"(?s)site=.*reduced in different orders on the ranks \(this "
                                                      r"rank reduced unit 'net\.3\.experts\.\d'; another unit "
                                                      r"'net\.3\.experts\.\d'\)") as info:
        fit_seeded(MixtureOfExperts, per_expert, 2, GLOBAL_BATCH // 2, samples=GLOBAL_BATCH * 4)
    # the unit's own message keeps the rank it met, so the report shows where that one was (the other unit)
    other = info.value.peer
    assert other in (0, 1) and any(n.startswith(f"rank {other} was here") for n in info.value.__notes__)

