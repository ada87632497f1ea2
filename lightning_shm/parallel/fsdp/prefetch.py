"""Prefetch: gather the next unit's parameters on a helper thread while the current unit computes.

Why it can help: a gather is a pure memory copy (W shards from /dev/shm into a fresh full
tensor, plus the page faults of that fresh allocation); the matmuls of the unit that runs
meanwhile are compute-bound. Both overlap only if a core is free for the copy -- torch releases
the GIL inside ``copy_``, so a second thread really runs in parallel. With W = cores there is no
free core and the copy just competes with compute (measured in ``scripts/bench_strategies.py``,
README "shm_fsdp"), hence off by default.

Who does what::

    main thread                         helper thread
    unit k pre-forward: take k's full   .
      allocate full_{k+1} (accounted)   .
      submit copy ------------------->  copy W shards -> full_{k+1}
    unit k forward (matmul)             (copying)
    unit k+1 pre-forward: wait(full_{k+1}), use it

Backward runs the same pattern in reverse order (unit k's backward while unit k-1's freed
storage is refilled). Every tensor with a copy in flight is waited for before it is used, freed
or refilled, so the helper never writes freed memory. Prefetched data is only valid until the
shards change (``optimizer.step``, loading a checkpoint): :meth:`discard` drops it then.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch


class Prefetcher:
    """One helper thread and the copies it has in flight, keyed by the destination tensor object
    (the unit's full tensor: the same Python object from gather to free)."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._inflight: dict[int, tuple[torch.Tensor, Future[None]]] = {}
        self.started = 0  # copies submitted so far

    def submit(self, dest: torch.Tensor, copy: Callable[[], None]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp-prefetch")
        self.wait(dest)
        self._inflight[id(dest)] = (dest, self._pool.submit(copy))
        self.started += 1

    def wait(self, t: torch.Tensor) -> None:
        """Block until no copy into ``t`` is in flight (re-raises the helper's error)."""
        entry = self._inflight.pop(id(t), None)
        if entry is not None:
            entry[1].result()

    def wait_all(self) -> None:
        entries, self._inflight = list(self._inflight.values()), {}
        for _, fut in entries:
            fut.result()

    def close(self) -> None:
        self.wait_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

