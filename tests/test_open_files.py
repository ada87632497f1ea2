"""Files a program leaves open: complete when the script ends, as in one process (``strategies/open_files.py``).

A worker leaves by ``os._exit``, which flushes nothing: a log a callback opened on rank 0 and never closed was
empty after the script ended, where one process's interpreter flushes it at exit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    class EpochLines(pl.Callback):
        \"\"\"Opens its own log on rank 0 and never closes it.\"\"\"

        def __init__(self, path):
            self.path = path

        def on_train_start(self, trainer, pl_module):
            if trainer.is_global_zero:
                self.f = open(self.path, "w")

        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                self.f.write(f"epoch {trainer.current_epoch}\\n")

    class WritesTheScriptsLog(BoringModel):
        def on_train_epoch_end(self):
            if self.trainer.is_global_zero and "SCRIPT_LOG" in globals():  # the script's own file (fork only)
                SCRIPT_LOG.write(f"module epoch {self.current_epoch}\\n")

    if __name__ == "__main__":
        import lightning_shm
        strategy, out = sys.argv[1], sys.argv[2]
        if strategy != "shm_ddp":  # a file the main process opened, copied into forked workers
            SCRIPT_LOG = open(os.path.join(out, "script.txt"), "w")
            SCRIPT_LOG.write("before fit\\n")
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1 if strategy == "auto" else 2,
                             max_epochs=3, limit_train_batches=2, limit_val_batches=1, logger=False,
                             enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                             callbacks=[EpochLines(os.path.join(out, "epochs.txt"))])
        trainer.fit(WritesTheScriptsLog())
        if strategy != "shm_ddp":
            SCRIPT_LOG.write("after fit\\n")
    """)


def _files_after(tmp_path: Path, strategy: str) -> dict[str, list[str]]:
    out = tmp_path / strategy
    out.mkdir()
    script = tmp_path / "leaves_files_open.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script), strategy, str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return {p.name: p.read_text().splitlines() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("strategy", ["shm_ddp_fork", "shm_ddp"])
def test_files_left_open_are_complete_when_the_script_ends(tmp_path, strategy):
    one = _files_after(tmp_path, "auto")
    assert one == {"epochs.txt": ["epoch 0", "epoch 1", "epoch 2"],
                   "script.txt": ["before fit", "module epoch 0", "module epoch 1", "module epoch 2", "after fit"]}
    got = _files_after(tmp_path, strategy)
    if strategy == "shm_ddp":  # the fork server's workers import the script again: no SCRIPT_LOG there
        one.pop("script.txt")
    assert got == one  # "before fit" once: the main process flushed it before the workers copied its buffer
