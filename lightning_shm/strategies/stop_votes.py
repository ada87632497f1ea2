"""``trainer.should_stop`` set on some ranks only: every rank stops at the same point.

One process stops where a hook sets ``trainer.should_stop``. The ranks of a run each see their own values --
their batch's loss, their clock --, so a decision the program takes from them (a time budget, a NaN check, a
threshold on an unsynced metric) may come on some ranks only, and the ranks went different ways::

    rank 0: batch 2, should_stop = True -> validation before the stop -> its metrics' all-reduce
    rank 1: batch 2                     -> batch 3's backward          -> the gradients' all-reduce

(a ``CollectiveMismatchError``; Lightning's ``ddp`` waits there until its timeout). Lightning's own
``EarlyStopping`` reduces its decision -- any rank's stop stops every rank -- and ``Timer`` broadcasts rank
0's; code that sets the flag itself does neither. So the ranks vote (one ``vote_max``, a barrier's price)
where the loops read the flag next, after the hooks that may have set it:

* the fit's start: the strategy's ``on_train_start``, after the callbacks' and the module's (and the sanity
  check's validation);
* a training epoch's start: after the callbacks' and the module's ``on_train_epoch_start``, before the epoch
  loop's first look at the flag;
* a training batch's end: after the callbacks' and the module's ``on_train_batch_end`` (the step, its
  backward and optimizer hooks came before), before the loop decides on validation and on leaving;
* a training epoch's end: after the module's ``on_train_epoch_end`` (and the callbacks' before it);
* validation's end: the strategy's ``on_validation_end``, after the callbacks' and the module's.

Any rank's stop stops every rank, EarlyStopping's rule; a stop that was not every rank's warns once. The
module's ``on_train_batch_start`` returning -1 (skip the rest of the epoch) is the same kind of decision and
gets the same rule, voted where the module overrides that hook. Lightning gives a strategy no hook after the
module's epoch start, batch start and end, and epoch end, so the strategy wraps those hooks of the module
for the fit (:mod:`.module_hooks`). A time-based ``val_check_interval`` is agreed at the batch's end too
(:mod:`.validation_clock`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason
from lightning_shm.strategies import module_hooks
from lightning_shm.strategies.validation_clock import ValidationClock

_WRAPPED = ("on_train_epoch_start", "on_train_batch_start", "on_train_batch_end", "on_train_epoch_end")
# votes of other reasons (a stop request's) never match these: a rank would take another's answer as its own
_STOP_VOTE = barrier_reason("a vote on trainer.should_stop, after the hooks that may set it")
_UNANIMOUS_VOTE = barrier_reason("a vote on whether every rank set trainer.should_stop")
_SKIP_VOTE = barrier_reason("a vote on on_train_batch_start returning -1 (skip the rest of the epoch)")
_UNANIMOUS_SKIP_VOTE = barrier_reason("a vote on whether every rank's on_train_batch_start returned -1")


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


def vote_on_skip(trainer: "pl.Trainer", group: Group, response: Any) -> Any:
    """-1 on every member of ``group`` if any of them got -1 from the module's ``on_train_batch_start``: one
    process skips the rest of its epoch there, and a rank skipping alone would meet the others' next step."""
    mine = int(response == -1)
    if not group.vote_max(mine, _SKIP_VOTE):
        return response
    if group.vote_max(1 - mine, _UNANIMOUS_SKIP_VOTE):
        rank_zero_warn(
            f"lightning_shm: on_train_batch_start returned -1 on some ranks only (epoch {trainer.current_epoch}, "
            f"global step {trainer.global_step}); every rank skips the rest of the epoch there (any rank's skip "
            "skips all). A decision from a rank's own values differs between ranks; to decide on the same values "
            "everywhere, reduce it (trainer.strategy.reduce_boolean_decision(skip, all=False)).")
    return -1


def install(trainer: "pl.Trainer", group: Group, epoch_start: Optional[Callable[[], None]] = None) -> None:
    """Wrap the module's hooks of :data:`_WRAPPED` with their votes, for this fit (:func:`uninstall` removes
    them); ``on_train_batch_start`` only where the module overrides it (it alone may return -1: no vote a batch
    otherwise). ``epoch_start``: the strategy's own work at a training epoch's start, after the module's hook
    and before the vote (Lightning gives a strategy no hook there)."""
    module = trainer.lightning_module
    if trainer.state.fn != TrainerFn.FITTING or group.size == 1:
        return

    def voting(where: str, clock: Optional[ValidationClock] = None,
               before: Optional[Callable[[], None]] = None) -> Callable[..., Any]:
        def around(hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            out = hook(*args, **kwargs)
            if before is not None:
                before()
            vote_on_stop(trainer, group, where)
            if clock is not None:  # after the stop's vote: the loop validates before a stop, too
                clock.agree()
            return out
        return around

    def skipping(hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return vote_on_skip(trainer, group, hook(*args, **kwargs))

    arounds: dict[str, Callable[..., Any]] = {
        "on_train_epoch_start": voting("train epoch start", before=epoch_start),
        "on_train_batch_end": voting("train batch end", ValidationClock.of(trainer, group)),
        "on_train_epoch_end": voting("train epoch end"),
    }
    if is_overridden("on_train_batch_start", module):
        arounds["on_train_batch_start"] = skipping
    for name, around in arounds.items():
        module_hooks.wrap(module, name, around)


def uninstall(module: "pl.LightningModule") -> None:
    module_hooks.unwrap(module, _WRAPPED)
