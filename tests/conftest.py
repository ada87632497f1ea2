"""Shared fixtures. Every test is checked for leaked /dev/shm segments (a full /dev/shm is a bus error)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


@pytest.fixture(autouse=True)
def _single_thread_torch():
    """Tests run many processes on 2 cores; keep the main process from oversubscribing them."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture
def mnist_dir() -> Path:
    """The real MNIST test split (IDX files) at ../shared/data/mnist."""
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.fail(f"the MNIST test split is expected at {MNIST_DIR} (see README: Data)")
    return MNIST_DIR
