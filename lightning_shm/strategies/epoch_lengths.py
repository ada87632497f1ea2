"""Ranks whose loaders give different numbers of batches: refused at the start of training, and of validation or
test between the ranks of one model replica; data-parallel replicas may evaluate different numbers (without stop
points then, :func:`eval_stop_points`).

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
from typing import Callable, Optional, Sequence

import lightning.pytorch as pl

from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason

_LENGTHS = barrier_reason("the data-parallel ranks' training epoch lengths")
_MEMBERS = barrier_reason("the loop lengths of one model replica's ranks")
_EVAL = barrier_reason("the ranks' validation or test loop lengths")


def _lengths(batches: Sequence[float]) -> tuple[int, ...]:
    return tuple(int(n) if math.isfinite(n) else -1 for n in batches)  # -1: a loader without a length


def check_replica_lengths(loop: str, lengths: tuple[int, ...], replica: Optional[Group],
                          ends_first: Optional[Callable[[int], bool]] = None) -> None:
    """Raise where the ranks of one model replica (tensor-parallel members, pipeline stages) would run different
    numbers of ``loop`` steps: each of their steps exchanges activations, so the one with fewer would leave the
    others waiting in an exchange. Before, a ``CollectiveMismatchError`` naming two collectives said nothing of
    the loader (a module sharding its data by ``global_rank`` under tp or pp). Unknown lengths are not checked,
    nor lengths where ``ends_first(shortest)`` (``max_steps`` ends the fit before the shortest epoch does)."""
    if replica is None or replica.size == 1:
        return
    counts = replica.all_gather_object(lengths, _MEMBERS)
    if any(-1 in c for c in counts) or all(c == counts[0] for c in counts):
        return
    if ends_first is not None and ends_first(min(sum(c) for c in counts)):
        return
    raise ValueError(
        f"the {loop} loader gives the ranks {list(replica.ranks)} of one model replica {[sum(c) for c in counts]} "
        "batches: tensor-parallel members and pipeline stages compute every step together, on one batch, so each "
        "must load as many. Shard the data by trainer.strategy.distributed_sampler_kwargs (num_replicas, rank: the "
        "data-parallel replicas), not by trainer.world_size / global_rank, which count every rank.")


def eval_stop_points(trainer: "pl.Trainer", node: Group, replica: Optional[Group]) -> bool:
    """Whether the validation or test loop starting now may hold stop points (votes of the ``node``'s ranks every
    few steps, :meth:`SHMStrategyBase.stop_point`): only where every rank runs as many steps. Data-parallel
    replicas may run different numbers, as under Lightning's ``ddp`` -- a loader the module shards itself, its
    accuracy gathered by a torchmetrics metric at the epoch's end --; a vote would then meet another collective
    (before: a ``CollectiveMismatchError`` at the shorter rank's end). The members of one replica may not
    (:func:`check_replica_lengths`)."""
    batches = trainer.num_sanity_val_batches if trainer.sanity_checking else \
        trainer.num_test_batches if trainer.testing else trainer.num_val_batches
    lengths = _lengths(batches)
    check_replica_lengths("test" if trainer.testing else "validation", lengths, replica)
    counts = node.all_gather_object(lengths, _EVAL)
    return all(-1 not in c and c == counts[0] for c in counts)


def check_equal_epochs(trainer: "pl.Trainer", group: Optional[Group], replica: Optional[Group] = None) -> None:
    """Raise where the data-parallel ranks of ``group`` would reach the end of their training epochs at different
    steps: their loaders (after ``limit_train_batches``) differ in length, and ``max_steps`` does not end the
    fit first; so too the ranks of one model ``replica`` (:func:`check_replica_lengths`). Loaders without a length
    (an IterableDataset) are not checked."""
    n = trainer.num_training_batches
    check_replica_lengths("training", _lengths([n]), replica, lambda shortest: _ends_first(trainer, shortest))
    if group is None or group.size == 1:
        return
    counts = group.all_gather_object(int(n) if math.isfinite(n) else -1, _LENGTHS)
    if -1 in counts or len(set(counts)) == 1 or _ends_first(trainer, min(counts)):
        return
    raise ValueError(
        f"the training loader gives the data-parallel ranks {counts} batches in epoch {trainer.current_epoch} (in "
        "rank order of the group "
        f"{list(group.ranks)}): every rank must take the same number of steps -- each step averages their "
        "gradients -- and the rank with fewer would end its epoch while the others wait for it in the next step. "
        "A DistributedSampler gives every rank as many samples (Lightning adds one unless "
        "use_distributed_sampler=False); a loader the module shards itself must do the same (equal shares, "
        "drop_last, or limit_train_batches).")


def _ends_first(trainer: "pl.Trainer", shortest: int) -> bool:
    """``max_steps`` ends the fit before the shortest epoch does."""
    return 0 < trainer.max_steps and (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches \
        <= shortest


def check_reloaded_epochs(trainer: "pl.Trainer", group: Optional[Group], replica: Optional[Group] = None) -> None:
    """:func:`check_equal_epochs` at a training epoch's start where the loaders are reloaded every n epochs (the
    fit's first epoch was checked at its start)."""
    if trainer.reload_dataloaders_every_n_epochs and trainer.current_epoch > 0:
        check_equal_epochs(trainer, group, replica)
