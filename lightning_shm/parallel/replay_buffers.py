"""Buffers a forward updates in place, kept as the forward found them for its replay in backward.

Activation checkpointing runs a forward twice: once as the step goes, again in backward to rebuild the graph
(a pipeline chunk, :mod:`.pipeline.engine`; an instance of a class the user named, :mod:`.checkpointing`). A
layer that updates a buffer as it runs would, without care, update it twice, and compute the second time from
the updated values, where one process updates it once: BatchNorm's running statistics drift towards each batch
twice as fast and ``num_batches_tracked`` counts double; spectral_norm's power iteration steps twice, and the
recomputed weight -- normalised with the advanced vector -- is not the one forward used (the gradients belong
to another weight). And a later forward (the next microbatch, a module applied twice) may move a buffer this
one only read before this one's replay. So the forward keeps the buffers' values from when it began, and the
replay runs on stand-ins holding them; the module's own buffers are not touched::

    forward:  kept = clone(watched buffers), versions -> forward (updates the buffers once)
    replay:   changed = buffers changed since the forward began (by it or a later forward)
              each changed one -> a copy of its kept value (in place) or the tensor it held then (reassigned)
              -> forward with graph (updates, and autograd saves, the stand-ins) -> the module's own back
              -> backward (reads what it saved: the stand-ins, never written again)

Which buffers to keep is learned per forward site: the first checkpointed forward keeps every buffer, later
ones those seen to change so far and every small one (up to ``SMALL_BYTES``: a counter, a running statistic, a
power-iteration vector), so one first changed after a warm-up is kept too. A large buffer (a mask, a table)
first changed later is not kept for the forwards in flight then: its replay reads its current value.
"Changed": its version counter moved, or it is a norm layer's running statistic in training mode -- torch's
batch-norm kernels update ``running_mean`` / ``running_var`` without moving the counter. A buffer *reassigned*
(``self.mean = 0.9 * self.mean + 0.1 * x.mean()``, as a custom normaliser may) needs no copy: the replay is
given the tensor the module held when the forward began.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

SMALL_BYTES = 1 << 16  # buffers up to this size are kept before every checkpointed forward, changed yet or not


class Updates(NamedTuple):
    """Buffers changed since a forward began: in place, or reassigned."""

    in_place: list[tuple[torch.Tensor, Optional[torch.Tensor]]]  # buffer, its value before (None: not kept)
    reassigned: list[tuple[nn.Module, str, Optional[torch.Tensor]]]  # module, buffer name, its tensor before


class ForwardBuffers:
    """Around one checkpointed forward of ``module``: the buffers as it began, for its replay.
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
        reassigned. Right after the forward: what it updated. Before the replay: also what later forwards updated
        (a buffer this forward only read, which a later microbatch moved)."""
        seen = {id(b) for b in self.norms}
        changed = self.norms + [b for b, v in self.versions if b._version != v and id(b) not in seen]
        return Updates([(b, self.before.get(id(b))) for b in changed],
                       [(m, name, b) for m, name, b in self.held if getattr(m, name) is not b])


@contextlib.contextmanager
def replaying(around: ForwardBuffers) -> Iterator[None]:
    """Around a replay of the forward ``around`` watched: each buffer changed since that forward began is
    swapped for a stand-in holding its value from then -- a copy of the kept value (changed in place; one not
    kept reads its current value) or the tensor the module held then (reassigned) -- and the module gets back
    what it holds now as the replay ends. The replay updates the stand-ins, and autograd saves them for the
    backward (a BatchNorm's saves the running statistics it was given): nothing writes them again, so nothing
    needs putting back after the backward, and the module's buffers keep what the step's forwards made them."""
    changed = around.changed()
    with torch.no_grad():
        stand_ins = {id(b): before.clone() for b, before in changed.in_place if before is not None}
    now: list[tuple[nn.Module, str, torch.Tensor]] = []
    for m, name, b in around.held:
        if getattr(m, name) is b and id(b) in stand_ins:
            now.append((m, name, b))
            setattr(m, name, stand_ins[id(b)])
    for m, name, before in changed.reassigned:
        now.append((m, name, getattr(m, name)))
        setattr(m, name, before)
    try:
        yield
    finally:
        for m, name, tensor in reversed(now):
            setattr(m, name, tensor)
