"""Start W workers, serve their shared-memory requests, watch them, and clean up on every path.

The main process:

1. sweeps segments left by dead runs, creates the control segment (abort flag);
2. starts W processes (``spawn`` by default, ``fork`` selectable) running ``fn(world, *args)``;
3. loops on ``multiprocessing.connection.wait`` over the workers' pipes *and* process sentinels:
   it creates segments on request (it is the only creator, see :mod:`.segment`), collects results,
   and notices a worker that raised or died (SIGKILL, segfault, OOM) the moment it happens;
4. on the first failure sets the abort flag -- every waiting rank raises
   :class:`PeerAbortedError` within milliseconds -- gives the others ``abort_grace_s`` to stop,
   then terminates / kills the rest;
5. re-raises the failing worker's own exception (same type and message, its traceback text as
   ``__cause__``), or :class:`WorkerDiedError` naming the rank and signal;
6. unlinks every segment in ``finally``: normal exit, worker exception, worker SIGKILL, Ctrl-C
   or SIGTERM to the main process (SIGTERM is turned into ``SystemExit`` while launching).

Workers ignore SIGINT (Ctrl-C reaches the whole process group; the main process coordinates the
shutdown) and ask the kernel to SIGKILL them if the main process dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Optional

from lightning_shm.runtime.errors import PeerAbortedError, WorkerDiedError, WorkerTraceback
from lightning_shm.runtime.messages import send
from lightning_shm.runtime.segment import Segment, sweep_stale
from lightning_shm.runtime.world import ABORT_WORD, CONTROL_BYTES, RuntimeConfig, World, thread_budget

log = logging.getLogger(__name__)

START_METHODS = ("spawn", "fork", "forkserver")


@dataclass
class LaunchConfig:
    """How to start and supervise the workers."""

    world_size: int
    start_method: str = "spawn"
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    abort_grace_s: float = 3.0  # after a failure: time for the others to notice the abort flag
    threads: Optional[int] = None  # per worker; None = user's OMP_NUM_THREADS or cores // W

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {self.start_method!r}")
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(f"start_method {self.start_method!r} is not available on this platform")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.abort_grace_s < 0:
            raise ValueError(f"abort_grace_s must be >= 0, got {self.abort_grace_s}")


@dataclass
class _Failure:
    rank: int
    at: float
    exc: BaseException
    secondary: bool  # a consequence of another failure (PeerAbortedError)


class Launcher:
    """Runs ``fn(world, *args, **kwargs)`` on ``world_size`` processes; returns every rank's result."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.procs: list[mp.process.BaseProcess] = []
        self._segments: dict[str, Segment] = {}
        self._control: Optional[Segment] = None

    # ------------------------------------------------------------------ public
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        cfg = self.config
        sweep_stale()
        ctx = mp.get_context(cfg.start_method)
        threads = cfg.threads or thread_budget(cfg.world_size)
        if cfg.start_method == "fork":
            threads = _fork_safe_threads(threads)
        conns: list[Connection] = []
        self.procs = []
        try:
            with _sigterm_as_exit():
                self._control = Segment.create(CONTROL_BYTES, "control")
                # spawn: pickle the job by value ourselves. multiprocessing's ForkingPickler would turn
                # every CPU tensor into shared memory -- all workers would then update one tensor
                # (seen: a torchmetrics SumMetric counting every rank's updates twice).
                job = (fn, args, kwargs) if cfg.start_method == "fork" else pickle.dumps(
                    (fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
                for rank in range(cfg.world_size):
                    parent, child = ctx.Pipe(duplex=True)
                    p = ctx.Process(
                        target=_worker_entry,
                        args=(rank, cfg.world_size, self._control.name, child, cfg.runtime, threads, os.getpid(), job),
                        name=f"lightning_shm-rank{rank}",
                    )
                    p.start()
                    child.close()
                    conns.append(parent)
                    self.procs.append(p)
                return self._supervise(conns)
        finally:
            self._shutdown(conns)

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Send ``signum`` to every live worker (Lightning's ``launcher.kill`` hook)."""
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    # ------------------------------------------------------------------ supervision
    def _supervise(self, conns: list[Connection]) -> list[Any]:
        W = self.config.world_size
        results: dict[int, Any] = {}
        failures: list[_Failure] = []
        finished: set[int] = set()  # process exited (with or without a message)
        conn_rank = {id(c): r for r, c in enumerate(conns)}
        open_conns = {r: c for r, c in enumerate(conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        abort_at: Optional[float] = None
        while len(finished) < W:
            timeout = 0.2 if abort_at is None else 0.05
            ready = wait(list(open_conns.values()) + [s for s, r in sentinels.items() if r not in finished], timeout)
            for obj in ready:
                if isinstance(obj, Connection):
                    self._drain(conn_rank[id(obj)], obj, open_conns, results, failures)
            for obj in ready:
                if not isinstance(obj, Connection) and sentinels[obj] not in finished:
                    r = sentinels[obj]
                    if r in open_conns:  # the last messages may arrive together with the exit
                        self._drain(r, open_conns[r], open_conns, results, failures)
                    self.procs[r].join(timeout=1.0)
                    finished.add(r)
                    if r not in results and not any(f.rank == r for f in failures):
                        failures.append(_Failure(r, time.monotonic(), _died(r, self.procs[r]), secondary=False))
            if failures and abort_at is None:
                self._set_abort(1)
                abort_at = time.monotonic()
            if abort_at is not None and time.monotonic() - abort_at > self.config.abort_grace_s:
                break  # stragglers are terminated in _shutdown
        if failures:
            raise self._primary_error(failures)
        return [results[r] for r in range(W)]

    def _drain(self, rank: int, conn: Connection, open_conns: dict[int, Connection], results: dict[int, Any],
               failures: list[_Failure]) -> None:
        try:
            while conn.poll():
                data = conn.recv_bytes()
                try:
                    msg = pickle.loads(data)
                except Exception as e:  # e.g. a result referencing a class the main process cannot import
                    err = RuntimeError(f"could not unpickle a message from worker rank {rank}: {e!r}")
                    failures.append(_Failure(rank, time.monotonic(), err, secondary=False))
                    continue
                kind = msg[0]
                if kind == "alloc":
                    send(conn, self._alloc(msg[1], msg[2]))
                elif kind == "done":
                    results[rank] = msg[1]
                elif kind == "error":
                    exc = _rebuild(rank, *msg[1:])
                    failures.append(_Failure(rank, time.monotonic(), exc, isinstance(exc, PeerAbortedError)))
        except (EOFError, OSError):
            open_conns.pop(rank, None)

    def _alloc(self, key: str, nbytes: int) -> tuple[str, Any]:
        seg = self._segments.get(key)
        try:
            if seg is None:
                seg = Segment.create(nbytes, key)
                self._segments[key] = seg
            elif seg.size < nbytes:
                raise ValueError(f"shared segment {key!r} was created with {seg.size} bytes; another rank asked "
                                 f"for {nbytes}: ranks disagree on its size")
            return ("ok", seg.name)
        except Exception as e:  # sent to the worker, raised there
            return ("error", e)

    def _set_abort(self, code: int) -> None:
        if self._control is not None and not self._control.closed:
            self._control.words()[ABORT_WORD] = code

    @staticmethod
    def _primary_error(failures: list[_Failure]) -> BaseException:
        primary = [f for f in failures if not f.secondary] or failures
        first = min(primary, key=lambda f: f.at)
        others = sorted({f.rank for f in failures} - {first.rank})
        if others and hasattr(first.exc, "add_note"):
            first.exc.add_note(f"(ranks {others} stopped because rank {first.rank} failed)")
        return first.exc

    # ------------------------------------------------------------------ cleanup
    def _shutdown(self, conns: list[Connection]) -> None:
        """Stop every worker and unlink every segment. Never raises over the original error."""
        try:
            if any(p.is_alive() for p in self.procs):
                self._set_abort(2)
                _join_all(self.procs, self.config.abort_grace_s)
                for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
                    if not any(p.is_alive() for p in self.procs):
                        break
                    self.kill(sig)
                    _join_all(self.procs, grace)
            for p in self.procs:
                with contextlib.suppress(Exception):
                    p.join(timeout=0)
                    if hasattr(p, "close") and not p.is_alive():
                        p.close()
        except BaseException:  # pragma: no cover - cleanup must not mask the original error
            log.exception("error while stopping workers")
        finally:
            for c in conns:
                with contextlib.suppress(Exception):
                    c.close()
            segs = list(self._segments.values()) + ([self._control] if self._control is not None else [])
            for seg in segs:
                try:
                    seg.close()
                finally:
                    seg.unlink()
            self._segments.clear()
            self._control = None


def launch(fn: Callable[..., Any], world_size: int, *args: Any, start_method: str = "spawn",
           runtime: Optional[RuntimeConfig] = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(world, *args, **kwargs)`` on ``world_size`` processes; return their results in rank order."""
    cfg = LaunchConfig(world_size, start_method=start_method, runtime=runtime or RuntimeConfig())
    return Launcher(cfg).run(fn, *args, **kwargs)


# ---------------------------------------------------------------------- worker side
def _worker_entry(rank: int, world_size: int, control_name: str, conn: Connection, runtime: RuntimeConfig,
                  threads: int, parent_pid: int, job: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent_pid)
    import torch

    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["LIGHTNING_SHM_RANK"] = str(rank)
    world: Optional[World] = None
    code = 0
    try:
        fn, args, kwargs = pickle.loads(job) if isinstance(job, bytes) else job
        world = World(rank, world_size, Segment.attach(control_name), conn, runtime)
        result = fn(world, *args, **kwargs)
        send(conn, ("done", result))
    except BaseException as e:  # noqa: BLE001 - everything is reported to the main process
        code = 1
        _report(conn, e)
    finally:
        if world is not None:
            world.close()
        with contextlib.suppress(Exception):
            conn.close()
    if code:
        sys.exit(code)  # multiprocessing still runs its finalizers (semaphores, queues) on the way out


def _report(conn: Connection, e: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        payload: Optional[bytes] = pickle.dumps(e)
        pickle.loads(payload)
    except Exception:
        payload = None
    with contextlib.suppress(Exception):
        send(conn, ("error", payload, f"{type(e).__module__}.{type(e).__qualname__}", str(e), tb))


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this worker when the main process dies (no orphan spinning in a barrier)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(1)


def _rebuild(rank: int, payload: Optional[bytes], type_name: str, message: str, tb: str) -> BaseException:
    exc: Optional[BaseException] = None
    if payload is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(payload)
    if exc is None:
        exc = RuntimeError(f"{type_name}: {message}")
    exc.__cause__ = WorkerTraceback(f"\n\nTraceback in worker rank {rank}:\n{tb}")
    if hasattr(exc, "add_note"):
        exc.add_note(f"raised in lightning_shm worker rank {rank}")
    return exc


def _died(rank: int, proc: mp.process.BaseProcess) -> WorkerDiedError:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code} without reporting a result"
    return WorkerDiedError(f"worker rank {rank} (pid {proc.pid}) {how}")


def _fork_safe_threads(threads: int) -> int:
    """Forked workers run single-threaded.

    GNU OpenMP (torch's CPU thread pool) hangs in a child forked after the parent started its pool:
    the child waits forever for pool threads that were not copied (seen here in a ``mul`` kernel).
    Whether the parent started it cannot be queried, so ``fork`` never gives a worker more than one
    thread; ``spawn`` (the default) has no such limit.
    """
    if threads > 1:
        log.warning("start_method='fork': workers use 1 thread instead of %d (OpenMP cannot run in a child "
                    "forked after the parent's thread pool started); use 'spawn' for %d threads per worker",
                    threads, threads)
        return 1
    return threads


def _join_all(procs: list[mp.process.BaseProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(timeout=max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit`` so ``finally`` clean-up runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
