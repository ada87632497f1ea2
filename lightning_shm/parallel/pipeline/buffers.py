"""Buffers a chunk's forward updates in place, run once more under activation checkpointing.

A checkpointed chunk runs its forward twice: without a graph in F, again with one in B. A layer that updates
a buffer as it runs -- BatchNorm's running mean, variance and batch count, a custom running statistic --
would update it twice, where one process updates it once (BatchNorm's statistics then drift towards each
batch twice as fast, and ``num_batches_tracked`` counts double). So F notes which buffers its forward
changed in place, and B saves those before the recomputation and puts them back after::

    F (no graph):   versions of chunk.buffers() -> forward -> changed = those whose version moved,
                    and the running statistics of its norm layers in training mode
    B (recompute):  saved = clone(changed) -> forward with graph -> backward -> changed.copy_(saved)

The norm layers are named because torch's batch-norm kernels update ``running_mean`` / ``running_var``
without moving their version counters (only ``num_batches_tracked``, updated in Python, moves).

The recomputation's outputs are unaffected: a training-mode BatchNorm normalises with the batch's own
statistics, never the running ones. A buffer the forward *reassigns* (``self.count = self.count + 1``)
is not seen; torch's layers update theirs in place.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase


class BufferVersions:
    """A module's buffers as a forward is about to run, to say after it which ones it updated."""

    def __init__(self, module: nn.Module) -> None:
        self.before = [(b, b._version) for b in module.buffers()]
        self.norms = [b for m in module.modules() if isinstance(m, _NormBase) and m.training
                      for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]

    def changed(self) -> list[torch.Tensor]:
        seen = {id(b) for b in self.norms}
        return self.norms + [b for b, v in self.before if b._version != v and id(b) not in seen]


def kept(buffers: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer with a copy of its values now, before the recomputation."""
    with torch.no_grad():
        return [(b, b.clone()) for b in buffers]


def put_back(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The values :func:`kept` copied, back in their buffers -- after backward: a BatchNorm's backward reads the
    running statistics it was given (autograd checks they were not changed in between)."""
    with torch.no_grad():
        for b, values in saved:
            b.copy_(values)
