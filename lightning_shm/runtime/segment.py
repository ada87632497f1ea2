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

Names are ``lshm_<owner pid>_<token>_<tag>``: :func:`sweep_stale` removes segments whose owner
died without cleaning up (SIGKILL of the main process), mode is 0600.

Tensor views are built on a NumPy array over the mapping: NumPy holds a buffer export, so
``mmap.close()`` refuses (``BufferError``) while any view is alive instead of leaving a dangling
pointer (``torch.frombuffer`` does not hold the export). :meth:`Segment.close` therefore never
crashes a process that still holds a view; the mapping is released when the last view dies.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
from typing import Optional

import numpy as np
import torch

from lightning_shm.runtime.errors import SharedMemoryFullError

log = logging.getLogger(__name__)

PREFIX = "lshm"
SHM_DIR = "/dev/shm"
ALIGN = 64  # cache line: every region starts on its own line
_NAME_RE = re.compile(rf"^{PREFIX}_(\d+)_[0-9a-f]+_")


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_free_space(nbytes: int, what: str = "segment") -> None:
    """Fail early, with numbers and the usual fixes, when /dev/shm cannot hold ``nbytes`` more."""
    if not os.path.isdir(SHM_DIR):
        raise SharedMemoryFullError(f"{SHM_DIR} does not exist: lightning_shm needs POSIX shared memory (Linux).")
    free = shm_free_bytes()
    if nbytes > free:
        raise SharedMemoryFullError(
            f"{what} needs {nbytes / 2**20:.1f} MiB of shared memory but {SHM_DIR} has only "
            f"{free / 2**20:.1f} MiB free. In Docker the default is 64 MB: start the container with "
            f"--shm-size=1g (or --ipc=host), or reduce the model / bucket / scratch sizes."
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink segments of this project whose owner process no longer exists. Returns their names."""
    removed: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in entries:
        m = _NAME_RE.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
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
    """Names of this project's segments owned by ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}_{pid}_"))
    except FileNotFoundError:
        return []


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
        name = f"{PREFIX}_{os.getpid()}_{secrets.token_hex(4)}_{safe_tag}"
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
        return self._base[offset:end].view(dtype)

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


def _unlink_quietly(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass
