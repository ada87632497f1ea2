"""Copies of the module's state kept outside it, made plain in checkpoints like the module's own.

In a worker, ``pl_module.state_dict()`` holds this rank's pieces (FSDP row blocks, tensor-parallel
slices, one pipeline stage's entries). A callback that keeps a copy of it -- a hand-written EMA,
``{k: v.clone() for k, v in pl_module.state_dict().items()}`` averaged after every batch -- trains
right, since each rank averages its own pieces, but its checkpoint state is rank 0's: pieces and one
stage's keys, which neither resume nor load in one process. So, in a checkpoint about to be written::

    rank r   {"net.1.weight": [392, 784] (rank r's rows), ...}   --ModelState.consolidate-->
    written  {"net.1.weight": [784, 784], ..., every stage's keys}

and in one read to resume, each such dict is cut back to the pieces and keys this rank holds
(``ModelState.localize``). A "copy" is a non-empty dict whose keys are all entries of the module's
state dict and whose values are tensors of the shapes those entries have on this rank (full shapes,
when reading). Consolidation is collective: the ranks first agree which copies every one of them
found (one object all-gather over the world), then consolidate those in the same order.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Collection, Iterator, Mapping

import torch

from lightning_shm.parallel.state import ModelState
from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason

_COPIES = barrier_reason("the copies of the module's state each rank holds (an EMA, weights kept in a checkpoint)")

Path = tuple[Any, ...]  # keys and list indices from the checkpoint's top level down to a copy


def consolidate_copies(tree: Any, state: ModelState, world: Group,
                       skip: Collection[Path] = ()) -> tuple[Any, list[Path]]:
    """``tree`` with every copy every rank found replaced by its full entries (the containers on the way
    are copied, never the callback's own); also the paths some ranks found but not all, which are left
    as this rank's (the caller warns)."""
    local = {k: v.shape for k, v in state.module.state_dict().items() if torch.is_tensor(v)}
    mine = list(_copies(tree, lambda k, v: local.get(k) == v.shape, skip))
    found = world.all_gather_object(mine, _COPIES)
    agreed = [p for p in found[0] if all(p in f for f in found)]
    partial = sorted({p for f in found for p in f if p not in agreed}, key=repr)
    out: Any = tree
    for path in agreed:
        out = _replaced(out, path, state.consolidate(_at(tree, path)))
    return out, partial


def localize_copies(tree: Any, state: ModelState, skip: Collection[Path] = ()) -> Any:
    """``tree`` (a checkpoint read to resume) with every copy of plain entries cut to this rank's pieces."""
    held = {k: state.full_shape(k, v) for k, v in state.module.state_dict().items() if torch.is_tensor(v)}
    plain = set(state.plain_keys)
    keys = list(held)
    out: Any = tree
    for path in list(_copies(tree, lambda k, v: k in plain and (k not in held or held[k] == v.shape), skip)):
        out = _replaced(out, path, state.localize(_at(tree, path), keys))
    return out


def _copies(tree: Any, fits: Callable[[str, torch.Tensor], bool], skip: Collection[Path],
            path: Path = ()) -> Iterator[Path]:
    if path in skip:
        return
    if isinstance(tree, Mapping):
        if path and tree and all(isinstance(k, str) and torch.is_tensor(v) and fits(k, v) for k, v in tree.items()):
            yield path
            return
        for k, v in tree.items():
            yield from _copies(v, fits, skip, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _copies(v, fits, skip, path + (i,))


def _at(tree: Any, path: Path) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _replaced(tree: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    new = list(tree) if isinstance(tree, tuple) else copy.copy(tree)
    new[path[0]] = _replaced(tree[path[0]], path[1:], value)
    return tuple(new) if isinstance(tree, tuple) else new
