"""Lightning calls that are collective: a rank making one alone is told so where its collective fails.

Lightning's contract is that every rank makes them; code ported from one process gates them on rank 0:

* ``trainer.save_checkpoint(path)`` (it writes on rank 0 only): under these strategies the save gathers
  -- the sharded layouts' whole weights, and under every layout the copies of the module's state a
  callback keeps (an EMA);
* ``self.log(name, value, sync_dist=True)`` -- and ``trainer.strategy.reduce`` itself: the value is
  combined over the data-parallel ranks, on the step for ``on_step`` values and at the epoch's end for
  ``on_epoch`` ones;
* ``self.all_gather``, ``trainer.strategy.broadcast`` and ``trainer.strategy.barrier``.

Under ``if trainer.is_global_zero:`` rank 0 enters that collective while the others go on to their next
one. The mismatch stops the run within a second (Lightning's ddp waits at its barrier for its 30-minute
timeout), but said only "rank 0 entered all_gather_v (...) but rank 1 entered vote (...)"; the note
added here says which call it was and what to change. The peer's notes stand beside whichever rank's
report the main process raises, so it is read either way.
"""

from __future__ import annotations

from types import TracebackType
from typing import Optional

from lightning_shm.runtime import BarrierTimeoutError, CollectiveMismatchError

SAVE = ("rank {rank} was saving a checkpoint (trainer.save_checkpoint, or the whole weights of "
        "trainer.strategy.lightning_module_state_dict()), which under {strategy} is collective: every rank takes "
        "part (rank 0 writes the file). If only some ranks save -- trainer.save_checkpoint(...) under `if "
        "trainer.is_global_zero:` -- call it on every rank, as Lightning's contract asks.")
REDUCE = ("rank {rank} was combining a value over the ranks (trainer.strategy.reduce: self.log(..., sync_dist=True) "
          "on the step, or at the epoch's end for on_epoch values), which every rank must do. If only some ranks log "
          "it -- under `if self.global_rank == 0:` or `if self.trainer.is_global_zero:` -- log it on every rank, or "
          "with rank_zero_only=True and without sync_dist.")

CALL = ("rank {{rank}} was in {call}, which every rank must call (under {{strategy}} it is a collective). If only "
        "some ranks call it -- under `if self.global_rank == 0:` or `if self.trainer.is_global_zero:` -- call it on "
        "every rank.")
GATHER = CALL.format(call="self.all_gather (trainer.strategy.all_gather)")
BROADCAST = CALL.format(call="trainer.strategy.broadcast")
BARRIER = CALL.format(call="trainer.strategy.barrier")


class noted:  # noqa: N801 - used as a context manager, named as one
    """Inside: a collective's mismatch or timeout gets ``note`` (a deadlock is a timeout found early). A class, not
    a generator: it wraps every ``self.log(..., sync_dist=True)`` reduce of every step (0.36 against 0.98 us)."""

    __slots__ = ("note", "rank", "strategy")

    def __init__(self, note: str, rank: int, strategy: str) -> None:
        self.note, self.rank, self.strategy = note, rank, strategy

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> bool:
        if isinstance(exc, (CollectiveMismatchError, BarrierTimeoutError)):
            exc.add_note(self.note.format(rank=self.rank, strategy=self.strategy))
        return False  # re-raised as it was
