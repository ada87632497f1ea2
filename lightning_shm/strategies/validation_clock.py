"""A time-based ``val_check_interval``: the ranks validate after the same batch.

``Trainer(val_check_interval={"minutes": 10})`` validates when that much time has passed since the last
validation, a decision Lightning takes after each training batch on each process's own clock::

    validate = time.monotonic() - trainer._last_val_time >= interval     (set again when a validation ends)

The ranks of a run reach that line apart -- microseconds, or milliseconds where rank 0 logs and another does
not -- so an interval ending in between sends one rank into validation and the other into its next step:
measured before this module, a ``CollectiveMismatchError`` in 1 of 3 fits of 80 steps at a 30 ms interval
under shm_ddp (Lightning's ``ddp`` waits there until its timeout). So after each training batch the ranks
vote (``vote_max``), each on its own clock: due if any rank's interval has passed, as one process validates
the first time its clock says so. Each rank's check is then made to read the vote, whatever its clock says
by then::

    vote: due     -> trainer._last_val_time = -inf   (every rank validates; the loop sets it to now after)
    vote: not due -> trainer._last_val_time = +inf   (no rank does)

and the real time of the last validation is kept here, read back whenever the loop has set a new one.
Only runs with a time-based interval vote; :func:`.stop_votes.install` calls :meth:`ValidationClock.agree`
after the batch-end vote on ``trainer.should_stop``.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import lightning.pytorch as pl

from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason

_DUE_VOTE = barrier_reason("a vote on whether a time-based val_check_interval has passed")


class ValidationClock:
    """Agrees on a time-based ``val_check_interval`` over ``group`` (the run's ranks) after each training
    batch."""

    def __init__(self, trainer: "pl.Trainer", group: Group, interval_s: float) -> None:
        self.trainer, self.group, self.interval_s = trainer, group, interval_s
        self.last_val_time = -math.inf  # this rank's clock, when its last validation (or the fit) started

    @classmethod
    def of(cls, trainer: "pl.Trainer", group: Group) -> Optional["ValidationClock"]:
        """A clock for ``trainer``'s fit if its ``val_check_interval`` is a time, else None (nothing to agree)."""
        interval = getattr(trainer, "_val_check_time_interval", None)
        return None if interval is None else cls(trainer, group, float(interval))

    def agree(self) -> bool:
        """Vote on whether the interval has passed and make this rank's check read the vote; returns it."""
        last = getattr(self.trainer, "_last_val_time", None)
        if last is not None and math.isfinite(last):  # the loop set it (the fit's start, a validation's end)
            self.last_val_time = last
        mine = time.monotonic() - self.last_val_time >= self.interval_s
        due = bool(self.group.vote_max(int(mine), _DUE_VOTE))
        self.trainer._last_val_time = -math.inf if due else math.inf
        return due
