"""``trainer.should_stop`` set on some ranks only: every rank stops at the same point.

One process stops where a hook sets ``trainer.should_stop``. The ranks of a run each see their own values --
their batch's loss, their clock --, so a decision the program takes from them (a time budget, a NaN check, a
threshold on an unsynced metric) may come on some ranks only, and the ranks went different ways::

    rank 0: batch 2, should_stop = True -> validation before the stop -> its metrics' all-reduce
    rank 1: batch 2                     -> batch 3's backward          -> the gradients' all-reduce

(a ``CollectiveMismatchError``; Lightning's ``ddp`` waits there until its timeout). Lightning's own
``EarlyStopping`` reduces its decision -- any rank's stop stops every rank -- and ``Timer`` broadcasts rank
0's; code that sets the flag itself does neither. So the ranks vote (one ``vote_max``, a barrier's price)
where the fit loop reads the flag next, after the hooks that may have set it:

* a training batch's end: after the callbacks' and the module's ``on_train_batch_end`` (the step, its
  backward and optimizer hooks came before), before the loop decides on validation and on leaving;
* a training epoch's end: after the module's ``on_train_epoch_end`` (and the callbacks' before it);
* validation's end: the strategy's ``on_validation_end``, after the callbacks' and the module's.

Any rank's stop stops every rank, EarlyStopping's rule; a stop that was not every rank's warns once.
Lightning gives a strategy no hook after the first two, so the strategy wraps the module's two hooks
(instance attributes, for the fit only).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason

_WRAPPED = ("on_train_batch_end", "on_train_epoch_end")
# votes of other reasons (a stop request's) never match these: a rank would take another's answer as its own
_STOP_VOTE = barrier_reason("a vote on trainer.should_stop, after the hooks that may set it")
_UNANIMOUS_VOTE = barrier_reason("a vote on whether every rank set trainer.should_stop")


def vote_on_stop(trainer: "pl.Trainer", group: Group, where: str) -> None:
    """Every member of ``group`` (the run's ranks) stops if any of them set ``trainer.should_stop``."""
    mine = int(bool(trainer.should_stop))
    if not group.vote_max(mine, _STOP_VOTE):
        return
    trainer.should_stop = True
    if group.vote_max(1 - mine, _UNANIMOUS_VOTE):  # some rank had not set it: its decision was its own
        rank_zero_warn(
            f"lightning_shm: trainer.should_stop was set on some ranks only ({where}, global step "
            f"{trainer.global_step}); every rank stops there, as EarlyStopping decides (any rank's stop stops all). "
            "A decision from a rank's own values (its loss, its clock) differs between ranks; to decide on the "
            "same values everywhere, log them with sync_dist=True or reduce the decision "
            "(trainer.strategy.reduce_boolean_decision(stop, all=False))."
        )


def install(trainer: "pl.Trainer", group: Group) -> None:
    """Wrap the module's batch- and epoch-end hooks with a vote, for this fit (:func:`uninstall` removes them)."""
    module = trainer.lightning_module
    if trainer.state.fn != TrainerFn.FITTING or group.size == 1:
        return
    for name in _WRAPPED:
        if not isinstance(module.__dict__.get(name), _Voting):  # not wrapped yet (a second start of the same fit)
            setattr(module, name, _Voting(getattr(module, name), trainer, group, name[3:].replace("_", " ")))


def uninstall(module: "pl.LightningModule") -> None:
    for name in _WRAPPED:
        if isinstance(module.__dict__.get(name), _Voting):
            delattr(module, name)


class _Voting:
    """The module's own hook, then the vote. A copy of the module made meanwhile (``deepcopy``, ``pickle``: an
    EMA teacher, a module saved whole) gets its own hook back, bound to the copy, without the vote."""

    def __init__(self, hook: Callable[..., Any], trainer: "pl.Trainer", group: Group, where: str) -> None:
        self.hook, self.trainer, self.group, self.where = hook, trainer, group, where
        functools.update_wrapper(self, hook)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.hook(*args, **kwargs)
        vote_on_stop(self.trainer, self.group, self.where)
        return out

    def __reduce__(self) -> Any:
        return functools.partial, (self.hook.__func__, self.hook.__self__)
