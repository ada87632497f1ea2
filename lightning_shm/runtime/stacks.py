"""Where was a worker? Python stacks dumped on request, so a hang names the line, not only the rank.

Each worker registers :mod:`faulthandler` on ``SIGUSR2`` with a file the main process created for
it (a segment, so it is cleaned up like every other). faulthandler writes from C inside the signal
handler, without the GIL, so it works while the worker sleeps, spins in a barrier or computes in a
kernel. The worker first writes its main thread's id, so the main process can pick that thread's
frames out of the dump::

    main 0x00007f3a...                               <- written by the worker at start
    Thread 0x00007f39... (most recent call first):   <- faulthandler, on SIGUSR2
      File ".../wait.py", line 88 in wait_ge
    Current thread 0x00007f3a... (most recent call first):
      File "train.py", line 12 in training_step
      ...
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sysconfig
import threading
import time
from typing import IO, Optional

DUMP_SIGNAL = signal.SIGUSR2
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_file: Optional[IO[bytes]] = None  # kept open for the worker's lifetime: faulthandler only has the fd


def register(path: str) -> None:
    """Worker side: dump every thread's stack into ``path`` on ``SIGUSR2``.

    The handler is installed *before* the header is written: the main process signals only workers
    whose header it can read (:func:`ready`), since SIGUSR2's default action kills a process -- a
    worker still starting (a fork server forks the ranks one after another) must never get it."""
    global _file
    _file = open(path, "r+b", buffering=0)  # noqa: SIM115 - must outlive this call
    faulthandler.register(DUMP_SIGNAL, file=_file, all_threads=True, chain=False)
    _file.write(f"main 0x{threading.main_thread().ident:016x}\n".encode())


def ready(path: str) -> bool:
    """Main side: has the worker dumping into ``path`` installed its handler?"""
    return _read(path).startswith(b"main 0x")


def request(pids: dict[int, int], paths: dict[int, str]) -> dict[int, str]:
    """Main side: ask the workers ``{rank: pid}`` that are :func:`ready` and still catch the signal to dump
    their stacks into ``paths[rank]``; returns ``{rank: path}`` of those asked (what :func:`collect` should
    read). A worker whose own code put the signal's default back (Lightning's teardown restores every handler
    Python knows of, and Python never saw faulthandler's) would be killed by the request: it is not asked."""
    asked = {}
    for rank, pid in pids.items():
        if not ready(paths[rank]) or not catches(pid, DUMP_SIGNAL):
            continue
        try:
            os.kill(pid, DUMP_SIGNAL)
            asked[rank] = paths[rank]
        except ProcessLookupError:
            pass
    return asked


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (Linux: its ``SigCgt`` mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def collect(paths: dict[int, str], timeout_s: float = 0.5) -> dict[int, list[tuple[str, int, str]]]:
    """Main side: the main thread's frames ``(file, line, function)``, innermost first, per rank.

    Waits until each dump has stopped growing (faulthandler writes it in one go) or ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    out: dict[int, list[tuple[str, int, str]]] = {}
    pending = dict(paths)
    last: dict[int, bytes] = {}
    while pending and time.monotonic() < deadline:
        time.sleep(0.02)
        for rank, path in list(pending.items()):
            text = _read(path)
            frames = parse(text.decode(errors="replace"))
            if frames and last.get(rank) == text:  # stable for one poll: complete
                out[rank] = frames
                del pending[rank]
            last[rank] = text
    for rank, path in pending.items():  # whatever arrived
        frames = parse(_read(path).decode(errors="replace"))
        if frames:
            out[rank] = frames
    return out


def parse(text: str) -> list[tuple[str, int, str]]:
    """Frames of the thread named on the ``main 0x...`` line (its last dump), innermost first."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("main "):
        return []
    main_id = int(lines[0].split()[1], 16)
    frames: list[tuple[str, int, str]] = []
    current: Optional[int] = None
    for line in lines[1:]:
        m = _THREAD.match(line)
        if m:
            current = int(m.group(1), 16)
            if current == main_id:
                frames = []  # a later dump replaces an earlier one
            continue
        f = _FRAME.match(line)
        if f and current == main_id:
            frames.append((f.group("file"), int(f.group("line")), f.group("func")))
    return frames


_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


_PACKAGE_DIR = os.path.dirname(_RUNTIME_DIR.rstrip(os.sep)) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _libraries(path: str) -> bool:
    """A frame of this package, of an installed one or of Python's own: not the program's."""
    path = os.path.abspath(path)
    return (path.startswith((_PACKAGE_DIR, _STDLIB_DIR)) or f"{os.sep}site-packages{os.sep}" in path
            or f"{os.sep}dist-packages{os.sep}" in path)


def describe(rank: int, frames: list[tuple[str, int, str]], depth: int = 4) -> str:
    """The ``depth`` innermost frames outside this runtime: a rank blocked in a wait is in the runtime's
    waiter, barrier and group, which say nothing of which call of the program it waits in. If none of them is
    the program's own (a collective inside a library's layer), the innermost one that is follows: the line of
    the program that made the call (a callback running the model on rank 0 alone)."""
    outside = [f for f in frames if not os.path.abspath(f[0]).startswith(_RUNTIME_DIR)]
    left_out = len(frames) - len(outside) if outside else 0
    kept = (outside or frames)[:depth]
    lines = [f'    File "{f}", line {n}, in {fn}' for f, n, fn in kept]
    if kept and all(_libraries(f) for f, _, _ in kept):
        own = next((i for i, (f, _, _) in enumerate(outside) if not _libraries(f)), None)
        if own is not None:
            f, n, fn = outside[own]
            lines += [f"    ... {own - len(kept)} frames of libraries ...", f'    File "{f}", line {n}, in {fn}']
    runtime = f", {left_out} of the runtime's own left out" if left_out else ""
    return f"rank {rank} was here (innermost frame first{runtime}):\n" + "\n".join(lines)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read().rstrip(b"\0")
    except OSError:
        return b""
