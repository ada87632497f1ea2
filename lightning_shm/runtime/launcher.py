"""Start W workers, serve their shared-memory requests, watch them, and clean up on every path.

The main process:

1. sweeps segments left by dead runs, creates the control segment (abort flag, stop requests);
2. starts W processes (``spawn`` by default; ``fork``, or ``forkserver`` -- a server with torch and
   lightning imported once, forking every worker -- selectable) running ``fn(world, *args)``. A
   spawned worker reads the pickled job from a segment (a pipe would block the main process for
   ever if the child died before reading it); its stderr passes through the main process
   (:mod:`.relay`), which keeps the last lines;
3. loops on ``multiprocessing.connection.wait`` over the workers' pipes, process sentinels, stderr
   pipes and a wake-up pipe for signals: it creates segments on request (it is the only creator,
   see :mod:`.segment`), collects results, and notices a worker that raised or died (SIGKILL,
   segfault, OOM, a failed start-up) the moment it happens;
4. on the first failure asks the surviving workers for their Python stacks (:mod:`.stacks`), sets
   the abort flag -- every waiting rank raises :class:`PeerAbortedError` within milliseconds --,
   gives them ``abort_grace_s`` to report, SIGKILLs the rest and re-raises the failing worker's own
   exception (same type and message, its traceback text as ``__cause__``; a timeout adds where the
   ranks it waited for were, a collective mismatch where the other rank was and what it noted of its
   program's state), or :class:`WorkerDiedError` with the worker's last stderr lines.
   All of it within ~2 s of the failure;
5. SIGINT / SIGTERM: with ``graceful_stop`` the first one becomes a stop request the workers agree
   on at their next safe point (:meth:`World.stop_requested`, :meth:`Group.vote_max`) and unwind
   from; a second signal, or ``stop_grace_s`` without them stopping, stops them at once. So does the first
   one while a rank has not polled yet (:func:`~.world.polls_word`: still starting, maybe for minutes), and,
   without ``graceful_stop``, any first signal. ``stop_signal`` tells the caller;
6. unlinks every segment in ``finally``: normal exit, worker exception, worker SIGKILL, signals.

Workers ignore SIGINT (Ctrl-C reaches the whole process group; the main process coordinates),
turn their own SIGTERM into a stop request (``graceful_stop``), ask the kernel to SIGKILL them if
the main process dies (``PR_SET_PDEATHSIG``) and leave with ``os._exit`` once their result is sent:
interpreter shutdown with torch loaded takes seconds and nothing in it matters to the run.

Processes a worker starts itself (a DataLoader's workers) start as they would in the user's own
process: with the main process's multiprocessing start method (multiprocessing would otherwise make
the fork server or spawn, whichever started the worker, its default), and with SIGTERM's default action.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Optional, Sequence

from lightning_shm.runtime import forkserver, stacks
from lightning_shm.runtime.deadlock import DeadlockError
from lightning_shm.runtime.errors import (
    BarrierTimeoutError,
    CollectiveMismatchError,
    PeerAbortedError,
    WorkerDiedError,
    WorkerTraceback,
)
from lightning_shm.runtime.messages import send
from lightning_shm.runtime.relay import StderrRelay
from lightning_shm.runtime.segment import SHM_DIR, Segment, close_inherited_owner_lock, sweep_stale
from lightning_shm.runtime.world import (
    ABORT_WORD,
    STOP_WORD,
    RuntimeConfig,
    World,
    control_bytes,
    polls_word,
    thread_budget,
)

log = logging.getLogger(__name__)

START_METHODS = ("spawn", "fork", "forkserver")
_STACK_BYTES = 64 << 10


@dataclass
class LaunchConfig:
    """How to start and supervise the workers."""

    world_size: int
    start_method: str = "spawn"
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    abort_grace_s: float = 1.0  # after a failure: time for the others to report before they are killed
    threads: Optional[int] = None  # per worker; None = user's OMP_NUM_THREADS or cores // W
    graceful_stop: bool = False  # SIGINT/SIGTERM: ask the workers to stop at a safe point (they must poll)
    stop_grace_s: float = 60.0  # ... and stop them at once if they have not stopped by then
    preload: tuple[str, ...] = ("torch",)  # forkserver: modules the server imports once for every worker

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {self.start_method!r}")
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(f"start_method {self.start_method!r} is not available on this platform")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.abort_grace_s < 0 or self.stop_grace_s < 0:
            raise ValueError(f"abort_grace_s and stop_grace_s must be >= 0, got {self.abort_grace_s}, "
                             f"{self.stop_grace_s}")


@dataclass
class _Failure:
    rank: int
    at: float
    exc: BaseException
    secondary: bool  # a consequence of another failure (PeerAbortedError)
    frames: tuple[tuple[str, int, str], ...] = ()  # where the worker raised it, innermost first


@dataclass(frozen=True)
class _WorkerArgs:
    rank: int
    world_size: int
    control: str
    runtime: RuntimeConfig
    threads: int
    parent_pid: int
    stack_path: str
    start_method: str
    graceful_stop: bool
    environ: Optional[dict[str, str]]  # fork server: the main process's environment now (the server's is old)
    mp_start_method: Optional[str]  # the main process's default start method (None: the platform's)


class Launcher:
    """Runs ``fn(world, *args, **kwargs)`` on ``world_size`` processes; returns every rank's result."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.procs: list[mp.process.BaseProcess] = []
        self.stop_signal = 0  # the first SIGINT/SIGTERM received while running (0: none)
        self._segments: dict[str, Segment] = {}
        self._control: Optional[Segment] = None
        self._stack_paths: dict[int, str] = {}
        self._relay = StderrRelay()
        self._signals: list[int] = []
        self._wake: Optional[tuple[int, int]] = None
        self._server_mark: Optional[int] = None  # fork server: where its output stood when this run began

    # ------------------------------------------------------------------ public
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        cfg = self.config
        sweep_stale()
        ctx = mp.get_context(cfg.start_method)
        if cfg.start_method == "forkserver":
            forkserver.ensure_running(ctx, cfg.preload)
            self._server_mark = forkserver.mark()
        threads = cfg.threads or thread_budget(cfg.world_size)
        if cfg.start_method == "fork":
            threads = _fork_safe_threads(threads)
        conns: list[Connection] = []
        self.procs = []
        self.stop_signal = 0
        try:
            with self._signal_handlers():
                self._control = self._create("control", control_bytes(cfg.world_size))
                job = self._job(fn, args, kwargs)
                for rank in range(cfg.world_size):
                    self._stack_paths[rank] = os.path.join(SHM_DIR, self._create(f"stack{rank}", _STACK_BYTES).name)
                    wargs = _WorkerArgs(rank, cfg.world_size, self._control.name, cfg.runtime, threads, os.getpid(),
                                        self._stack_paths[rank], cfg.start_method, cfg.graceful_stop,
                                        dict(os.environ) if cfg.start_method == "forkserver" else None,
                                        mp.get_start_method(allow_none=True))
                    parent, child = ctx.Pipe(duplex=True)
                    with self._relay.capturing(rank) as stderr_fd:
                        # a fork server's children inherit the server's fds 0-2, not ours: send the pipe
                        err = Connection(os.dup(stderr_fd), readable=False) if cfg.start_method == "forkserver" \
                            else None
                        p = ctx.Process(target=_worker_entry, args=(wargs, child, job, err),
                                        name=f"lightning_shm-rank{rank}")
                        p.start()
                        if err is not None:
                            err.close()
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

    # ------------------------------------------------------------------ set-up
    def _create(self, key: str, nbytes: int) -> Segment:
        seg = Segment.create(nbytes, key)
        self._segments[key] = seg
        return seg

    def _job(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Fork: the objects themselves. Spawn: pickled here, by value -- multiprocessing's ForkingPickler
        would turn every CPU tensor into shared memory and all workers would update one tensor (seen:
        a torchmetrics SumMetric counting every rank's updates twice) -- into a segment the workers read.
        A pickling error surfaces here, before any worker starts."""
        if self.config.start_method == "fork":
            return ("object", (fn, args, kwargs))
        try:
            data = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError, RuntimeError) as e:  # RuntimeError: TorchScript's
            e.add_note(f"start_method={self.config.start_method!r} sends the job to every worker by pickling it -- the "
                       "function and its arguments, everything they refer to. A lambda, a function or class defined "
                       "inside another, an open file or lock, a TorchScript module (torch.jit.script) cannot be "
                       "pickled: define it at a module's top level (script a model after training), or start the "
                       "workers with start_method='fork'.")
            raise
        seg = self._create("job", len(data))
        seg.write_bytes(data)
        return ("segment", seg.name, len(data))

    @contextlib.contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        """SIGINT / SIGTERM are queued and handled by the supervision loop (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._wake = (r, w)

        def handler(signum: int, frame: Any) -> None:
            self._signals.append(signum)
            with contextlib.suppress(OSError):
                os.write(w, b"\0")

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self._wake = None
            os.close(r)
            os.close(w)

    # ------------------------------------------------------------------ supervision
    def _supervise(self, conns: list[Connection]) -> list[Any]:
        cfg = self.config
        W = cfg.world_size
        results: dict[int, Any] = {}
        failures: list[_Failure] = []
        finished: set[int] = set()  # process exited (with or without a message)
        conn_rank = {id(c): r for r, c in enumerate(conns)}
        open_conns = {r: c for r, c in enumerate(conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        abort_at: Optional[float] = None
        stop_at: Optional[float] = None
        hard_stop = 0
        where: dict[int, list[tuple[str, int, str]]] = {}
        while len(finished) < W:
            waitables: list[Any] = list(open_conns.values()) + [s for s, r in sentinels.items() if r not in finished]
            waitables += self._relay.fds + ([self._wake[0]] if self._wake else [])
            ready = wait(waitables, 0.2 if abort_at is None else 0.02)
            for obj in ready:
                if isinstance(obj, int):
                    self._relay.pump(obj)
            for obj in ready:
                if isinstance(obj, Connection):
                    self._drain(conn_rank[id(obj)], obj, open_conns, results, failures)
            for obj in ready:
                if obj in sentinels and sentinels[obj] not in finished:
                    r = sentinels[obj]
                    if r in open_conns:  # the last messages may arrive together with the exit
                        self._drain(r, open_conns[r], open_conns, results, failures)
                    self.procs[r].join(timeout=1.0)
                    finished.add(r)
                    if r not in results and not any(f.rank == r for f in failures):
                        self._relay.pump_all()
                        failures.append(_Failure(r, time.monotonic(), self._died(r), secondary=False))
            # signals: the first asks for a graceful stop (if enabled), any further one stops at once
            if self._wake is not None:
                with contextlib.suppress(OSError):
                    os.read(self._wake[0], 64)
            while self._signals:
                signum = self._signals.pop(0)
                if cfg.graceful_stop and not self.stop_signal:
                    self.stop_signal = signum
                    starting = self._starting(finished | set(results))
                    if starting:  # nothing trained to save yet, and maybe no step for minutes (a rendezvous)
                        log.warning("received %s before rank%s %s reached a first step (still starting: setup, a "
                                    "rendezvous, a hook): stopping the workers at once", signal.Signals(signum).name,
                                    "s" * (len(starting) > 1), ", ".join(map(str, starting)))
                        hard_stop = signum
                    else:
                        self._control.words()[STOP_WORD] = signum  # type: ignore[union-attr]
                        stop_at = time.monotonic()
                        log.warning("received %s: the workers stop at their next safe point (send it again to stop "
                                    "them at once)", signal.Signals(signum).name)
                elif not hard_stop:
                    self.stop_signal = self.stop_signal or signum
                    hard_stop = signum
            if stop_at is not None and not hard_stop and time.monotonic() - stop_at > cfg.stop_grace_s:
                log.warning("the workers did not stop within stop_grace_s=%g s of %s; stopping them now",
                            cfg.stop_grace_s, signal.Signals(self.stop_signal).name)
                hard_stop = self.stop_signal
            if (failures or hard_stop) and abort_at is None:
                where = self._where(finished | set(results))
                self._set_abort(1)
                abort_at = time.monotonic()
            if abort_at is not None and time.monotonic() - abort_at > cfg.abort_grace_s:
                break  # stragglers are killed in _shutdown
        if failures and not (hard_stop and all(f.secondary for f in failures)):
            raise self._primary_error(failures, where)
        if hard_stop:
            for rank, frames in sorted(where.items()):
                log.warning(stacks.describe(rank, frames))
            raise KeyboardInterrupt() if hard_stop == signal.SIGINT else SystemExit(128 + hard_stop)
        return [results[r] for r in range(W)]

    def _starting(self, done: set[int]) -> list[int]:
        """The running ranks that have not polled for stop requests yet (:func:`~.world.polls_word`)."""
        words = self._control.words()  # type: ignore[union-attr]
        W = self.config.world_size
        return [r for r in range(W) if r not in done and not words[polls_word(r, W)]]

    def _where(self, done: set[int]) -> dict[int, list[tuple[str, int, str]]]:
        """Stacks of the workers still running, taken before the abort flag moves them."""
        live = {r: p.pid for r, p in enumerate(self.procs) if r not in done and p.pid is not None and p.is_alive()}
        if not live:
            return {}
        return stacks.collect(stacks.request(live, self._stack_paths))

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
                    exc = _rebuild(rank, *msg[1:5])
                    failures.append(_Failure(rank, time.monotonic(), exc, isinstance(exc, PeerAbortedError),
                                             tuple(msg[5])))
        except (EOFError, OSError):
            open_conns.pop(rank, None)

    def _alloc(self, key: str, nbytes: int) -> tuple[str, Any]:
        seg = self._segments.get(key)
        try:
            if seg is None:
                seg = self._create(key, nbytes)
            elif seg.size < nbytes:
                raise ValueError(f"shared segment {key!r} was created with {seg.size} bytes; another rank asked "
                                 f"for {nbytes}: ranks disagree on its size")
            return ("ok", seg.name)
        except Exception as e:  # sent to the worker, raised there
            return ("error", e)

    def _set_abort(self, code: int) -> None:
        if self._control is not None and not self._control.closed:
            self._control.words()[ABORT_WORD] = code

    def _died(self, rank: int) -> WorkerDiedError:
        err = _died(rank, self.procs[rank])
        tail = self._relay.tail(rank)
        if tail:
            err.add_note(f"last lines rank {rank} wrote to stderr:\n{tail}")
        elif self._server_mark is not None:  # died before taking its own stderr (e.g. importing the script)
            early = forkserver.output_since(self._server_mark)
            if early:
                err.add_note(f"last lines the fork server's workers wrote to stderr:\n{early}")
        return err

    @staticmethod
    def _primary_error(failures: list[_Failure], where: dict[int, list[tuple[str, int, str]]]) -> BaseException:
        primary = [f for f in failures if not f.secondary] or failures
        first = min(primary, key=lambda f: f.at)
        raised = {f.rank: f for f in failures}
        others = sorted(set(raised) - {first.rank})
        # the other side of a mismatch, another rank of a deadlock's cycle, found it too: it did not stop because
        # of the reported rank
        same = next((t for t in (DeadlockError, CollectiveMismatchError) if isinstance(first.exc, t)), None)
        met = [r for r in others if same is not None and isinstance(raised[r].exc, same)]
        if met:
            what = "deadlock" if same is DeadlockError else "mismatch"
            first.exc.add_note(f"(ranks {met} met the same {what} on their side)")
        stopped = [r for r in others if r not in met]
        if stopped:
            first.exc.add_note(f"(ranks {stopped} stopped because rank {first.rank} failed)")
        if isinstance(first.exc, BarrierTimeoutError):
            for rank in first.exc.missing:  # where each was when asked (a rank still waiting or computing)
                _add_peer(first.exc, rank, raised.get(rank), where.get(rank))
        elif isinstance(first.exc, CollectiveMismatchError) and first.exc.peer in raised:
            # the other side of a mismatch meets it at the same generation and raises too: where it raised is
            # the call it made instead
            _add_peer(first.exc, first.exc.peer, raised[first.exc.peer])
        return first.exc

    # ------------------------------------------------------------------ cleanup
    def _shutdown(self, conns: list[Connection]) -> None:
        """Stop every worker and unlink every segment. Never raises over the original error.

        Workers still alive here either missed the abort flag (stuck outside our waits) or the main
        process is leaving on an error of its own: SIGKILL, not SIGTERM (a worker's SIGTERM is a stop
        request that user code may not reach)."""
        try:
            if any(p.is_alive() for p in self.procs):
                self._set_abort(2)
                _join_all(self.procs, 0.2)
                self.kill(signal.SIGKILL)
                _join_all(self.procs, 5.0)
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
            with contextlib.suppress(Exception):
                self._relay.close()
            segs = list(self._segments.values())
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
def _worker_entry(a: _WorkerArgs, conn: Connection, job: Any, stderr: Optional[Connection] = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if stderr is not None:
        os.dup2(stderr.fileno(), 2)
        stderr.close()
    if a.environ is not None:
        os.environ.clear()
        os.environ.update(a.environ)
    _die_with_parent(a.parent_pid, direct=a.start_method != "forkserver")
    if a.start_method == "fork":
        close_inherited_owner_lock()  # the main process's liveness lock stays the main process's
    _start_children_as_the_user_would(a.mp_start_method)
    stacks.register(a.stack_path)
    if a.runtime.keep_freed_memory:
        keep_freed_memory()
    import torch

    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    os.environ["LIGHTNING_SHM_RANK"] = str(a.rank)
    world: Optional[World] = None
    code = 0
    try:
        fn, args, kwargs = _load_job(job)
        world = World(a.rank, a.world_size, Segment.attach(a.control), conn, a.runtime)
        if a.graceful_stop:
            w = world
            signal.signal(signal.SIGTERM, lambda signum, frame: w.request_stop(signum))
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
    _fast_exit(code, run_atexit=a.start_method != "fork")


def _start_children_as_the_user_would(method: Optional[str]) -> None:
    """Processes this worker starts (a DataLoader's ``num_workers``) start as in the main process.

    multiprocessing makes the method that started a process its default for the processes it starts.
    A DataLoader's workers in a rank would then come from the fork server or spawn: each imports
    torch and unpickles the dataset -- ~20 s before each epoch's first batch on 2 cores, and an
    error for a dataset that does not pickle -- where the user's own process (and Lightning's
    ``ddp``) forks them. They also must not inherit the rank's SIGTERM handler (a stop request for the
    whole run): a DataLoader terminates a worker that does not exit in time with SIGTERM.
    """
    mp.set_start_method(method, force=True)
    os.register_at_fork(after_in_child=_default_sigterm)


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # allowed in any forked child: its one thread is its main thread


def keep_freed_memory() -> None:
    """Make glibc keep freed large blocks in the heap instead of returning them to the OS.

    Training allocates and frees the same large tensors every step (gradients, FSDP's gathered
    units). glibc serves blocks over its mmap threshold (at most 32 MiB) with fresh mappings and
    unmaps them on free, so each step faults every page in again: a 64 MiB copy into fresh memory
    takes ~28 ms here, into reused memory ~5 ms. Like a caching allocator, the worker's footprint
    then stays at its peak instead of breathing with every step. Public: the benchmarks' one-process
    rows call it too, so that they run under the workers' policy.
    """
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
        libc.mallopt(m_arena_max, 1)  # one heap for every thread: it can grow without bound (brk)
        libc.mallopt(m_mmap_max, 0)  # every block from that heap, none mmap'd on its own
        libc.mallopt(m_trim_threshold, 2**31 - 1)  # and its free top is not given back


def _load_job(job: Any) -> tuple[Callable[..., Any], tuple, dict]:
    if job[0] == "object":
        return job[1]
    _, name, nbytes = job
    seg = Segment.attach(name)
    try:
        data = seg.read_bytes(nbytes)
    finally:
        seg.close()
    return pickle.loads(data)


def _fast_exit(code: int, run_atexit: bool) -> None:
    """Leave without interpreter shutdown: flush, run what must run (a spawned worker's own atexit
    handlers, multiprocessing's exit function -- it stops DataLoader workers), then ``os._exit``.
    A forked worker skips atexit, as multiprocessing's own fork children do: the handlers are the
    parent's."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    if run_atexit:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        mp.util._exit_function()
    os._exit(code)


def _report(conn: Connection, e: BaseException) -> None:
    tb = traceback.format_exc()
    frames = [(f.filename, f.lineno or 0, f.name) for f in reversed(traceback.extract_tb(e.__traceback__))]
    try:
        payload: Optional[bytes] = pickle.dumps(e)
        pickle.loads(payload)
    except Exception:
        payload = None
    with contextlib.suppress(Exception):
        send(conn, ("error", payload, f"{type(e).__module__}.{type(e).__qualname__}", str(e), tb, frames))


def _die_with_parent(parent_pid: int, direct: bool = True) -> None:
    """SIGKILL this worker when the main process dies (no orphan spinning in a barrier). Its child
    (spawn, fork): Linux does it (``PR_SET_PDEATHSIG``). A fork server's child: the server is its
    parent, so a thread waits on a pidfd of the main process instead."""
    if not direct:
        threading.Thread(target=_kill_self_when_gone, args=(parent_pid,), name="lightning_shm-parent-watch",
                         daemon=True).start()
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(1)


def _kill_self_when_gone(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
        select.select([fd], [], [])  # readable when the process has exited
    except OSError:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                pass
            time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def _rebuild(rank: int, payload: Optional[bytes], type_name: str, message: str, tb: str) -> BaseException:
    exc: Optional[BaseException] = None
    if payload is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(payload)
    if exc is None:
        exc = RuntimeError(f"{type_name}: {message}")
    exc.__cause__ = WorkerTraceback(f"\n\nTraceback in worker rank {rank}:\n{tb}")
    exc.add_note(_raised_in(rank))
    return exc


def _add_peer(exc: BaseException, rank: int, failure: Optional[_Failure],
              frames: Optional[Sequence[tuple[str, int, str]]] = None) -> None:
    """Beside the reported error: where another rank involved was -- where it raised, if it failed on its own (when
    asked it may have been unwinding that error already, or gone), else ``frames`` as asked for -- and what the
    layer above noted on its own error there (a Trainer's loop position: the two ranks' paths side by side)."""
    if failure is not None and failure.frames and (not failure.secondary or not frames):
        frames = failure.frames
    if frames:
        exc.add_note(stacks.describe(rank, list(frames)))
    if failure is not None:
        for note in getattr(failure.exc, "__notes__", ()):
            if note != _raised_in(rank):
                exc.add_note(note)


def _raised_in(rank: int) -> str:
    return f"raised in lightning_shm worker rank {rank}"


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
