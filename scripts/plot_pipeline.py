"""Gantt charts of measured pipeline timelines, one PNG per schedule.

    python scripts/plot_pipeline.py                          # P=2 and P=4, M=8, every schedule
    python scripts/plot_pipeline.py --stages 2 --microbatches 4 --out-dir docs/img

Each worker records (action, microbatch, chunk, start, end) for every forward (F), backward (B)
and zero-bubble weight pass (W) of a training step of an MLP pipelined over P processes
(:func:`lightning_shm.parallel.pipeline.driver.train_pipeline`). One row per rank; the title gives
the bubble measured from the chart (idle share of rank-time between the first start and the last
end) beside the ideal one of the schedule (uniform costs, no communication).

With more stages than cores (P=4 on 2 cores) ranks share cores, so part of a bar can be time the
process was descheduled: read those charts for the shape of the schedule, not for speed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_shm.parallel.pipeline import PipelineSchedule, Schedule  # noqa: E402
from lightning_shm.parallel.pipeline.driver import train_pipeline  # noqa: E402
from lightning_shm.runtime import launch  # noqa: E402

COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
HIDDEN = [512] * 8  # 9 Linear layers (25 in all): every chunk of P=4 x 2 virtual stages can hold one


def measured_bubble(results: Sequence[Any]) -> float:
    recs = [r for res in results for r in res.timeline]
    t0, t1 = min(r.start for r in recs), max(r.end for r in recs)
    busy = sum(r.end - r.start for r in recs)
    return 1.0 - busy / (len(results) * (t1 - t0))


def run(schedule: str, stages: int, microbatches: int, batch: int, steps: int = 3) -> list[Any]:
    v = 2 if schedule == "interleaved_1f1b" else 1
    return launch(train_pipeline, stages, HIDDEN, schedule, microbatches, v, steps, batch, start_method="fork")


def gantt(results: Sequence[Any], schedule: str, stages: int, microbatches: int, path: Path) -> float:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = 2 if schedule == "interleaved_1f1b" else 1
    ideal = PipelineSchedule(Schedule(schedule), stages, microbatches, v).ideal_bubble()
    bubble = measured_bubble(results)
    t0 = min(r.start for res in results for r in res.timeline)
    span = max(r.end for res in results for r in res.timeline) - t0
    fig, ax = plt.subplots(figsize=(12, 0.7 * stages + 1.4))
    for res in results:
        for r in res.timeline:
            ax.barh(res.rank, (r.end - r.start) * 1e3, left=(r.start - t0) * 1e3, color=COLORS[r.kind],
                    edgecolor="white", height=0.8)
            label = f"{r.mb}" if v == 1 else f"{r.mb}.{r.chunk // stages}"
            if r.end - r.start > 0.012 * span:  # label bars wide enough to read
                ax.text((r.start + r.end - 2 * t0) / 2 * 1e3, res.rank, label, ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(stages), [f"rank {r}" for r in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in COLORS.items() if k != "W" or schedule == "zero_bubble"]
    names = ["forward", "backward" if schedule != "zero_bubble" else "backward (input grad)", "weight grad"]
    ax.legend(handles, names[: len(handles)], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(f"{schedule}: P={stages}, M={microbatches}{', v=2' if v > 1 else ''} -- measured bubble "
                 f"{bubble:.1%} (ideal {ideal:.1%})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return bubble


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--schedules", nargs="+", default=[s.value for s in Schedule])
    p.add_argument("--out-dir", type=Path, default=Path("outputs/pipeline"))
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for stages in args.stages:
        for schedule in args.schedules:
            results = run(schedule, stages, args.microbatches, args.batch)
            path = args.out_dir / f"pipeline_{schedule}_p{stages}.png"
            bubble = gantt(results, schedule, stages, args.microbatches, path)
            print(f"{path}: measured bubble {bubble:.1%}")


if __name__ == "__main__":
    main()
