"""Where a rank's Trainer stood when the runtime stopped it for taking another path than the others.

A :class:`CollectiveMismatchError`, a deadlock or a timeout names the collectives or waits that met, in the
runtime's terms; the cause is usually a decision of the program taken on some ranks only. The commonest: a
callback setting ``trainer.should_stop`` from a rank's own values where the ranks do not vote on it
(:mod:`.stop_votes`; an ``EarlyStopping`` subclass deciding by itself, at an epoch's end)::

    rank 0: epoch 0 ends, should_stop = True -> its fit ends -> the end-of-fit gathers
    rank 1: epoch 0 ends                     -> epoch 1's start -> its vote on the flag

Each rank notes where its loop stood (stage, epoch, step, ``should_stop``); the launcher puts the other
rank's note and stack beside the reported error, so the two paths read side by side.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_shm.runtime.errors import BarrierTimeoutError, CollectiveMismatchError, PeerAbortedError

# a deadlock is a timeout reported early; a rank the others' report names may have been stopped by the abort
_DIVERGED = (CollectiveMismatchError, BarrierTimeoutError, PeerAbortedError)


def note_loop_position(trainer: "pl.Trainer", exc: BaseException) -> None:
    """Add this rank's loop position to ``exc`` if it says the ranks took different paths (or, stopped by the
    abort, may be one the report names: the launcher shows a rank's notes only beside an error naming it)."""
    if not isinstance(exc, _DIVERGED):
        return
    try:
        exc.add_note(_position(trainer))
    except Exception as e:  # noqa: BLE001 - a note must never replace the error it explains
        exc.add_note(f"(this rank's loop position could not be read: {type(e).__name__}: {e})")


def _position(trainer: "pl.Trainer") -> str:
    fn, status = trainer.state.fn, trainer.state.status
    call = f"`{fn.value}`" if fn is not None else "no Trainer call"
    if status == TrainerStatus.FINISHED:
        where = f"had finished {call} and was gathering what the main process gets back"
    else:
        where = f"was in {call}, " + _where_in(trainer)
    note = (f"rank {trainer.global_rank} {where} (epoch {trainer.current_epoch}, global step {trainer.global_step}), "
            f"trainer.should_stop={trainer.should_stop}")
    if trainer.should_stop and fn == TrainerFn.FITTING:
        note += (" -- set on some ranks only where the ranks do not vote on it before the loop reads it (they do "
                 "after the hooks of the fit's start, a training epoch's start, a batch's end, validation's end and "
                 "the module's epoch end -- EarlyStopping's and ModelCheckpoint's own, subclasses included, run "
                 "after it), a stop sends the ranks different ways: set it in one of those hooks, or decide it "
                 "alike on every rank, e.g. `trainer.should_stop = trainer.strategy.reduce_boolean_decision(stop, "
                 "all=False)`")
    return note


def _where_in(trainer: "pl.Trainer") -> str:
    """The loop the rank was in. Lightning's stage reads "train" for the whole fit, also in the hooks before its
    train loop starts (``setup``, ``on_fit_start``) and after it ends (``on_fit_end``): the strategy's own
    ``train_loop`` says which."""
    stage = trainer.state.stage
    if stage is None:
        return "outside its loops"
    phase = getattr(trainer.strategy, "train_loop", "running")
    if stage.value == "train" and phase == "not started":
        return ("before its train loop ran a step (the fit's start: setup, on_fit_start, loading the data, "
                "on_train_start)")
    if stage.value == "train" and phase == "ended":
        return "past its train loop (the fit's end: on_train_end, on_fit_end)"
    return f"its {stage.value} loop"
