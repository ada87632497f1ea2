"""The module's own torch.distributed checks: False in the workers, said once on rank 0."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_shm.models import MNISTClassifier
from lightning_shm.strategies import base
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, loader, mnist_like, trainer


class GuardedGather(MNISTClassifier):
    """Gathers only where torch.distributed runs -- SimCLR / CLIP losses guard their negatives' gather so."""

    def training_step(self, batch, batch_idx):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise AssertionError("torch.distributed is not started in the workers")
        return super().training_step(batch, batch_idx)


def test_a_torch_distributed_check_in_the_modules_code_is_warned_once(tmp_path, monkeypatch):
    """Under Lightning's ddp such code gathers over every rank; in our workers it quietly ran on the rank's data
    alone (a SimCLR-style loss 0.078 off one process after 4 steps under shm_ddp)."""
    said = tmp_path / "warnings"
    monkeypatch.setattr(base, "rank_zero_warn", lambda msg: said.open("a").write(f"{rank_zero_only.rank} {msg}\n"))
    trainer(strategy="shm_ddp_fork", devices=2, max_epochs=1, logger=True, default_root_dir=tmp_path).fit(
        GuardedGather(), loader(mnist_like(GLOBAL_BATCH * 3), GLOBAL_BATCH // 2))
    lines = sorted(said.read_text().splitlines())  # rank_zero_warn itself says it on rank 0 only
    assert [line[:2] for line in lines] == ["0 ", "1 "], lines  # once per rank; not for Lightning's or torch's checks
    line = inspect.getsourcelines(GuardedGather.training_step)[1] + 1  # the check's line
    assert lines[0].startswith(f"0 {__name__} ({__file__}:{line})")
    assert "self.all_gather(x, sync_grads=True)" in lines[0]
    assert torch.distributed.is_initialized.__module__ == "torch.distributed.distributed_c10d"  # the main process's


class LogsAnEpochMetricUnsynced(MNISTClassifier):
    """Logs a validation loss without ``sync_dist`` (each rank's own batches) and one with it; records Lightning's
    hints of the fit (on rank 0, which comes back)."""

    def __init__(self) -> None:
        super().__init__()
        self.hints: list[str] = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("val_local", loss)
        self.log("val_synced", loss, sync_dist=True)

    def on_fit_start(self):
        self._recording = warnings.catch_warnings(record=True)  # the workers' warnings never reach pytest's
        self._records = self._recording.__enter__()
        warnings.simplefilter("always")

    def on_fit_end(self):
        self._recording.__exit__(None, None, None)
        self.hints = [str(w.message) for w in self._records if "when logging on epoch level" in str(w.message)]


@pytest.mark.parametrize("layout, hinted", [("ddp", True), ("dp2xpp2-shard", True), ("tp2", False)])
def test_lightnings_hint_on_an_epoch_metric_logged_without_sync_comes_where_ranks_hold_different_data(layout,
                                                                                                       hinted):
    """Lightning asks torch.distributed whether to give it, which these workers never start: until 2026-12-06
    the hint never came. Under tensor parallelism alone every rank holds the same samples: nothing to say."""
    make, devices, dp = LAYOUTS[layout]
    _, model = fit_seeded(LogsAnEpochMetricUnsynced, make(), devices, GLOBAL_BATCH // dp, validate=True)
    said = ("It is recommended to use `self.log('val_local', ..., sync_dist=True)` when logging on epoch level in "
            "distributed setting to accumulate the metric across devices.")
    assert model.hints == ([said] if hinted else []), model.hints
