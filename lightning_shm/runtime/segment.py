"""POSIX shared-memory segments: created and unlinked by the main process only, attached by workers.

Why not ``multiprocessing.shared_memory.SharedMemory``? Three reasons, all about never hanging or
leaking:

* On Python < 3.13 every process that *attaches* registers the segment with the resource tracker,
  which unlinks it when that process exits (cpython#82300) -- a worker finishing early would pull
  the memory from under the others. Workers here map the file directly and never register.
* ``posix_fallocate`` reserves every page at creation, so a too-small ``/dev/shm`` is a clear
  ``SharedMemoryFullError`` now instead of a SIGBUS in the middle of training. It also pays the
  first-touch cost of fresh tmpfs pages (~10x a normal write) once, in the main process.
* Workers map with ``MAP_POPULATE``: their page tables are filled at attach time, not on the hot
  path.

Names are ``lshm_<pid>.<owner token>_<token>_<tag>``, mode 0600. A creating process that dies without
unlinking (SIGKILL of the main process, the OOM killer) leaves them to two cleaners:

* multiprocessing's resource tracker, a process of its own that outlives its creator: each segment (and the
  owner file below) is registered with it as the creator makes it and unregistered as the creator unlinks it,
  so what a killed creator still held is unlinked within a second of its death, with the tracker's "leaked
  shared_memory objects" warning. Workers only attach, never register (see the first point above);
* :func:`sweep_stale`, at the start of every run, for what the tracker could not remove because it died
  too (a scheduler killing the whole process group, ``docker kill``): each creating process holds an
  exclusive ``flock`` on its owner file ``lshm_<pid>.<owner token>.lock`` for as long as it lives, and
  the sweep removes the segments of an owner whose lock it can take. A lock, unlike ``kill(pid, 0)``, means
  the same thing in every PID namespace that shares ``/dev/shm`` (``docker --ipc=host``, pods sharing
  IPC), so a run never deletes the segments of a live run it cannot see.

Tensor views are built on a NumPy array over the mapping: NumPy holds a buffer export, so
``mmap.close()`` refuses (``BufferError``) while any view is alive instead of leaving a dangling
pointer (``torch.frombuffer`` does not hold the export). :meth:`Segment.close` therefore never
crashes a process that still holds a view; the mapping is released when the last view dies.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import multiprocessing.util
import os
import re
import secrets
import threading
from multiprocessing import resource_tracker
from typing import Optional

import numpy as np
import torch

from lightning_shm.runtime.errors import SharedMemoryFullError

log = logging.getLogger(__name__)

PREFIX = "lshm"
SHM_DIR = "/dev/shm"
ALIGN = 64  # cache line: every region starts on its own line
_OWNER_RE = re.compile(rf"^{PREFIX}_(\d+)\.([0-9a-f]{{8}})(\.lock$|_)")


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_free_space(nbytes: int, what: str = "segment", detail: str = "") -> None:
    """Fail early, with numbers and the usual fixes, when /dev/shm cannot hold ``nbytes`` more."""
    if not os.path.isdir(SHM_DIR):
        raise SharedMemoryFullError(f"{SHM_DIR} does not exist: lightning_shm needs POSIX shared memory (Linux).")
    free = shm_free_bytes()
    if nbytes > free:
        raise SharedMemoryFullError(
            f"{what} needs {nbytes / 2**20:.1f} MiB of shared memory but {SHM_DIR} has only "
            f"{free / 2**20:.1f} MiB free{detail}. In Docker the default is 64 MB: start the container with "
            f"--shm-size=1g (or --ipc=host), or reduce the model / bucket / scratch sizes."
        )


class _Owner:
    """This process's identity in segment names, and the lock that says it is alive."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = f"{self.pid}.{secrets.token_hex(4)}"
        self.lock_name = f"{PREFIX}_{self.token}.lock"
        fd = os.open(_path(self.lock_name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _track(self.lock_name)
        self.fd = fd
        atexit.register(self.release)
        # a multiprocessing child (fork / forkserver: a sweep's trial, a benchmark run) leaves with
        # os._exit after its target, skipping atexit; it does run multiprocessing's finalizers
        multiprocessing.util.Finalize(None, self.release, exitpriority=0)

    def release(self) -> None:
        """Drop the lock file (at exit of the creating process only: forked children inherit atexit
        handlers and multiprocessing finalizers)."""
        if os.getpid() != self.pid or self.fd < 0:
            return
        _unlink_quietly(self.lock_name)
        os.close(self.fd)
        self.fd = -1


_owner: Optional[_Owner] = None
_owner_guard = threading.Lock()


def owner_token() -> str:
    """``<pid>.<token>`` of this process, creating (and locking) its owner file on first use."""
    global _owner
    with _owner_guard:
        if _owner is None or _owner.pid != os.getpid():  # a forked child is a new owner
            _owner = _Owner()
        return _owner.token


def close_inherited_owner_lock() -> None:
    """In a forked child: close the copy of the parent's lock fd (the parent keeps its lock; this
    child, should it create segments, becomes an owner of its own)."""
    if _owner is not None and _owner.pid != os.getpid() and _owner.fd >= 0:
        os.close(_owner.fd)
        _owner.fd = -1


def _owner_alive(lock_name: str) -> bool:
    """True while some process holds the owner's lock (any PID namespace)."""
    try:
        fd = os.open(_path(lock_name), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except PermissionError:  # another user's run: not ours to judge
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the lock if we took it
    return False


def sweep_stale() -> list[str]:
    """Unlink segments (and lock files) of owners that no longer hold their lock. Returns their names."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    by_owner: dict[str, list[str]] = {}
    for name in entries:
        m = _OWNER_RE.match(name)
        if m is not None:
            by_owner.setdefault(f"{m.group(1)}.{m.group(2)}", []).append(name)
    removed: list[str] = []
    for token, names in by_owner.items():
        lock = f"{PREFIX}_{token}.lock"
        if _owner_alive(lock):
            continue
        for name in sorted(names, key=lambda n: n == lock):  # segments first, the lock file last
            try:
                os.unlink(_path(name))
                removed.append(name)
            except FileNotFoundError:
                pass
            except PermissionError:  # another user's stale segment: not ours to remove
                continue
    if removed:
        log.warning("removed %d stale shared-memory segment(s) of dead processes: %s", len(removed), removed)
    return removed


def list_owned(pid: Optional[int] = None) -> list[str]:
    """Names of this project's segments (not lock files) created by process ``pid`` (default: this one)."""
    pid = os.getpid() if pid is None else pid
    try:
        return sorted(n for n in os.listdir(SHM_DIR)
                      if n.startswith(f"{PREFIX}_{pid}.") and not n.endswith(".lock"))
    except FileNotFoundError:
        return []


def normal_views() -> torch.inference_mode:
    """Around cutting a view of shared memory that is kept and written later: cut inside
    ``torch.inference_mode`` (a collective first run in Lightning's validation) it could not be written
    outside it ("Inplace update to inference tensor outside InferenceMode")."""
    return torch.inference_mode(False)


class Segment:
    """One mapped shared-memory file. ``create`` in the main process, ``attach`` in workers."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mm: Optional[mmap.mmap] = mm
        self._base: Optional[torch.Tensor] = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        self._words: Optional[memoryview] = None

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, nbytes: int, tag: str = "seg") -> "Segment":
        """Create, reserve (fallocate) and map a new segment. Main process only."""
        nbytes = max(align_up(nbytes, mmap.PAGESIZE), mmap.PAGESIZE)
        check_free_space(nbytes, f"shared-memory segment '{tag}'")
        safe_tag = re.sub(r"[^A-Za-z0-9.-]", "-", tag)[:80]
        name = f"{PREFIX}_{owner_token()}_{secrets.token_hex(4)}_{safe_tag}"
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise SharedMemoryFullError(
                        f"could not reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR} for '{tag}' "
                        f"({shm_free_bytes() / 2**20:.1f} MiB free): start Docker with --shm-size=1g or "
                        f"--ipc=host, or use smaller buckets / scratch."
                    ) from e
                raise
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_quietly(name)
            raise
        os.close(fd)
        _track(name)
        return cls(name, nbytes, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment (no resource-tracker registration, page tables pre-filled)."""
        fd = os.open(_path(name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def close(self) -> None:
        """Drop our views and unmap. If a caller still holds a view the unmap is left to GC."""
        if self._words is not None:
            self._words.release()
            self._words = None
        self._base = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                log.debug("segment %s still has live tensor views; unmapped when they are freed", self.name)

    def unlink(self) -> None:
        _unlink_quietly(self.name)

    @property
    def closed(self) -> bool:
        return self._mm is None

    # ------------------------------------------------------------------ views
    def tensor(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        """A 1-D ``dtype`` view of ``numel`` elements starting ``offset`` bytes into the segment."""
        if self._base is None:
            raise ValueError(f"segment {self.name} is closed")
        itemsize = torch.empty((), dtype=dtype).element_size()
        end = offset + numel * itemsize
        if offset % itemsize or end > self.size:
            raise ValueError(f"view [{offset}, {end}) of {dtype} does not fit segment {self.name} of {self.size} bytes")
        with normal_views():
            return self._base[offset:end].view(dtype)

    def write_bytes(self, data: bytes, offset: int = 0) -> None:
        if self._mm is None:
            raise ValueError(f"segment {self.name} is closed")
        self._mm[offset:offset + len(data)] = data

    def read_bytes(self, nbytes: int, offset: int = 0) -> bytes:
        if self._mm is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._mm[offset:offset + nbytes]

    def words(self) -> memoryview:
        """The whole segment as int64 words: fast scalar loads/stores for flags and counters.

        A ``memoryview`` item store is one aligned 8-byte store (atomic on x86-64) and costs ~50 ns
        from Python, half of a NumPy scalar access.
        """
        if self._words is None:
            if self._mm is None:
                raise ValueError(f"segment {self.name} is closed")
            self._words = memoryview(self._mm).cast("q")
        return self._words

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size} bytes, owner={self.owner})"


_tracked: dict[str, int] = {}  # name -> pid of the process that registered it with the resource tracker


def _track(name: str) -> None:
    """Register ``name`` with multiprocessing's resource tracker, which unlinks it should this process die
    without doing so (it unlinks what is still registered once every process holding its pipe has exited)."""
    try:
        resource_tracker.register("/" + name, "shared_memory")
    except Exception as e:  # no tracker (it could not start): the next run's sweep still removes a leftover
        log.debug("resource tracker unavailable for %s: %s", name, e)
        return
    _tracked[name] = os.getpid()


def _unlink_quietly(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass
    if _tracked.get(name) == os.getpid():  # only what this process registered (not a forked parent's)
        del _tracked[name]
        with contextlib.suppress(Exception):
            resource_tracker.unregister("/" + name, "shared_memory")
