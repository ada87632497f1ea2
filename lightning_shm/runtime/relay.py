"""Workers' stderr passes through the main process, which keeps the last lines of each.

Why: a worker can die before it runs any of our code -- a spawned interpreter that fails to import
the user's script (no ``if __name__ == "__main__":`` guard, a script read from stdin, an import
error), an OOM kill during start-up. Its own traceback then exists only on its stderr. With each
worker's fd 2 a pipe read by the main process, the output still reaches the terminal (forwarded
as it arrives) and :class:`~lightning_shm.runtime.errors.WorkerDiedError` can quote it.

The pipe becomes the child's fd 2 by swapping the main process's fd 2 for the duration of
``Process.start()`` (spawn and fork children inherit fds 0-2 as they are at that moment). A fork
server's children inherit the server's instead: they are sent the pipe and make it their fd 2 first
thing (what fails before that, e.g. importing the main module, goes to the server's stderr).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

TAIL_BYTES = 8192


class StderrRelay:
    """One pipe per worker: forward its bytes to our stderr, remember the tail."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # read end -> rank
        self._tails: dict[int, bytearray] = {}

    @contextlib.contextmanager
    def capturing(self, rank: int) -> Iterator[int]:
        """Inside: a child started now gets a pipe to us as its stderr (yields the write end, for a
        child that does not inherit our fd 2 and must be handed it)."""
        r, w = os.pipe()
        saved = os.dup(2)
        try:
            os.dup2(w, 2)
            yield w
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(w)
        os.set_blocking(r, False)
        self._fds[r] = rank
        self._tails[rank] = bytearray()

    @property
    def fds(self) -> list[int]:
        return list(self._fds)

    def pump(self, fd: int) -> None:
        """Forward what ``fd`` holds now (non-blocking); close it at end of file."""
        rank = self._fds.get(fd)
        if rank is None:
            return
        for _ in range(64):  # bounded: a chatty worker must not starve the supervision loop
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                del self._fds[fd]
                os.close(fd)
                return
            with contextlib.suppress(OSError):
                os.write(2, data)
            tail = self._tails[rank]
            tail += data
            del tail[:-TAIL_BYTES]

    def pump_all(self) -> None:
        for fd in list(self._fds):
            self.pump(fd)

    def tail(self, rank: int, lines: int = 25) -> str:
        text = bytes(self._tails.get(rank, b"")).decode(errors="replace")
        return "\n".join(text.replace("\r", "\n").rstrip().splitlines()[-lines:])

    def close(self) -> None:
        self.pump_all()
        for fd in list(self._fds):
            os.close(fd)
        self._fds.clear()
