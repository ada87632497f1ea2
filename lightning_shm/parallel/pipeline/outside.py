"""Parameters outside the pipelined ``nn.Sequential``: a copy on every stage, one gradient for all.

Only the Sequential is cut into stages; everything else the module holds -- an input scale, an
embedding the step applies before the Sequential, a head or a learned temperature after it -- stays
on every stage, and the step uses it where its code runs: before the Sequential on the first stage
(which captures the Sequential's input), after it on the last (which computes the loss). Each stage
therefore sees only part of such a parameter's gradient (none, the part from its own use, or -- for
one used on both sides -- a share of it). Trained on those parts the copies drift apart, and the
checkpoint takes one of them (the last stage's: an input scale there never trained).

So the parts are summed over the pipeline group before the optimizer step, as Megatron sums the
gradients of an embedding tied between its first and last stage::

    stage s:  g_s = this stage's gradient of p (zeros where the step did not use p here)
    all-reduce(sum) over the pp group:  every stage's p.grad = sum_s g_s  -> identical updates

A parameter no stage used in the step (an auxiliary head every other step, a decoder only
``predict_step`` calls) keeps None, as in one process, whose optimizer skips it -- with zeros AdamW
would still decay it. Whether each stage used each parameter rides in the same all-reduce.

Weights tied between two layers *of* the Sequential that sit on different stages -- GPT-2's embedding and
head at its two ends, which no cut can keep together -- are summed the same way, but only over the stages
holding them (Megatron's embedding group)::

    P=4, embedding on stage 0 tied to the head on stage 3:
      stages 0, 1, 2, 3:  all-reduce of the outside parameters' gradients (if any) over the pp group
      stages 0 and 3:     all-reduce of the tie's gradient over the group {0, 3}; stages 1, 2 take no part

Where every stage holds the tie (P=2) it rides in the pp group's all-reduce: one collective, not two.

Cost: the bytes of the outside gradients per step on every stage, of a tie's on its holders; a model with
large modules outside its Sequential (an embedding table) pays it -- put them in the Sequential to give them
to one stage.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
from torch import nn

from lightning_shm.parallel.sequential import held_outside
from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason

_HOLDERS = barrier_reason("which stages hold each parameter tied across stages")

Holders = tuple[int, ...]  # the members of the pipeline group holding a tied weight, ascending


def held_apart(ties: Sequence[nn.Parameter], stage: nn.Module, group: Group) -> list[tuple[nn.Parameter, Holders]]:
    """Of ``ties`` (the Sequential's tied weights, the same list on every stage, taken before the cut), those
    held by several stages of ``group``, each with the members holding it (a collective over the pipeline
    group; the same list on every stage)."""
    if not ties:
        return []
    mine = {id(p) for p in stage.parameters()}
    held = [id(p) in mine for p in ties]
    columns = zip(*group.all_gather_object(held, _HOLDERS))
    holders = [tuple(i for i, h in enumerate(column) if h) for column in columns]
    return [(p, h) for p, h in zip(ties, holders) if len(h) > 1]


class OutsideParameters:
    """The parameters of ``module`` that the pipeline ``stage`` does not hold, and the sum over ``group``
    (the pipeline group) of the gradients of those that require one. Every stage constructs it alike.

    ``apart``: weights tied between layers that sit on several stages (:func:`held_apart`), summed over their
    holders: in ``group``'s all-reduce where every stage holds them, else over ``tie_groups[holders]`` (the
    group of those members; each rank passes the ones it belongs to)."""

    def __init__(self, module: nn.Module, stage: nn.Module, group: Group,
                 apart: Sequence[tuple[nn.Parameter, Holders]] = (),
                 tie_groups: Optional[Mapping[Holders, Group]] = None) -> None:
        # also a stage layer's parameter a module outside holds (GPT-2's input embedding tied to the last layer)
        # or the module keeps under another name (self.classifier = self.net[-1]): every stage has it then.
        # In the order of those outside names, which every stage shares (its own names may differ: the stage
        # holding the layer names it after the layer): the all-reduce below is positional
        elsewhere = held_outside(module, stage)
        order = {pid: i for i, pid in enumerate(elsewhere)}
        outside = sorted(((n, p) for n, p in module.named_parameters() if id(p) in elsewhere),
                         key=lambda t: order[id(t[1])])
        self.names = [n for n, _ in outside]
        self.params = [p for _, p in outside]
        self.stages_holding = {n: group.size for n in self.names}
        # this rank's name of each tied weight its stage holds (in the order of ``apart``, which every holder shares)
        local = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            local.setdefault(id(p), n)
        everywhere = tuple(range(group.size))
        self.apart: list[nn.Parameter] = []  # tied across every stage: summed with the outside parameters
        self.ties: dict[Holders, list[nn.Parameter]] = {}  # tied across some: summed over their holders' group
        for p, holders in apart:
            if id(p) not in local or id(p) in elsewhere:
                continue
            self.names.append(local[id(p)])
            self.stages_holding[local[id(p)]] = len(holders)
            if holders == everywhere:
                self.apart.append(p)
            else:
                self.ties.setdefault(holders, []).append(p)
        self.tie_groups = {h: (tie_groups or {})[h] for h in sorted(self.ties)}  # one order on every rank
        self.group = group

    def sum_grads(self) -> None:
        """Every stage's ``p.grad`` becomes the sum of the stages' gradients (one collective per dtype and
        group). Which outside parameters require a gradient is read now: a callback may (un)freeze them on
        every stage."""
        # a tied weight's entry is there on every holder whatever its requires_grad: frozen, it has no gradient
        _sum_over(self.group, [p for p in self.params if p.requires_grad] + self.apart)
        for holders, group in self.tie_groups.items():  # in sorted order everywhere: overlapping groups cannot wait
            _sum_over(group, self.ties[holders])         # on each other


def _sum_over(group: Group, params: list[nn.Parameter]) -> None:
    """``p.grad`` = the sum over ``group`` of its members' ``p.grad`` (None counted as zeros; one that is None on
    every member stays None). One all-reduce per dtype: the gradients flattened, then a used flag per parameter."""
    if not params or group.size == 1:
        return
    for dtype in sorted({p.dtype for p in params}, key=str):
        same = [p for p in params if p.dtype == dtype]
        used = torch.tensor([float(p.grad is not None) for p in same], dtype=dtype)
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype)
                          for p in same] + [used])
        group.all_reduce(flat, "sum")
        offset = 0
        for p, anywhere in zip(same, flat[-len(same):].tolist()):
            if anywhere > 0:  # else no member used it: None, as in one process (AdamW would decay it)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
