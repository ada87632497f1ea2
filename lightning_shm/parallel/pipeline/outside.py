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
head at its two ends, which no cut can keep together -- are summed the same way (Megatron's embedding
group): each holding stage keeps its copy and adds the others' gradient parts; a stage holding none adds
zeros to the positional all-reduce and keeps nothing.

Cost: the bytes of these gradients per step, on every stage; a model with large modules outside its
Sequential (an embedding table) pays it -- put them in the Sequential to give them to one stage.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lightning_shm.parallel.sequential import held_outside
from lightning_shm.runtime import Group


def held_apart(ties: Sequence[nn.Parameter], stage: nn.Module, group: Group) -> list[tuple[nn.Parameter, int]]:
    """Of ``ties`` (the Sequential's tied weights, the same list on every stage, taken before the cut), those
    held by several stages of ``group``, each with how many hold it (a collective over the pipeline group)."""
    if not ties:
        return []
    mine = {id(p) for p in stage.parameters()}
    held = [id(p) in mine for p in ties]
    counts = [sum(column) for column in zip(*group.all_gather_object(held))]
    return [(p, n) for p, n in zip(ties, counts) if n > 1]


class OutsideParameters:
    """The parameters of ``module`` that the pipeline ``stage`` does not hold, and the sum over ``group``
    (the pipeline group) of the gradients of those that require one. Every stage constructs it alike.

    ``apart``: weights tied between layers that sit on several stages (:func:`held_apart`), summed too."""

    def __init__(self, module: nn.Module, stage: nn.Module, group: Group,
                 apart: Sequence[tuple[nn.Parameter, int]] = ()) -> None:
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
        # this rank's name of each tied weight its stage holds; the others' entries are zeros in the all-reduce
        local = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            local.setdefault(id(p), n)
        # a stage holding none of its layers keeps only its size (a meta tensor, whose gradient is None: zeros)
        self.apart = [p if id(p) in local else p.detach().to("meta") for p, _ in apart if id(p) not in elsewhere]
        for p, holders in apart:
            if id(p) in local and id(p) not in elsewhere:
                self.names.append(local[id(p)])
                self.stages_holding[local[id(p)]] = holders
        self.group = group

    def sum_grads(self) -> None:
        """Every stage's ``p.grad`` becomes the sum of the stages' gradients (one collective per dtype).
        Which parameters require a gradient is read now: a callback may (un)freeze them on every stage."""
        # a tied weight's entry is there on every stage whatever its requires_grad: a stage holding none of its
        # layers cannot follow a callback (un)freezing it; frozen, it has no gradient on the stages that hold it
        params = [p for p in self.params if p.requires_grad] + self.apart
        if not params or self.group.size == 1:
            return
        for dtype in sorted({p.dtype for p in params}, key=str):
            same = [p for p in params if p.dtype == dtype]
            used = torch.tensor([float(p.grad is not None) for p in same], dtype=dtype)
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype)
                              for p in same] + [used])
            self.group.all_reduce(flat, "sum")
            offset = 0
            for p, anywhere in zip(same, flat[-len(same):].tolist()):
                # else no stage used it: None, as in one process (AdamW would decay it); a meta stand-in keeps none
                if anywhere > 0 and not p.is_meta:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
