"""What a spawned or fork-server worker takes of the main process's interpreter state.

A forked worker is a copy of the main process. A spawned one -- and one the fork server forks, which
imported torch and lightning but never ran the script's guarded block -- starts from a fresh
interpreter: what ``if __name__ == "__main__":`` set up before ``fit`` is not there. Lightning's spawn
launcher carries the deterministic flags and the random states (:class:`_GlobalStateSnapshot`); a worker
also takes, as a forked one would have them:

* torch's default dtype -- ``torch.set_default_dtype(torch.float64)`` did not reach it: a tensor its step
  or dataset created without a dtype was float32 beside float64 weights;
* torch's float32 precision for matmuls and convolutions (``torch.set_float32_matmul_precision("medium")``,
  or the ``torch.backends.*.fp32_precision`` settings): on a CPU with bfloat16 units "medium" has oneDNN
  multiply in bfloat16 -- one process did, the workers multiplied in float32;
* the globals ``torch.load`` may rebuild (``torch.serialization.add_safe_globals([Config])``): a checkpoint
  holding such an object (a dataclass in the hyperparameters) resumed in one process and failed in those
  workers' ``fit(ckpt_path=...)`` with torch's "Weights only load failed";
* the warning filters -- ``warnings.filterwarnings("ignore", ...)`` silenced a warning in one process,
  and each worker printed it; a test run's ``filterwarnings`` did not reach the workers;
* the logging configuration -- every logger's level, ``propagate`` and ``disabled``, ``logging.disable``,
  and its handlers where they can be rebuilt: a stream handler on stdout or stderr (``basicConfig``'s) and
  a file handler (reopened for appending; the main process's own file appends from then on), with their
  level, formatter and filters. Before, a worker printed Lightning's model summary under
  ``logging.getLogger("lightning.pytorch").setLevel(ERROR)``, and dropped the INFO records
  ``logging.basicConfig(level=INFO)`` asked for.

Data movement: the main process captures this once per launch; it travels with the job to every worker,
which restores it before the Trainer's code runs. Each warning filter, each safe global and each logger's
handlers travel as bytes of their own, unpickled one by one in the worker: one that does not load there (a
warning category or formatter class defined inside the main block, which a spawned worker never runs) is
left behind alone, and never stops a worker from starting. A logger with a handler of another kind (a rotating file, a
socket, a test runner's capture) keeps the worker's own handlers.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot


def pickled(obj: Any) -> Optional[bytes]:
    """``obj`` as bytes of its own, None where it does not pickle: it stays behind, alone."""
    try:
        return pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - whatever the reason, it stays behind
        return None


def unpickled(blob: bytes) -> Any:
    """The object again, None where it does not load here (a class this process cannot import)."""
    try:
        return pickle.loads(blob)
    except Exception:  # noqa: BLE001 - a class the worker cannot import: left behind
        return None


@dataclass(frozen=True)
class HandlerSpec:
    """A handler to rebuild in the worker: ``stream`` is "stdout" or "stderr", else ``path`` is a file's."""

    level: int
    formatter: Optional[logging.Formatter]
    filters: tuple
    stream: Optional[str] = None
    path: Optional[str] = None
    encoding: Optional[str] = None

    @classmethod
    def of(cls, h: logging.Handler) -> Optional["HandlerSpec"]:
        """None where ``h`` is of a kind not rebuilt. A file handler's open file appends from now on
        (:func:`_append_from_now_on`)."""
        kept = (h.level, h.formatter, tuple(h.filters))
        if type(h) is logging.FileHandler:
            _append_from_now_on(h)
            return cls(*kept, path=h.baseFilename, encoding=h.encoding)
        if type(h) is logging.StreamHandler:
            for name in ("stdout", "stderr"):
                if h.stream is getattr(sys, name) or h.stream is getattr(sys, f"__{name}__"):
                    return cls(*kept, stream=name)
        return None

    def build(self) -> logging.Handler:
        h: logging.Handler
        if self.path is not None:  # the main process opened it (and truncated it, for mode "w") already
            h = logging.FileHandler(self.path, mode="a", encoding=self.encoding, delay=True)
        else:
            h = logging.StreamHandler(getattr(sys, self.stream or "stderr"))
        h.setLevel(self.level)
        h.setFormatter(self.formatter)
        for f in self.filters:
            h.addFilter(f)
        return h


def _append_from_now_on(h: logging.FileHandler) -> None:
    """The main process's own records after the workers' land after theirs, as a forked worker's shared file
    offset has them: its file opened with "w" (``basicConfig(filename=..., filemode="w")``) wrote at its own
    offset, over the lines the workers had appended (a record after the fit overwrote them)."""
    if h.stream is None:  # not opened yet (delay=True)
        return
    try:
        fd = h.stream.fileno()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if not flags & os.O_APPEND:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_APPEND)
    except (OSError, ValueError, AttributeError):  # a closed or unusual stream: left as it is
        pass


@dataclass(frozen=True)
class LoggerSpec:
    level: int
    propagate: bool
    disabled: bool
    handlers: Optional[bytes]  # a pickled tuple of HandlerSpec; None: one is not rebuilt, the worker keeps its own

    @classmethod
    def of(cls, logger: logging.Logger) -> "LoggerSpec":
        specs = tuple(HandlerSpec.of(h) for h in logger.handlers)
        handlers = None if any(s is None for s in specs) else pickled(specs)
        return cls(logger.level, logger.propagate, logger.disabled, handlers)

    def restore(self, logger: logging.Logger) -> None:
        if logger.level != self.level:  # setLevel clears every logger's cache: ~300 loggers, 11 ms when all set
            logger.setLevel(self.level)
        logger.propagate, logger.disabled = self.propagate, self.disabled
        specs = unpickled(self.handlers) if self.handlers is not None else None
        if specs is None or not (specs or logger.handlers):
            return
        for h in list(logger.handlers):
            logger.removeHandler(h)
        for spec in specs:
            logger.addHandler(spec.build())


def capture_logging() -> tuple[int, dict[Optional[str], LoggerSpec]]:
    """``logging.disable``'s level and ``{logger name (None: the root): its spec}``."""
    loggers: dict[Optional[str], logging.Logger] = {None: logging.getLogger()}
    loggers.update((n, lg) for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger))
    return logging.root.manager.disable, {n: LoggerSpec.of(lg) for n, lg in loggers.items()}


def restore_logging(disable: int, loggers: dict[Optional[str], LoggerSpec]) -> None:
    logging.disable(disable)
    for name, spec in loggers.items():
        spec.restore(logging.getLogger(name))


def capture_warning_filters() -> tuple[bytes, ...]:
    """``warnings.filters`` in order (the first that matches decides), each pickled on its own."""
    return tuple(b for b in map(pickled, warnings.filters) if b is not None)


def restore_warning_filters(blobs: tuple[bytes, ...]) -> None:
    """Rebuilt through the public calls, last first, so that each lands in front as it did in the main process."""
    warnings.resetwarnings()
    for action, message, category, module, lineno in reversed([f for f in map(unpickled, blobs) if f is not None]):
        if message is None and module is None:
            warnings.simplefilter(action, category, lineno)
        else:  # filterwarnings compiles the message case-insensitively, as the main process's call did
            warnings.filterwarnings(action, _pattern(message), category, _pattern(module), lineno)


def _pattern(p: Any) -> str:
    """A filter's compiled pattern as filterwarnings takes it; a plain string (the interpreter's own filters
    name ``__main__`` so) matches only itself."""
    return "" if p is None else p.pattern if isinstance(p, re.Pattern) else re.escape(p) + r"\Z"


def capture_safe_globals() -> tuple[bytes, ...]:
    """What ``torch.load(weights_only=True)`` may rebuild beyond its own list, each pickled on its own with the
    name a checkpoint gives it: a class of the main script is ``__main__.Config`` in the file, and its copy in a
    worker (which runs the script as ``__mp_main__``) must answer to that name."""
    named = (g if isinstance(g, tuple) else (g, f"{g.__module__}.{g.__qualname__}")
             for g in torch.serialization.get_safe_globals())
    return tuple(b for b in map(pickled, named) if b is not None)


def restore_safe_globals(blobs: tuple[bytes, ...]) -> None:
    found = [g for g in map(unpickled, blobs) if g is not None]
    if found:
        torch.serialization.add_safe_globals(found)


# the settings torch keeps per backend (CPU ones); where a version lacks one, it is not carried
_FP32_PRECISIONS = ("", "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _backend(path: str) -> Any:
    obj: Any = torch.backends
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name, None)
    return obj


def capture_precision() -> tuple[Optional[str], dict[str, str]]:
    """The legacy setting's value (None where the main process mixed it with the per-backend settings, which
    makes torch refuse to read it) and each per-backend ``fp32_precision``."""
    try:
        legacy: Optional[str] = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = None
    backends = {p: getattr(_backend(p), "fp32_precision") for p in _FP32_PRECISIONS
                if hasattr(_backend(p), "fp32_precision")}
    return legacy, backends


def restore_precision(legacy: Optional[str], backends: dict[str, str]) -> None:
    """The legacy call first (it sets the backends' values as it did in the main process), then only the values
    that still differ: a worker set as the main process was reads back as it does."""
    if legacy is not None and torch.get_float32_matmul_precision() != legacy:
        torch.set_float32_matmul_precision(legacy)
    for path, value in backends.items():
        obj = _backend(path)
        if obj is not None and getattr(obj, "fp32_precision", value) != value:
            obj.fp32_precision = value


@dataclass
class MainGlobals(_GlobalStateSnapshot):
    """Lightning's snapshot plus the default dtype, the float32 precision, torch.load's safe globals, the warning
    filters and the logging configuration."""

    default_dtype: torch.dtype = torch.float32
    matmul_precision: Optional[str] = "highest"
    fp32_precisions: dict = field(default_factory=dict)
    safe_globals: tuple = ()
    warning_filters: tuple = ()
    logging_disable: int = logging.NOTSET
    loggers: dict = field(default_factory=dict)

    @classmethod
    def capture(cls) -> "MainGlobals":
        disable, loggers = capture_logging()
        legacy, backends = capture_precision()
        return cls(**vars(_GlobalStateSnapshot.capture()), default_dtype=torch.get_default_dtype(),
                   matmul_precision=legacy, fp32_precisions=backends, safe_globals=capture_safe_globals(),
                   warning_filters=capture_warning_filters(), logging_disable=disable, loggers=loggers)

    def restore(self) -> None:
        super().restore()
        torch.set_default_dtype(self.default_dtype)
        restore_precision(self.matmul_precision, self.fp32_precisions)
        restore_safe_globals(self.safe_globals)
        restore_warning_filters(self.warning_filters)
        restore_logging(self.logging_disable, self.loggers)
