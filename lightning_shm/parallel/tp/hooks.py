"""The model's forward hooks on a layer tensor parallelism splits see the tensors one process would.

A column layer's output, a row layer's input and the features of a norm between them are this rank's
slice. A forward hook the model put on such a layer -- keeping an activation for a loss (a feature
penalty, distillation) or statistics to log -- saw the slice: a mean over half the features, another
value on every rank (0.059 off one process after 5 steps under tp2, a penalty on ``fc1``'s output).
So each hook is wrapped where it sits in the layer's hook dict (a handle the model kept still removes
it): the split tensors are all-gathered along the split dimension before the hook sees them, and a
tensor the hook returns in their place is cut back to this rank's slice::

    column layer     hook(m, args, out)     out      [B, H_r] -> [B, H]   (its input is whole already; of a
                                                     fused one, [B, 3 H_r] -> [B, 3 H]: q, k and v each gathered)
    row layer        pre-hook(m, args)      args[0]  [B, H_r] -> [B, H]   hook(m, args, out): args[0] too
    norm between     both                   args[0] and out
    (conv layers, BatchNorm, InstanceNorm, GroupNorm: the channel dimension, 1; Linear and LayerNorm: the last)

The gather's backward keeps this rank's slice of the gradient (:func:`~.mappings.gather_from_tp`): every
tp rank runs the same hooks on the same batch, so a loss on the whole tensor is the same on each. Every
member gathers, in the same order: hooks must be registered alike on every rank, as the model is built.
Hooks registered on the original layer after the plan is applied run unwrapped.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_shm.parallel.tp.mappings import gather_from_tp
from lightning_shm.runtime import Group


class _Slices:
    """This rank's slice of a split dimension and its gather; ``blocks``: the dimension is that many equal parts,
    the rank's slice of each side by side (a fused q, k, v projection's output)."""

    def __init__(self, group: Group, sizes: Sequence[int], dim: int, blocks: int = 1) -> None:
        self.group, self.sizes, self.dim, self.blocks = group, tuple(sizes), dim, blocks
        self.lo, self.n = sum(sizes[:group.index]), sizes[group.index]

    def _sized(self, t: Any, n: int) -> bool:
        return isinstance(t, torch.Tensor) and -t.dim() <= self.dim < t.dim() and t.shape[self.dim] == self.blocks * n

    def whole(self, t: Any) -> Any:
        if not self._sized(t, self.n):
            return t
        parts = t.movedim(self.dim, -1).unflatten(-1, (self.blocks, self.n))  # [..., blocks, n]
        return gather_from_tp(parts, self.group, self.sizes).flatten(-2).movedim(-1, self.dim)

    def mine(self, t: Any) -> Any:
        if not self._sized(t, sum(self.sizes)):
            return t
        parts = t.movedim(self.dim, -1).unflatten(-1, (self.blocks, sum(self.sizes)))
        return parts.narrow(-1, self.lo, self.n).flatten(-2).movedim(-1, self.dim)

    def first_whole(self, args: tuple) -> tuple:
        return (self.whole(args[0]),) + tuple(args[1:]) if args else args

    def first_mine(self, args: Any) -> Any:
        if isinstance(args, tuple):
            return (self.mine(args[0]),) + args[1:] if args else args
        return self.mine(args)  # a pre-hook may return the single new input


def _pre_hook(hook: Callable, s: _Slices, with_kwargs: bool) -> Callable:
    @functools.wraps(hook)
    def wrapped(module: nn.Module, args: tuple, *kwargs: Any) -> Any:
        out = hook(module, s.first_whole(args), *kwargs)
        if out is None:
            return None
        if with_kwargs:
            new_args, new_kwargs = out
            return s.first_mine(new_args), new_kwargs
        return s.first_mine(out)

    return wrapped


def _hook(hook: Callable, inputs: _Slices | None, output: _Slices | None) -> Callable:
    @functools.wraps(hook)
    def wrapped(module: nn.Module, args: tuple, *rest: Any) -> Any:
        *kwargs, out = rest
        seen_args = inputs.first_whole(args) if inputs is not None else args
        seen_out = output.whole(out) if output is not None else out
        new = hook(module, seen_args, *kwargs, seen_out)
        return output.mine(new) if new is not None and output is not None else new

    return wrapped


def whole_tensors_for_hooks(layer: nn.Module, group: Group, sizes: Sequence[int], dim: int, inputs_split: bool,
                            output_split: bool, blocks: int = 1) -> None:
    """Wrap ``layer``'s forward (pre-)hooks, in place in its hook dicts, so that they see whole tensors where the
    layer's input (``inputs_split``) or output (``output_split``) is this rank's slice along ``dim`` (of each of
    ``blocks`` parts)."""
    s = _Slices(group, sizes, dim, blocks)
    if inputs_split:
        for key, hook in list(layer._forward_pre_hooks.items()):
            layer._forward_pre_hooks[key] = _pre_hook(hook, s, key in layer._forward_pre_hooks_with_kwargs)
    for key, hook in list(layer._forward_hooks.items()):
        layer._forward_hooks[key] = _hook(hook, s if inputs_split else None, s if output_split else None)
