"""A failing, killed or late worker must never hang the others or leak /dev/shm.

Each test measures how long the main process takes to raise: the contract is "within seconds"
(10 s here, with margin for a loaded 2-core CI machine).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lightning_shm.runtime import (
    BarrierTimeoutError,
    CollectiveMismatchError,
    RuntimeConfig,
    SharedMemoryFullError,
    WorkerDiedError,
    launch,
)
from lightning_shm.runtime.segment import PREFIX, Segment, check_free_space, list_owned, sweep_stale

ROOT = Path(__file__).resolve().parents[2]


def _raise_on_rank_1(world):
    g = world.group()
    g.barrier()
    if world.rank == 1:
        raise ValueError("boom from rank 1: bad value 42")
    g.all_reduce(torch.ones(10))  # rank 0 waits here for a peer that will never come


def test_worker_exception_is_reraised_with_type_message_and_traceback():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom from rank 1: bad value 42") as info:
        launch(_raise_on_rank_1, 3, start_method="fork")
    assert time.monotonic() - t0 < 10
    cause = info.value.__cause__
    assert cause is not None and "_raise_on_rank_1" in str(cause) and "Traceback" in str(cause)
    assert "rank 1" in str(cause)


def _die_mid_collective(world):
    g = world.group()
    pids = g.all_gather_object(os.getpid())
    x = torch.randn(1 << 20)
    for i in range(10_000):
        if world.rank == 0 and i == 20:
            os.kill(pids[1], signal.SIGKILL)
        g.all_reduce(x, "mean")


def test_sigkilled_worker_stops_everyone_within_seconds():
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 .* killed by signal SIGKILL"):
        launch(_die_mid_collective, 3, start_method="fork")
    assert time.monotonic() - t0 < 10


def _late(world):
    if world.rank == 1:
        time.sleep(60)
    world.group().barrier()


def test_barrier_timeout_names_the_missing_rank():
    t0 = time.monotonic()
    with pytest.raises(BarrierTimeoutError, match=r"rank\(s\) \[1\] did not arrive"):
        launch(_late, 2, start_method="fork", runtime=RuntimeConfig(timeout_s=1.0))
    assert time.monotonic() - t0 < 10


def _mismatch(world):
    g = world.group()
    if world.rank == 0:
        g.all_reduce(torch.ones(4))
    else:
        g.broadcast(torch.ones(4), src=0)


def test_mismatched_collectives_raise_instead_of_corrupting():
    with pytest.raises(CollectiveMismatchError, match="all_reduce.*broadcast|broadcast.*all_reduce"):
        launch(_mismatch, 2, start_method="fork")


def _size_mismatch(world):
    world.group().all_reduce(torch.ones(4 + world.rank))


def test_mismatched_sizes_raise():
    with pytest.raises(CollectiveMismatchError, match="numel=4.*numel=5|numel=5.*numel=4"):
        launch(_size_mismatch, 2, start_method="fork")


def _exit_silently(world):
    world.group().barrier()
    if world.rank == 1:
        os._exit(3)
    world.group().barrier()


def test_worker_exiting_without_result_is_reported():
    with pytest.raises(WorkerDiedError, match="rank 1 .* exited with code 3"):
        launch(_exit_silently, 2, start_method="fork")


def test_spawn_start_method_reports_errors_too():
    with pytest.raises(ValueError, match="boom from rank 1"):
        launch(_raise_on_rank_1, 2, start_method="spawn")


def test_free_space_check_says_how_much_and_how_to_fix():
    with pytest.raises(SharedMemoryFullError, match=r"needs .* MiB .* --shm-size"):
        check_free_space(1 << 50)


def test_segments_are_private_and_removed():
    seg = Segment.create(10_000, "unit-test")
    try:
        mode = os.stat(f"/dev/shm/{seg.name}").st_mode & 0o777
        assert mode == 0o600
        assert seg.name.startswith(f"{PREFIX}_{os.getpid()}_")
        assert seg.name in list_owned()
        view = seg.tensor(torch.float32, 64, 10)
        view.fill_(3.0)
        seg.close()  # a live view must not crash close() nor dangle
        assert float(view.sum()) == 30.0
    finally:
        seg.unlink()
    assert seg.name not in list_owned()


_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from lightning_shm.runtime import launch

    def loop(world):
        g = world.group()
        x = torch.ones(1000)
        while True:
            g.all_reduce(x)
            time.sleep(0.001)

    if __name__ == "__main__":
        print("started", flush=True)
        launch(loop, 2, start_method=sys.argv[1])
    """
)


def _run_script(tmp_path: Path, start_method: str) -> subprocess.Popen:
    script = tmp_path / "loop.py"
    script.write_text(_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), start_method], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(list_owned(proc.pid)) < 2:  # control + group segments exist
        time.sleep(0.05)
    assert len(list_owned(proc.pid)) >= 2, "workers did not start"
    return proc


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_main_process_stops_workers_and_cleans_up(tmp_path, sig):
    proc = _run_script(tmp_path, "fork")
    workers = _children(proc.pid)
    t0 = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=15)
    assert time.monotonic() - t0 < 10
    assert list_owned(proc.pid) == []
    time.sleep(0.2)
    assert all(not Path(f"/proc/{w}").exists() or "Z" in Path(f"/proc/{w}/stat").read_text().split()[2]
               for w in workers)


def test_sigkill_of_main_kills_workers_and_sweep_removes_its_segments(tmp_path):
    proc = _run_script(tmp_path, "fork")
    workers = _children(proc.pid)
    assert workers
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{w}").exists() for w in workers):
        time.sleep(0.05)
    assert not any(Path(f"/proc/{w}").exists() for w in workers), "workers survived their parent"
    leftovers = list_owned(proc.pid)
    assert leftovers, "SIGKILL cannot run clean-up; the segments are expected to be left for the sweep"
    removed = sweep_stale()
    assert set(leftovers) <= set(removed)
    assert list_owned(proc.pid) == []
