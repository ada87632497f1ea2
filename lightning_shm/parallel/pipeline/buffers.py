"""Buffers a chunk's forward updates in place, run once more under activation checkpointing.

A checkpointed chunk runs its forward twice: without a graph in F, again with one in B. A layer that updates
a buffer as it runs would, without care, update it twice, and compute the second time from the updated
values, where one process updates it once: BatchNorm's running statistics drift towards each batch twice as
fast and ``num_batches_tracked`` counts double; spectral_norm's power iteration steps twice, and the
recomputed weight -- normalised with the advanced vector -- is not the one forward used (the gradients belong
to another weight). And a later microbatch's forward may move a buffer this one only read before this
one's recomputation. So F keeps the buffers' values from when it began, and B rewinds to them whatever has
changed since, runs the recomputation, and puts the buffers back as it found them after its backward::

    F (no graph):   kept = clone(watched buffers), versions -> forward
    B (recompute):  changed = buffers changed since F began (by it or a later forward of the chunk)
                    now = clone(changed) -> changed.copy_(kept) -> forward with graph -> backward
                    -> changed.copy_(now)

Which buffers to keep is learned per chunk: the first checkpointed forward keeps every buffer, later ones
those seen to change so far and every small one (up to ``SMALL_BYTES``: a counter, a running statistic, a
power-iteration vector), so one first changed after a warm-up is rewound too. A large buffer (a mask, a
table) first changed later is not rewound for the microbatches in flight then, only put back after them.
"Changed": its version counter moved, or it is a norm layer's running statistic in training mode -- torch's
batch-norm kernels update ``running_mean`` / ``running_var`` without moving the counter. Putting back waits for
backward: a BatchNorm's backward checks the statistics it saved are unchanged. A buffer *reassigned*
(``self.mean = 0.9 * self.mean + 0.1 * x.mean()``, as a custom normaliser may) needs no copy: the module
is given back the tensor it held when the forward began for the recomputation, and the one it holds now
after it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

SMALL_BYTES = 1 << 16  # buffers up to this size are kept before every checkpointed forward, changed yet or not


class Updates(NamedTuple):
    """Buffers changed since a forward began: in place, or reassigned."""

    in_place: list[tuple[torch.Tensor, Optional[torch.Tensor]]]  # buffer, its value before (None: not kept)
    reassigned: list[tuple[nn.Module, str, Optional[torch.Tensor]]]  # module, buffer name, its tensor before


class ForwardBuffers:
    """Around one checkpointed forward of ``module``: the buffers as it began, to rewind the recomputation to.
    ``watched``: ids of the buffers to keep a copy of, besides the small ones (None: all of them)."""

    def __init__(self, module: nn.Module, watched: Optional[set[int]]) -> None:
        self.held = [(m, name, b) for m in module.modules() for name, b in m.named_buffers(recurse=False)]
        found = list({id(b): b for _, _, b in self.held}.values())
        self.versions = [(b, b._version) for b in found]
        self.norms = [b for m in module.modules() if isinstance(m, _NormBase) and m.training
                      for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
        ids = {id(b) for b in self.norms} | (watched if watched is not None else {id(b) for b in found})
        ids |= {id(b) for b in found if b.numel() * b.element_size() <= SMALL_BYTES}
        with torch.no_grad():
            self.before = {id(b): b.clone() for b in found if id(b) in ids}

    def changed(self) -> Updates:
        """Each buffer changed since the forward began, with its value from then (None where not kept), and each
        reassigned. Right after the forward: what it updated. Before the recomputation: also what the chunk's
        later forwards updated (a buffer this forward only read, which a later microbatch moved)."""
        seen = {id(b) for b in self.norms}
        changed = self.norms + [b for b, v in self.versions if b._version != v and id(b) not in seen]
        return Updates([(b, self.before.get(id(b))) for b in changed],
                       [(m, name, b) for m, name, b in self.held if getattr(m, name) is not b])


def rewound(updated: Updates) -> Updates:
    """The buffers set to their values from when the forward began, for the recomputation; returns what they
    hold now, for :func:`put_back` after its backward."""
    with torch.no_grad():
        now = Updates([(b, b.clone()) for b, _ in updated.in_place],
                      [(m, name, getattr(m, name)) for m, name, _ in updated.reassigned])
        for b, before in updated.in_place:
            if before is not None:
                b.copy_(before)
    for m, name, before in updated.reassigned:
        setattr(m, name, before)
    return now


def put_back(saved: Updates) -> None:
    """What :func:`rewound` returned, back in the buffers -- after backward: a BatchNorm's backward reads the
    running statistics it was given (autograd checks they were not changed in between)."""
    with torch.no_grad():
        for b, values in saved.in_place:
            b.copy_(values)
    for m, name, tensor in saved.reassigned:
        setattr(m, name, tensor)
