"""The ranks computing one model replica -- tensor-parallel members and pipeline stages -- must compute
on the same input.

Each rank of a tp group holds a slice of every planned layer, and the sampler gives every rank of
the group the same indices. If each rank loaded its batch itself and the data pipeline draws its
randomness per rank -- Lightning's ``seed_everything(workers=True)`` seeds each rank's loader
workers with its global rank -- the two halves of a column layer would see differently augmented
images and the row layer would add up their partial sums: training goes on, silently wrong. A
pipeline's first stage takes the input from its batch and the last computes the loss on the targets
of its own: a random mask (masked language modelling), a mixup or a crop applied to inputs and targets
together would pair one rank's inputs with another's targets. ``tp_batch=...`` (named before stages
used it) chooses how the rule is held over the replica's ranks (``ParallelGroups.replica``):

* ``"auto"`` (default): ``"split"`` for loaders where that is exact, else ``"broadcast"``;
* ``"split"``: each member loads only its share of the rows and the shares are all-gathered
  (:mod:`lightning_shm.parallel.tp.loading`): every sample is loaded once, by one member;
* ``"broadcast"``: every member loads the whole batch, then gets member 0's tensors
  (:func:`broadcast_from_first`, Megatron's ``broadcast_data``);
* ``"check"``: every member all-gathers a fingerprint of its batch (two float64 sums per tensor,
  ``[W, 2k]``) and all members raise together if they differ (:func:`check_same`);
* ``"off"``: trust the data.

Each is a synchronisation per batch (the faster rank waits for the slower one's loading);
``"split"`` also divides the loading work by the group size.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_shm.runtime import Group

MODES = ("auto", "split", "broadcast", "check", "off")


def fingerprint(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Two float64 sums per tensor, the second over every 7th element: equal on two ranks for equal tensors."""
    parts = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        parts += [flat.sum(dtype=torch.float64), flat[::7].sum(dtype=torch.float64)]  # order-sensitive enough
    return torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64)


def check_same(tensors: Sequence[torch.Tensor], group: Group) -> None:
    """Raise ``ValueError`` on every member if the members' ``tensors`` differ (by fingerprint)."""
    prints = group.all_gather(fingerprint(tensors))  # [W, 2 * len(tensors)]
    ref = prints[0]
    for member in range(1, prints.shape[0]):
        if not torch.allclose(prints[member], ref, rtol=1e-9, atol=1e-9):
            raise ValueError(
                f"the ranks of a model replica (tp members, pipeline stages) received different batches: member "
                f"{member}'s tensor sums {prints[member].tolist()} vs member 0's {ref.tolist()}. A data pipeline "
                "seeded per rank (seed_everything(workers=True) seeds loader workers by global rank) gives them "
                "different random augmentations. Pass tp_batch='broadcast' to compute on member 0's "
                "batch on every rank, or make the pipeline rank-independent.")


def broadcast_from_first(tensors: Sequence[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """Member 0's ``tensors`` on every member, as new tensors (a loader may hand out views of its dataset)."""
    return [group.broadcast(t if group.index == 0 else t.clone(), src_member=0) for t in tensors]
