"""``torch.save`` of something holding this rank's pieces of parameters: said at the save, naming them.

Under shm_fsdp and tensor parallelism a worker holds a piece of each cut parameter, and so does
``pl_module.state_dict()`` there. Code ported from plain PyTorch that saves it itself -- a callback keeping the
last or best weights::

    if trainer.is_global_zero:
        torch.save(pl_module.state_dict(), "best.pt")     # rank 0's rows: net.1.weight [128, 784] of [256, 784]

wrote rank 0's pieces without a word, and the file failed where it was loaded, far from the cause ("size mismatch
for net.1.weight: copying a param with shape torch.Size([128, 784]) from checkpoint, the shape in current model
is torch.Size([256, 784])" under shm_fsdp, its "copy" gather and tp2; `/tmp/ph/psave.py`, a local script).
While a worker trains such a layout, the first ``torch.save`` on a rank of an object holding such a piece
warns there, naming the parameters and the ways to whole weights. Lightning's checkpoints hold whole tensors
(the strategy consolidates them first) and pass unseen. A name imported before the fit (``from torch import
save``) is torch's own.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from lightning_shm.parallel.state import ModelState

WHY = ("lightning_shm: torch.save of {what} holding this rank's pieces of parameters ({pieces}): under this layout "
       "({layout}) a worker holds only its part of each such parameter, and so does pl_module.state_dict() -- the "
       "file holds rank {rank}'s parts and loads into the whole model nowhere. For whole weights, call "
       "trainer.save_checkpoint(path) on every rank (a checkpoint holds whole tensors), or take "
       "trainer.strategy.lightning_module_state_dict() on every rank (collective) and save that on rank 0.")


@contextlib.contextmanager
def piece_saves_warned(state: ModelState, layout: str, rank: int) -> Iterator[None]:
    """Inside, ``torch.save`` warns the first time it is handed pieces of ``state``'s parameters."""
    original = torch.save
    warned = [False]

    @functools.wraps(original)
    def save(obj: Any, *args: Any, **kwargs: Any) -> Any:
        pieces = _pieces(state) if not warned[0] else {}
        if pieces:  # a layout cutting no parameter here (a pipeline stage's whole layers): nothing to look for
            found = _pieces_in(obj, pieces)
            if found:
                warned[0] = True
                named = ", ".join(f"'{n}' {list(s)} of {list(f)}" for n, s, f in found[:3])
                more = f" and {len(found) - 3} more" if len(found) > 3 else ""
                what = "a module" if isinstance(obj, nn.Module) else f"an object ({type(obj).__name__})"
                warnings.warn(WHY.format(what=what, pieces=named + more, layout=layout, rank=rank), stacklevel=2)
        return original(obj, *args, **kwargs)

    torch.save = save
    try:
        yield
    finally:
        torch.save = original


def _pieces(state: ModelState) -> dict[int, tuple[str, torch.Size, torch.Size]]:
    """``data_ptr -> (name, piece shape, whole shape)`` of the parameters this rank holds a piece of."""
    found = {}
    for name, p in state.module.named_parameters():
        whole = state.full_shape(name, p)
        if p.numel() and whole != p.shape:
            found[p.data_ptr()] = (name, p.shape, whole)
    return found


def _pieces_in(obj: Any, pieces: Mapping[int, tuple[str, torch.Size, torch.Size]],
               depth: int = 0) -> list[tuple[str, torch.Size, torch.Size]]:
    """The pieces ``obj`` holds -- a tensor viewing exactly a piece's elements (``state_dict()``'s entries, ``p``
    or ``p.data``), inside dicts, lists and tuples, or among a module's parameters."""
    if isinstance(obj, torch.Tensor):
        hit = pieces.get(obj.data_ptr()) if obj.numel() else None
        return [hit] if hit is not None and obj.shape == hit[1] else []  # a whole tensor may start at a piece
    if depth > 8:
        return []
    if isinstance(obj, nn.Module):
        items: Any = list(obj.parameters())
    elif isinstance(obj, Mapping):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    else:
        return []
    return [hit for item in items for hit in _pieces_in(item, pieces, depth + 1)]
