"""Files the program's objects hold open for writing, flushed as one process's exit would flush them.

A callback that opens a log in ``on_train_start`` and writes a line per epoch without closing it (``self.f =
open(...)``) leaves a complete file in one process: the interpreter flushes open files when it exits. A worker
leaves with ``os._exit`` (the runtime: interpreter shutdown with torch loaded takes seconds), which flushes
nothing, so rank 0's lines stayed in its buffer and the file was empty -- as after Lightning's spawn launchers,
whose workers exit the same way. :func:`flush_held_files` flushes what the run's objects hold before the worker
sends its result.

Where: the attributes of the LightningModule, the datamodule, the callbacks and the loggers (and the public lists
and dicts among them, one level down, up to 1,000 entries), and the main script's globals -- where a program keeps
what it opens. A file reached no other way (on a submodule, only inside a ``csv.writer``) is not found.

Under fork a worker starts with a copy of the main process's buffers: the main process flushes the same files
before the workers start (:func:`flush_held_files` there too), so that a worker's flush writes only its own lines
and the main process's pending ones are written once, by it.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any, Iterator

import lightning.pytorch as pl

_LOOK_INTO = 1000  # a list or dict longer than this holds data, not the files a program keeps


def flush_held_files(trainer: "pl.Trainer") -> None:
    """Never raises: it runs on the way out of a worker, also of one that failed."""
    with contextlib.suppress(Exception):
        for f in _held_files(trainer):
            with contextlib.suppress(Exception):  # a file another thread closed, a full disk: as the exit would
                f.flush()


def _held_files(trainer: "pl.Trainer") -> Iterator[io.IOBase]:
    seen: set[int] = set()
    for value in _values(trainer):
        if isinstance(value, io.IOBase) and id(value) not in seen and not value.closed and _writable(value):
            seen.add(id(value))
            yield value


def _values(trainer: "pl.Trainer") -> Iterator[Any]:
    holders: list[Any] = [trainer.lightning_module, trainer.datamodule, *trainer.callbacks, *trainer.loggers]
    spaces = [vars(h) for h in holders if h is not None and hasattr(h, "__dict__")]
    main = sys.modules.get("__main__")
    if main is not None:
        spaces.append(vars(main))
    for space in spaces:
        for name, value in list(space.items()):
            yield value
            # into public lists and dicts (a private one is torch's: a module's _parameters, _forward_hooks, ...)
            if isinstance(value, (list, tuple, dict)) and not name.startswith("_") and len(value) <= _LOOK_INTO:
                yield from list(value.values() if isinstance(value, dict) else value)


def _writable(f: io.IOBase) -> bool:
    try:
        return f.writable()
    except Exception:  # a detached or half-closed wrapper
        return False
