"""Ranks that wait for each other in a cycle stop in seconds with a DeadlockError, not at the timeout.

Processes: the ranks take different paths (a collective on one, a receive or a send on another), with a
timeout of 30 s -- only the cycle check can end these runs as a DeadlockError. A fake clock: a
cycle is reported only once it has stood unchanged for ``deadlock_s``, never while the peer's wait changes.
"""

from __future__ import annotations

import math
import mmap
import os
from types import SimpleNamespace

import pytest
import torch

from lightning_shm.runtime import BarrierTimeoutError, ChannelConfig, DeadlockError, RuntimeConfig, launch
from lightning_shm.runtime import wait as wait_mod
from lightning_shm.runtime.deadlock import COLLECTIVE, RECEIVE, WaitBoard
from lightning_shm.runtime.wait import Waiter, WaitPolicy

PATIENT = RuntimeConfig(timeout_s=30.0)


def _collective_against_receive(world):
    g = world.group()
    ch = world.channel(0, 1)
    g.barrier()
    if world.rank == 0:
        g.all_reduce(torch.ones(4))  # a collective rank 1 skips
    else:
        ch.recv()  # rank 0 never sends


def _three_ranks_in_a_ring(world):
    """0 sends into a full channel to 1; 1 waits in a barrier of {1, 2}; 2 waits to receive from 0."""
    small = ChannelConfig(slots=1, slot_bytes=4096)
    world.group().barrier()
    if world.rank == 0:
        to_1 = world.channel(0, 1, config=small)
        to_1.send(torch.ones(4))
        to_1.send(torch.ones(4))  # waits for rank 1 to take the first
    elif world.rank == 1:
        world.group([1, 2]).barrier()
    else:
        world.channel(0, 2, config=small).recv()


@pytest.mark.parametrize("body,size,said", [
    (_collective_against_receive, 2, ["rank 0 waits in a collective (all_reduce) for rank(s) [1]",
                                      "rank 1 waits in a receive for rank(s) [0]"]),
    (_three_ranks_in_a_ring, 3, ["rank 0 waits in a send for rank(s) [1]",
                                 "rank 1 waits in a collective (barrier) for rank(s) [2]",
                                 "rank 2 waits in a receive for rank(s) [0]"]),
])
def test_ranks_waiting_for_each_other_raise_a_deadlock_naming_each_wait_and_where_the_others_were(body, size, said):
    with pytest.raises(DeadlockError) as info:
        launch(body, size, start_method="fork", runtime=PATIENT)
    message = str(info.value)
    assert all(s in message for s in said), message
    others = info.value.missing
    assert others and len(others) == size - 1
    where = [n for n in info.value.__notes__ if "was here" in n]
    assert len(where) == size - 1 and all(body.__name__ in n for n in where), info.value.__notes__
    assert isinstance(info.value, BarrierTimeoutError)  # caught where a timeout is


def _late_sender(world):
    """Rank 0 computes (outside every wait) longer than deadlock_s before it sends: no cycle, no error."""
    ch = world.channel(0, 1)
    g = world.group()
    g.barrier()
    if world.rank == 0:
        import time
        time.sleep(1.5)
        ch.send(torch.full((4,), 3.0))
    else:
        assert ch.recv().tolist() == [3.0] * 4
    g.barrier()
    return world.rank


def test_a_long_wait_for_a_rank_that_is_not_waiting_is_no_deadlock():
    runtime = RuntimeConfig(timeout_s=120.0, wait=WaitPolicy(timeout_s=120.0, deadlock_s=0.5, check_s=0.05))
    assert launch(_late_sender, 2, start_method="fork", runtime=runtime) == [0, 1]


# ---------------------------------------------------------------------- the check on a fake clock
ROW = 16


def _board(words: memoryview, rank: int, size: int) -> WaitBoard:
    return WaitBoard(words, [(r + 1) * ROW for r in range(size)], rank, ROW)


def test_a_cycle_is_found_only_through_ranks_that_all_wait():
    words = memoryview(mmap.mmap(-1, 4096)).cast("q")
    b0, b1, b2 = (_board(words, r, 3) for r in range(3))
    b0.publish(COLLECTIVE, [1])
    b1.publish(RECEIVE, [2])
    assert b0.cycle() is None  # rank 2 is not waiting: it computes, and will come
    b2.publish(COLLECTIVE, [0, 1])
    cycle = b0.cycle()
    assert cycle is not None and set(cycle) == {0, 1, 2}
    assert cycle[1][1:] == (RECEIVE, frozenset({2}))
    b1.clear()
    assert b0.cycle() is None and b2.cycle() is None


class _FakeTime:
    """Advances 1 ms per yield and by each sleep; ``on_tick(now)`` runs after every advance."""

    def __init__(self, on_tick) -> None:
        self.now, self.on_tick = 0.0, on_tick

    def monotonic(self) -> float:
        return self.now

    def sched_yield(self) -> None:
        self.now += 0.001
        self.on_tick(self.now)

    def sleep(self, s: float) -> None:
        self.now += s
        self.on_tick(self.now)


def _wait_for_rank_1(monkeypatch, on_tick, words, deadlock_s: float = 5.0) -> tuple[Waiter, _FakeTime]:
    fake = _FakeTime(on_tick)
    monkeypatch.setattr(wait_mod, "time", SimpleNamespace(monotonic=fake.monotonic, sleep=fake.sleep))
    monkeypatch.setattr(wait_mod, "os", SimpleNamespace(sched_yield=fake.sched_yield, getppid=os.getppid))
    waiter = Waiter(words, 8, WaitPolicy(timeout_s=60, spin_iters=10, yield_s=0.002, deadlock_s=deadlock_s,
                                         check_s=0.25))
    waiter.board = _board(words, 0, 2)
    return waiter, fake


def test_a_cycle_standing_for_deadlock_s_is_a_deadlock(monkeypatch):
    words = memoryview(mmap.mmap(-1, 4096)).cast("q")
    _board(words, 1, 2).publish(RECEIVE, [0])  # rank 1 waits to receive from rank 0, and stays so
    waiter, fake = _wait_for_rank_1(monkeypatch, lambda now: None, words)
    with pytest.raises(DeadlockError, match=r"rank 1 waits in a receive for rank\(s\) \[0\]") as info:
        waiter.wait_ge(words, 0, 1, lambda: "timed out", lambda: [1])
    assert 5.0 <= fake.now <= 5.0 + 0.25 + 0.01, fake.now
    assert info.value.missing == [1]
    assert words[ROW + 2] == 0  # this rank no longer says it waits


def test_a_peer_whose_wait_keeps_changing_is_waited_for_until_it_comes(monkeypatch):
    """Rank 1 goes from wait to wait for rank 0 -- a new one every second, each for the same rank -- and
    finally arrives: a check always sees the cycle, but never the same one for 5 s, so the wait ends
    normally at 12 s."""
    words = memoryview(mmap.mmap(-1, 4096)).cast("q")
    peer = _board(words, 1, 2)
    peer.publish(RECEIVE, [0])
    second = [0]

    def tick(now: float) -> None:
        if now >= 12.0:
            words[0] = 1
        elif int(now) != second[0]:
            second[0] = int(now)
            peer.clear()  # that wait ended; the next begins at once
            peer.publish(RECEIVE, [0])

    waiter, fake = _wait_for_rank_1(monkeypatch, tick, words)
    waiter.wait_ge(words, 0, 1, lambda: "timed out", lambda: [1])
    assert fake.now >= 12.0 and words[0] == 1
    assert words[ROW + 2] == 0


def test_a_stop_of_the_whole_run_longer_than_deadlock_s_is_no_deadlock(monkeypatch):
    """The run is stopped (Ctrl-Z, a suspended VM) for 30 s just after this rank saw an apparent cycle:
    rank 1's wait was over, but it had not run since. After the stop rank 1 runs again within half a second;
    one late look at the unchanged board must not be taken for five seconds of deadlock."""
    words = memoryview(mmap.mmap(-1, 4096)).cast("q")
    peer = _board(words, 1, 2)
    peer.publish(RECEIVE, [0])
    stopped = [False]

    def tick(now: float) -> None:
        if not stopped[0] and now > 0.01:  # this rank has looked once: the stop comes
            stopped[0] = True
            fake.now += 30.0
        elif stopped[0] and now > 30.5:
            peer.clear()
            if now > 31.0:
                words[0] = 1

    waiter, fake = _wait_for_rank_1(monkeypatch, tick, words)
    waiter.wait_ge(words, 0, 1, lambda: "timed out", lambda: [1])
    assert stopped[0] and words[0] == 1


def test_deadlock_s_inf_turns_the_check_off(monkeypatch):
    words = memoryview(mmap.mmap(-1, 4096)).cast("q")
    _board(words, 1, 2).publish(RECEIVE, [0])  # a standing cycle

    def tick(now: float) -> None:
        if now >= 12.0:
            words[0] = 1

    waiter, fake = _wait_for_rank_1(monkeypatch, tick, words, deadlock_s=math.inf)
    waiter.wait_ge(words, 0, 1, lambda: "timed out", lambda: [1])
    assert fake.now >= 12.0
