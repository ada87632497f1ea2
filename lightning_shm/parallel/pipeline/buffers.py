"""Buffers a chunk's forward updates in place, run once more under activation checkpointing.

A checkpointed chunk runs its forward twice: without a graph in F, again with one in B. A layer that updates
a buffer as it runs would, without care, update it twice, and compute the second time from the updated
values, where one process updates it once: BatchNorm's running statistics drift towards each batch twice as
fast and ``num_batches_tracked`` counts double; spectral_norm's power iteration steps twice, and the
recomputed weight -- normalised with the advanced vector -- is not the one forward used (the gradients belong
to another weight). So F keeps the values of the buffers its forward updates from before it, and B runs the
recomputation from those and puts the buffers back as it found them after its backward::

    F (no graph):   kept = clone(watched buffers) -> forward -> updated = those that changed
    B (recompute):  now = clone(updated) -> updated.copy_(kept) -> forward with graph -> backward
                    -> updated.copy_(now)

Which buffers change is learned per chunk: the first checkpointed forward keeps every buffer, later ones
those seen to change so far (a buffer first changed later is put back after the recomputation, not rewound
before it). "Changed": its version counter moved, or it is a norm layer's running statistic in training mode --
torch's batch-norm kernels update ``running_mean`` / ``running_var`` without moving the counter. Putting back
waits for backward: a BatchNorm's backward checks the statistics it saved are unchanged. A buffer the forward
*reassigns* (``self.count = self.count + 1``) is not seen; torch's layers update theirs in place.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


class ForwardBuffers:
    """Around one checkpointed forward of ``module``: the buffers it updates, with their values from before it.
    ``watched``: ids of the buffers to keep (None: all of them)."""

    def __init__(self, module: nn.Module, watched: Optional[set[int]]) -> None:
        found = list(module.buffers())
        self.versions = [(b, b._version) for b in found]
        self.norms = [b for m in module.modules() if isinstance(m, _NormBase) and m.training
                      for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
        ids = {id(b) for b in self.norms} | (watched if watched is not None else {id(b) for b in found})
        with torch.no_grad():
            self.before = {id(b): b.clone() for b in found if id(b) in ids}

    def updated(self) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """After the forward: each buffer it updated, with its value from before (None where not kept)."""
        seen = {id(b) for b in self.norms}
        changed = self.norms + [b for b, v in self.versions if b._version != v and id(b) not in seen]
        return [(b, self.before.get(id(b))) for b in changed]


def rewound(updated: list[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The buffers set to their values from before the forward, for the recomputation; returns their values
    now, for :func:`put_back` after its backward."""
    with torch.no_grad():
        now = [(b, b.clone()) for b, _ in updated]
        for b, before in updated:
            if before is not None:
                b.copy_(before)
    return now


def put_back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The values :func:`rewound` returned, back in their buffers -- after backward: a BatchNorm's backward reads
    the running statistics it was given (autograd checks they were not changed in between)."""
    with torch.no_grad():
        for b, values in saved:
            b.copy_(values)
