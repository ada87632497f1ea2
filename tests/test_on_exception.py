"""An error in a step: Lightning's ``on_exception`` runs in the workers, where the state at the error is.

One process runs the callbacks' ``on_exception`` before the error leaves ``fit``: ``OnExceptionCheckpoint`` writes
the step it failed at, its weights and optimizer state. Under the strategies the ranks run it where every rank
stopped at the same step -- each failing there, or (a pipeline) waiting in a hand-over from a stage that failed --
and the checkpoint equals one process's. An error of some ranks only is reported at once, with no checkpoint
(Lightning's ``ddp_spawn`` writes one of step 0 from its main process).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, SEED, layouts, loader, mnist_like, reference_loader, trainer

FAIL_AT = 3


class FailsAtStep(MNISTClassifier):
    """Raises in ``training_step`` of batch ``FAIL_AT`` on every rank, or (``last_only``) on the last rank alone --
    under a pipeline its last stage, where the loss is computed."""

    def __init__(self, last_only: bool = False) -> None:
        super().__init__(optimizer="adam", lr=0.01)
        self.last_only = last_only

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == FAIL_AT and (not self.last_only or self.global_rank == self.trainer.world_size - 1):
            raise ValueError(f"bad batch {batch_idx}")
        return super().training_step(batch, batch_idx)


class SeenInWorkers(Callback):
    """Appends ``rank step error`` to ``path`` where ``on_exception`` runs in a worker."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if "LIGHTNING_SHM_RANK" in os.environ:
            with open(self.path, "a") as f:
                f.write(f"{trainer.global_rank} {trainer.global_step} {type(exception).__name__}\n")


def fit_failing(tmp_path: Path, strategy: Any, devices: int, batch: int, *, ref: bool = False,
                last_only: bool = False) -> tuple[Optional[dict[str, Any]], list[str]]:
    """A float64 Adam fit failing at batch ``FAIL_AT``: its ``on_exception.ckpt`` (None if not written) and what
    the workers' ``on_exception`` recorded."""
    pl.seed_everything(SEED)
    ds = mnist_like(GLOBAL_BATCH * 6, seed=1)
    t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true", enable_checkpointing=True,
                callbacks=[OnExceptionCheckpoint(tmp_path), SeenInWorkers(tmp_path / "seen.txt")])
    with pytest.raises(ValueError, match=f"bad batch {FAIL_AT}"):
        t.fit(FailsAtStep(last_only), reference_loader(ds, batch, SEED) if ref else loader(ds, batch))
    path, seen = tmp_path / "on_exception.ckpt", tmp_path / "seen.txt"
    ckpt = torch.load(path, weights_only=False) if path.exists() else None
    return ckpt, sorted(seen.read_text().splitlines()) if seen.exists() else []


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["global_step"] == want["global_step"] == FAIL_AT
    assert list(got["state_dict"]) == list(want["state_dict"])
    for k, v in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][k], v, rtol=0, atol=1e-12, msg=k)
    for i, s in want["optimizer_states"][0]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["optimizer_states"][0]["state"][i][k], s[k], rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt, _ = fit_failing(tmp_path_factory.mktemp("one"), "auto", 1, GLOBAL_BATCH, ref=True)
    assert ckpt is not None
    return ckpt


@pytest.mark.parametrize("name", list(layouts("ddp", "fsdp", "tp2", "pp2-1f1b", "dp2xpp2-shard")))
def test_every_rank_failing_at_a_step_writes_one_process_checkpoint_of_it(tmp_path, one_process, name):
    """Each rank raises at the top of the step (a pipeline's first stage while it runs the step up to the
    Sequential, its last stage waiting for that activation joins); the checkpoint: one process's at that step."""
    make, devices, dp = layouts(name)[name]
    ckpt, seen = fit_failing(tmp_path, make(), devices, GLOBAL_BATCH // dp)
    assert ckpt is not None, "no on_exception.ckpt written"
    _assert_same_state(ckpt, one_process)
    ranks, steps, errors = zip(*(line.split() for line in seen))
    assert sorted(map(int, ranks)) == list(range(devices)) and set(steps) == {str(FAIL_AT)}
    first = devices // 2 if "pp" in name else devices  # a pipeline's last stage waited for the first's activation
    assert errors.count("ValueError") == first and errors.count("PeerFailedError") == devices - first


def test_a_pipeline_failing_in_its_loss_writes_the_checkpoint_from_every_stage(tmp_path, one_process):
    """The last stage alone raises (a check on the loss); the first stage, waiting for its gradient, joins."""
    make, devices, _ = layouts("pp2-1f1b")["pp2-1f1b"]
    ckpt, seen = fit_failing(tmp_path, make(), devices, GLOBAL_BATCH, last_only=True)
    assert ckpt is not None, "no on_exception.ckpt written"
    _assert_same_state(ckpt, one_process)
    assert seen == [f"0 {FAIL_AT} PeerFailedError", f"1 {FAIL_AT} ValueError"]


def test_a_rank_failing_alone_writes_no_checkpoint(tmp_path, caplog):
    """Under data parallelism the other rank is mid-step: there is no state both stand at. The error is rank 1's,
    and the main process, which holds the state from before the run, writes nothing either."""
    make, devices, dp = layouts("ddp")["ddp"]
    with caplog.at_level("INFO"):
        ckpt, seen = fit_failing(tmp_path, make(), devices, GLOBAL_BATCH // dp, last_only=True)
    assert ckpt is None and seen == []
    assert "not writing" in caplog.text and "none after an error of some ranks only" in caplog.text


class _FailsToo(Callback):
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if "LIGHTNING_SHM_RANK" in os.environ:
            raise OSError("the disk is full")


def test_an_error_of_the_workers_on_exception_is_a_note_of_the_runs_error(tmp_path):
    """One process would raise the callback's error, its own as context; the workers keep the run's error and
    say what the handling raised."""
    make, devices, dp = layouts("ddp")["ddp"]
    pl.seed_everything(SEED)
    t = trainer(strategy=make(), devices=devices, max_epochs=1, callbacks=[_FailsToo()])
    with pytest.raises(ValueError, match=f"bad batch {FAIL_AT}") as info:
        t.fit(FailsAtStep(), loader(mnist_like(GLOBAL_BATCH * 6, seed=1), GLOBAL_BATCH // dp))
    assert "lightning_shm: on_exception in the workers failed too: OSError: the disk is full" in info.value.__notes__
