"""The waiter's phases (spin, yield, sleep) on a fake clock: which phase a wait of a given length reaches.

No processes and no real time: ``time.monotonic``, ``os.sched_yield`` and ``time.sleep`` of the wait
module are replaced by a clock that advances 1 ms per yield and by the sleep's own length, and the
waited word is published once the clock passes the peer's "arrival" time.
"""

from __future__ import annotations

import mmap
import os
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_shm.runtime import wait as wait_mod
from lightning_shm.runtime.wait import Waiter, WaitPolicy


class _FakeTime:
    """A clock that moves only when the waiter yields (1 ms) or sleeps; publishes ``words[0] = 1`` at ``arrive_s``."""

    def __init__(self, words: memoryview, arrive_s: float) -> None:
        self.now, self.words, self.arrive_s = 0.0, words, arrive_s
        self.yields, self.sleeps = 0, []

    def _advance(self, dt: float) -> None:
        self.now += dt
        if self.now >= self.arrive_s:
            self.words[0] = 1

    def monotonic(self) -> float:
        return self.now

    def sched_yield(self) -> None:
        self.yields += 1
        self._advance(0.001)

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self._advance(s)


def _wait(policy: WaitPolicy, arrive_s: float, monkeypatch: pytest.MonkeyPatch) -> _FakeTime:
    words = memoryview(mmap.mmap(-1, 4096)).cast("q")
    fake = _FakeTime(words, arrive_s)
    monkeypatch.setattr(wait_mod, "time", SimpleNamespace(monotonic=fake.monotonic, sleep=fake.sleep))
    monkeypatch.setattr(wait_mod, "os", SimpleNamespace(sched_yield=fake.sched_yield, getppid=os.getppid))
    Waiter(words, 8, policy).wait_ge(words, 0, 1, lambda: "never")
    assert words[0] == 1
    return fake


@pytest.mark.parametrize("arrive_ms", [5, 15])
def test_a_rank_with_its_own_core_yields_through_a_pipeline_hand_over_without_sleeping(
        arrive_ms: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # a peer's microbatch forward takes a few ms: a sleeping waiter would wake up to a back-off period late
    fake = _wait(WaitPolicy.for_world(2, cores=2, timeout_s=60), arrive_ms / 1e3, monkeypatch)
    assert fake.sleeps == []
    assert fake.yields == pytest.approx(arrive_ms, abs=1)


def test_a_long_wait_with_its_own_core_sleeps_after_20_ms(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _wait(WaitPolicy.for_world(2, cores=2, timeout_s=60), 0.1, monkeypatch)
    assert fake.yields == pytest.approx(20, abs=1)
    assert fake.sleeps[0] == pytest.approx(2e-5) and max(fake.sleeps) == pytest.approx(0.001)


@pytest.mark.parametrize("world_size", [3, 8])
def test_ranks_sharing_cores_sleep_after_2_ms(world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # more ranks than cores: a waiter that kept yielding would take turns from the ranks it waits for
    fake = _wait(WaitPolicy.for_world(world_size, cores=2, timeout_s=60), 0.015, monkeypatch)
    assert fake.yields == pytest.approx(2, abs=1)
    assert len(fake.sleeps) >= 5


def test_policy_values_are_validated() -> None:
    bad: list[dict[str, Any]] = [dict(timeout_s=0), dict(spin_iters=-1), dict(yield_s=-1), dict(max_sleep_s=0)]
    for kw in bad:
        with pytest.raises(ValueError, match=next(iter(kw))):
            WaitPolicy(**kw)
