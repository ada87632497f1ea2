"""Bring every rank's predictions back in dataset order, batched as a single process would batch them.

Under a distributed sampler rank ``r`` predicts samples ``r, r+W, r+2W, ...`` (Lightning's
``UnrepeatedDistributedSamplerWrapper``, no padding). Lightning records the sample indices of each
batch (``_IndexBatchSamplerWrapper.seen_batch_indices``); we gather ``(indices, outputs)`` from all
ranks, split outputs into per-sample rows, sort by index and cut into batches of the dataloader's
batch size. ``trainer.predict`` in the main process then returns exactly what ``devices=1`` would.

Outputs that cannot be split per sample (not tensors with a leading batch dimension or lists of one
string / number per sample, or no recorded indices) are returned as every rank's batches in rank order.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import is_namedtuple
from torch import Tensor

_SCALARS = (str, bytes, int, float, bool)  # what default collation keeps as a list: file names, ids as strings


def _split_rows(output: Any, n: int) -> Optional[list[Any]]:
    """Split a batch output into ``n`` per-sample rows, or None if it has no leading batch dim."""
    if isinstance(output, list) and len(output) == n and output and all(isinstance(v, _SCALARS) for v in output):
        return list(output)  # one value per sample (a collated list of strings)
    if isinstance(output, Tensor):
        return list(output.unbind(0)) if output.dim() > 0 and output.shape[0] == n else None
    if isinstance(output, dict):
        cols = {k: _split_rows(v, n) for k, v in output.items()}
        if any(c is None for c in cols.values()):
            return None
        return [{k: cols[k][i] for k in output} for i in range(n)]
    if isinstance(output, (list, tuple)) and output:
        cols = [_split_rows(v, n) for v in output]
        if any(c is None for c in cols):
            return None
        return [_like(output, [c[i] for c in cols]) for i in range(n)]
    return None


def _stack_rows(rows: Sequence[Any]) -> Any:
    first = rows[0]
    if isinstance(first, _SCALARS):
        return list(rows)
    if isinstance(first, Tensor):
        return torch.stack(list(rows))
    if isinstance(first, dict):
        return {k: _stack_rows([r[k] for r in rows]) for k in first}
    return _like(first, [_stack_rows([r[i] for r in rows]) for i in range(len(first))])


def _like(seq: Sequence[Any], items: list[Any]) -> Any:
    """``items`` in the sequence type of ``seq``: a list, or the same tuple type (a namedtuple, torch's
    ``return_types.topk``)."""
    if is_namedtuple(seq):
        return type(seq)(*items)
    return type(seq)(items) if isinstance(seq, tuple) else items


def merge_predictions(per_rank: Sequence[tuple[list[Any], list[Optional[list[list[int]]]], list[int]]]) -> list[Any]:
    """``per_rank[r] = (outputs per dataloader, batch indices per dataloader, batch size per dataloader)``."""
    num_dl = len(per_rank[0][0])
    merged: list[Any] = []
    for d in range(num_dl):
        rows: list[tuple[int, Any]] = []
        ok = True
        for outputs, indices, _ in per_rank:
            idx = indices[d]
            if idx is None or len(idx) != len(outputs[d]):
                ok = False
                break
            for out, batch_idx in zip(outputs[d], idx):
                split = _split_rows(out, len(batch_idx))
                if split is None:
                    ok = False
                    break
                rows.extend(zip(batch_idx, split))
            if not ok:
                break
        if not ok:
            rank_zero_warn("predictions could not be split per sample; returning every rank's batches in rank order")
            merged.append([b for outputs, _, _ in per_rank for b in outputs[d]])
            continue
        rows.sort(key=lambda t: t[0])
        bs = max(1, per_rank[0][2][d])
        merged.append([_stack_rows([r for _, r in rows[i:i + bs]]) for i in range(0, len(rows), bs)])
    return merged
