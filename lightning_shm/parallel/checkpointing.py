"""Activation checkpointing by module class: each instance keeps only its inputs in forward and runs again in
backward -- what Lightning's ``FSDPStrategy(activation_checkpointing_policy={Block})`` asks for, under every layout.

Why the instance's ``forward`` and not a wrapper module (torch's ``CheckpointWrapper``): a wrapper renames the
parameters (``..._checkpoint_wrapped_module...``), and with them the checkpoint's keys, the FSDP units and the
tensor-parallel plan's paths; replacing ``forward`` on the instance keeps the module tree as the user built it.
It is put on last (after the tensor-parallel layers replaced the plain ones, the FSDP units and the pipeline's
patches took their places), so the forward it replays is the one that runs, and taken off at teardown.

Data movement, one instance in a training step::

    forward:   y = forward(x) under torch.utils.checkpoint (non-reentrant): keeps x and the random state,
               not the activations inside; copies of the instance's small and changing buffers
    backward:  forward(x) again from that random state (the same dropout masks; a tensor-parallel split
               region seeds its own stream from it, :mod:`.tp.rng`; Python's, numpy's and the generators its
               modules hold too, for a forward that draws from them: :class:`.streams.ReplayStreams`), on
               stand-ins for the buffers the forward changed (:mod:`.replay_buffers`: BatchNorm's statistics
               move once), then the backward through it

Without gradients (evaluation, ``torch.no_grad``) the forward runs as it is.
"""

from __future__ import annotations

from typing import AbstractSet, Any, Callable, Optional

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_shm.parallel import replay_buffers
from lightning_shm.parallel.streams import Drawn, ReplayStreams


def module_classes(value: Any) -> tuple[type, ...]:
    """``value`` as nn.Module classes -- a set, list or tuple of them, or one class --, else ``()``."""
    classes = value if isinstance(value, (AbstractSet, list, tuple)) else [value]
    if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return tuple(classes)
    return ()


class _Recomputed:
    """The instance's ``forward``, replayed in backward on the buffers as the forward found them
    (:mod:`.replay_buffers`): a BatchNorm inside updates its running statistics once per forward, as without
    checkpointing, and a spectral_norm's replay rebuilds the weight the forward used."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self.module, self.forward = module, forward
        self.updating: Optional[set[int]] = None  # ids of the buffers its forwards were seen to update
        self.streams = ReplayStreams(module)  # besides torch's stream, which the checkpoint keeps

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        around = replay_buffers.ForwardBuffers(self.module, self.updating)
        before = self.streams.before_forward()
        drawn: Drawn = []  # what the forward drew from, known once it ran
        calls = 0

        def run(*a: Any, **kw: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward itself
                return self.forward(*a, **kw)
            with replay_buffers.replaying(around), self.streams.replaying(drawn):
                return self.forward(*a, **kw)

        out = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)
        self.updating = (self.updating or set()) | {id(b) for b, _ in around.changed().in_place}
        drawn += self.streams.drawn(before)
        return out


def checkpoint_instances(module: nn.Module, classes: tuple[type, ...]) -> Callable[[], None]:
    """Recompute in backward every instance of ``classes`` in ``module`` that no other selected instance holds
    (one nested in another is replayed with it). Returns what takes it off again. A pipeline stage may hold none
    (the class lives on another stage); that the whole model holds one is checked before the workers start
    (:func:`~lightning_shm.parallel.compose.validate`)."""
    inside: set[int] = set()
    done: list[tuple[nn.Module, Any]] = []
    for _, m in module.named_modules():
        if id(m) in inside or not isinstance(m, classes):
            continue
        inside.update(id(sub) for sub in m.modules())
        done.append((m, vars(m).get("forward")))  # an instance's own forward (a patched one) comes back after
        m.forward = _Recomputed(m, m.forward)

    def undo() -> None:
        for m, own in done:
            if own is None:
                vars(m).pop("forward", None)
            else:
                m.forward = own

    return undo
