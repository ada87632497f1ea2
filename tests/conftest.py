"""Shared fixtures. Every test is checked for leaked /dev/shm segments (a full /dev/shm is a bus error)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_shm.strategies.launcher as strategy_launcher
from lightning_shm.runtime.segment import list_owned

ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = (ROOT / ".." / "shared" / "data" / "mnist").resolve()


@pytest.fixture(autouse=True)
def no_shm_leak():
    """Fail any test that leaves a segment of this test process behind.

    Only this process's own segments count (their names carry its pid; see ``segment.list_owned``):
    other programs on the machine may use /dev/shm as they like. Tests that start scripts in
    processes of their own check those processes' segments themselves."""
    before = set(list_owned())
    yield
    leaked = sorted(set(list_owned()) - before)
    if leaked:
        pytest.fail(f"test left shared-memory segments behind in /dev/shm: {leaked}")


@pytest.fixture(autouse=True, scope="session")
def _single_thread_session():
    """Module-scoped references run before function fixtures: one thread for them too. A reduction's
    order depends on the thread count, and spectral_norm's power iteration under Adam turns that
    rounding into 1e-9 differences after 5 steps."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _single_thread_torch(_single_thread_session):
    """Tests run many processes on 2 cores; keep the main process from oversubscribing them (and undo
    a test's own setting)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture
def no_worker_starts(monkeypatch):
    """For refusals that must come before any worker starts: starting one fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was about to start")

    monkeypatch.setattr(strategy_launcher, "Launcher", refuse)


@pytest.fixture
def mnist_dir() -> Path:
    """The real MNIST test split (IDX files) at ../shared/data/mnist."""
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.fail(f"the MNIST test split is expected at {MNIST_DIR} (see README: Data)")
    return MNIST_DIR
