"""Ctrl-C / SIGTERM to a training run: the workers stop together and save their real state.

The signal goes to the main process (as Ctrl-C or ``kill`` does); every rank stops at the start of
the same step (ranks check for stop requests every ``stop_check_every`` = 4 steps), Lightning's
``on_exception`` callbacks run where the trained state is, and ``OnExceptionCheckpoint`` writes the
real step and weights. ``fit(ckpt_path="last")`` then
continues from that step. Exit status as in one process: 1 after SIGINT, 0 after SIGTERM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lightning_shm import SHMDDPStrategy, SHMFSDPStrategy, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.runtime.segment import PREFIX, SHM_DIR
from tests.helpers import loader, mnist_like

ROOT = Path(__file__).resolve().parents[1]


class Interrupted(MNISTClassifier):
    """Signals ``signum`` to ``to`` from rank 0 at step ``signal_at``; records every step rank 0 starts."""

    def __init__(self, signal_at: int, signum: int, steps_file: str, main_pid: int, to: str) -> None:
        super().__init__()
        self.signal_at, self.signum, self.steps_file, self.main_pid = signal_at, signum, steps_file, main_pid
        self.signal_to = to

    def training_step(self, batch, batch_idx):
        # (a pipeline calls this once per microbatch: record and signal once per step)
        if self.global_rank == 0 and self.global_step != getattr(self, "_seen", None):
            self._seen = self.global_step
            with open(self.steps_file, "a") as f:
                f.write(f"{self.global_step}\n")
            if self.global_step == self.signal_at:
                if self.signal_to == "group":  # as Ctrl-C in a terminal: main process, workers, fork server
                    os.killpg(os.getpgid(self.main_pid), self.signum)
                elif self.signal_to == "worker":  # as a scheduler that signals every process of the job may
                    os.kill(os.getpid(), self.signum)
                else:  # as kill would (by pid: under a fork server the workers' parent is the server)
                    os.kill(self.main_pid, self.signum)
                time.sleep(1.0)  # its stop request is in place before the next step starts
        return super().training_step(batch, batch_idx)


def fit(name: str, start: str, model: Interrupted, ckpt_dir: str, ckpt_path: Optional[str] = None) -> pl.Trainer:
    strategy = {
        "ddp": lambda: SHMDDPStrategy(start_method=start),
        "fsdp": lambda: SHMFSDPStrategy(start_method=start),
        "tp": lambda: SHMTensorParallel(tensor_parallel_size=2, start_method=start),
        "pipeline": lambda: SHMPipeline(pipeline_parallel_size=2, microbatches=2, start_method=start),
    }[name]()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1,
                         callbacks=[OnExceptionCheckpoint(ckpt_dir)], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=True, default_root_dir=ckpt_dir)
    trainer.fit(model, loader(mnist_like(24 * 24), 24), ckpt_path=ckpt_path)
    return trainer


# The interrupted run: a main process of its own, which the signal reaches as Ctrl-C or kill would.
_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import lightning.pytorch as pl
    from tests.test_interrupts import Interrupted, fit

    if __name__ == "__main__":
        name, start, signame, to, ckpt_dir, steps_file = sys.argv[1:]
        pl.seed_everything(0)
        model = Interrupted(5, int(getattr(signal, signame)), steps_file, os.getpid(), to)
        trainer = fit(name, start, model, ckpt_dir)
        print("global_step", trainer.global_step, flush=True)
    """
)


@pytest.mark.parametrize("name, start, signame, to", [
    ("ddp", "forkserver", "SIGINT", "group"), ("fsdp", "forkserver", "SIGTERM", "main"),
    ("pipeline", "fork", "SIGINT", "main"), ("tp", "spawn", "SIGTERM", "worker")])
def test_interrupt_saves_the_real_step_and_resume_continues_from_it(tmp_path, name, start, signame, to):
    """Every start method (forkserver: the default); the signal to the main process alone (``kill``; by its pid:
    a fork server's workers have the server as their parent), to the whole process group (Ctrl-C) or to rank 0's
    worker alone (its SIGTERM is a stop request for the run). The interrupted run has a main process of its own;
    the resumed one runs in this process and forks its workers, whatever the interrupted run's start method:
    what it checks is the checkpoint, and a fresh interpreter importing torch and lightning cost the suite
    15-20 s a run (its workers, under a fork server or spawn, 12-15 s more)."""
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    steps = tmp_path / "steps.txt"
    args = [name, start, signame, to, str(tmp_path), str(steps)]
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # its own process group, which a Ctrl-C reaches
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    stdout, stderr = proc.communicate(timeout=300)
    left = [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}_{proc.pid}.")]
    assert not left, f"left in /dev/shm: {left}"
    assert proc.returncode == (1 if signame == "SIGINT" else 0), stderr[-3000:]
    assert "global_step" not in stdout or signame == "SIGTERM"
    ckpt = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    # signalled during step 5; every rank stopped together at the next stop check (every 4th batch: 8)
    assert ckpt["global_step"] == 8
    assert ckpt["optimizer_states"][0]["state"], "the checkpoint must hold the trained optimizer state"
    assert [int(s) for s in steps.read_text().split()] == list(range(8))

    steps.write_text("")
    pl.seed_everything(0)
    resumed = fit(name, "fork", Interrupted(-1, 0, str(steps), os.getpid(), to), str(tmp_path), ckpt_path="last")
    total = 12 if name in ("ddp", "fsdp") else 24  # 576 samples in batches of 24 per data-parallel replica
    assert [int(s) for s in steps.read_text().split()] == list(range(8, total))
    assert resumed.global_step == total


def test_second_signal_stops_at_once(tmp_path):
    """A rank that never reaches a step boundary (stuck in user code) cannot stop gracefully: the second
    Ctrl-C stops everything at once, and the main process exits 1 as Lightning does."""
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent(
        """
        import os, signal, time
        import lightning.pytorch as pl
        from lightning.pytorch.demos.boring_classes import BoringModel

        class Stuck(BoringModel):
            def training_step(self, batch, batch_idx):
                if self.global_rank == 0 and batch_idx == 1:
                    os.kill(os.getppid(), signal.SIGINT)
                    time.sleep(0.5)
                    os.kill(os.getppid(), signal.SIGINT)
                    time.sleep(60)
                return super().training_step(batch, batch_idx)

        if __name__ == "__main__":
            import lightning_shm
            pl.Trainer(strategy="shm_ddp_fork", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                       enable_progress_bar=False, enable_checkpointing=False).fit(Stuck())
        """))
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "rank 0 was here" in out.stderr and "in training_step" in out.stderr, out.stderr[-3000:]


def test_ctrl_c_during_a_long_setup_stops_at_once(tmp_path):
    """Before its first step a rank has no safe point to stop at (``setup`` downloading, a multi-node rendezvous):
    Ctrl-C there stops the run at once, as in one process. It waited ``stop_grace_s`` (60 s) until 2026-12-07."""
    script = tmp_path / "slow_setup.py"
    script.write_text(textwrap.dedent(
        """
        import os, signal, time
        import lightning.pytorch as pl
        from lightning.pytorch.demos.boring_classes import BoringModel

        class SlowSetup(BoringModel):
            def setup(self, stage):
                if self.global_rank == 0:
                    os.kill(os.getppid(), signal.SIGINT)  # the main process (forked workers' parent)
                    time.sleep(120)

        if __name__ == "__main__":
            import lightning_shm
            pl.Trainer(strategy="shm_ddp_fork", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                       enable_progress_bar=False, enable_checkpointing=False).fit(SlowSetup())
        """))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 45, "the run waited for a safe point rank 0 was not going to reach"
    assert proc.returncode == 1, stderr[-3000:]
    assert "received SIGINT before ranks 0, 1 reached a first step" in stderr, stderr[-3000:]
    assert "in setup" in stderr  # where rank 0 was
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}_{proc.pid}.")]


def _a_trainer_call_then_a_stack_request(path: str) -> None:
    from lightning_shm.runtime import stacks
    from lightning_shm.strategies.launcher import _StopRequestConnector

    stacks.register(path)  # as every worker does at start
    connector = _StopRequestConnector(pl.Trainer(logger=False), world=None)  # type: ignore[arg-type]
    connector.register_signal_handlers()  # a Trainer call's start ...
    connector.teardown()  # ... and its end: Lightning puts back "every signal's handler"
    os.kill(os.getpid(), stacks.DUMP_SIGNAL)  # what the main process sends when another rank fails
    time.sleep(0.2)


def test_a_worker_answers_a_stack_request_after_its_trainer_call_ended(tmp_path):
    """Lightning's teardown re-installed the handler Python saw for every signal -- the default, for the one
    faulthandler installs in C --, so the main process's stack request killed a rank whose fit had ended while
    another one failed (seen: "worker rank 0 was killed by signal SIGUSR2" beside a collective mismatch)."""
    import multiprocessing as mp

    from lightning_shm.runtime import stacks

    path = tmp_path / "stack"
    path.write_bytes(b"\0" * 65536)
    child = mp.get_context("fork").Process(target=_a_trainer_call_then_a_stack_request, args=(str(path),))
    child.start()
    child.join(30)
    assert child.exitcode == 0, f"the stack request ended the worker (exit code {child.exitcode})"
    frames = stacks.parse(path.read_bytes().rstrip(b"\0").decode())
    assert any(f[2] == "_a_trainer_call_then_a_stack_request" for f in frames), frames
