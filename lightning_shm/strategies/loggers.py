"""The Trainer's loggers across the process boundary: what goes out to the workers, what comes back from rank 0.

Only rank 0 logs, into its own copy of each logger; one process logs into the logger the user holds. What keeps
the two alike, in the order a run meets it:

* :func:`resolve_log_versions` -- a CSV / TensorBoard logger's ``version_N`` is picked in the main process before
  the workers copy it, so ``trainer.logger.log_dir`` there is where rank 0 writes.
* :func:`carried` / :func:`take_carried` -- a worker started by fork gets each logger as pickling carries it, as
  a spawn or fork-server worker does, so a logger's own ``__getstate__`` decides what crosses whatever the start
  method. W&B's makes its run in the pickling process (the main one) and hands over the id that rank 0 attaches
  to; copied by fork instead, rank 0 made a run of its own, the main process another when the script read
  ``logger.experiment`` after ``fit``, and a ``test`` after the fit a third -- one process makes one.
* :func:`logger_writers` / :func:`apply_logger_writers` -- rank 0's CSV writer comes back, so the next run of the
  Trainer appends to its ``metrics.csv`` instead of deleting it.
* a logger's plain data, private too (the MLflow run it made, rows a logger of the user's kept in lists), comes
  back with the module's and callbacks' (:func:`.main_state.gathered_attributes`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import lightning.pytorch as pl
from lightning.fabric.loggers.csv_logs import CSVLogger
from lightning.fabric.loggers.csv_logs import _ExperimentWriter as CSVWriter
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_shm.strategies.main_globals import pickled, unpickled


def resolve_log_versions(trainer: "pl.Trainer") -> None:
    """A CSV / TensorBoard logger picks its version (``version_N``) the first time it is asked, by listing the
    directory. Asked here, before the workers copy the Trainer, so rank 0 writes where the main process's
    ``trainer.logger.log_dir`` points; asked later in the main process it found rank 0's new directory and
    named the next one, which does not exist."""
    for logger in trainer.loggers:
        if isinstance(logger, (CSVLogger, TensorBoardLogger)):
            logger.version  # noqa: B018 -- the property picks and keeps the version


def carried(trainer: "pl.Trainer") -> list[Optional[bytes]]:
    """In the main process, before fork-started workers copy it: each logger pickled, as a spawn worker would
    receive it (None for one that does not pickle: the workers keep fork's copy). Pickled here, not in the
    workers, because a logger's ``__getstate__`` may make what every worker must share (W&B's run)."""
    return [pickled(logger) for logger in trainer.loggers]


def take_carried(trainer: "pl.Trainer", loggers: Sequence[Optional[bytes]]) -> None:
    """In a fork-started worker: each logger becomes what :func:`carried` pickled -- in place, so what holds it
    (the Trainer, a callback given it) holds the carried one."""
    for logger, blob in zip(trainer.loggers, loggers):
        received = unpickled(blob) if blob is not None else None
        if received is not None and hasattr(logger, "__dict__"):
            vars(logger).clear()
            vars(logger).update(vars(received))


def logger_writers(trainer: "pl.Trainer") -> list[Optional[bytes]]:
    """Rank 0's CSV loggers' writers (their columns, the file they append to), pickled; None for other loggers and
    ranks, and for a writer that does not pickle (a hyperparameter it holds).

    One process's CSV logger makes its writer once and appends every later run's rows (``fit`` then ``test``,
    ``fit`` again) to the same ``metrics.csv``; a writer made anew deletes that file first ("Previous log files
    ... will be deleted"). The main process never logs, so its logger had none: each run's rank 0 made one and
    deleted the previous run's rows -- a ``test`` after ``fit`` left only the test's metrics -- and so did the
    main process's own first ``trainer.logger.experiment``. The writer comes back to the main process
    (:func:`apply_logger_writers`) and goes out again with the next run's Trainer."""
    writers = (getattr(lg, "_experiment", None) if isinstance(lg, CSVLogger) else None for lg in trainer.loggers)
    return [pickled(w) if isinstance(w, CSVWriter) else None for w in writers]


def apply_logger_writers(trainer: "pl.Trainer", writers: Sequence[Optional[bytes]]) -> None:
    for logger, blob in zip(trainer.loggers, writers):
        writer = unpickled(blob) if blob is not None else None
        if writer is not None:
            logger._experiment = writer
