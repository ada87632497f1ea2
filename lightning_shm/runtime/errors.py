"""Exceptions of the shared-memory runtime.

Each one names the values that went wrong (ranks, sizes, ops) so that a failure in one of W
processes can be understood from the single traceback the main process re-raises.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


class SHMRuntimeError(RuntimeError):
    """Base class of every runtime failure."""


class SharedMemoryFullError(SHMRuntimeError):
    """/dev/shm has too little free space for the segments a run needs."""


class PeerAbortedError(SHMRuntimeError):
    """Raised in a waiting rank when another process failed and the main process set the abort flag.

    It is a consequence, never the cause: the launcher reports the failing worker's own exception.
    """


class PeerFailedError(PeerAbortedError):
    """Raised in a rank waiting for ``rank``, which failed and waits for the others to fail too
    (:meth:`~lightning_shm.runtime.group.Group.agree_failed`). ``joinable``: this rank waited in a channel (a
    pipeline's hand-over), which leaves no collective half done: it stands where the failed rank stands and may
    agree with it; in a collective its group is mid-way, and it only reports."""

    def __init__(self, message: str, rank: int = -1, joinable: bool = False) -> None:
        super().__init__(message)
        self.rank, self.joinable = rank, joinable

    def __reduce__(self) -> Any:
        return (type(self), (self.args[0] if self.args else "", self.rank, self.joinable), self.__dict__)


class BarrierTimeoutError(SHMRuntimeError, TimeoutError):
    """A wait exceeded its timeout; the message names the ranks that did not arrive (``missing``)."""

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)

    def __reduce__(self) -> Any:  # keep ``missing`` (and notes) across the pipe to the main process
        return (type(self), (self.args[0] if self.args else "", self.missing), self.__dict__)


class CollectiveMismatchError(SHMRuntimeError):
    """Ranks of one group entered different collectives (kind, dtype, size, reduce op or source, sequence number).
    ``mine`` / ``theirs``: the two descriptors (seq, coll, dtype, numel, arg), for callers that say it their way;
    ``peer``: the global rank that entered ``theirs`` (the launcher adds where that rank was to the report)."""

    def __init__(self, message: str, mine: Optional[dict[str, int]] = None,
                 theirs: Optional[dict[str, int]] = None, peer: int = -1) -> None:
        super().__init__(message)
        self.mine, self.theirs, self.peer = mine or {}, theirs or {}, peer

    def __reduce__(self) -> Any:  # keep the descriptors (and notes) across the pipe to the main process
        return (type(self), (self.args[0] if self.args else "", self.mine, self.theirs, self.peer), self.__dict__)


class WorkerDiedError(SHMRuntimeError):
    """A worker process exited without reporting a result (SIGKILL, os._exit, segfault, OOM killer)."""


class WorkerTraceback(Exception):
    """Carries the traceback text of a worker as the ``__cause__`` of the re-raised exception.

    Like ``concurrent.futures.process._RemoteTraceback``: printing the main-process exception shows
    the worker's original stack under "The above exception was the direct cause of ...".
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class NodeStoppedError(SHMRuntimeError):
    """Another node of a multi-node run stopped (its processes died, failed or timed out): the collective
    across nodes could not complete. The error that stopped it is reported on that node."""
