"""A copy of the model's Sequential kept beside it: an EMA teacher (BYOL, DINO, mean teacher) or a frozen reference.

The teacher is updated after each step by ``zip(teacher.parameters(), net.parameters())``, pairing the two by
position. shm_tp splits such a copy as it splits the Sequential, so pieces pair with pieces (until 2026-12-03 it
stayed whole: a shape error). A pipeline stage holds only its layers of the Sequential, so the pairs mismatch:
with layers of equal shapes the run trained on, silently (the teacher 0.126 off one process after 4 steps, the
student 0.0091); such an update is now refused at the next step, saying why. A frozen copy trains as before.
"""

from __future__ import annotations

import copy
import os
import types

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_shm  # noqa: F401
from lightning_shm import SHMModelParallel, SHMPipeline, SHMTensorParallel
from lightning_shm.parallel import compose
from lightning_shm.parallel.sequential import copies_of
from tests.helpers import GLOBAL_BATCH, fit_seeded, flat_params


class Teacher(pl.LightningModule):
    """Blocks of equal shapes (the case a mismatched pairing passes silently); the loss matches the teacher's
    outputs on a flipped view; ``ema=False``: a frozen reference copy."""

    ema = True

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
        self.teacher = copy.deepcopy(self.net).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x = batch[0].flatten(1)[:, :32]
        student = self.net(x)[:, :10]
        with torch.no_grad():
            target = self.teacher(x.flip(-1))[:, :10]
        return F.cross_entropy(student, batch[1]) + F.kl_div(F.log_softmax(student, -1), F.softmax(target, -1),
                                                             reduction="batchmean")

    def on_train_batch_end(self, *args):
        if self.ema:
            with torch.no_grad():
                for t, s in zip(self.teacher.parameters(), self.net.parameters()):
                    t.mul_(0.9).add_(s, alpha=0.1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=0.01)


class FrozenReference(Teacher):
    ema = False


def test_a_deepcopy_of_the_sequential_is_found_and_other_sequentials_are_not():
    model = Teacher()
    model.other = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 16), nn.Tanh())])  # other shapes
    assert [n for n, _ in copies_of(model, "net")] == ["teacher"]


@pytest.fixture(scope="module")
def one_process():
    return {cls: fit_seeded(cls, "auto", 1, GLOBAL_BATCH, ref=True, samples=GLOBAL_BATCH * 4)[1]
            for cls in (Teacher, FrozenReference)}


@pytest.mark.parametrize("devices, dp", [(2, 1), (4, 2)], ids=["tp2", "dp2xtp2"])
def test_an_ema_teacher_is_split_as_the_sequential_and_trains_as_one_process(one_process, devices, dp, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = SHMTensorParallel(start_method="fork", tensor_parallel_size=2)
    _, model = fit_seeded(Teacher, strategy, devices, GLOBAL_BATCH // dp, samples=GLOBAL_BATCH * 4,
                          enable_checkpointing=True, default_root_dir=tmp_path,
                          callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    ref = one_process[Teacher]
    torch.testing.assert_close(flat_params(model.net), flat_params(ref.net), rtol=0, atol=1e-10)
    torch.testing.assert_close(flat_params(model.teacher), flat_params(ref.teacher), rtol=0, atol=1e-10)
    plain = Teacher().double()  # the checkpoint holds the whole teacher
    plain.load_state_dict(torch.load(os.path.join(tmp_path, "last.ckpt"), weights_only=False)["state_dict"])
    torch.testing.assert_close(flat_params(plain.teacher), flat_params(ref.teacher), rtol=0, atol=1e-10)


PIPELINES = {
    "pp2": (lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4), 2, 1),
    "dp2xpp2-shard": (lambda: SHMModelParallel(start_method="fork", data_parallel_size=2, pipeline_parallel_size=2,
                                               data_parallel="shard", microbatches=2), 4, 2),
}


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_an_ema_teacher_under_a_pipeline_is_refused_at_the_next_step(layout):
    make, devices, dp = PIPELINES[layout]
    with pytest.raises(RuntimeError, match=r"the parameters of \['teacher'\] changed outside the optimizer .* "
                                           r"architecture of the pipelined nn.Sequential 'net' .* shm_tp"):
        fit_seeded(Teacher, make(), devices, GLOBAL_BATCH // dp, samples=GLOBAL_BATCH * 4)


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_a_frozen_copy_under_a_pipeline_trains_as_one_process_and_is_noted_once(one_process, layout, tmp_path,
                                                                                 monkeypatch):
    said = tmp_path / "notes"
    monkeypatch.setattr(compose, "warnings", types.SimpleNamespace(  # the forked workers inherit the patch
        warn=lambda msg, stacklevel: said.open("a").write(msg + "\n")))
    make, devices, dp = PIPELINES[layout]
    _, model = fit_seeded(FrozenReference, make(), devices, GLOBAL_BATCH // dp, samples=GLOBAL_BATCH * 4)
    torch.testing.assert_close(flat_params(model), flat_params(one_process[FrozenReference]), rtol=0, atol=1e-10)
    notes = said.read_text().splitlines()
    assert len(notes) == 1 and "['teacher'] copy the architecture of the pipelined nn.Sequential 'net'" in notes[0]


class TwoTowers(Teacher):
    """A second tower of the Sequential's architecture that the optimizer trains (its own weights, not an EMA)."""

    ema = False

    def __init__(self) -> None:
        super().__init__()
        self.teacher.requires_grad_(True)

    def training_step(self, batch, batch_idx):
        x = batch[0].flatten(1)[:, :32]
        return F.cross_entropy(self.net(x)[:, :10] + self.teacher(x.flip(-1))[:, :10], batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_a_copy_the_optimizer_trains_under_a_pipeline_trains_as_one_process():
    _, one = fit_seeded(TwoTowers, "auto", 1, GLOBAL_BATCH, ref=True, samples=GLOBAL_BATCH * 4)
    make, devices, dp = PIPELINES["pp2"]
    _, model = fit_seeded(TwoTowers, make(), devices, GLOBAL_BATCH // dp, samples=GLOBAL_BATCH * 4)
    torch.testing.assert_close(flat_params(model), flat_params(one), rtol=0, atol=1e-10)

