"""Lightning's failure handling in the workers, where the state at the error is.

One process that raises runs Lightning's ``_interrupt`` before the error leaves ``fit``: the callbacks' and
the datamodule's ``on_exception`` (``OnExceptionCheckpoint`` writes the weights, optimizer and loop state at
the error), the strategy's, the loggers' ``finalize("failed")``. Under a process-launching strategy Lightning
runs it in the main process only, which holds the state from before the run: Lightning's ``ddp_spawn``
writes an ``on_exception.ckpt`` of step 0 there (a resume from it starts over). The workers run it here
instead, where every rank failed at the same step::

    rank 0: error at step 3 -> agree_failed(3) --+-- all here: on_exception on every rank (a sharded
    rank 1: error at step 3 -> agree_failed(3) --+   checkpoint gathers its pieces), then each raises

    rank 1: error at step 3 -> agree_failed(3)   x   rank 0 meets it in its step's all-reduce: PeerAbortedError
                                                     there, rank 1 skips on_exception and raises at once

A rank waiting for a failed one in a pipeline's hand-over (the last stage receiving the activation the first
stage's step never computed) learns of it within the wait policy's ``check_s`` and joins: nothing of a
collective is half done there, and it stands at the same step. A run that fails on some ranks only has no
state every rank stands at; its checkpoint is not written, as before, and the failing rank's error is reported
at once -- or after ``AGREE_WITHIN_S`` where the others compute on without meeting it.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.trainer import call

from lightning_shm.runtime import Group
from lightning_shm.runtime.errors import PeerFailedError, SHMRuntimeError

# How long a failed rank waits for the others to fail too. They reach the same point within the step's skew
# between ranks (milliseconds here); a rank that has not failed is told at its next collective with this one,
# and only one computing on for longer without any delays the report, by this much.
AGREE_WITHIN_S = 1.0


def on_exception_where_all_failed(trainer: "pl.Trainer", group: Group, exc: BaseException) -> None:
    """Run Lightning's failure handling for ``exc`` if every member of ``group`` (the node's ranks) failed at the
    same step; errors it raises become notes of ``exc``, which the caller raises next."""
    joins = isinstance(exc, PeerFailedError) and exc.joinable  # stopped in a hand-over from a rank that failed
    if isinstance(exc, SHMRuntimeError) and not joins:  # the runtime stopped mid-way (a peer died, a collective
        return  # half done): no collective of theirs can be trusted
    if not group.agree_failed(trainer.global_step, AGREE_WITHIN_S):
        return
    try:
        call._interrupt(trainer, exc)
    except BaseException as e:  # noqa: BLE001 - the run's own error is the one to report
        exc.add_note(f"lightning_shm: on_exception in the workers failed too: {type(e).__name__}: {e}")
