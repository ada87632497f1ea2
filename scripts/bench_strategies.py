"""Training throughput of the strategies, side by side in one run, on the MNIST models.

    python scripts/bench_strategies.py                 # W=2: reference MLP, ~20M-parameter MLP, CNN, transformer
    python scripts/bench_strategies.py --quick         # fewer steps
    python scripts/bench_strategies.py --world-size 4 --models reference cnn

Rows (same global batch everywhere, synthetic MNIST-shaped data held in memory):

* ``single``: one process, batch = global batch, torch's default threads (all cores);
* ``ddp_spawn``: Lightning's own DDP over gloo, W processes;
* ``shm_ddp``: this project, W processes;
* ``ceiling``: W independent single-process trainings (batch = global / W, cores // W threads each)
  running concurrently -- no communication at all: the limit for W ranks on this machine;
* ``single`` and ``ceiling`` keep freed memory in the process as the strategies' workers do
  (``RuntimeConfig.keep_freed_memory``): without it their every step faults in fresh pages for its
  large gradients, which the ratios against them would count as the strategies' gain (``ddp_spawn``
  runs as Lightning runs it);
* ``ceiling, lock-step``: the same W trainings, made to wait for each other (a shared-memory barrier)
  where shm_ddp's ranks do -- after the loss (the logged ``sync_dist`` value) and after backward (the
  gradient all-reduce) --, still without moving any data: the limit for a *synchronous* strategy
  with shm_ddp's sync points. On a VM whose vCPUs do not run at the same speed at every moment, each
  step runs at the slower rank's pace; this row measures what that costs in the same run.

Every process iterates over the same MNIST-sized synthetic array (60,000 samples; epochs repeat).
Each configuration runs in its own process, forked from a server that imported torch and lightning
once (the driver waits until every process a run started has exited before the next); throughput is
measured over steady-state steps after a warm-up (start-up and process spawning excluded), ceiling
processes start their measured window together (file barrier). Prints a markdown table, writes it
and a PNG to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
MODELS: dict[str, dict[str, Any]] = {  # MNISTClassifier arguments
    "reference": {"arch": "mlp", "hidden_sizes": [256, 64]},
    "wide": {"arch": "mlp", "hidden_sizes": [4096, 4096]},
    "cnn": {"arch": "cnn"},
    "transformer": {"arch": "transformer"},
}
STEPS = {"reference": (50, 1000), "wide": (3, 12), "cnn": (5, 60), "transformer": (5, 60)}  # (warm-up, measured)
DATASET_SAMPLES = 60_000
LOCKSTEP_ROW = "ceiling, lock-step (no comm)"
TABLES = ("memory", "prefetch", "tp", "pipeline", "fixed", "layouts", "breakdown", "phases", "tp_layers")


@dataclass
class RunSpec:
    """One measured configuration (serialised to the child process as JSON)."""

    row: str
    strategy: str  # "single" | Lightning strategy name | "ceiling"
    devices: int
    model: str
    global_batch: int
    warmup: int
    steps: int
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    data_parallel: Optional[int] = None  # replicas seeing different data (default: devices)
    barrier_dir: Optional[str] = None
    index: int = 0
    count: int = 1
    lockstep: bool = False  # ceiling only: the independent runs wait for each other where shm_ddp syncs
    lockstep_segment: Optional[str] = None  # the barrier's shared memory (set by measure())
    phases: bool = False  # also split each step by phase (PhaseTimer)


# ---------------------------------------------------------------------- child process
class StepTimer(Callback):
    """Times ``steps`` optimizer steps after ``warmup`` on rank 0; writes seconds to ``out_path``."""

    def __init__(self, spec: RunSpec, out_path: Path) -> None:
        self.spec, self.out_path, self.t0 = spec, out_path, 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        spec = self.spec
        if trainer.global_step == spec.warmup:
            if spec.barrier_dir:  # ceiling: all independent runs measure the same window
                Path(spec.barrier_dir, f"ready{spec.index}").touch()
                while len(list(Path(spec.barrier_dir).glob("ready*"))) < spec.count:
                    time.sleep(0.001)
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.spec.warmup + self.spec.steps and trainer.is_global_zero:
            self.out_path.write_text(json.dumps({"seconds": time.perf_counter() - self.t0,
                                                 "threads": torch.get_num_threads()}))


class LockStep(Callback):
    """The lock-step ceiling: rank ``spec.index`` of ``spec.count`` independent trainings enters a barrier
    (the runtime's, over a segment the driver created) after each loss and after each backward -- the
    two points where shm_ddp's ranks synchronise. Counts the barriers and the time spent in them
    during the measured steps."""

    def __init__(self, spec: RunSpec) -> None:
        from lightning_shm.runtime.barrier import Barrier
        from lightning_shm.runtime.ops import Coll
        from lightning_shm.runtime.segment import Segment
        from lightning_shm.runtime.wait import Waiter, WaitPolicy

        assert spec.lockstep_segment is not None
        self.spec, self.coll = spec, int(Coll.BARRIER)
        self.segment = Segment.attach(spec.lockstep_segment)
        words = self.segment.words()
        policy = WaitPolicy.for_world(spec.count, os.cpu_count() or 1, timeout_s=120.0)
        waiter = Waiter(words, lockstep_abort_word(spec.count), policy)
        self.barrier = Barrier(words, 0, list(range(spec.count)), spec.index, waiter, "lock-step ceiling")
        self.seq = 0
        self.barriers = 0
        self.waited = 0.0

    def _sync(self, trainer: Any) -> None:
        self.seq += 1
        t0 = time.perf_counter()
        self.barrier.wait(self.seq, self.coll, 0, 0, 0)
        if self.spec.warmup <= trainer.global_step < self.spec.warmup + self.spec.steps:
            self.barriers += 1
            self.waited += time.perf_counter() - t0

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._sync(trainer)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._sync(trainer)


def middle_mean(rows: list[dict[str, float]], by: str = "step") -> dict[str, float]:
    """Each key's mean over the middle half of ``rows`` ranked by ``by`` (its interquartile steps).

    Why not each key's median: the medians of the parts do not add up to the median whole (on this
    noisy machine they once missed it by 11%), so such a table does not partition its step. Means
    over one set of steps do, exactly; leaving out the fastest and the slowest quarter keeps a
    preempted step from moving them."""
    ranked = sorted(rows, key=lambda r: r[by])
    q = len(ranked) // 4
    middle = ranked[q:len(ranked) - q]
    return {k: statistics.fmean(r[k] for r in middle) for k in rows[0]}


def lockstep_abort_word(count: int) -> int:
    """Layout of the lock-step segment: ``count`` barrier rows, then one abort word (never set)."""
    from lightning_shm.runtime.barrier import ROW_WORDS

    return count * ROW_WORDS


class PhaseTimer(Callback):
    """Every rank: each measured step split by Lightning's hooks, plus the time the runtime spent in
    collectives and, inside them, waiting for a peer -- ``middle_mean`` of the steps written to
    ``out_dir/rank<r>.json``.

    ``load``: previous step's end to this step's start (fetching the batch -- for split tp loading
    also its gather -- and moving it to the device); ``forward``: the training_step up to the loss;
    ``backward`` (shm_ddp's bucket all-reduces run here, in autograd hooks); ``sync``: after backward
    until the optimizer step (the strategy's post-backward); ``optimizer``: the step and zero_grad.
    ``collectives`` / ``waiting`` overlap the phases above.
    """

    _HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_train_batch_end")
    PHASES = ("load", "forward", "backward", "sync", "optimizer")  # between consecutive hooks

    def __init__(self, warmup: int, out_dir: Path) -> None:
        self.warmup, self.out_dir, self.rows = warmup, out_dir, []
        self.acc = {"collectives": 0.0, "waiting": 0.0}
        self.marks: dict[str, tuple[float, dict[str, float]]] = {}
        self.prev: tuple[float, dict[str, float]] = (0.0, dict(self.acc))

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Wrap the runtime's blocking points in this worker (a benchmark may look inside; the adapter does not)."""
        from lightning_shm.runtime.group import Group
        from lightning_shm.runtime.wait import Waiter

        depth = dict.fromkeys(self.acc, 0)

        def timed(fn: Any, key: str) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                depth[key] += 1
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    depth[key] -= 1
                    if depth[key] == 0:  # a collective built on another one counts once
                        self.acc[key] += time.perf_counter() - t0
            return wrapper

        Waiter.wait_ge = timed(Waiter.wait_ge, "waiting")  # type: ignore[method-assign]
        for name in ("barrier", "all_reduce", "reduce_scatter", "reduce_scatter_coalesced", "all_gather",
                     "all_gather_v", "broadcast", "broadcast_object", "all_gather_object", "vote_max"):
            setattr(Group, name, timed(getattr(Group, name), "collectives"))

    def _mark(self, hook: str) -> None:
        self.marks[hook] = (time.perf_counter(), dict(self.acc))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._mark("on_train_batch_start")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._mark("on_before_backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._mark("on_after_backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._mark("on_before_optimizer_step")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._mark("on_train_batch_end")
        marks = [self.prev] + [self.marks[h] for h in self._HOOKS]
        if trainer.global_step > self.warmup and self.prev[0]:
            row = {"step": marks[-1][0] - marks[0][0],
                   **{k: marks[-1][1][k] - marks[0][1][k] for k in self.acc}}
            for name, (t0, a0), (t1, a1) in zip(self.PHASES, marks, marks[1:]):
                row[name] = t1 - t0
                row[f"{name} in collectives"] = a1["collectives"] - a0["collectives"]
            self.rows.append(row)
        self.prev = marks[-1]

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        ms = {k: v * 1e3 for k, v in middle_mean(self.rows).items()}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(ms))


def run_one(spec: RunSpec) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT))
    import lightning_shm  # noqa: F401
    from lightning_shm.models import MNISTClassifier
    from lightning_shm.runtime.launcher import keep_freed_memory

    if spec.strategy in ("single", "ceiling"):
        # the memory policy of the strategies' workers (RuntimeConfig.keep_freed_memory), before anything large is
        # allocated: otherwise these rows fault in fresh pages for every step's gradients and the ratios against
        # them count that as the strategies' gain
        keep_freed_memory()
    replicas = 1 if spec.strategy == "single" else (spec.data_parallel or spec.devices)
    per_rank = spec.global_batch // replicas
    # an MNIST-sized training set, the same array in every row and process (epochs repeat as needed):
    # the input pipeline's cost grows with the array it gathers random rows from
    n = spec.global_batch * (DATASET_SAMPLES // spec.global_batch)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
    tmp = tempfile.TemporaryDirectory(prefix="bench_")  # removed when read back (or at exit)
    out_path = Path(tmp.name) / "timing.json"

    pl.seed_everything(0)
    model = MNISTClassifier(**MODELS[spec.model], optimizer="sgd", lr=0.01)
    if spec.strategy in ("single", "ceiling"):
        strategy, devices = "auto", 1
    elif spec.strategy_kwargs:
        from lightning.pytorch.strategies import StrategyRegistry

        entry = StrategyRegistry[spec.strategy]
        strategy = entry["strategy"](**{**entry["init_params"], **spec.strategy_kwargs})
        devices = spec.devices
    else:
        strategy, devices = spec.strategy, spec.devices
    callbacks: list[Callback] = [StepTimer(spec, out_path)]
    lockstep = LockStep(spec) if spec.lockstep else None
    if lockstep is not None:
        callbacks.append(lockstep)
    if spec.phases:
        callbacks.append(PhaseTimer(spec.warmup, out_path.parent))
    trainer = pl.Trainer(accelerator="cpu", strategy=strategy, devices=devices, max_steps=spec.warmup + spec.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(data, batch_size=per_rank, shuffle=True, drop_last=True))
    timing = json.loads(out_path.read_text())
    samples = spec.global_batch // (spec.count if spec.strategy == "ceiling" else 1) * spec.steps
    phases = [json.loads(f.read_text()) for f in sorted(out_path.parent.glob("rank*.json"))]
    tmp.cleanup()
    return {"samples_per_s": samples / timing["seconds"], "step_ms": timing["seconds"] / spec.steps * 1e3,
            "threads": timing["threads"], "phases": phases,
            "barriers_per_step": lockstep.barriers / spec.steps if lockstep else 0.0,
            "waited_ms_per_step": lockstep.waited / spec.steps * 1e3 if lockstep else 0.0}


# ---------------------------------------------------------------------- where a pipeline step goes
class StepBreakdown(Callback):
    """Every rank: its step's wall time split into compute actions (F / B / W, from the engine's
    timeline), waiting inside the schedule (the span of its actions minus their time) and the rest
    of the step outside the schedule (Lightning's loop, optimizer step, data, the step's broadcast)."""

    def __init__(self, warmup: int, out_dir: Path) -> None:
        self.warmup, self.out_dir, self.rows, self.t0 = warmup, out_dir, [], 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = time.perf_counter() - self.t0
        engine = trainer.strategy.parallel.engine  # a benchmark may look inside; the adapter does not
        if trainer.global_step <= self.warmup or not engine.timeline:
            return
        tl = engine.timeline
        busy = {k: sum(t.end - t.start for t in tl if t.kind == k) for k in ("F", "B", "W")}
        span = max(t.end for t in tl) - min(t.start for t in tl)
        self.rows.append({"step": step, **busy, "wait": span - sum(busy.values()), "outside": step - span})

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(middle_mean(self.rows)))


def breakdown_one(model: str, microbatches: int, schedule: str, global_batch: int,
                  split_linear: bool = False) -> list[dict[str, float]]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT))
    from lightning_shm import SHMPipeline
    from lightning_shm.models import MNISTClassifier

    warmup, steps = {"wide": (2, 8), "transformer": (5, 30)}[model]
    g = torch.Generator().manual_seed(0)
    n = global_batch * 20
    data = TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
    tmp = tempfile.TemporaryDirectory(prefix="bench_")
    out_dir = Path(tmp.name)
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", strategy=SHMPipeline(pipeline_parallel_size=2, microbatches=microbatches,
                                                                 schedule=schedule, split_linear=split_linear),
                         devices=2, max_steps=warmup + steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[StepBreakdown(warmup, out_dir)])
    trainer.fit(MNISTClassifier(**MODELS[model], optimizer="sgd", lr=0.01),
                DataLoader(data, batch_size=global_batch, shuffle=True, drop_last=True))
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    tmp.cleanup()
    return ranks


def breakdown_table(global_batch: int) -> str:
    lines = [f"## Where a pipeline step goes (P=2, global batch {global_batch}; ms per step, mean of the middle half "
             "of the steps; per stage)\n",
             "| model | cut | schedule | M | stage | step | F | B | W | waiting inside the schedule | "
             "outside the schedule |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    runs = [(model, split, schedule, M) for model, splits in (("wide", (False, True)), ("transformer", (False,)))
            for split in splits for schedule, M in (("1f1b", 4), ("1f1b", 8), ("zero_bubble", 4))]
    for model, split, schedule, M in runs:
        proc = subprocess.run([sys.executable, __file__, "--breakdown-one", model, str(M), schedule,
                               str(global_batch), str(int(split))], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"breakdown child failed:\n{proc.stderr[-3000:]}")
        for stage, r in enumerate(json.loads(proc.stdout.strip().splitlines()[-1])):
            ms = {k: v * 1e3 for k, v in r.items()}
            lines.append(f"| {model} | {'split_linear' if split else 'layers'} | {schedule} | {M} | {stage} | "
                         f"{ms['step']:.1f} | {ms['F']:.1f} | "
                         f"{ms['B']:.1f} | {ms['W']:.1f} | {ms['wait']:.1f} | {ms['outside']:.1f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- fixed cost per fit
class Edges(Callback):
    """Rank 0 writes the wall-clock time of its first step's start and its last step's end."""

    def __init__(self, out_path: Path) -> None:
        self.out_path, self.first = out_path, 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 0 and not self.first:
            self.first = time.time()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == trainer.max_steps and trainer.is_global_zero:
            self.out_path.write_text(json.dumps({"first": self.first, "last": time.time()}))


def fixed_cost_one(strategy: str, fits: int) -> list[dict[str, float]]:
    """``fits`` short fits in this process: seconds from ``fit()`` to rank 0's first step (start) and
    from rank 0's last step to ``fit()`` returning (stop). A second fit shows what a warm launcher saves."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT))
    import lightning_shm  # noqa: F401
    from lightning_shm.models import MNISTClassifier

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(640, 1, 28, 28, generator=g), torch.randint(0, 10, (640,), generator=g))
    out = []
    for _ in range(fits):
        with tempfile.TemporaryDirectory(prefix="bench_") as tmp:
            path = Path(tmp) / "edges.json"
            trainer = pl.Trainer(accelerator="cpu", strategy=strategy, devices=2, max_steps=5, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=[Edges(path)], num_sanity_val_steps=0)
            t_fit = time.time()
            trainer.fit(MNISTClassifier(**MODELS["reference"]), DataLoader(data, batch_size=32))
            t_ret = time.time()
            edges = json.loads(path.read_text())
        out.append({"start_s": edges["first"] - t_fit, "stop_s": t_ret - edges["last"]})
    return out


FIXED_COST_ROWS = {  # row -> registered strategy name
    "ddp_spawn (gloo)": "ddp_spawn",
    "shm_ddp (spawn)": "shm_ddp_spawn",
    "shm_ddp (forkserver, the default)": "shm_ddp",
    "shm_ddp (fork)": "shm_ddp_fork",
}


def fixed_costs(repeats: int, fits: int = 2, rows: Optional[list[str]] = None) -> dict[str, list[dict[str, float]]]:
    """Median over ``repeats`` fresh interpreters of each fit's start/stop seconds."""
    res = {}
    for row, name in FIXED_COST_ROWS.items():
        if rows is not None and row not in rows:
            continue
        runs = []
        for _ in range(repeats):
            proc = subprocess.run([sys.executable, __file__, "--fixed-cost-one", name, str(fits)], cwd=ROOT,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"fixed-cost child failed:\n{proc.stderr[-3000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        res[row] = [{k: statistics.median(r[i][k] for r in runs) for k in ("start_s", "stop_s")} for i in range(fits)]
    return res


def fixed_cost_table(res: dict[str, list[dict[str, float]]]) -> str:
    lines = ["## Fixed cost per fit (reference MLP, W=2; seconds, median of fresh interpreters)\n",
             "| row | first fit: fit() -> first step | last step -> fit() returns | second fit in the same "
             "process: start | stop |", "|---|---:|---:|---:|---:|"]
    for row, fits in res.items():
        a, b = fits[0], fits[-1]
        lines.append(f"| {row} | {a['start_s']:.2f} | {a['stop_s']:.2f} | {b['start_s']:.2f} | {b['stop_s']:.2f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- driver
class PreloadedChild:
    """One measured run in a process forked from a server that imported torch, lightning and
    lightning_shm once (:mod:`lightning_shm.runtime.forkserver`), instead of a fresh interpreter that
    imports them again: ~9 s per run on a slow day here, 27 runs in ``--summary``. Only steady-state
    steps are timed, so the rows measure the same thing either way; the fixed-cost rows, which time a
    fresh interpreter's start, keep ``subprocess``.

    Popen's surface, as :func:`collect` uses it: ``communicate()`` -> (stdout, stderr), ``returncode``
    (negative: killed by that signal), ``kill()``. The server's fds 0-2 are not ours, so the child
    writes stdout and stderr to files in a private directory, read back once it has exited."""

    def __init__(self, spec: RunSpec, env: Optional[dict[str, str]] = None) -> None:
        import multiprocessing

        from lightning_shm.runtime import forkserver
        from lightning_shm.strategies.launcher import FORKSERVER_PRELOAD

        ctx = multiprocessing.get_context("forkserver")
        forkserver.ensure_running(ctx, FORKSERVER_PRELOAD)
        self._tmp = tempfile.TemporaryDirectory(prefix="bench_child_")  # removed by communicate() or when dropped
        self._proc = ctx.Process(target=forked_run_one, args=(json.dumps(asdict(spec)), dict(env or os.environ),
                                                               self._tmp.name))
        self._proc.start()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()
        self._kill_group()

    def communicate(self) -> tuple[str, str]:
        self._proc.join()
        self._wait_for_group()
        with self._tmp as d:
            out, err = (Path(d, n).read_text() if Path(d, n).exists() else "" for n in ("stdout", "stderr"))
        return out, err

    def _wait_for_group(self, timeout_s: float = 60.0) -> None:
        """Return once every process the child started has exited (its process group is empty): a
        strategy's own fork server outlives the fit by its interpreter's shutdown (1-2 s of CPU), which
        would otherwise run beside the next row's measured steps. Stragglers after ``timeout_s`` are killed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self._proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.01)
        self._kill_group()

    def _kill_group(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def forked_run_one(spec_json: str, env: dict[str, str], out_dir: str) -> None:
    """:func:`run_one` in a fork-server child: the driver's environment, working directory and thread
    count (a fresh interpreter would take them from ``env`` at start-up), output into ``out_dir``; a
    process group of its own, so that the driver can wait for (or kill) everything it starts."""
    os.setpgrp()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(os.path.join(out_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    print(json.dumps(run_one(RunSpec(**json.loads(spec_json)))), flush=True)


def launch_child(spec: RunSpec, env: Optional[dict[str, str]] = None) -> PreloadedChild:
    return PreloadedChild(spec, env)


def collect(proc: Any) -> dict[str, Any]:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def collect_all(procs: list[Any]) -> list[dict[str, Any]]:
    """Every child's result, in order. The first child to fail stops the others -- whichever it is:
    they would wait for it (the ceiling's start file, a lock-step barrier) -- and its error is raised."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    with ThreadPoolExecutor(len(procs)) as pool:
        futures = [pool.submit(collect, p) for p in procs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            for p in procs:
                p.kill()
            raise failed[0].exception()  # type: ignore[misc]
        return [f.result() for f in futures]


def measure(spec: RunSpec) -> dict[str, Any]:
    if spec.strategy != "ceiling":
        return collect(launch_child(spec))
    from lightning_shm.runtime.segment import Segment

    segment = Segment.create(8 * (lockstep_abort_word(spec.devices) + 1), tag="bench-lockstep") if spec.lockstep \
        else None
    try:
        with tempfile.TemporaryDirectory() as barrier:
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // spec.devices))}
            procs = [launch_child(RunSpec(**{**asdict(spec), "barrier_dir": barrier, "index": i, "count": spec.devices,
                                             "lockstep_segment": segment.name if segment else None}), env)
                     for i in range(spec.devices)]
            results = collect_all(procs)
    finally:
        if segment is not None:
            segment.close()
            segment.unlink()
    return {"samples_per_s": sum(r["samples_per_s"] for r in results),
            "step_ms": max(r["step_ms"] for r in results), "threads": results[0]["threads"],
            "phases": [ph for r in results for ph in r["phases"]],
            **({"barriers_per_step": min(r["barriers_per_step"] for r in results),
                "waited_ms_per_step": [r["waited_ms_per_step"] for r in results]} if spec.lockstep else {})}


def fast_start(specs: list[RunSpec]) -> list[RunSpec]:
    """``specs`` with the shm strategies' workers forked where each gets one thread (cores // W <= 1).
    Such workers are the same as those the default fork server starts (fork's hazard is an OpenMP pool
    in the parent, which one thread per worker never starts), and start in a fraction of a second
    instead of an interpreter importing torch and lightning. Only steady-state steps are timed, so the
    rows measure the same thing; the fixed-cost rows, which time the start, keep their start methods."""
    for s in specs:
        if s.strategy.startswith("shm_") and (os.cpu_count() or 1) // s.devices <= 1:
            s.strategy_kwargs = {"start_method": "fork", **s.strategy_kwargs}
    return specs


def measure_rounds(specs: list[RunSpec], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Every row's runs, round by round: each of ``repeats`` rounds measures every row once, in order."""
    runs: dict[str, list[dict[str, Any]]] = {s.row: [] for s in specs}
    for _ in range(repeats):
        for s in specs:
            runs[s.row].append(measure(s))
    return runs


def median_runs(runs: dict[str, list[dict[str, Any]]], by: str = "samples_per_s") -> dict[str, dict[str, Any]]:
    """Each row's median run by ``by``."""
    return {row: sorted(r, key=lambda x: x[by])[len(r) // 2] for row, r in runs.items()}


def measure_interleaved(specs: list[RunSpec], repeats: int, by: str = "samples_per_s") -> dict[str, dict[str, Any]]:
    """Each row's median run (by ``by``) over ``repeats`` rounds; every round measures every row once, so
    drift on a shared machine hits every row alike."""
    return median_runs(measure_rounds(specs, repeats), by)


def paired_ratios(runs: dict[str, list[dict[str, Any]]], ref: str, by: str = "samples_per_s") -> dict[str, float]:
    """Each row's median over the rounds of its run divided by ``ref``'s run of the same round.

    Why not one median divided by the other: this VM's speed moves by a third between runs minutes apart,
    and the two medians may come from different rounds -- a fast round's ceiling over a slow round's row.
    A row and the reference measured in one round saw closer speeds."""
    return {row: statistics.median(r[by] / c[by] for r, c in zip(rs, runs[ref], strict=True))
            for row, rs in runs.items()}


def throughput_rows(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """A throughput table from every row's runs (:func:`measure_rounds`): each row's median run, and its ratios
    to single, ddp_spawn and the ceiling as medians of each round's ratio (:func:`paired_ratios`)."""
    refs = ("single", "ddp_spawn (gloo)", "ceiling (no comm)")
    vs = {ref: paired_ratios(runs, ref) for ref in refs if ref in runs}
    lines = ["| row | samples/s | step ms | vs single | vs ddp_spawn | vs ceiling |", "|---|---:|---:|---:|---:|---:|"]
    for row, r in median_runs(runs).items():
        ratios = " | ".join(f"{vs[ref][row]:.2f}x" if ref in vs else "n/a" for ref in refs)
        lines.append(f"| {row}{lockstep_note(r)} | {r['samples_per_s']:,.0f} | {r['step_ms']:.2f} | {ratios} |")
    return lines


def lockstep_note(result: dict[str, Any]) -> str:
    """What the lock-step ceiling's barriers did: how many per step, and each rank's wait in them."""
    waited = result.get("waited_ms_per_step")
    if not isinstance(waited, list):
        return ""
    return (f" [{result['barriers_per_step']:g} barriers per step; each rank waited "
            f"{' / '.join(f'{w:.2f}' for w in waited)} ms per step]")


def rows_for(model: str, world: int, gb: int, warmup: int, steps: int) -> list[RunSpec]:
    common = dict(model=model, global_batch=gb, warmup=warmup, steps=steps)
    rows = [
        RunSpec("single", "single", 1, **common),
        RunSpec("ddp_spawn (gloo)", "ddp_spawn", world, **common),
        RunSpec("shm_ddp", "shm_ddp", world, **common),
        RunSpec("shm_fsdp", "shm_fsdp", world, **common),
        RunSpec("shm_fsdp, gather copy", "shm_fsdp", world, strategy_kwargs={"gather": "copy"}, **common),
        RunSpec("shm_fsdp, gather copy + prefetch", "shm_fsdp", world,
                strategy_kwargs={"gather": "copy", "prefetch": True}, **common),
        RunSpec(f"shm_tp (tp={world})", "shm_tp", world, strategy_kwargs={"tensor_parallel_size": world},
                data_parallel=1, **common),
        # the reference MLP's derived plan gathers its first Linear; the Megatron pair it used to get, beside it
        *([RunSpec(f"shm_tp (tp={world}), column -> row pair", "shm_tp", world, data_parallel=1,
                   strategy_kwargs={"tensor_parallel_size": world, "plan": TP_PAIR_PLAN}, **common)]
          if model == "reference" else []),
        RunSpec(f"shm_tp (tp={world}), tp_batch broadcast", "shm_tp", world, data_parallel=1,
                strategy_kwargs={"tensor_parallel_size": world, "tp_batch": "broadcast"}, **common),
        RunSpec(f"shm_tp (tp={world}), tp_batch off", "shm_tp", world, data_parallel=1,
                strategy_kwargs={"tensor_parallel_size": world, "tp_batch": "off"}, **common),
        RunSpec(f"shm_pipeline (1f1b, P={world}, M=4)", "shm_pipeline", world, data_parallel=1,
                strategy_kwargs={"pipeline_parallel_size": world, "microbatches": 4, "schedule": "1f1b"}, **common),
        RunSpec(f"shm_pipeline (1f1b, P={world}, M=8)", "shm_pipeline", world, data_parallel=1,
                strategy_kwargs={"pipeline_parallel_size": world, "microbatches": 8, "schedule": "1f1b"}, **common),
        # the MLPs only: the CNN's and the transformer's Sequentials balance at layer boundaries (no cut chosen)
        *(RunSpec(f"shm_pipeline (1f1b, P={world}, M={m}), split_linear", "shm_pipeline", world, data_parallel=1,
                  strategy_kwargs={"pipeline_parallel_size": world, "microbatches": m, "schedule": "1f1b",
                                   "split_linear": True}, **common)
          for m in (4, 8) if model in ("reference", "wide")),
        RunSpec("ceiling (no comm)", "ceiling", world, **common),
        RunSpec(LOCKSTEP_ROW, "ceiling", world, lockstep=True, **common),
    ]
    if model == "wide":
        rows.insert(3, RunSpec("shm_ddp, 4 MB buckets", "shm_ddp", world,
                               strategy_kwargs={"bucket_cap_mb": 4.0}, **common))
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixed-cost-one", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--breakdown-one", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--summary", action="store_true", help="the short run (under 5 minutes on 2 cores) that ends "
                   "with one 'summary:' line of ratios against the ceiling")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(MODELS))
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-memory", action="store_true", help="skip the extra tables (same as --tables without names)")
    p.add_argument("--tables", nargs="*",
                   default=[t for t in TABLES if t not in ("layouts", "breakdown", "phases", "tp_layers")],
                   choices=list(TABLES),
                   help="extra tables after the throughput rows (default: all but 'layouts' -- W=4 runs of "
                        "the wide MLP --, 'breakdown' -- pipeline steps split by where the time goes --, "
                        "'phases' -- ddp / fsdp / tp / ceiling steps split the same way -- and 'tp_layers' -- "
                        "shm_tp's mechanics without Lightning, layer by layer; "
                        "a few minutes each)")
    p.add_argument("--no-throughput", action="store_true", help="only the extra tables")
    p.add_argument("--rows", nargs="+", default=None, help="only these rows (by name prefix, e.g. shm_ddp "
                   "ddp_spawn); 'single' and 'ceiling' are always measured since the ratios refer to them")
    p.add_argument("--steps", type=int, default=None, help="measured steps (overrides the per-model default)")
    p.add_argument("--repeats", type=int, default=None, help="alternating repeats; the median is reported")
    p.add_argument("--out-dir", type=Path, default=Path("outputs/bench_strategies"))
    args = p.parse_args(argv)
    if args.breakdown_one:
        model, M, schedule, gb, split = args.breakdown_one
        print(json.dumps(breakdown_one(model, int(M), schedule, int(gb), bool(int(split)))))
        return
    if args.fixed_cost_one:
        print(json.dumps(fixed_cost_one(args.fixed_cost_one[0], int(args.fixed_cost_one[1]))))
        return
    if args.summary:
        summary(args.global_batch, args.repeats or 3)
        return
    repeats = args.repeats or (1 if args.quick else 3)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# Training throughput, W={args.world_size}, global batch {args.global_batch}, "
             f"{os.cpu_count()} cores, median of {repeats}; each ratio the median of its rounds' ratios\n"]
    plot_data = {}
    t_start = time.time()
    for model in [] if args.no_throughput else args.models:
        steps = STEPS[model]  # reference: windows of ~3 s
        warmup, n_steps = (steps[0], steps[1] // 3) if args.quick else steps
        n_steps = args.steps or n_steps
        specs = fast_start([s for s in rows_for(model, args.world_size, args.global_batch, warmup, n_steps)
                            if args.rows is None or s.row.startswith(("single", "ceiling", *args.rows))])
        runs = measure_rounds(specs, repeats)
        lines += [f"## {describe(model)}\n", *throughput_rows(runs), ""]
        plot_data[model] = {row: r["samples_per_s"] for row, r in median_runs(runs).items()}
    tables = [] if args.no_memory else args.tables
    if "memory" in tables:
        lines.append(memory_table([2, 4], args.models))
    if "prefetch" in tables:
        mlps = [m for m in args.models if m in ("reference", "wide")]
        lines.append(prefetch_table(mlps, args.global_batch, 4 if args.quick else 10, repeats))
    if "tp" in tables:
        lines.append(tp_table([2, 4], args.models, args.global_batch))
    if "pipeline" in tables:
        lines.append(pipeline_table([2, 4], [4, 8], args.global_batch, 4 if args.quick else 11))
    if "fixed" in tables:
        lines.append(fixed_cost_table(fixed_costs(1 if args.quick else 3)))
    if "layouts" in tables:
        lines.append(layouts_table("wide", args.global_batch, repeats, args.quick))
    if "breakdown" in tables:
        lines.append(breakdown_table(args.global_batch))
    if "phases" in tables:
        lines.append(phases_table(args.models, args.world_size, args.global_batch, repeats, args.steps))
    if "tp_layers" in tables:
        lines.append(tp_layers_table(args.world_size, args.global_batch, repeats, args.steps or 300))
    text = "\n".join(lines)
    (args.out_dir / f"strategies_w{args.world_size}.md").write_text(text)
    if plot_data:
        plot(args.out_dir / f"strategies_w{args.world_size}.png", plot_data, args.world_size)
    print(text)
    print(f"(written to {args.out_dir}/; {time.time() - t_start:.0f} s)")


# ---------------------------------------------------------------------- composed layouts
LAYOUTS = [  # (dp, tp, pp, data_parallel) at W = dp x tp x pp
    (4, 1, 1, "replicate"), (4, 1, 1, "shard"), (1, 4, 1, "replicate"), (2, 2, 1, "replicate"),
    (2, 2, 1, "shard"), (2, 1, 2, "replicate"), (2, 1, 2, "shard"), (1, 2, 2, "replicate"),
]


def layout_name(dp: int, tp: int, pp: int, how: str) -> str:
    parts = [f"dp{dp} {how}" if dp > 1 else "", f"tp{tp}" if tp > 1 else "", f"pp{pp}" if pp > 1 else ""]
    return " x ".join(p for p in parts if p)


def layout_memory_worker(world: Any, model_kw: dict[str, Any], dp: int, tp: int, pp: int, how: str) -> int:
    """Bytes a rank keeps between steps with Adam: its parameters, their gradients, the optimizer state."""
    sys.path.insert(0, str(ROOT))
    import lightning_shm.parallel.compose as compose
    from lightning_shm.models import MNISTClassifier
    from lightning_shm.runtime import Topology

    torch.manual_seed(0)
    model = MNISTClassifier(**model_kw)
    config = compose.ParallelConfig(dp, tp, pp, how, sequential="net", balance="params")
    compose.parallelize(model, config, world, Topology(world.size, dp=dp, tp=tp, pp=pp).groups(world),
                        training=True)
    params = [p for p in model.parameters()]
    opt = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    local = sum(p.numel() * p.element_size() for p in params)
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if v.dim())
    return 2 * local + state  # parameters + gradients + Adam's two moments


def layouts_table(model: str, global_batch: int, repeats: int, quick: bool) -> str:
    """W=4 layouts of the composed strategy: persistent memory per rank and throughput, side by side."""
    from lightning_shm.runtime import launch

    warmup, steps = (1, 2) if quick else (2, 6)
    full = n_params(model) * 4 * 4  # fp32 parameters + gradients + two Adam moments, one process
    specs = []
    for dp, tp, pp, how in LAYOUTS:
        kw = {"data_parallel_size": dp, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
              "data_parallel": how}
        specs.append(RunSpec(layout_name(dp, tp, pp, how), "shm_model_parallel", 4, model, global_batch, warmup,
                             steps, strategy_kwargs=kw, data_parallel=dp))
    specs.append(RunSpec("ceiling (no comm)", "ceiling", 4, model, global_batch, warmup, steps))
    runs = measure_rounds(specs, repeats)
    med = {row: r["samples_per_s"] for row, r in median_runs(runs).items()}
    ceiling, vs_ceiling = med["ceiling (no comm)"], paired_ratios(runs, "ceiling (no comm)")
    lines = [f"## Composed layouts, W=4 ({describe(model)}, global batch {global_batch}, {os.cpu_count()} cores, "
             f"median of {repeats}; vs ceiling: the median of each round's ratio)\n",
             "| layout | persistent MiB per rank (params + grads + Adam) | of one process | samples/s | vs ceiling |",
             "|---|---:|---:|---:|---:|"]
    for (dp, tp, pp, how), s in zip(LAYOUTS, specs):
        mem = max(launch(layout_memory_worker, 4, MODELS[model], dp, tp, pp, how, start_method="fork"))
        lines.append(f"| {s.row} | {mem / 2**20:,.1f} | {mem / full:.3f} | {med[s.row]:,.0f} | "
                     f"{vs_ceiling[s.row]:.2f}x |")
    lines.append(f"| ceiling (4 independent processes) | {full / 2**20:,.1f} | 1.000 | {ceiling:,.0f} | 1.00x |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- memory per rank
def memory_worker(world: Any, model_kw: dict[str, Any], kind: str) -> dict[str, int]:
    """Bytes one rank holds for a training step with Adam: persistent (params, grads, optimizer state)
    and the peak, counted from tensor storage sizes (not RSS)."""
    from torch import nn

    sys.path.insert(0, str(ROOT))
    from lightning_shm.models import MNISTClassifier
    from lightning_shm.parallel.ddp import GradReducer
    from lightning_shm.parallel.fsdp import FSDPState

    torch.manual_seed(0)
    model = MNISTClassifier(**model_kw, optimizer="adam")
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def nbytes(ts: Any) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    if kind == "ddp":
        reducer = GradReducer(list(model.named_parameters()), world.group())
        opt = model.configure_optimizers()
        nn.functional.cross_entropy(model(x), y).backward()
        reducer.post_backward()
        opt.step()
        params = nbytes(model.parameters())
        grads = nbytes(b.buffer.local for b in reducer.buckets[:1])  # one flat bucket buffer per dtype
        optim = nbytes(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        return {"params": params, "grads": grads, "optimizer": optim, "peak": params + grads + optim + largest}
    sharded = FSDPState(model, world.group())
    opt = model.configure_optimizers()
    sharded.watch([opt])
    sharded.stats.reset_peak()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    per = sharded.persistent_bytes(opt)
    largest_unit = max(u.numel * 4 for u in sharded.units)
    # peak: persistent + the unsharded parameters alive at once (measured) + one unit's full gradient
    per["peak"] = sum(per.values()) + sharded.stats.peak + largest_unit
    per["largest_unit"] = largest_unit
    return per


def memory_table(worlds: list[int], models: list[str]) -> str:
    from lightning_shm.runtime import launch

    lines = ["## Memory per rank, one Adam step (tensor storage bytes, MiB)\n",
             "| model | W | DDP params+grads+optim | FSDP params+grads+optim | FSDP peak | FSDP / DDP | "
             "goal: DDP/W + one unit |", "|---|---:|---:|---:|---:|---:|---:|"]
    for model in models:
        for w in worlds:
            ddp = launch(memory_worker, w, MODELS[model], "ddp", start_method="fork")[0]
            fsdp = launch(memory_worker, w, MODELS[model], "fsdp", start_method="fork")[0]
            d = ddp["params"] + ddp["grads"] + ddp["optimizer"]
            f = fsdp["params"] + fsdp["grads"] + fsdp["optimizer"]
            mib = 2 ** 20
            lines.append(f"| {model} | {w} | {d / mib:.2f} | {f / mib:.2f} | {fsdp['peak'] / mib:.2f} | "
                         f"{f / d:.3f} | {(d / w + fsdp['largest_unit']) / mib:.2f} |")
    return "\n".join(lines) + "\n"


def prefetch_worker(world: Any, model_kw: dict[str, Any], policy: Optional[int], mode: str, batch: int, steps: int,
                    threads: int) -> dict[str, float]:
    """Median FSDP training step (SGD) for ``mode`` "copy", "prefetch" (copy on a helper thread) or "view"
    (no copy), and the time spent copying."""
    from torch import nn

    sys.path.insert(0, str(ROOT))
    from lightning_shm.models import MNISTClassifier
    from lightning_shm.parallel.fsdp import FSDPState

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = MNISTClassifier(**model_kw)
    sharded = FSDPState(model, world.group(), policy, prefetch=mode == "prefetch",
                        gather="view" if mode == "view" else "copy")
    gather = [0.0]  # seconds spent copying shards into full tensors (on whichever thread does it)
    for u in sharded.units:
        copy = u.copy_shards_into

        def timed(flat: torch.Tensor, copy: Any = copy) -> None:
            t0 = time.perf_counter()
            copy(flat)
            gather[0] += time.perf_counter() - t0

        u.copy_shards_into = timed  # type: ignore[method-assign]
    opt = model.configure_optimizers()
    sharded.watch([opt])
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    times, gathers = [], []
    for _ in range(steps + 2):
        gather[0] = 0.0
        t0 = time.perf_counter()
        sharded.begin_step()
        sharded.stats.reset_peak()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        gathers.append(gather[0])
    sharded.close()
    return {"step_ms": statistics.median(times[2:]) * 1e3, "gather_ms": statistics.median(gathers[2:]) * 1e3,
            "peak_mib": sharded.stats.peak / 2**20}


def prefetch_table(models: list[str], global_batch: int, steps: int, repeats: int) -> str:
    """shm_fsdp's gathers: copying (with and without prefetch) against computing on the shared rows
    ("view"), where no core is free (W=2) and where one is (W=1, 1 thread),
    with the default units and with units of >= 1M parameters (each LayerNorm merged into the next
    Linear, so the unit prefetched during a Linear's compute is the next big one)."""
    from lightning_shm.runtime import launch

    lines = [f"## shm_fsdp gather: copy, copy + prefetch, view (runtime only, SGD, batch {global_batch // 2} per "
             f"rank, median step of {repeats} repeats; speed-ups: the median of each repeat's)\n",
             "| model | units | ranks x compute threads | step ms, copy | step ms, prefetch | prefetch speed-up | "
             "step ms, view | view speed-up | copying per step ms | full params peak MiB, copy | with prefetch | "
             "view |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    configs = [(m, None) for m in models] + ([("wide", 1_000_000)] if "wide" in models else [])
    for model, policy in configs:
        for w in (2, 1):
            res: dict[str, list[dict[str, float]]] = {"copy": [], "prefetch": [], "view": []}
            for _ in range(repeats):  # interleaved
                for mode in res:
                    res[mode].append(launch(prefetch_worker, w, MODELS[model], policy, mode, global_batch // 2, steps,
                                            1, start_method="fork")[0])
            med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in res.items()}
            off, on, view = med["copy"], med["prefetch"], med["view"]
            # a speed-up: the median over the repeats of copy's step over the mode's step in the same repeat
            faster = {mode: paired_ratios(res, mode, by="step_ms")["copy"] for mode in ("prefetch", "view")}
            note = "a core free" if w < (os.cpu_count() or 1) else "no core free"
            units = "per layer" if policy is None else f">= {policy:,} params"
            lines.append(f"| {model} | {units} | {w} x 1 ({note}) | {off['step_ms']:.1f} | {on['step_ms']:.1f} | "
                         f"{faster['prefetch']:.2f}x | {view['step_ms']:.1f} | "
                         f"{faster['view']:.2f}x | {off['gather_ms']:.1f} | "
                         f"{off['peak_mib']:.2f} | {on['peak_mib']:.2f} | {view['peak_mib']:.2f} |")
    return "\n".join(lines) + "\n"


def tp_worker(world: Any, model_kw: dict[str, Any], tp: int, global_batch: int) -> dict[str, Any]:
    """One training step of the MLP under dp x tp: bytes each rank sends into collectives, parameter bytes."""
    from torch import nn

    sys.path.insert(0, str(ROOT))
    from lightning_shm.models import MNISTClassifier
    from lightning_shm.parallel.ddp import GradReducer
    from lightning_shm.parallel.tp import TensorParallelState, check_plan, plan_for
    from lightning_shm.runtime import Topology

    topo = Topology.infer(world.size, tp=tp)
    groups = topo.groups(world)
    torch.manual_seed(0)
    model = MNISTClassifier(**model_kw)
    tpm = TensorParallelState(model, groups.tp, check_plan(model, plan_for(model, None, tp), tp))
    reducer = GradReducer(list(model.named_parameters()), groups.dp) if groups.dp.size > 1 else None
    b = global_batch // topo.dp
    x, y = torch.randn(b, 1, 28, 28), torch.randint(0, 10, (b,))
    before = {id(g): dict(g.traffic) for g in (groups.tp, groups.dp)}
    nn.functional.cross_entropy(model(x), y).backward()
    if reducer is not None:
        reducer.post_backward()
    sent = {name: sum(g.traffic.values()) - sum(before[id(g)].values())
            for name, g in (("tp", groups.tp), ("dp", groups.dp))}
    return {"param_bytes": tpm.parameter_bytes(), **sent}


def tp_table(worlds: list[int], models: list[str], global_batch: int) -> str:
    from lightning_shm.runtime import launch

    lines = [f"## Tensor parallel: bytes per rank per training step (global batch {global_batch})\n",
             "| model | W | tp x dp | parameter MiB per rank | full model MiB | TP collectives KiB | "
             "DP all-reduce KiB |", "|---|---:|---|---:|---:|---:|---:|"]
    for model in models:
        full = n_params(model)
        for w in worlds:
            for tp in sorted({w, 2}):
                r = launch(tp_worker, w, MODELS[model], tp, global_batch, start_method="fork")[0]
                lines.append(f"| {model} | {w} | {tp} x {w // tp} | {r['param_bytes'] / 2**20:.2f} | "
                             f"{full * 4 / 2**20:.2f} | {r['tp'] / 1024:.1f} | {r['dp'] / 1024:.1f} |")
    return "\n".join(lines) + "\n"


def phases_table(models: list[str], world: int, global_batch: int, repeats: int, steps: Optional[int] = None) -> str:
    """Where a training step goes, per strategy and the ceiling (PhaseTimer): ms per step, mean over ranks."""
    lines = [f"## Where a step goes (W={world}, global batch {global_batch}; ms per step, mean of the middle half "
             f"of the steps, mean over ranks; in parentheses: time inside the runtime's collectives)\n",
             "| model | row | step | load | forward | backward | sync | optimizer | collectives | waiting for a "
             "peer (least / most of the ranks) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model in models:
        warmup, default_steps = STEPS[model]
        common = dict(model=model, global_batch=global_batch, warmup=warmup, steps=steps or default_steps, phases=True)
        specs = fast_start([
            RunSpec("ceiling (no comm)", "ceiling", world, **common), RunSpec("shm_ddp", "shm_ddp", world, **common),
            RunSpec("shm_fsdp", "shm_fsdp", world, **common),
            RunSpec(f"shm_tp (tp={world})", "shm_tp", world, strategy_kwargs={"tensor_parallel_size": world},
                    data_parallel=1, **common)])
        res = measure_interleaved(specs, repeats, by="step_ms")
        for s in specs:
            r = res[s.row]
            ph = r["phases"]

            def mean(k: str) -> float:
                return statistics.fmean(p[k] for p in ph)

            cells = [f"{mean(k):.2f}" + (f" ({mean(k + ' in collectives'):.2f})"
                                         if mean(k + " in collectives") >= 0.005 else "")
                     for k in PhaseTimer.PHASES]
            waits = sorted((p["waiting"] for p in ph), reverse=True)
            lines.append(f"| {model} | {s.row} | {mean('step'):.2f} | {' | '.join(cells)} | "
                         f"{mean('collectives'):.2f} | {waits[-1]:.2f} / {waits[0]:.2f} |")
    return "\n".join(lines) + "\n"


TP_PAIR_PLAN = {"net.1": "column", "net.4": "row"}  # the reference MLP as a Megatron pair (split LayerNorm between)


def tp_layers_worker(world: Any, mode: str, global_batch: int, steps: int) -> dict[str, Any]:
    """Runtime only (no Lightning): microseconds of each layer's forward, the loss, and the step's
    forward / backward / optimizer, for one rank of shm_tp (tp = W, the whole batch; ``mode`` "derived":
    the plan shm_tp derives, "pair": :data:`TP_PAIR_PLAN`) or of the ceiling (the whole model, an
    independent process with its 1/W of the batch); ``middle_mean`` of the steps, so the layers and the
    loss add up to the forward, the phases to the step."""
    from torch import nn

    sys.path.insert(0, str(ROOT))
    from lightning_shm.models import MNISTClassifier
    from lightning_shm.parallel.sequential import find_sequential
    from lightning_shm.parallel.tp import TensorParallelState, check_plan, plan_for

    torch.manual_seed(0)
    model = MNISTClassifier(**MODELS["reference"])
    rows = global_batch
    if mode != "ceiling":
        plan = plan_for(model, TP_PAIR_PLAN if mode == "pair" else None, world.size)
        TensorParallelState(model, world.group(), check_plan(model, plan, world.size))
    else:
        rows = global_batch // world.size
    _, seq = find_sequential(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(rows, 1, 28, 28), torch.randint(0, 10, (rows,))
    names = [f"{i}" for i in range(len(seq))] + ["loss"]
    steps_timed: list[dict[str, float]] = []
    for step in range(steps + 20):  # the first 20 warm up
        h, t0 = x, time.perf_counter()
        laps = []
        for layer in seq:
            h = layer(h)
            laps.append(time.perf_counter())
        loss = nn.functional.cross_entropy(h, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if step >= 20:
            steps_timed.append({**{n: b - a for n, a, b in zip(names, [t0, *laps], [*laps, t1])},
                                "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0})
    return {"times": {n: v * 1e6 for n, v in middle_mean(steps_timed).items()},
            "labels": {f"{i}": type(m).__name__ + (" (gathered)" if getattr(m, "gather_output", False) else "")
                       for i, m in enumerate(seq)}}


def tp_layers_table(world: int, global_batch: int, repeats: int, steps: int) -> str:
    """shm_tp's mechanics against the ceiling without Lightning: which layer costs what on one rank.

    Each run's ranks are averaged; of the ``repeats`` runs the one with the median step is shown whole
    (per-part medians over runs would not add up to their step)."""
    from lightning_shm.runtime import launch

    modes = ("ceiling", "derived", "pair")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    kinds: dict[str, dict[str, str]] = {}  # layer index -> its module's class name
    for _ in range(repeats):  # interleaved
        for mode in modes:
            ranks = launch(tp_layers_worker, world, mode, global_batch, steps, start_method="fork")
            runs[mode].append({k: statistics.fmean(r["times"][k] for r in ranks) for k in ranks[0]["times"]})
            kinds[mode] = ranks[0]["labels"]
    med = {m: sorted(rs, key=lambda r: r["step"])[len(rs) // 2] for m, rs in runs.items()}
    lines = [f"## shm_tp's mechanics without Lightning (reference MLP, tp={world}, global batch {global_batch}; "
             f"us per step, mean of the middle half of the steps, mean over ranks, the median of {repeats} runs)\n",
             f"Layer names: the ceiling's module -> shm_tp's with the derived plan / with the column -> row pair "
             f"{TP_PAIR_PLAN}. A ceiling rank runs {global_batch // world} rows through the whole model, a shm_tp "
             f"rank {global_batch} rows through 1/{world} of the split layers.\n",
             "| part | ceiling | shm_tp, derived plan | difference | shm_tp, column -> row pair | difference |",
             "|---|---:|---:|---:|---:|---:|"]
    for k in med["ceiling"]:
        a, b, c = med["ceiling"][k], med["derived"][k], med["pair"][k]
        name = k
        if k in kinds["ceiling"]:
            names = [kinds[m][k] for m in modes]
            name = f"layer {k}: {names[0]}" + (f" -> {names[1]} / {names[2]}" if len(set(names)) > 1 else "")
        lines.append(f"| {name} | {a:,.0f} | {b:,.0f} | {b - a:+,.0f} | {c:,.0f} | {c - a:+,.0f} |")
    return "\n".join(lines) + "\n"


PIPE_HIDDEN = [512] * 8  # 9 Linear layers: every chunk of P=4 x 2 virtual stages gets one


def pipeline_table(stages: list[int], microbatches: list[int], batch: int, steps: int) -> str:
    """Per schedule: throughput, measured vs ideal bubble, hand-overs, peak activation memory per stage.

    Bubbles are medians over the steps after the first, each step against the ideal at its own
    stage times: one step's timeline moves by points on a VM whose vCPUs stall now and then. "Of which
    the delays": the same simulation paying each step's median hand-over and time between actions --
    how much of "measured - that" those two account for."""
    sys.path.insert(0, str(ROOT))
    from lightning_shm.parallel.pipeline import (
        PipelineSchedule,
        Schedule,
        between_actions,
        bubble_fraction,
        handover_delays,
        measured_costs,
        simulate,
    )
    from lightning_shm.parallel.pipeline.driver import train_pipeline
    from lightning_shm.runtime import launch

    lines = [f"## Pipeline schedules (runtime only; MLP {PIPE_HIDDEN[0]}x{len(PIPE_HIDDEN)}, batch {batch}, "
             f"{os.cpu_count()} cores, medians of {steps - 1} steps)\n",
             "| schedule | P | M | samples/s | measured bubble | ideal at the measured stage times | measured - that "
             "| hand-over (us) | between actions (us) | of which the delays | ideal bubble | textbook "
             "| peak activations per stage (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    med = statistics.median
    for P in stages:
        for M in microbatches:
            for kind in Schedule:
                v = 2 if kind == Schedule.INTERLEAVED_1F1B else 1
                try:
                    sched = PipelineSchedule(kind, P, M, v)
                except ValueError:
                    continue
                res = launch(train_pipeline, P, PIPE_HIDDEN, kind.value, M, v, steps, batch, start_method="fork")
                step = med(max(r.step_seconds[i] for r in res) for i in range(1, steps))
                bubble, at_costs, handover, between, delays = [], [], [], [], []
                for i in range(1, steps):
                    recs = [rec for r in res for rec in r.timelines[i]]
                    costs = measured_costs(recs)
                    bubble.append(bubble_fraction(recs))
                    at_costs.append(bubble_fraction(simulate(sched, costs)))  # this step's (im)balance
                    step_hand, step_between = handover_delays(sched, recs), between_actions(sched, recs)
                    handover += step_hand
                    between += step_between
                    paid = [med(d) if d else 0.0 for d in (step_hand, step_between)]  # a step without any: none
                    delays.append(bubble_fraction(simulate(sched, costs, *paid)) - at_costs[-1])
                gap = med(b - a for b, a in zip(bubble, at_costs))
                mem = " / ".join(f"{r.peak_activation_bytes / 2**20:.1f}" for r in res)
                lines.append(f"| {kind.value} | {P} | {M} | {batch / step:,.0f} | {med(bubble):.1%} "
                             f"| {med(at_costs):.1%} | {gap * 100:+.1f} | {med(handover) * 1e6:,.0f} "
                             f"| {med(between) * 1e6:,.0f} | {med(delays) * 100:+.1f} | {sched.ideal_bubble():.1%} "
                             f"| {sched.formula_bubble():.1%} | {mem} |")
    return "\n".join(lines) + "\n"


def n_params(model: str) -> int:
    sys.path.insert(0, str(ROOT))
    from lightning_shm.models import MNISTClassifier

    return sum(p.numel() for p in MNISTClassifier(**MODELS[model]).parameters())


def describe(model: str) -> str:
    kw = MODELS[model]
    what = {"mlp": f"{model} MLP {kw.get('hidden_sizes')}", "cnn": "CNN, channels [32, 64]",
            "transformer": "transformer, dim 64, 4 blocks of 4 heads"}[kw["arch"]]
    return f"{what} ({n_params(model) / 1e6:.2f}M parameters)"


def plot(path: Path, data: dict[str, dict[str, float]], world: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data), figsize=(6 * len(data), 4), squeeze=False)
    for ax, (model, rows) in zip(axes[0], data.items()):
        names = list(rows)
        colors = ["grey", "tab:red", "tab:blue", "tab:cyan", "tab:green", "tab:purple", "tab:olive", "black"]
        ax.barh(names, [rows[n] for n in names], color=colors[: len(names)])
        ax.invert_yaxis()
        ax.set_xlabel("samples / s")
        ax.set_title(f"{model}, W={world}")
        for i, n in enumerate(names):
            ax.text(rows[n], i, f" {rows[n]:,.0f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------- --summary
SUMMARY_STEPS = {"reference": (20, 200), "wide": (2, 6)}  # (warm-up, measured): short windows, several repeats
SUMMARY_M = 4  # microbatches of the summary's pipeline row
# row name -> the summary's key. The pipeline as a user would run the wide MLP: its one big Linear cut
# between the stages (the layer-boundary cut, 0.58 of a balanced pipeline at best, is in the main table)
SUMMARY_KEYS = {"shm_ddp": "ddp", "shm_fsdp": "fsdp", "shm_tp (tp=2)": "tp",
                f"shm_pipeline (1f1b, P=2, M={SUMMARY_M}), split_linear": "pp",
                "ceiling (no comm)": "ceiling", LOCKSTEP_ROW: "lockstep"}
SUMMARY_WANTED = {"reference": ("ddp", "tp", "ceiling", "lockstep"), "wide": ("ddp", "fsdp", "tp", "pp", "ceiling")}


def summary(global_batch: int, repeats: int) -> None:
    """The rows the performance targets name, medians of ``repeats`` interleaved runs, and one line. Ratios
    are medians of per-round ratios (:func:`paired_ratios`).
    The rows' workers are forked where that measures the same (:func:`fast_start`) to stay under 5
    minutes, as they use preloaded children (:class:`PreloadedChild`)."""
    from lightning_shm.parallel.pipeline import PipelineSchedule, Schedule

    t_start = time.time()
    M, key, wanted = SUMMARY_M, SUMMARY_KEYS, SUMMARY_WANTED
    bubble = PipelineSchedule(Schedule.ONE_F_ONE_B, 2, M, 1).formula_bubble()
    ratios: dict[str, dict[str, float]] = {}
    lines = [f"# Summary: W=2, global batch {global_batch}, {os.cpu_count()} cores, median of {repeats}\n",
             "| model | row | samples/s (median) | vs ceiling (median of each round's ratio) |", "|---|---|---:|---:|"]
    for model, rows in wanted.items():
        warmup, steps = SUMMARY_STEPS[model]
        specs = fast_start([s for s in rows_for(model, 2, global_batch, warmup, steps) if key.get(s.row) in rows])
        runs = measure_rounds(specs, repeats)
        res, paired = median_runs(runs), paired_ratios(runs, "ceiling (no comm)")
        ratios[model] = {key[row]: paired[row] for row in res}
        lines += [f"| {model} | {row}{lockstep_note(r)} | {r['samples_per_s']:,.0f} | {paired[row]:.2f}x |"
                  for row, r in res.items()]
    spawn, server = "shm_ddp (spawn)", "shm_ddp (forkserver, the default)"
    # the line reports spawn's first fit and the fork server's second: no more fits than that
    fixed = {**fixed_costs(repeats, fits=1, rows=[spawn]), **fixed_costs(repeats, fits=2, rows=[server])}
    ref, wide = ratios["reference"], ratios["wide"]
    print("\n".join(lines))
    print(f"\n(pipeline theory: 1 - bubble = {1 - bubble:.2f} of the ceiling at P=2, M={M}; "
          f"{time.time() - t_start:.0f} s)")
    print(f"summary: ddp_ref={ref['ddp']:.2f} ddp_wide={wide['ddp']:.2f} fsdp_wide={wide['fsdp']:.2f} "
          f"fsdp_vs_ddp_wide={wide['fsdp'] / wide['ddp']:.2f} tp_ref={ref['tp']:.2f} "
          f"tp_wide={wide['tp']:.2f} pp_wide_vs_theory={wide['pp'] / (1 - bubble):.2f} "
          f"start_s={fixed[spawn][0]['start_s']:.2f} stop_s={fixed[spawn][0]['stop_s']:.2f} "
          f"start_s_later_fits={fixed[server][1]['start_s']:.2f} lockstep_ref={ref['lockstep']:.2f}")


if __name__ == "__main__":
    main()
