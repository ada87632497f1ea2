"""``trainer.should_stop`` set on some ranks only stops every rank where one process stops.

A decision from a rank's own values (its loss, its clock) comes on some ranks only. Before 2026-12-06 the ranks
went different ways -- the stopping one to the validation and epoch-end hooks before a stop, the others to their
next step -- and the run failed with a ``CollectiveMismatchError`` (Lightning's ``ddp`` waits there until its
timeout). Each test here sets the flag on one rank only, at each place a program sets it, and compares with one
process setting it at the same point.
"""

from __future__ import annotations

import copy
import functools
import pickle
import warnings

import lightning.pytorch as pl
import pytest

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, flat_params

WARNED = "trainer.should_stop was set on some ranks only"


class _StopsOnOneRank(MNISTClassifier):
    """Sets ``trainer.should_stop`` on one rank (``rank``: 0 or the last) at ``where``: the step itself, the
    module's batch or epoch end, or (by the callback below) validation's end."""

    def __init__(self, where: str, rank: str) -> None:
        super().__init__(optimizer="adam", lr=0.01)
        self.where, self.rank = where, rank
        self.warned: list[str] = []  # what rank 0 was warned of (comes back to the main process)

    def on_train_start(self):
        self._recording = warnings.catch_warnings(record=True)  # the workers' warnings never reach pytest's
        self._records = self._recording.__enter__()
        warnings.simplefilter("always")

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


class _StopsAtValidationEnd(pl.Callback):
    def on_validation_end(self, trainer, pl_module):
        if pl_module.where == "validation_end" and not trainer.sanity_checking and pl_module._mine():
            trainer.should_stop = True


def _fit(where: str, rank: str, layout: str):
    make, devices, dp = (lambda: "auto", 1, 1) if layout == "one process" else LAYOUTS[layout]
    # 4 epochs of 4 batches: each place stops the run early, before its end
    t, model = fit_seeded(lambda: _StopsOnOneRank(where, rank), make(), devices, GLOBAL_BATCH // dp,
                          ref=layout == "one process", samples=GLOBAL_BATCH * 4, validate=where == "validation_end",
                          max_epochs=4, limit_val_batches=1, callbacks=[_StopsAtValidationEnd()])
    return flat_params(model), t.global_step, t.current_epoch, model.warned


# (where the flag is set, on which rank, layout, warned): a pipeline's stages share what its step set (the last
# stage runs the loss and broadcasts the step's outcome), so its step's stop is every rank's -- no warning there
CASES = [("batch_end", "first", name, True) for name in ("ddp", "fsdp", "tp2", "pp2-1f1b", "dp2xpp2-shard")] + [
    ("training_step", "last", "ddp", True), ("training_step", "last", "pp2-1f1b", False),
    ("training_step", "last", "dp2xpp2-shard", True), ("epoch_end", "first", "ddp", True),
    ("epoch_end", "last", "pp2-1f1b", True), ("validation_end", "last", "ddp", True),
    ("validation_end", "first", "dp2xpp2-shard", True)]


@pytest.mark.parametrize("where, rank, layout, warns", CASES, ids=[f"{w}-{r}-{n}" for w, r, n, _ in CASES])
def test_a_stop_set_on_one_rank_stops_every_rank_where_one_process_stops(where, rank, layout, warns):
    one_weights, one_step, one_epoch, one_warned = _fit(where, rank, "one process")
    assert one_step == {"epoch_end": 4, "validation_end": 4}.get(where, 3) and not one_warned  # of 16: early
    weights, step, epoch, warned = _fit(where, rank, layout)
    assert (step, epoch) == (one_step, one_epoch)
    assert (weights - one_weights).abs().max() < 1e-12
    assert len(warned) == (1 if warns else 0), warned  # once, on rank 0, whichever rank set it
    label = {"epoch_end": "train epoch end", "validation_end": "validation end"}.get(where, "train batch end")
    assert not warns or f"({label}, global step {step})" in warned[0]


class _CopiedMidFit(MNISTClassifier):
    """Copies itself while the vote wraps its hooks (an EMA teacher, a module saved whole), and looks whether
    the wrappers are gone once the fit ends; plain results, which come back to the main process."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []
        self.left_wrapped: list[str] = ["not looked"]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx == 1 and not self.copies:
            for how, copy_of in (("deepcopy", copy.deepcopy), ("pickle", lambda m: pickle.loads(pickle.dumps(m)))):
                other = copy_of(self)
                hook = other.on_train_batch_end
                self.copies.append(f"{how}: {hook.func.__name__ if isinstance(hook, functools.partial) else hook}, "
                                   f"bound to the copy: {hook.args[0] is other}")

    def on_fit_end(self):
        self.left_wrapped = [name for name in ("on_train_batch_end", "on_train_epoch_end") if name in self.__dict__]


def test_a_module_copied_while_the_ranks_vote_gets_its_own_hooks_and_the_fit_leaves_none_wrapped():
    make, devices, dp = LAYOUTS["ddp"]
    _, model = fit_seeded(_CopiedMidFit, make(), devices, GLOBAL_BATCH // dp)
    assert model.copies == ["deepcopy: on_train_batch_end, bound to the copy: True",
                            "pickle: on_train_batch_end, bound to the copy: True"]
    assert model.left_wrapped == []
