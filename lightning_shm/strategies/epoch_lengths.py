"""Data-parallel ranks whose training loaders give different numbers of batches per epoch: refused at the start.

Every data-parallel rank must take the same steps: each step averages their gradients. A DistributedSampler
(which Lightning adds unless ``use_distributed_sampler=False``) pads the ranks' shares to one length; a loader
the module shards itself (a dataset cut by ``self.global_rank``) may not::

    rank 0: 8 batches  ... step 7, epoch ends -> epoch-end hooks, logging, validation
    rank 1: 10 batches ... step 7, step 8     -> the gradient all-reduce: another collective than rank 0's

Lightning's ``ddp`` waits there until its timeout; the runtime stopped with a ``CollectiveMismatchError`` naming
two collectives, not why they differ. Checked when training starts, with one small gather, and again at each
training epoch's start where the loader is reloaded (``reload_dataloaders_every_n_epochs``): a loader the module
builds anew may give the ranks other lengths later (before: the same ``CollectiveMismatchError`` at the reloaded
epoch's end, `/tmp/ph/reload_len.py`, a local script).
"""

from __future__ import annotations

import math
from typing import Optional

import lightning.pytorch as pl

from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason

_LENGTHS = barrier_reason("the data-parallel ranks' training epoch lengths")


def check_equal_epochs(trainer: "pl.Trainer", group: Optional[Group]) -> None:
    """Raise where the data-parallel ranks of ``group`` would reach the end of their training epochs at different
    steps: their loaders (after ``limit_train_batches``) differ in length, and ``max_steps`` does not end the
    fit first. Loaders without a length (an IterableDataset) are not checked."""
    if group is None or group.size == 1:
        return
    n = trainer.num_training_batches
    counts = group.all_gather_object(int(n) if math.isfinite(n) else -1, _LENGTHS)
    if -1 in counts or len(set(counts)) == 1:
        return
    batches_left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
    if 0 < trainer.max_steps and batches_left <= min(counts):
        return  # the fit ends before the shortest epoch does
    raise ValueError(
        f"the training loader gives the data-parallel ranks {counts} batches in epoch {trainer.current_epoch} (in "
        "rank order of the group "
        f"{list(group.ranks)}): every rank must take the same number of steps -- each step averages their "
        "gradients -- and the rank with fewer would end its epoch while the others wait for it in the next step. "
        "A DistributedSampler gives every rank as many samples (Lightning adds one unless "
        "use_distributed_sampler=False); a loader the module shards itself must do the same (equal shares, "
        "drop_last, or limit_train_batches).")


def check_reloaded_epochs(trainer: "pl.Trainer", group: Optional[Group]) -> None:
    """:func:`check_equal_epochs` at a training epoch's start where the loaders are reloaded every n epochs (the
    fit's first epoch was checked at its start)."""
    if trainer.reload_dataloaders_every_n_epochs and trainer.current_epoch > 0:
        check_equal_epochs(trainer, group)
