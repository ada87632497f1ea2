"""``trainer.should_stop`` set on some ranks only stops every rank where one process stops.

A decision from a rank's own values (its loss, its clock) comes on some ranks only. Before 2026-12-06 the ranks
went different ways -- the stopping one to the validation and epoch-end hooks before a stop, the others to their
next step -- and the run failed with a ``CollectiveMismatchError`` (Lightning's ``ddp`` waits there until its
timeout). Each test here sets the flag on one rank only, at each place a program sets it, and compares with one
process setting it at the same point; so for ``on_train_batch_start`` returning -1 (skip the rest of the epoch)
and for a time-based ``val_check_interval``, decided on each rank's clock.
"""

from __future__ import annotations

import copy
import functools
import pickle
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

from lightning_shm.models import MNISTClassifier
from lightning_shm.strategies.stop_votes import _WRAPPED
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, flat_params

WARNED = "on some ranks only"  # trainer.should_stop was set / on_train_batch_start returned -1


class _StopsOnOneRank(MNISTClassifier):
    """Sets ``trainer.should_stop`` on one rank (``rank``: 0 or the last) at ``where``: the fit's or epoch 1's
    start, the step itself, the module's batch or epoch end, or (by the callback below) epoch 1's start or
    validation's end; or skips the rest of epoch 0 from its batch 2 on (``on_train_batch_start`` returns -1)."""

    def __init__(self, where: str, rank: str) -> None:
        super().__init__(optimizer="adam", lr=0.01)
        self.where, self.rank = where, rank
        self.warned: list[str] = []  # what rank 0 was warned of (comes back to the main process)

    def on_train_start(self):
        self._recording = warnings.catch_warnings(record=True)  # the workers' warnings never reach pytest's
        self._records = self._recording.__enter__()
        warnings.simplefilter("always")
        if self.where == "train_start" and self._mine():
            self.trainer.should_stop = True

    def on_train_epoch_start(self):
        if self.where == "epoch_start" and self.current_epoch == 1 and self._mine():
            self.trainer.should_stop = True

    def on_train_batch_start(self, batch, batch_idx):
        if self.where == "skip" and self.current_epoch == 0 and batch_idx == 2 and self._mine():
            return -1
        return None

    def on_train_end(self):
        self._recording.__exit__(None, None, None)
        self.warned = [str(w.message) for w in self._records if WARNED in str(w.message)]

    def _mine(self) -> bool:
        return self.global_rank == (0 if self.rank == "first" else self.trainer.world_size - 1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.where == "training_step" and batch_idx == 2 and self._mine():
            self.trainer.should_stop = True
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.where == "batch_end" and batch_idx == 2 and self._mine():
            self.trainer.should_stop = True

    def on_train_epoch_end(self):
        if self.where == "epoch_end" and self._mine():
            self.trainer.should_stop = True


class _StopsInCallbacks(pl.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if pl_module.where == "epoch_start_callback" and trainer.current_epoch == 1 and pl_module._mine():
            trainer.should_stop = True

    def on_validation_end(self, trainer, pl_module):
        if pl_module.where == "validation_end" and not trainer.sanity_checking and pl_module._mine():
            trainer.should_stop = True


def _fit(where: str, rank: str, layout: str):
    make, devices, dp = (lambda: "auto", 1, 1) if layout == "one process" else LAYOUTS[layout]
    # 4 epochs of 4 batches: each place stops the run early, before its end
    t, model = fit_seeded(lambda: _StopsOnOneRank(where, rank), make(), devices, GLOBAL_BATCH // dp,
                          ref=layout == "one process", samples=GLOBAL_BATCH * 4, validate=where == "validation_end",
                          max_epochs=4, limit_val_batches=1, callbacks=[_StopsInCallbacks()])
    return flat_params(model), t.global_step, t.current_epoch, model.warned


# (where the flag is set, on which rank, layout, warned): a pipeline's stages share what its step set (the last
# stage runs the loss and broadcasts the step's outcome), so its step's stop is every rank's -- no warning there
CASES = [("batch_end", "first", name, True) for name in ("ddp", "fsdp", "tp2", "pp2-1f1b", "dp2xpp2-shard")] + [
    ("training_step", "last", "ddp", True), ("training_step", "last", "pp2-1f1b", False),
    ("training_step", "last", "dp2xpp2-shard", True), ("epoch_end", "first", "ddp", True),
    ("epoch_end", "last", "pp2-1f1b", True), ("validation_end", "last", "ddp", True),
    ("validation_end", "first", "dp2xpp2-shard", True), ("train_start", "last", "ddp", True),
    ("train_start", "first", "pp2-1f1b", True), ("epoch_start", "first", "fsdp", True),
    ("epoch_start_callback", "last", "dp2xpp2-shard", True), ("skip", "first", "ddp", True),
    ("skip", "last", "tp2", True), ("skip", "first", "pp2-1f1b", True)]
# global steps one process takes (4 epochs of 4 batches): the fit's start stops at once, epoch 1's start after
# epoch 0, a skip at epoch 0's batch 2 leaves 2 + 3 x 4; the others stop at their step 3 or their epoch 0's end
ONE_STEPS = {"epoch_end": 4, "validation_end": 4, "train_start": 0, "epoch_start": 4, "epoch_start_callback": 4,
             "skip": 14}
WHERE = {"epoch_end": "train epoch end", "validation_end": "validation end", "train_start": "train start",
         "epoch_start": "train epoch start", "epoch_start_callback": "train epoch start",
         "skip": "epoch 0"}


@pytest.mark.parametrize("where, rank, layout, warns", CASES, ids=[f"{w}-{r}-{n}" for w, r, n, _ in CASES])
def test_a_stop_set_on_one_rank_stops_every_rank_where_one_process_stops(where, rank, layout, warns):
    one_weights, one_step, one_epoch, one_warned = _fit(where, rank, "one process")
    assert one_step == ONE_STEPS.get(where, 3) and not one_warned  # of 16: early (a skip: 2 less)
    weights, step, epoch, warned = _fit(where, rank, layout)
    assert (step, epoch) == (one_step, one_epoch)
    assert (weights - one_weights).abs().max() < 1e-12
    assert len(warned) == (1 if warns else 0), warned  # once, on rank 0, whichever rank set it
    said = f"({WHERE.get(where, 'train batch end')}, global step {2 if where == 'skip' else step})"
    assert not warns or said in warned[0], (said, warned)


class _CopiedMidFit(MNISTClassifier):
    """Copies itself while the vote wraps its hooks (an EMA teacher, a module saved whole), and looks whether
    the wrappers are gone once the fit ends; plain results, which come back to the main process."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []
        self.left_wrapped: list[str] = ["not looked"]
        self.wrapped_batch_start = False

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx == 1 and not self.copies:
            for how, copy_of in (("deepcopy", copy.deepcopy), ("pickle", lambda m: pickle.loads(pickle.dumps(m)))):
                other = copy_of(self)
                hook = other.on_train_batch_end
                self.copies.append(f"{how}: {hook.func.__name__ if isinstance(hook, functools.partial) else hook}, "
                                   f"bound to the copy: {hook.args[0] is other}")

    def on_train_batch_start(self, batch, batch_idx):  # overridden: wrapped too (it may return -1)
        self.wrapped_batch_start = "on_train_batch_start" in self.__dict__

    def on_fit_end(self):
        self.left_wrapped = [name for name in _WRAPPED if name in self.__dict__]


def test_a_module_copied_while_the_ranks_vote_gets_its_own_hooks_and_the_fit_leaves_none_wrapped():
    make, devices, dp = LAYOUTS["ddp"]
    _, model = fit_seeded(_CopiedMidFit, make(), devices, GLOBAL_BATCH // dp)
    assert model.copies == ["deepcopy: on_train_batch_end, bound to the copy: True",
                            "pickle: on_train_batch_end, bound to the copy: True"]
    assert model.left_wrapped == [] and model.wrapped_batch_start


class _SlowLogger(Logger):
    """Rank 0's logging of step 2 takes 0.3 s, past the validation interval (0.2 s), between the ranks' last
    collective of the batch and the loop's look at the clock: before 2026-12-06 rank 0 validated after that
    batch and rank 1 did not."""

    name, version = "slow", 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        if step == 2 and rank_zero_only.rank == 0:
            time.sleep(0.3)


class _RecordsValidations(MNISTClassifier):
    """Records the global steps this rank validated at and, at the fit's end, what every data-parallel rank
    recorded (their count and sum, gathered)."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam", lr=0.01)
        self.validated: list[int] = []
        self.every_ranks: list[list[int]] = []

    def on_validation_start(self):
        self.validated.append(self.global_step)

    def on_train_end(self):
        mine = torch.tensor([len(self.validated), sum(self.validated)])
        self.every_ranks = self.all_gather(mine).reshape(-1, 2).tolist() if self.trainer.world_size > 1 else []


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_a_time_based_validation_interval_validates_every_rank_after_the_same_batch(layout):
    def fit(strategy, devices, dp):
        return fit_seeded(_RecordsValidations, strategy, devices, GLOBAL_BATCH // dp, ref=devices == 1,
                          samples=GLOBAL_BATCH * 8, validate=True, limit_val_batches=1, num_sanity_val_steps=0,
                          val_check_interval={"milliseconds": 200}, logger=_SlowLogger(), log_every_n_steps=1)

    one, one_model = fit("auto", 1, 1)
    make, devices, dp = LAYOUTS[layout]
    t, model = fit(make(), devices, dp)
    # one process validates once, after the batch its slow logging ended past the interval; every rank validates
    # once, after the next batch (the first vote to see the interval passed: rank 0's clock), at the same step
    assert one_model.validated == [3] and model.validated == [4], (one_model.validated, model.validated)
    assert model.every_ranks == [[1, 4]] * dp
    assert t.global_step == one.global_step == 8
