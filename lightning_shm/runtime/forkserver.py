"""The fork server: torch and lightning imported once per main process, every worker forked from it.

A spawned worker is a fresh interpreter: it imports torch and lightning (seconds) before its first
step, on every fit. ``fork`` skips that but copies a parent that may have started OpenMP threads
(torch then runs the child single-threaded). multiprocessing's fork server is the middle way: a
process started on the first launch, which imports the modules it is given (the strategies give
torch, lightning and this package) and never computes anything, then forks each worker on request.
The first fit costs what spawn costs; every later fit in the same main process (``fit`` then
``test``, a sweep, a test suite) starts in a fraction of a second.

What a fork-server child does not get from the main process, and where it comes from instead:

* its environment is the server's, from when the server started: the launcher sends the main
  process's current ``os.environ`` with the job (``PL_GLOBAL_SEED`` changes between fits);
* its fds 0-2 are the server's: the launcher sends each worker its stderr pipe (:mod:`.relay`),
  which the worker makes its fd 2 first thing. What a worker writes before that -- the traceback of
  a main script that fails to import -- goes to the server's stderr, which is a pipe this module
  reads on a thread, forwards to the real stderr, and keeps the tail of for
  :class:`~lightning_shm.runtime.errors.WorkerDiedError`.

When the main process exits, the server sees its end of a pipe close and raises ``SystemExit``: an
interpreter shutdown with torch and lightning loaded (1.2 s here) that nothing needs -- the server
computed nothing and holds no results. It still holds the main process's stdout, so a shell pipe
(``python train.py | tee log``) or a parent reading the output waits for it. The server therefore
leaves with ``os._exit`` at its first exit handler (:func:`leave_at_once`, registered by
:mod:`.forkserver_exit`, a module only the server imports: its last preload).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from multiprocessing import forkserver
from typing import Any, Optional, Sequence

TAIL_BYTES = 16384
NOTE_LINES = 80  # see output_since


class _ServerOutput:
    """The fork server's stderr: forwarded to ours by a daemon thread; the tail kept, with a count of
    every byte so far (a launch marks where it started).

    A worker that dies writes its last lines and exits; the main process may notice the exit before
    the thread has read them. So :meth:`since` first drains the pipe itself: reads happen only under
    the lock, on a non-blocking fd, whoever does them -- what a dead worker wrote is in the tail.
    """

    def __init__(self) -> None:
        self._read, self.write_fd = os.pipe()
        os.set_blocking(self._read, False)
        self._terminal = os.dup(2)  # our stderr now (the relay swaps fd 2 while it starts workers)
        self._tail = bytearray()
        self._total = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, name="lightning_shm-forkserver-stderr", daemon=True).start()

    def _pump(self) -> None:
        while True:
            try:
                select.select([self._read], [], [])
            except (OSError, ValueError):
                return
            with self._lock:
                if not self._take():
                    return

    def _take(self) -> bool:
        """Forward and keep what the pipe holds now (lock held); False at end of file."""
        while True:
            try:
                data = os.read(self._read, 65536)
            except BlockingIOError:  # empty (or drained by since())
                return True
            except OSError:
                return False
            if not data:
                return False
            try:
                os.write(self._terminal, data)
            except OSError:
                pass
            self._tail += data
            del self._tail[:-TAIL_BYTES]
            self._total += len(data)

    def mark(self) -> int:
        with self._lock:
            return self._total

    def since(self, mark: int) -> str:
        with self._lock:
            self._take()
            new = min(self._total - mark, len(self._tail))
            return bytes(self._tail[len(self._tail) - new:]).decode(errors="replace") if new > 0 else ""


_output: Optional[_ServerOutput] = None
_lock = threading.Lock()


def ensure_running(ctx: Any, preload: Sequence[str]) -> None:
    """Start the fork server if it is not running: its stderr our pipe, ``preload`` imported (a server
    already running keeps what it imported)."""
    global _output
    with _lock:
        if _output is None:
            _output = _ServerOutput()
        # the exit module last: its handler, registered after the others', runs first
        ctx.set_forkserver_preload([*preload, "lightning_shm.runtime.forkserver_exit"])
        saved = os.dup(2)
        try:
            os.dup2(_output.write_fd, 2)  # the server (a new interpreter) inherits fds 0-2
            forkserver.ensure_running()
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def mark() -> int:
    """Position in the server's output; :func:`output_since` returns what came after it."""
    return _output.mark() if _output is not None else 0


def output_since(mark: int, lines: int = NOTE_LINES) -> str:
    """The last ``lines`` lines the workers wrote to the server's stderr since ``mark``.

    Generous on purpose: workers failing the same way (a main script without a ``__main__`` guard)
    all print the same traceback there, and the ones killed after the first died may stop half-way
    -- 25 lines once held only such a cut-off copy, not the message of the worker that died."""
    if _output is None:
        return ""
    return last_lines(_output.since(mark), lines)


def last_lines(text: str, lines: int) -> str:
    return "\n".join(text.replace("\r", "\n").rstrip().splitlines()[-lines:])


def leave_at_once(server_pid: int) -> None:
    """The server's exit: flush and ``os._exit``. A worker forked from the server inherits this handler
    (and runs the exit handlers when it leaves): there it does nothing."""
    if os.getpid() != server_pid:
        return
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(0)
