"""Plot loss and accuracy curves from a run's CSVLogger metrics file.

    python scripts/plot_metrics.py lightning_logs/version_0/metrics.csv -o curves.png
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path: Path) -> dict[str, list[tuple[float, float]]]:
    """{column: [(step, value), ...]} for every numeric column except epoch/step."""
    series: dict[str, list[tuple[float, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = float(row.get("step") or 0)
            for key, value in row.items():
                if key in ("step", "epoch") or value in ("", None):
                    continue
                series.setdefault(key, []).append((step, float(value)))
    return series


def plot(series: dict[str, list[tuple[float, float]]], out: Path, title: str) -> None:
    losses = {k: v for k, v in series.items() if "loss" in k}
    accs = {k: v for k, v in series.items() if "acc" in k}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, group, ylabel in ((axes[0], losses, "loss"), (axes[1], accs, "accuracy")):
        for name, points in sorted(group.items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(points) < 30 else None, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if group:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", type=Path, help="metrics.csv written by CSVLogger")
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: next to metrics.csv)")
    args = parser.parse_args()
    series = read_metrics(args.metrics)
    if not series:
        raise SystemExit(f"{args.metrics} holds no metrics")
    out = args.output or args.metrics.with_name("curves.png")
    plot(series, out, str(args.metrics.parent))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
