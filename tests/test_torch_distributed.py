"""The module's own torch.distributed checks: False in the workers, said once on rank 0."""

from __future__ import annotations

import inspect

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_shm.models import MNISTClassifier
from lightning_shm.strategies import base
from tests.helpers import GLOBAL_BATCH, loader, mnist_like, trainer


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
