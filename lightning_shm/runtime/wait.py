"""Waiting on a shared counter: spin, then yield, then sleep -- with a timeout and an abort flag.

Every blocking point of the runtime (barrier, p2p send/recv) waits through :class:`Waiter`, so
every one of them

* returns within ~1 us when the peer is already running on another core (pure spin phase);
* stays usable when there are more processes than cores (W=4 or 8 on 2 cores): after a short spin
  it calls ``os.sched_yield()`` so the peer it waits for gets the core, and after a few ms it
  sleeps with exponential back-off up to ``max_sleep_s`` so idle waiters cost nothing;
* when every rank has its own core, keeps yielding (a spin that gives way to any runnable task)
  for 20 ms before it sleeps: a sleeping waiter wakes up to one back-off period late (0.5-0.9 ms
  median after 5-20 ms waits on the 2-core VM, against ~3 us while yielding), and a pipeline's
  hand-overs wait a few ms each (a microbatch's forward on the other stage);
* raises :class:`PeerAbortedError` within one back-off period of the main process setting the
  abort flag (a worker died), and :class:`BarrierTimeoutError` after ``timeout_s``;
* while it sleeps, says whom it waits for (:mod:`.deadlock`) and raises :class:`DeadlockError` once
  it has waited ``deadlock_s`` in an unchanged cycle of ranks waiting for each other, and
  :class:`PeerFailedError` within ``check_s`` of a rank it waits for failing (``Group.agree_failed``);
* notices that its parent (the main process) has died, and stops instead of waiting forever.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lightning_shm.runtime.deadlock import (
    COLLECTIVE,
    FAILED,
    RECEIVE,
    SEND,
    DeadlockError,
    WaitBoard,
    deadlock_message,
    kind_name,
)
from lightning_shm.runtime.errors import BarrierTimeoutError, PeerAbortedError, PeerFailedError


@dataclass(frozen=True)
class WaitPolicy:
    """How long to spin, yield and sleep. ``spin_iters`` ~ 50 ns each from Python. ``deadlock_s``: how long
    ranks must have waited for each other in an unchanged cycle before it is called a deadlock
    (``math.inf``: never; the timeout still ends the wait); checked every ``check_s`` while sleeping."""

    timeout_s: float = 300.0
    spin_iters: int = 4000
    yield_s: float = 0.002
    max_sleep_s: float = 0.001
    deadlock_s: float = 5.0
    check_s: float = 0.25

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not (self.deadlock_s > 0 and self.check_s > 0):
            raise ValueError(f"deadlock_s and check_s must be > 0, got {self.deadlock_s}, {self.check_s}")
        if self.spin_iters < 0 or self.yield_s < 0 or self.max_sleep_s <= 0:
            raise ValueError(
                f"spin_iters, yield_s must be >= 0 and max_sleep_s > 0, got "
                f"{self.spin_iters}, {self.yield_s}, {self.max_sleep_s}"
            )

    @classmethod
    def for_world(cls, world_size: int, cores: int, timeout_s: float) -> "WaitPolicy":
        """Spin and yield long only when every rank can have its own core; else yield almost at once
        and sleep after 2 ms, so the ranks sharing a core run instead of their waiting peers."""
        if world_size > cores:
            return cls(timeout_s=timeout_s, spin_iters=50, yield_s=0.002)
        return cls(timeout_s=timeout_s, spin_iters=4000, yield_s=0.02)


class Waiter:
    """Per-process waiting helper bound to the world's abort word."""

    def __init__(self, abort_words: memoryview, abort_index: int, policy: WaitPolicy) -> None:
        self._abort = abort_words
        self._abort_idx = abort_index
        self.policy = policy
        self._ppid = os.getppid()
        self.board: Optional[WaitBoard] = None  # set by the World: where this rank says whom it waits for
        # past Group.agree_failed: every rank failed, and a rank still marked as waiting there is only not awake yet
        self.agreed_failed = False

    def aborted(self) -> bool:
        return bool(self._abort[self._abort_idx])

    def check_abort(self) -> None:
        code = self._abort[self._abort_idx]
        if code:
            raise PeerAbortedError(
                f"another process of the run failed (abort code {code}); this rank stops waiting. "
                "The main process reports the original error."
            )

    def wait_ge(self, words: memoryview, index: int, target: int, describe: Callable[[], str],
                missing: Optional[Callable[[], Sequence[int]]] = None, timeout_s: Optional[float] = None,
                kind: int = COLLECTIVE) -> None:
        """Block until ``words[index] >= target``. ``describe()`` builds the timeout message, ``missing()``
        names the ranks waited for (carried by the error, so the main process can say where they were; and
        published, with ``kind``, for the deadlock check). ``timeout_s`` overrides the policy's for this wait
        (``math.inf``: no deadline; an abort or a deadlock still ends it)."""
        for _ in range(self.policy.spin_iters):
            if words[index] >= target:
                return
        abort, aidx = self._abort, self._abort_idx
        now = time.monotonic()
        deadline = now + (self.policy.timeout_s if timeout_s is None else timeout_s)
        yield_until = now + self.policy.yield_s
        sleep = 2e-5
        board = self.board if missing is not None else None
        check_at, cycle, since, looks = 0.0, None, 0.0, 0
        enough = max(2, int(min(self.policy.deadlock_s, 3600.0) / self.policy.check_s / 2))  # looks in deadlock_s
        try:
            while words[index] < target:
                if abort[aidx]:
                    self.check_abort()
                now = time.monotonic()
                if now < yield_until:
                    os.sched_yield()
                    continue
                if now > deadline:
                    raise BarrierTimeoutError(describe(), missing() if missing is not None else ())
                if os.getppid() != self._ppid:
                    raise PeerAbortedError("the main process died; this worker stops waiting")
                if board is not None and now >= check_at:
                    check_at = now + self.policy.check_s
                    assert missing is not None
                    waited = missing()
                    board.publish(kind, waited)
                    failed = board.failed(waited) if kind != FAILED and not self.agreed_failed else []
                    if failed:
                        raise PeerFailedError(f"rank {failed[0]} failed: it stopped at its error while this rank "
                                              f"waited for it in {kind_name(kind)}", failed[0],
                                              joinable=kind in (RECEIVE, SEND))
                    seen = board.cycle()
                    looks += 1
                    if seen is None or seen != cycle:
                        cycle, since, looks = seen, now, 1
                    # and seen often enough: after a stop of the whole run (SIGSTOP, a suspended VM) the first
                    # look comes late, before a peer whose wait was already over has run again
                    elif now - since >= self.policy.deadlock_s and looks >= enough:
                        raise DeadlockError(deadlock_message(seen, now - since), sorted(set(seen) - {board.rank}))
                time.sleep(sleep)
                sleep = min(sleep * 2, self.policy.max_sleep_s)
        finally:
            if board is not None:
                board.clear()
