"""Two simulated nodes x two devices on loopback: shm_ddp (hierarchical) vs Lightning's ddp (gloo).

    python scripts/bench_nodes.py            # reference and wide MLP, a few hundred / a dozen steps

Each configuration runs through scripts/launch_nodes.py (2 node processes, NODE_RANK / MASTER_ADDR /
MASTER_PORT set as on real machines). Rank 0 times steady-state steps and reads the loopback
interface's byte counter (/proc/net/dev, ``lo``) at the start and end of its window: every byte any
process of the job sent over TCP in between -- Lightning's ddp runs gloo between all four ranks,
shm_ddp only between the nodes, on each rank's rail. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"reference": [256, 64], "wide": [4096, 4096]}
STEPS = {"reference": (30, 300), "wide": (3, 12)}  # (warm-up, measured)


def loopback_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])  # transmitted bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


class Window(Callback):
    """Rank 0 times steps [warmup, warmup + steps) and counts loopback bytes over them."""

    def __init__(self, warmup: int, steps: int, out: Path) -> None:
        self.warmup, self.steps, self.out = warmup, steps, out

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warmup and trainer.is_global_zero:
            self.t0, self.b0 = time.perf_counter(), loopback_bytes()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.warmup + self.steps and trainer.is_global_zero:
            self.out.write_text(json.dumps({"seconds": time.perf_counter() - self.t0,
                                            "bytes": loopback_bytes() - self.b0, "steps": self.steps}))


def run_one(strategy: str, model: str, global_batch: int, out: Path) -> None:
    """One node of the job (all four ranks run this; rank 0 measures)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT))
    import lightning_shm  # noqa: F401
    from lightning_shm.models import MNISTClassifier

    warmup, steps = STEPS[model]
    g = torch.Generator().manual_seed(0)
    n = global_batch * 50
    data = TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", strategy=strategy, devices=2, num_nodes=2, max_steps=warmup + steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Window(warmup, steps, out)], num_sanity_val_steps=0)
    trainer.fit(MNISTClassifier(hidden_sizes=MODELS[model], lr=0.01),
                DataLoader(data, batch_size=global_batch // 4, shuffle=True, drop_last=True))


def measure(strategy: str, model: str, global_batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "window.json"
        cmd = [sys.executable, str(ROOT / "scripts" / "launch_nodes.py"), "--nodes", "2", "--",
               sys.executable, __file__, "--run-one", strategy, model, str(global_batch), str(out)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{strategy} failed:\n{done.stderr[-3000:]}")
        w = json.loads(out.read_text())
    return {"samples_per_s": global_batch * w["steps"] / w["seconds"], "step_ms": w["seconds"] / w["steps"] * 1e3,
            "kib_per_step": w["bytes"] / w["steps"] / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-one", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    if args.run_one:
        strategy, model, gb, out = args.run_one
        run_one(strategy, model, int(gb), Path(out))
        return
    lines = [f"# 2 nodes x 2 devices on loopback, global batch {args.global_batch}, {os.cpu_count()} cores, "
             f"median of {args.repeats}\n",
             "| model | strategy | samples/s | step ms | bytes over TCP per step | vs ddp |",
             "|---|---|---:|---:|---:|---:|"]
    for model in args.models:
        res: dict[str, list[dict[str, float]]] = {"ddp": [], "shm_ddp": []}
        for _ in range(args.repeats):
            for s in res:
                res[s].append(measure(s, model, args.global_batch))
        med = {s: sorted(r, key=lambda x: x["samples_per_s"])[len(r) // 2] for s, r in res.items()}
        for s in ("ddp", "shm_ddp"):
            r, ratio = med[s], med[s]["samples_per_s"] / med["ddp"]["samples_per_s"]
            lines.append(f"| {model} | {s} | {r['samples_per_s']:,.0f} | {r['step_ms']:.1f} | "
                         f"{r['kib_per_step'] / 1024:.2f} MiB | {ratio:.2f}x |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
