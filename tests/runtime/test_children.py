"""Processes a worker starts itself (a DataLoader's ``num_workers``) start as in the user's own process.

multiprocessing makes the method that started a process its default; without the launcher's reset a
rank started by the fork server (the strategies' default) or by spawn would start its DataLoader
workers the same way -- re-importing torch (~20 s before each epoch's first batch on 2 cores) and
pickling the dataset, which fails for one that does not pickle --, and they would inherit the
rank's SIGTERM handler, which turns a DataLoader's ``terminate()`` into a stop request for the run.
"""

from __future__ import annotations

import multiprocessing as mp
import signal

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_shm.runtime import launch
from lightning_shm.runtime.launcher import LaunchConfig, Launcher


class _Unpicklable(Dataset):
    """Fine in a forked DataLoader worker; any other start method has to pickle it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])

    def __reduce__(self):
        raise RuntimeError("this dataset was pickled")


def _children(world) -> dict:
    method = mp.get_start_method()
    batches = [b.tolist() for b in DataLoader(_Unpicklable(), batch_size=2, num_workers=1)]  # raises unless forked
    # a child forked from this rank must die of SIGTERM, not turn it into a stop request for the run
    ctx = mp.get_context("fork")
    started = ctx.Event()
    child = ctx.Process(target=_wait_forever, args=(started,), daemon=True)
    child.start()
    assert started.wait(30)
    child.terminate()  # SIGTERM, as a DataLoader does to a worker that does not exit in time
    child.join(10)
    survived = child.is_alive()
    if survived:  # fail, do not hang
        child.kill()
        child.join()
    return dict(method=method, batches=batches, child_exitcode="survived SIGTERM" if survived else child.exitcode,
                stop=world.stop_requested(), own_sigterm_is_default=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)


def _wait_forever(started) -> None:
    started.set()
    signal.pause()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_a_workers_dataloader_forks_its_workers_as_the_main_process_would(start_method):
    main_default = mp.get_start_method()  # the platform's default unless a test changed it
    assert main_default == "fork", "another test changed the process-wide start method"
    results = Launcher(LaunchConfig(2, start_method=start_method, graceful_stop=True)).run(_children)
    for r in results:
        assert r["method"] == main_default
        assert r["batches"] == [[[0.0], [1.0]], [[2.0], [3.0]]]  # the unpicklable dataset, loaded by a forked worker
        assert r["child_exitcode"] == -signal.SIGTERM and r["stop"] == 0
        assert not r["own_sigterm_is_default"]  # the rank itself still turns SIGTERM into a stop request


def _method(world) -> str:
    return mp.get_start_method()


def test_the_main_processs_own_start_method_is_passed_on():
    prev = mp.get_start_method(allow_none=True)
    mp.set_start_method("spawn", force=True)
    try:
        assert launch(_method, 2, start_method="forkserver") == ["spawn", "spawn"]
    finally:
        mp.set_start_method(prev, force=True)
