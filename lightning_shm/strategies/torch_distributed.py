"""Say so when the module's own code asks whether ``torch.distributed`` is running.

The workers communicate through shared memory: ``torch.distributed`` is not initialized in them (on one
node; between nodes the rails are gloo groups of their own, not its default group). Code that gathers
or reduces by itself only when it is -- a contrastive loss gathering the other ranks' embeddings as
negatives (SimCLR, CLIP), a download done by rank 0 only -- then quietly works on this rank's data
alone, where Lightning's ``ddp`` runs it over every rank: measured, a SimCLR-style loss 0.078 off one
process after 4 steps under shm_ddp. Lightning's own calls (``self.all_gather(x, sync_grads=True)``,
``self.trainer.strategy.reduce``) go through our groups. So the first time code outside torch, Lightning,
torchmetrics and lightning_shm calls ``torch.distributed.is_initialized()`` in a worker and gets False,
rank 0 warns, naming the caller and those calls.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

# packages that ask for their own reasons and are served by the strategies' collectives
_OURS = {"torch", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics", "lightning_utilities",
         "lightning_shm", "torchvision"}


def warn_on_user_checks(warn: Callable[[str], None]) -> Callable[[], None]:
    """Replace ``torch.distributed.is_initialized`` by one that calls ``warn`` once for a caller outside
    :data:`_OURS`; returns the function that puts torch's back."""
    dist = torch.distributed
    original = dist.is_initialized
    warned = False

    def is_initialized() -> bool:
        nonlocal warned
        result = original()
        if not result and not warned:
            frame = sys._getframe(1)
            caller = frame.f_globals.get("__name__", "")
            if caller.partition(".")[0] not in _OURS:
                warned = True
                warn(f"{caller} ({frame.f_code.co_filename}:{frame.f_lineno}) called torch.distributed.is_initialized()"
                     ": it is False in lightning_shm's workers, "
                     "which communicate through shared memory, so code that gathers or reduces only when it is True "
                     "runs on this rank's data alone. Use self.all_gather(x, sync_grads=True) or "
                     "self.trainer.strategy.reduce(x) -- they span the ranks under every strategy.")
        return result

    return _replaced(dist, "is_initialized", is_initialized)


def hint_unsynced_epoch_metrics() -> Callable[[], None]:
    """Give back Lightning's hint on tensors logged on epoch level without ``sync_dist`` where ranks hold
    different data: "It is recommended to use `self.log('val_loss', ..., sync_dist=True)` when logging on epoch
    level in distributed setting to accumulate the metric across devices". Each data-parallel rank's value
    covers its own batches; rank 0's is what is shown and checkpointed, and a callback or scheduler monitoring it
    decides on each rank's own. Lightning asks ``torch.distributed`` whether to say so, and it is never
    initialized in these workers, so the hint never came; its check (the only use of that name in Lightning's
    result module) is answered True. Returns the function that puts it back."""
    from lightning.pytorch.trainer.connectors.logger_connector import result

    if not hasattr(result, "_distributed_is_initialized"):  # another Lightning: nothing to answer
        return lambda: None
    return _replaced(result, "_distributed_is_initialized", lambda: True)


def _replaced(owner: Any, name: str, new: Callable[..., Any]) -> Callable[[], None]:
    """Set ``owner.name`` to ``new``; returns the function that puts the original back (if ``new`` is still
    there)."""
    original = getattr(owner, name)
    setattr(owner, name, new)

    def restore() -> None:
        if getattr(owner, name) is new:
            setattr(owner, name, original)

    return restore


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` that names the first frame outside :data:`_OURS` (the module's own
    code) when passed by the function calling this one."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _OURS:
        frame, level = frame.f_back, level + 1
    return level
