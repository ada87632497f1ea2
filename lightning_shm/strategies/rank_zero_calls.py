"""Rank-zero-only calls a step makes on a pipeline's last stage, made on rank 0.

Under a pipeline the module's steps run on the last stage, which is not rank 0, and Lightning's
loggers and ``LightningModule.print`` act on rank 0 only: a ``self.logger.log_metrics(...)``,
``self.logger.experiment.add_image(...)`` or ``self.print(...)`` in ``validation_step`` did nothing,
silently (``self.log`` is replayed by :mod:`~lightning_shm.strategies.pipeline_io`). While the step
runs there, :func:`recording_rank_zero_calls` stands recorders in for the trainer's loggers and the
module's ``print``; the step's broadcast carries the calls to the other stages, and rank 0 makes
them (:func:`replay`)::

    last stage   self.logger.experiment.add_image("pred", img, 3)  ->  (0, "experiment", "add_image"), args
    rank 0       trainer.loggers[0].experiment.add_image("pred", img, 3)

Attributes that are not methods (``log_dir``, ``version``) are read from the real logger. What a
recorded call returns is None. A call whose arguments do not pickle is dropped with a warning.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from typing import Any, Iterator

import lightning.pytorch as pl

Call = tuple[tuple[Any, ...], tuple, dict]  # path (logger index and attribute names, or ("print",)), args, kwargs


class _Recorder:
    """Records a call to ``path`` (any attribute of it extends the path: ``experiment.add_image``)."""

    def __init__(self, path: tuple[Any, ...], sink: list[Call]) -> None:
        self._path, self._sink = path, sink

    def __getattr__(self, name: str) -> "_Recorder":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Recorder(self._path + (name,), self._sink)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        try:
            pickle.dumps((args, kwargs))
        except Exception as exc:
            warnings.warn(f"lightning_shm: {'.'.join(map(str, self._path[1:]))}(...) on the pipeline's last stage "
                          f"is not made on rank 0: its arguments do not pickle ({exc})")
            return
        self._sink.append((self._path, args, kwargs))


class _RecordingLogger:
    """A logger whose methods (and its ``experiment``'s) are recorded; other attributes are the real ones."""

    def __init__(self, logger: Any, index: int, sink: list[Call]) -> None:
        self._logger, self._index, self._sink = logger, index, sink

    def __getattr__(self, name: str) -> Any:
        if name == "experiment":
            return _Recorder((self._index, "experiment"), self._sink)
        value = getattr(self._logger, name)
        return _Recorder((self._index, name), self._sink) if callable(value) else value


@contextlib.contextmanager
def recording_rank_zero_calls(module: pl.LightningModule, sink: list[Call]) -> Iterator[None]:
    """Inside, the trainer's loggers and ``module.print`` append their calls to ``sink`` instead of acting
    (on rank 0 too: the first stage runs the step up to the Sequential per microbatch, and the calls it
    makes there are the last stage's to make, once)."""
    trainer = module._trainer
    if trainer is None:
        yield
        return
    loggers = trainer.loggers
    trainer.loggers = [_RecordingLogger(lg, i, sink) for i, lg in enumerate(loggers)]  # type: ignore[misc]
    module.print = _Recorder(("print",), sink)  # type: ignore[method-assign]
    try:
        yield
    finally:
        trainer.loggers = loggers
        del module.print


def replay(module: pl.LightningModule, calls: list[Call]) -> None:
    """Make ``calls`` here, on rank 0."""
    trainer = module._trainer
    if trainer is None or not trainer.is_global_zero:
        return
    for path, args, kwargs in calls:
        target: Any = module.print if path == ("print",) else trainer.loggers[path[0]]
        for name in path[1:] if path != ("print",) else ():
            target = getattr(target, name)
        target(*args, **kwargs)
