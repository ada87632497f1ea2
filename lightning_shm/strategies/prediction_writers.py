"""One prediction writer per model replica.

Lightning's ``BasePredictionWriter`` runs on every rank and writes what that rank predicted -- under
data parallelism each rank's share of the dataset, so the files of all ranks hold every sample once.
Under tensor or pipeline parallelism the ranks of one model replica (tp members, pipeline stages)
predict the *same* samples and hold the same outputs: every one of them writing made each sample
appear ``tp x pp`` times in the union of the files (a user's "load every rank's file and
concatenate" read two copies under tp=2). So only the replica's first rank writes::

    dp2 x pp2:  replica {0, 1} -> rank 0 writes its samples; replica {2, 3} -> rank 2 writes its own
                ranks 1 and 3 call no write_on_batch_end / write_on_epoch_end

The other ranks still run every other hook of the writer (``setup``, ``on_predict_*_start``...): only
the two write methods, which Lightning documents as where outputs go to storage, are skipped.
"""

from __future__ import annotations

from typing import Any, Iterable

from lightning.pytorch.callbacks import BasePredictionWriter

_WRITES = ("write_on_batch_end", "write_on_epoch_end")


def _skip_write(*args: Any, **kwargs: Any) -> None:
    """Stands in for a writer's write method on a rank whose replica's first rank writes."""


def mute_writers(callbacks: Iterable[Any]) -> list[BasePredictionWriter]:
    """Skip the write methods of the prediction writers among ``callbacks``; returns them for :func:`unmute_writers`."""
    writers = [cb for cb in callbacks if isinstance(cb, BasePredictionWriter)]
    for w in writers:
        for name in _WRITES:
            setattr(w, name, _skip_write)  # an instance attribute shadows the method
    return writers


def unmute_writers(writers: Iterable[BasePredictionWriter]) -> None:
    for w in writers:
        for name in _WRITES:
            w.__dict__.pop(name, None)
