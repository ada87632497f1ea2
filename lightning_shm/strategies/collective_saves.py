"""A checkpoint save is collective: a rank saving alone is told so where its collective fails.

Lightning's contract is that ``trainer.save_checkpoint`` runs on every rank (it writes on rank 0 only).
Under these strategies the save gathers: the sharded layouts' whole weights and optimizer states, and
under every layout the copies of the module's state a callback keeps (an EMA). A callback saving under
``if trainer.is_global_zero:`` -- code ported from one process -- sends rank 0 into that gather while the
others go on to their next collective. The mismatch stops the run within a second (Lightning's ddp waits
at its barrier for its 30-minute timeout), but said only "rank 0 entered all_gather_v (... weights kept in a
checkpoint) but rank 1 entered vote (...)"; the note added here says what to change. The peer's notes stand
beside whichever rank's report the main process raises, so it is read either way.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from lightning_shm.runtime import BarrierTimeoutError, CollectiveMismatchError

NOTE = ("rank {rank} was saving a checkpoint, which under {strategy} is collective: every rank takes part (rank 0 "
        "writes the file). If only some ranks save -- trainer.save_checkpoint(...) under `if "
        "trainer.is_global_zero:` -- call it on every rank, as Lightning's contract asks.")


@contextlib.contextmanager
def collective_save(rank: int, strategy: str) -> Iterator[None]:
    """Inside: a collective's mismatch or timeout gets :data:`NOTE` (a deadlock is a timeout found early)."""
    try:
        yield
    except (CollectiveMismatchError, BarrierTimeoutError) as exc:
        exc.add_note(NOTE.format(rank=rank, strategy=strategy))
        raise
