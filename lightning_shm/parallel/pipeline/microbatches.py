"""Cut a Lightning batch into the pipeline's microbatches, keeping its structure.

The step code of the user's module runs once per microbatch, on what :func:`split_batch` returns, so
each microbatch must be the batch the step expects with fewer samples: the same namedtuple, dataclass,
dict (or ``Mapping``: a tokenizer's ``BatchEncoding``) and lists, walked as Lightning walks a batch to
move it (``apply_to_collection``)::

    batch  {"x": [B, ...], "y": [B], "name": [B strings], "mask": [T, T]}
    mb i   {"x": [B_i, ...], "y": [B_i], "name": [B_i strings], "mask": [T, T]}    (B_0 + ... = B)

Per sample, and so cut: a tensor whose leading dimension is the batch size ``B`` (the first
non-scalar tensor's), and a list or tuple of ``B`` items not all of which hold that dimension
themselves -- what a collate function keeps per sample: strings (a list, or a tuple inside a
namedtuple), sequences of varying length. A list whose items all hold it is the batch's fields
(``[x, y, names]``, as ``default_collate`` turns a tuple sample). Everything else goes to every
microbatch whole. Sizes follow ``torch.tensor_split``: the first ``B % parts`` get one more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection, is_namedtuple

_CUT = (torch.Tensor, list, tuple)  # what split_batch decides on; dicts and dataclasses are walked through


def batch_size(batch: Any) -> Optional[int]:
    """The leading dimension of the batch's first non-scalar tensor (in the order ``apply_to_collection``
    walks it); None if it holds none. Stops at the first: it runs for every batch and microbatch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, Mapping):
        items: Iterable[Any] = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return None
    for item in items:
        n = batch_size(item)
        if n is not None:
            return n
    return None


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``parts`` microbatches of ``batch`` (uneven allowed); tensors are views, nothing is copied."""
    size = batch_size(batch)
    if size is None:
        walked = isinstance(batch, (torch.Tensor, Mapping, list, tuple)) or dataclasses.is_dataclass(batch)
        raise ValueError(
            f"cannot split a batch into microbatches: the {type(batch).__name__} " + (
                "holds no tensor with a batch dimension to cut." if walked else
                "is not a structure the pipeline walks -- it cuts tensors, lists and tuples inside dicts (Mappings), "
                "dataclasses, namedtuples, lists and tuples, as Lightning walks a batch to move it. Have the "
                "collate function return one of those (a dataclass with the same fields), or train under a "
                "strategy that does not cut the batch (shm_ddp, shm_fsdp, shm_tp)."))
    edges = [i * (size // parts) + min(i, size % parts) for i in range(parts + 1)]

    def part(i: int) -> Any:
        lo, hi = edges[i], edges[i + 1]

        def cut(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return v[lo:hi] if v.dim() and v.shape[0] == size else v
            if len(v) == size and not all(_holds_batch_dim(item, size) for item in v):
                return v[lo:hi]  # one item per sample
            fields = [apply_to_collection(item, _CUT, cut) for item in v]
            return type(v)(*fields) if is_namedtuple(v) else type(v)(fields)

        return apply_to_collection(batch, _CUT, cut)

    return [part(i) for i in range(parts)]


def _holds_batch_dim(item: Any, size: int) -> bool:
    """A list or tuple of ``size`` items, or a collection whose first non-scalar tensor has ``size`` rows.
    Asked of every item of a list of ``size``: sequences of varying length, one of which may happen to
    have ``size`` rows, are still one per sample."""
    return (isinstance(item, (list, tuple)) and len(item) == size) or batch_size(item) == size
