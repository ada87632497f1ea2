"""The benchmark scripts run and print their tables (speed is measured by running them, not here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str]) -> str:
    """No wall-clock limit of its own: how long a benchmark takes depends on the machine's load; pytest's
    per-test timeout (pyproject) still catches a hang."""
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_bench_collectives_prints_table_plot_and_summary(tmp_path):
    out = run(["scripts/bench_collectives.py", "--quick", "--sizes", "4KiB", "64KiB", "--out-dir", str(tmp_path)])
    assert "| 4KiB |" in out and "| 64KiB |" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("summary: ")
    pairs = dict(kv.split("=") for kv in summary[len("summary: "):].split())
    assert {"allreduce_4KiB_us", "barrier_us", "speedup_vs_gloo_1MiB", "fraction_of_bound_64MiB"} <= set(pairs)
    assert float(pairs["allreduce_4KiB_us"]) > 0 and float(pairs["barrier_us"]) > 0
    assert (tmp_path / "collectives.png").stat().st_size > 1000


def test_bench_strategies_runs_the_rows(tmp_path):
    out = run(["scripts/bench_strategies.py", "--quick", "--models", "reference", "--rows", "shm_ddp",
               "--steps", "20", "--repeats", "1", "--out-dir", str(tmp_path)])
    for row in ("single", "shm_ddp", "ceiling"):
        assert re.search(rf"\| {re.escape(row)}[^|]* \| [\d,]+ \|", out), out
    assert "## shm_fsdp prefetch" in out and "| reference | per layer | 2 x 1" in out
    assert (tmp_path / "strategies_w2.png").exists()


def test_plot_pipeline_draws_a_gantt_chart_per_schedule(tmp_path):
    out = run(["scripts/plot_pipeline.py", "--stages", "2", "--microbatches", "4", "--batch", "64",
               "--out-dir", str(tmp_path)])
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"):
        png = tmp_path / f"pipeline_{schedule}_p2.png"
        assert png.stat().st_size > 5000, png
        assert f"pipeline_{schedule}_p2.png: measured bubble" in out
