"""The benchmark scripts run and print their tables (speed is measured by running them, not here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str]) -> str:
    """No wall-clock limit of its own: how long a benchmark takes depends on the machine's load; pytest's
    per-test timeout (pyproject) still catches a hang."""
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


_SCRIPTS = {  # the runs of the scripts that train without Lightning's fit, for the tests below; OUT: a directory
    "collectives": ["scripts/bench_collectives.py", "--quick", "--sizes", "4KiB", "64KiB", "--out-dir", "OUT"],
    "plot_pipeline": ["scripts/plot_pipeline.py", "--stages", "2", "--microbatches", "4", "--batch", "64",
                      "--out-dir", "OUT"],
    "stage_grads": ["scripts/bench_stage_grads.py", "--quick"],
    "stage_grads_bound": ["scripts/bench_stage_grads.py", "--bound", "--quick"],
    "stage_grads_bound_transformer": ["scripts/bench_stage_grads.py", "--bound", "--transformer", "--repeats", "1"],
    "stage_grads_record": ["scripts/bench_stage_grads.py", "--record", "--quick"],
}
_RUN_IN_ONE_INTERPRETER = """
import json, runpy, sys, traceback
for key, argv in json.loads(sys.argv[1]).items():
    print("=== script:", key, flush=True)
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")  # as `python <argv...>` runs it
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        print("=== failed", flush=True)
"""


@pytest.fixture(scope="module")
def scripts_run(tmp_path_factory) -> tuple[dict[str, str], Path]:
    """``_SCRIPTS``, each run as ``__main__``, one after the other in one fresh interpreter: importing torch costs
    more than their quick runs. Returns what each printed, by key, and the directory they wrote to."""
    out_dir = tmp_path_factory.mktemp("scripts")
    argvs = {key: [str(out_dir) if a == "OUT" else a for a in argv] for key, argv in _SCRIPTS.items()}
    printed = run(["-c", _RUN_IN_ONE_INTERPRETER, json.dumps(argvs)]).split("=== script: ")[1:]
    outputs = dict(part.split("\n", 1) for part in printed)
    assert list(outputs) == list(_SCRIPTS), printed
    return outputs, out_dir


def printed(scripts_run: tuple[dict[str, str], Path], key: str) -> str:
    """What ``_SCRIPTS[key]`` printed; the test fails with its traceback if it raised."""
    text = scripts_run[0][key]
    assert "=== failed" not in text, text[-3000:]
    return text


def _bench_dirs() -> set[Path]:
    """The directories benchmark runs make for their timing files (each must remove its own)."""
    return set(Path(tempfile.gettempdir()).glob("bench_*"))


def test_bench_collectives_prints_table_plot_and_summary(scripts_run):
    out = printed(scripts_run, "collectives")
    assert "| 4KiB |" in out and "| 64KiB |" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("summary: ")
    pairs = dict(kv.split("=") for kv in summary[len("summary: "):].split())
    assert {"allreduce_4KiB_us", "barrier_us", "speedup_vs_gloo_1MiB", "fraction_of_bound_64MiB",
            "channel_roundtrip_64KiB_us"} <= set(pairs)
    assert float(pairs["channel_roundtrip_64KiB_us"]) > 0
    assert float(pairs["allreduce_4KiB_us"]) > 0 and float(pairs["barrier_us"]) > 0
    row = next(line for line in out.splitlines() if line.startswith("| 64KiB |"))
    assert row.split("|")[3].strip().endswith(" us"), row  # W=2: reduce-scatter + all-gather beside the one-shot
    assert (scripts_run[1] / "collectives.png").stat().st_size > 1000
    # the pair's floor (copy in + barrier + cross-core read) and the ratios printed beside it
    header = next(line for line in out.splitlines() if line.startswith("| size |"))
    col = {name.strip(): i for i, name in enumerate(header.split("|"))}
    for size in ("4KiB", "64KiB"):
        cells = next(line for line in out.splitlines() if line.startswith(f"| {size} |")).split("|")
        floor, zfloor = _us(cells[col["floor"]])[0], _us(cells[col["zero-copy floor"]])[0]
        assert floor > zfloor >= float(pairs["barrier_us"]) * 0.95, cells  # both include one barrier
        for ratio, num, den in (("of floor", "floor", "shm"), ("bound / floor", "bound", "floor"),
                                ("zero-copy of floor", "zero-copy floor", "shm zero-copy"),
                                ("bound / zero-copy floor", "bound", "zero-copy floor")):
            (n, n_half), (d, d_half) = _us(cells[col[num]]), _us(cells[col[den]])
            # the times are printed rounded: the ratio computed from them lies within what their rounding allows
            low, high = (n - n_half) / (d + d_half) - 0.006, (n + n_half) / (d - d_half) + 0.006
            assert low <= float(cells[col[ratio]]) <= high, (ratio, cells)
    row_4k = next(line for line in out.splitlines() if line.startswith("| 4KiB |")).split("|")
    floor_4k, half = _us(row_4k[col["floor"]])
    assert abs(float(pairs["floor_4KiB_us"]) - floor_4k) <= half + 0.01 * floor_4k


def _us(cell: str) -> tuple[float, float]:
    """A printed time ("12.3 us" or "1.20 ms") in microseconds, and half its last printed digit."""
    value, unit = cell.split()
    scale = {"us": 1.0, "ms": 1e3}[unit]
    return float(value) * scale, 0.5 * 10.0 ** -len(value.split(".")[1]) * scale


def _section(out: str, heading: str) -> str:
    """The table under the ``## <heading>...`` line, up to the next heading: tables' rows look alike."""
    start = out.index(f"## {heading}")
    end = out.find("\n#", start + 1)
    return out[start:end if end >= 0 else len(out)]


@pytest.fixture(scope="module")
def strategies_run(tmp_path_factory) -> tuple[str, Path, set[Path]]:
    """One run of bench_strategies.py for the tests below (a fresh interpreter and its workers' imports cost
    more than the short runs): the reference MLP's single, ceiling and shm_ddp rows, every default table but the fixed
    costs (a dozen fresh interpreters: a test below runs one row of it), the phases and tp's layer by layer.
    Returns its output, its output directory and the timing directories left after it."""
    out_dir = tmp_path_factory.mktemp("bench_strategies")
    before = _bench_dirs()
    out = run(["scripts/bench_strategies.py", "--quick", "--models", "reference", "--rows", "shm_ddp",
               "--steps", "20", "--repeats", "1", "--tables", "memory", "prefetch", "tp", "pipeline", "phases",
               "tp_layers", "--out-dir", str(out_dir)])
    return out, out_dir, _bench_dirs() - before


def test_bench_strategies_runs_the_rows(strategies_run):
    out, out_dir, left = strategies_run
    for row in ("single", "shm_ddp", "ceiling", "ceiling, lock-step"):
        assert re.search(rf"\| {re.escape(row)}[^|]* \| [\d,]+ \|", out), out
    # the lock-step ceiling's ranks really met where shm_ddp's do: after each loss and each backward
    note = re.search(r"lock-step \(no comm\) \[([\d.]+) barriers per step; each rank waited ([\d.]+) / ([\d.]+) ms",
                     out)
    assert note and float(note.group(1)) == 2.0, out
    assert "(no comm) [" not in out.replace("lock-step (no comm) [", ""), out  # the plain ceiling has no barriers
    assert "## shm_fsdp gather: copy, copy + prefetch, view" in out and "| reference | per layer | 2 x 1" in out
    for table in ("Memory per rank", "Tensor parallel: bytes per rank", "Pipeline schedules"):
        assert f"## {table}" in out, out
    assert (out_dir / "strategies_w2.png").exists()
    assert left == set()  # each run's timing files were removed


def test_fixed_cost_rows_time_each_fit_from_a_fresh_interpreter_and_leave_no_files(monkeypatch):
    """The table of seconds from ``fit()`` to the first step and from the last step to ``fit()`` returning,
    for a first and a second fit of one fresh interpreter (the forked workers' row: the quickest to start)."""
    bench = _bench_module(monkeypatch)
    before = _bench_dirs()
    res = bench.fixed_costs(1, fits=2, rows=["shm_ddp (fork)"])
    assert list(res) == ["shm_ddp (fork)"] and len(res["shm_ddp (fork)"]) == 2
    for fit in res["shm_ddp (fork)"]:
        assert 0 < fit["start_s"] < 120 and 0 <= fit["stop_s"] < 120, fit
    first, second = res["shm_ddp (fork)"]
    row = f"| shm_ddp (fork) | {first['start_s']:.2f} | {first['stop_s']:.2f} | {second['start_s']:.2f} | "
    assert row in bench.fixed_cost_table(res)
    # each fit's edges file was in a directory of its own, removed once read
    assert _bench_dirs() == before


def test_measured_rows_fork_their_workers_only_where_each_gets_one_thread(monkeypatch):
    """Forked workers start in a fraction of a second; they are the fork server's workers only when each
    gets one thread (no OpenMP pool in the parent to inherit). Lightning's gloo row keeps its start."""
    bench = _bench_module(monkeypatch)
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    start = {s.row: s.strategy_kwargs.get("start_method") for s in bench.fast_start(bench.rows_for("wide", 2, 8, 1, 1))}
    assert {row for row, how in start.items() if how == "fork"} == {
        row for row in start if row.startswith(("shm_ddp", "shm_fsdp", "shm_tp", "shm_pipeline"))}
    assert start["shm_ddp, 4 MB buckets"] == "fork" and start["ddp_spawn (gloo)"] is None and start["single"] is None
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 16)
    assert not any("start_method" in s.strategy_kwargs for s in bench.fast_start(bench.rows_for("wide", 2, 8, 1, 1)))


@pytest.mark.parametrize("strategy", ["single", "ceiling"])
def test_the_reference_rows_keep_freed_memory_as_the_workers_do(monkeypatch, tmp_path, strategy):
    """The single and ceiling rows run plain Lightning in one process; they take the strategies' workers' memory
    policy (``RuntimeConfig.keep_freed_memory``) before building anything, or each of their steps faults in fresh
    pages for its gradients (the wide MLP's ceiling ran ~20% slower that way) and the ratios against them count
    it as the strategies' gain."""
    bench = _bench_module(monkeypatch)
    import lightning_shm.models
    from lightning_shm.runtime import launcher

    events: list[str] = []
    monkeypatch.setattr(launcher, "keep_freed_memory", lambda: events.append("keep freed memory"))

    class Recorded(lightning_shm.models.MNISTClassifier):
        def __init__(self, **kwargs) -> None:
            events.append("model")
            super().__init__(**kwargs)

    monkeypatch.setattr(lightning_shm.models, "MNISTClassifier", Recorded)
    spec = bench.RunSpec(strategy, strategy, 1, "reference", 32, 1, 2, barrier_dir=str(tmp_path))
    assert bench.run_one(spec)["samples_per_s"] > 0
    assert events == ["keep freed memory", "model"]


def test_bench_strategies_splits_steps_into_phases(strategies_run):
    out = _section(strategies_run[0], "Where a step goes")
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0] == "reference":
            rows[cells[1]] = cells[2:]
    assert set(rows) == {"ceiling (no comm)", "shm_ddp", "shm_fsdp", "shm_tp (tp=2)"}, out

    def ms(cell: str) -> float:
        return float(cell.split()[0])

    for row, cells in rows.items():
        step, phases = ms(cells[0]), [ms(c) for c in cells[1:6]]
        assert step > 0 and all(p >= 0 for p in phases), (row, cells)
        # the phases partition the step: means over the same steps add up (to the cells' rounding)
        assert abs(sum(phases) - step) <= 6 * 0.005 + 1e-9, (row, cells)
    # the runtime's collectives are timed where they run: none in independent processes, some in every strategy
    assert ms(rows["ceiling (no comm)"][6]) == 0.0
    for row in ("shm_ddp", "shm_fsdp", "shm_tp (tp=2)"):
        assert ms(rows[row][6]) > 0.0, (row, rows[row])
    assert "(" in rows["shm_ddp"][3]  # the gradient all-reduce runs inside backward
    assert "(" in rows["shm_fsdp"][3]  # so do the reduce-scatters
    assert "(" in rows["shm_tp (tp=2)"][1]  # split loading gathers the members' shares while loading


def test_plot_pipeline_draws_a_gantt_chart_per_schedule(scripts_run):
    out = printed(scripts_run, "plot_pipeline")
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"):
        png = scripts_run[1] / f"pipeline_{schedule}_p2.png"
        assert png.stat().st_size > 5000, png
        assert f"pipeline_{schedule}_p2.png: measured bubble" in out


def test_bench_strategies_times_tp_layer_by_layer(strategies_run):
    out = _section(strategies_run[0], "shm_tp's mechanics without Lightning")
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1].replace(",", "").isdigit():
            rows[cells[0]] = [float(c.replace(",", "")) for c in cells[1:]]
    # the plans' layers, named as the ceiling's -> shm_tp's derived plan's / the column -> row pair's
    assert {"layer 1: Linear -> ColumnParallelLinear (gathered) / ColumnParallelLinear",
            "layer 2: LayerNorm -> LayerNorm / ShardedLayerNorm",
            "layer 4: Linear -> Linear / RowParallelLinear", "layer 5: LayerNorm", "loss",
            "forward", "step"} <= set(rows), out
    for ceiling, derived, d_diff, pair, p_diff in rows.values():
        assert min(ceiling, derived, pair) > 0, out
        assert abs(derived - ceiling - d_diff) <= 1 and abs(pair - ceiling - p_diff) <= 1, out
    for col in (0, 1, 3):  # means over the same steps: the parts add up to their whole (to the cells' rounding)
        parts = [v[col] for k, v in rows.items() if k.startswith("layer ") or k == "loss"]
        assert abs(sum(parts) - rows["forward"][col]) <= 0.5 * (len(parts) + 1), out
        phases = sum(rows[k][col] for k in ("forward", "backward", "optimizer"))
        assert abs(phases - rows["step"][col]) <= 0.5 * 4, out


def _bench_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_strategies

    return bench_strategies


def test_collectives_time_the_call_alone_after_what_runs_before_it(monkeypatch):
    """The zero-copy column rewrites the buffer before each timed all-reduce (as a backward writes a bucket):
    that write must run before every call, and outside the time."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_collectives

    order: list[str] = []

    def before() -> None:
        order.append("before")
        time.sleep(0.02)

    median = bench_collectives._time_ops(lambda: order.append("call"), 5, before=before)
    assert order == ["before", "call"] * 8  # 3 warm-up calls, then 5 timed
    assert median < 0.01


def test_a_pairs_floor_copies_in_waits_once_and_reads_what_the_peer_wrote(monkeypatch):
    """The floor columns: this member's bytes into its region (a private tensor's only), plus one barrier, plus the
    peer's region read just after the peer wrote it (the fake barrier is where the peer's write lands) -- not
    this member's own."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_collectives
    import torch

    class Pair:  # member 1 of a pair; the peer writes 5s into its region before each barrier
        index = 1

        def __init__(self) -> None:
            self.regions = [torch.zeros(8), torch.zeros(8)]
            self.local = self.regions[1]

        def region(self, member: int) -> torch.Tensor:
            return self.regions[member]

        def barrier(self) -> None:
            self.regions[0].fill_(5.0)

    calls: list[tuple[bool, torch.Tensor]] = []

    def one_call(fn, reps, before=None):  # runs once; returns a fixed "time" per call, in order
        if before is not None:
            before()
        calls.append((before is not None, fn().clone()))
        return [1.0, 10.0][len(calls) - 1]

    monkeypatch.setattr(bench_collectives, "_time_ops", one_call)
    pair = Pair()
    src = torch.arange(8.0)
    assert bench_collectives.pair_floors(pair, pair, src, 3, barrier_s=100.0) == (111.0, 110.0)
    (rewrote_first, copied_in), (rewrote, read) = calls
    assert not rewrote_first and torch.equal(copied_in, src)  # my bytes into my region, nothing before it
    assert rewrote and torch.equal(read, torch.full((8,), 5.0))  # after the peer's write: its region, not mine
    assert torch.equal(pair.local, src)


def test_pipeline_table_reports_medians_over_steps_and_hand_overs(monkeypatch):
    """Runtime-only schedules at P=2: every schedule gets a row with a bubble, the gap to its ideal at the
    measured stage times (a median of per-step differences: with 2 steps, the difference of the medians),
    and a hand-over delay and a time between actions -- the runtime's costs -- that were measured, and the share of
    the gap that a simulation paying those two delays gives (never below the ideal: delays only push actions later)."""
    table = _bench_module(monkeypatch).pipeline_table([2], [4], 64, 3)
    assert "medians of 2 steps" in table
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and " P " not in line]
    assert sorted(r[0].strip() for r in rows) == sorted(["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
    for r in rows:
        bubble, at_costs, gap = (float(r[i].strip().rstrip("%")) for i in (4, 5, 6))
        assert 0 < bubble < 100 and gap == pytest.approx(bubble - at_costs, abs=0.15)  # 2 steps: medians are means
        assert float(r[7].replace(",", "")) > 0  # hand-over us: a copy through a channel is never free
        assert float(r[8].replace(",", "")) > 0  # between actions us: a rank's bookkeeping is never free either
        assert float(r[9]) >= 0


def test_a_failing_ceiling_child_stops_the_others(monkeypatch):
    """A ceiling child that fails must not leave the driver waiting for a peer that waits for it (at the
    start file or a lock-step barrier): the peer is killed and the failure raised, whichever child fails."""
    bench_strategies = _bench_module(monkeypatch)

    started = []

    def fake_child(spec, env=None):
        code = "import time; time.sleep(300)" if spec.index == 0 else "import sys; sys.exit('child 1 broke')"
        started.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
        return started[-1]

    monkeypatch.setattr(bench_strategies, "launch_child", fake_child)
    spec = bench_strategies.RunSpec("ceiling (no comm)", "ceiling", 2, "reference", 64, 1, 1)
    with pytest.raises(RuntimeError, match="child 1 broke"):
        bench_strategies.measure(spec)
    assert started[0].returncode == -9  # the waiting child (collected first) was killed, not waited for


def test_preloaded_children_take_their_environment_and_leave_nothing_running(monkeypatch):
    """Measured runs are forked from a server that imported torch and lightning once. Each must run with the
    environment it is given (the ceiling's one thread per process), raise its own failure, and leave no
    process behind once collected: a strategy's own fork server, still shutting down, ran beside the next
    row's measured steps and slowed the ceiling after a shm_ddp row (measured 2026-12-02)."""
    bench = _bench_module(monkeypatch)
    single = bench.RunSpec("single", "single", 1, "reference", 32, 1, 1)
    for threads in (1, 2):
        result = bench.collect(bench.launch_child(single, {**os.environ, "OMP_NUM_THREADS": str(threads)}))
        assert result["threads"] == threads and result["samples_per_s"] > 0
    since = _ticks_since_boot()
    ddp = bench.launch_child(bench.RunSpec("shm_ddp", "shm_ddp", 2, "reference", 32, 1, 1))  # starts a fork server
    assert bench.collect(ddp)["samples_per_s"] > 0
    assert _processes_started_since(since) == [], "a process the child started outlived its collection"
    with pytest.raises(RuntimeError, match="KeyError: 'no-such-model'"):
        bench.collect(bench.launch_child(bench.RunSpec("single", "single", 1, "no-such-model", 32, 1, 1)))


def _ticks_since_boot() -> int:
    return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _processes_started_since(tick: int) -> list[str]:
    """Command lines of the live multiprocessing processes (fork servers, their children) started at or
    after ``tick``, other than this process's own fork server and resource tracker."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        state, ppid, start = fields[0], int(fields[1]), int(fields[19])
        if start >= tick and ppid != me and state != "Z" and int(stat.parent.name) != me and "multiprocessing" in cmd:
            found.append(cmd)
    return found


def test_summary_rows_exist_and_its_pipeline_row_cuts_the_wide_linear(monkeypatch):
    """The summary picks its rows from the main table by name: a renamed row would silently drop out of
    its measurement. Its pipeline row is the one with the wide MLP's big Linear cut between the stages."""
    bench = _bench_module(monkeypatch)
    for model, keys in bench.SUMMARY_WANTED.items():
        rows = {bench.SUMMARY_KEYS.get(s.row): s for s in bench.rows_for(model, 2, 128, 1, 1)}
        assert set(keys) <= set(rows), (model, set(keys) - set(rows))
        if "pp" in keys:
            pp = rows["pp"].strategy_kwargs
            assert pp["split_linear"] is True and pp["microbatches"] == bench.SUMMARY_M, pp


def test_summary_ratios_divide_each_round_by_its_own_ceiling(monkeypatch):
    """The machine slows down between rounds: the ceiling's median comes from its third round and the row's
    from its second, so one median over the other (54 / 80 = 0.675) mixes two speeds; the row ran at 0.9 of
    the ceiling in two of the three rounds, which is what the summary reports."""
    bench = _bench_module(monkeypatch)
    runs = {"ceiling": [{"samples_per_s": v} for v in (100.0, 60.0, 80.0)],
            "row": [{"samples_per_s": v} for v in (90.0, 54.0, 40.0)]}
    assert bench.median_runs(runs)["row"]["samples_per_s"] / bench.median_runs(runs)["ceiling"]["samples_per_s"] \
        == pytest.approx(0.675)
    assert bench.paired_ratios(runs, "ceiling") == pytest.approx({"ceiling": 1.0, "row": 0.9})
    with pytest.raises(ValueError):  # rounds must pair up
        bench.paired_ratios({"ceiling": runs["ceiling"], "row": runs["row"][:2]}, "ceiling")


def test_throughput_table_ratios_are_each_rounds_ratio(monkeypatch):
    """The main tables pair rounds as the summary does: a row that ran at 0.9 of the ceiling and 1.5x ddp_spawn
    in two of three rounds shows 0.90x and 1.50x, not one median over another (54 / 80 = 0.68x); without a
    ddp_spawn row that column says n/a. Samples/s and step ms are the row's median run."""
    bench = _bench_module(monkeypatch)

    def runs_of(values: tuple[float, ...]) -> list[dict[str, float]]:
        return [{"samples_per_s": v, "step_ms": 1000.0 / v} for v in values]

    runs = {"single": runs_of((50.0, 30.0, 40.0)), "ddp_spawn (gloo)": runs_of((60.0, 36.0, 40.0)),
            "row": runs_of((90.0, 54.0, 40.0)), "ceiling (no comm)": runs_of((100.0, 60.0, 80.0))}
    cells = {c[0]: c[1:] for c in ([x.strip() for x in line.strip("|").split("|")]
                                   for line in bench.throughput_rows(runs)[2:])}
    assert cells["row"] == ["54", "18.52", "1.80x", "1.50x", "0.90x"]
    assert cells["ceiling (no comm)"][-1] == "1.00x"
    del runs["ddp_spawn (gloo)"]
    assert [line.split("|")[5].strip() for line in bench.throughput_rows(runs)[2:]] == ["n/a"] * 3


def test_prefetch_speed_ups_are_each_repeats_ratio(monkeypatch):
    """The prefetch table's speed-ups pair repeats too: copy's step over prefetch's (view's) step of the same
    repeat, the median over the repeats -- 2.00x and 4.00x here, where one median over another gives 1.20x and
    2.40x. Its step columns stay each mode's median step."""
    bench = _bench_module(monkeypatch)
    import lightning_shm.runtime as runtime

    per_repeat = {"copy": (10.0, 6.0, 3.0), "prefetch": (5.0, 3.0, 9.0), "view": (2.5, 1.5, 4.0)}
    steps = {mode: iter(v * 2) for mode, v in per_repeat.items()}  # W=2, then W=1
    monkeypatch.setattr(runtime, "launch", lambda fn, w, model, policy, mode, *a, **k: [
        {"step_ms": next(steps[mode]), "gather_ms": 1.0, "peak_mib": 0.0}])
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    rows = [line for line in bench.prefetch_table(["reference"], 256, 4, 3).splitlines() if line.startswith("| ref")]
    row = [c.strip() for c in rows[0].strip("|").split("|")]  # W=2, the first configuration
    assert row[3:8] == ["6.0", "5.0", "2.00x", "2.5", "4.00x"], row


def test_reference_rows_put_the_former_tp_pair_beside_the_derived_plan(monkeypatch):
    """The reference MLP's derived plan gathers its first Linear; the extra row runs the column -> row pair
    it had before, so one run compares both (the wide MLP derives that pair itself: no extra row)."""
    from lightning_shm.models import MNISTClassifier
    from lightning_shm.parallel.tp import plan_for

    bench = _bench_module(monkeypatch)
    ref = {s.row: s for s in bench.rows_for("reference", 2, 128, 1, 1)}
    assert "plan" not in ref["shm_tp (tp=2)"].strategy_kwargs
    pair = ref["shm_tp (tp=2), column -> row pair"].strategy_kwargs["plan"]
    model = MNISTClassifier(**bench.MODELS["reference"])
    styles = {k: v.style for k, v in plan_for(model, pair, 2).items()}
    assert styles == {"net.1": "column", "net.4": "row"}
    assert {k: v.style for k, v in plan_for(model, None, 2).items()} == {"net.1": "column_gathered"}
    assert not [s.row for s in bench.rows_for("wide", 2, 128, 1, 1) if "pair" in s.row]


def test_bench_stage_grads_prints_both_variants(scripts_run):
    out = printed(scripts_run, "stage_grads")
    rows = [line for line in out.splitlines() if re.match(r"\| \(256, 512\) \| 64 \| [48] \|", line)]
    assert len(rows) == 2 and all(line.rstrip().endswith("x |") for line in rows)


def test_bench_stage_grads_prints_what_the_activation_record_costs(scripts_run):
    out = printed(scripts_run, "stage_grads_record")
    rows = [[x.strip() for x in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| MLP") or line.startswith("| transformer")]
    assert [(r[0], r[1]) for r in rows] == [(m, M) for m in ("MLP 512 x 8", "transformer") for M in ("4", "8")], out
    for _, _, saved, on, off, cost in rows:
        assert int(saved) > 0 and float(on) > 0 and float(off) > 0
        # the printed cost is the difference of the printed times (each rounded to 0.01 ms) over the second
        low, high = (float(on) - 0.005 - float(off) - 0.005) / (float(off) + 0.005), \
            (float(on) + 0.005 - float(off) + 0.005) / (float(off) - 0.005)
        assert low - 0.0005 <= float(cost.rstrip("%")) / 100 <= high + 0.0005, (on, off, cost)


@pytest.mark.parametrize("key, model", [("stage_grads_bound", "MLP [256, 64]"),
                                        ("stage_grads_bound_transformer", "transformer")])
def test_bench_stage_grads_prints_the_microbatch_bound(scripts_run, key, model):
    out = printed(scripts_run, key)
    assert f"microbatch size: {model}, global batch 256" in out, out
    rows = {c[0]: c[1:] for c in ([x.strip() for x in line.strip("|").split("|")] for line in out.splitlines())
            if len(c) == 4 and (c[0].startswith("ceiling") or c[0].startswith("stage-like"))}
    assert rows["ceiling rank (autograd)"] == ["128 x 1", rows["ceiling rank (autograd)"][1], "1.00"], out
    for M in (1, 4, 8):
        for name in (f"stage-like, M={M}", f"stage-like, M={M}, re-strided"):
            assert rows[name][0] == f"{256 // M} x {M}" and float(rows[name][1]) > 0 and float(rows[name][2]) > 0, out
