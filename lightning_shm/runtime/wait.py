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
* notices that its parent (the main process) has died, and stops instead of waiting forever.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lightning_shm.runtime.errors import BarrierTimeoutError, PeerAbortedError


@dataclass(frozen=True)
class WaitPolicy:
    """How long to spin, yield and sleep. ``spin_iters`` ~ 50 ns each from Python."""

    timeout_s: float = 300.0
    spin_iters: int = 4000
    yield_s: float = 0.002
    max_sleep_s: float = 0.001

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
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
                missing: Optional[Callable[[], Sequence[int]]] = None, timeout_s: Optional[float] = None) -> None:
        """Block until ``words[index] >= target``. ``describe()`` builds the timeout message, ``missing()``
        names the ranks waited for (carried by the error, so the main process can say where they were).
        ``timeout_s`` overrides the policy's for this wait (``math.inf``: no deadline; an abort still ends it)."""
        for _ in range(self.policy.spin_iters):
            if words[index] >= target:
                return
        abort, aidx = self._abort, self._abort_idx
        now = time.monotonic()
        deadline = now + (self.policy.timeout_s if timeout_s is None else timeout_s)
        yield_until = now + self.policy.yield_s
        sleep = 2e-5
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
            time.sleep(sleep)
            sleep = min(sleep * 2, self.policy.max_sleep_s)
