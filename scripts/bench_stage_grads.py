"""One pipeline stage's step: the engine's weight gradients (rows gathered over microbatches, or
one in-place product per microbatch) against autograd's, side by side.

    python scripts/bench_stage_grads.py           # four layer sizes, M = 4 and 8, 4 alternating repeats (~1 min)
    python scripts/bench_stage_grads.py --quick   # one small layer, two repeats
    python scripts/bench_stage_grads.py --bound   # the wide MLP, per-sample cost by microbatch size (~1 min)
    python scripts/bench_stage_grads.py --bound --transformer   # the same for the small transformer
    python scripts/bench_stage_grads.py --record  # what the engine's activation-memory record costs a step (~1 min)

A stage back-propagates M microbatches per step. Autograd computes each Linear's weight gradient as
a fresh ``grad_output^T @ input`` per microbatch and adds it to ``.grad``. The engine (through
``SinkLinear``, parallel/linear_grads.py) either adds each microbatch's product in place with
``addmm_`` ("per microbatch", ``stash_fraction = 0``) or keeps the microbatches' rows and takes one
product over all of them ("gathered", the default ``stash_fraction``). All run the same 1F1B step in
this process (one stage, one thread, the workers' malloc settings) on Linear(in, out) + ReLU +
Linear(out, 10); the engine's variants take every weight (``in_place_min_numel = 0``), "autograd" is
the engine with its Linear patch removed (``close()``). Medians of steps, per alternating repeat.
The sizes bracket the engine's default ``in_place_min_numel`` (2^20): below it the custom autograd
node costs about what the engine's products save.

``--bound``: what the microbatch size alone costs a pipeline. A ceiling rank trains the whole model on
global batch / 2 rows at once; at P=2 each stage trains half of it on all global-batch rows, cut into M
microbatches. Timing the whole model in one process at both sizes (step = forward, backward, SGD step;
the ceiling with autograd's Linear, the stage through the engine, with and without the re-strided
weight copies of ``linear_grads.PaddedWeights``) gives ``e = 2 x ceiling step / stage-like step``: the
pipeline's per-sample compute against the ceiling's, so ``samples/s <= e x (1 - bubble) x ceiling``
even with balanced stages and free hand-overs. Steps of all rows alternate; medians.

``--record``: the engine's step with and without ``track_activation_memory`` (a Python hook on every tensor
autograd saves, called again when backward unpacks it), alternating step by step on one engine; the
strategies build their engines without it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_shm.runtime.launcher import keep_freed_memory  # noqa: E402

keep_freed_memory()  # before torch allocates: like a worker

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lightning_shm.parallel.pipeline import PipelineSchedule, Schedule  # noqa: E402
from lightning_shm.parallel.pipeline.driver import _PlainIO  # noqa: E402
from lightning_shm.parallel.pipeline.engine import PipelineEngine  # noqa: E402


def step_ms(net: nn.Module, x: torch.Tensor, y: torch.Tensor, M: int, mode: str, steps: int) -> float:
    """``mode``: "gathered", "per microbatch" (the engine's weight gradients) or "autograd"."""
    engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.ONE_F_ONE_B, 1, M, 1), 0, [0], world=None)
    if mode == "autograd":
        engine.close()  # the Linear layers back to autograd's weight gradients
    else:
        engine.in_place_min_numel = 0  # every weight, whatever its size
        engine.stash_fraction = PipelineEngine.stash_fraction if mode == "gathered" else 0.0
    times = []
    try:
        for _ in range(steps + 1):
            net.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            engine.train_step(_PlainIO(x, y, M))
            times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    return statistics.median(times[1:]) * 1e3


MODES = ("gathered", "per microbatch", "autograd")


def microbatch_bound(hidden: list[int] | None, global_batch: int, rounds: int) -> None:
    """The ``--bound`` table (module docstring); ``hidden`` None: the transformer."""
    from lightning_shm.models import MNISTClassifier, build_mlp
    from lightning_shm.parallel.linear_grads import PaddedWeights

    torch.manual_seed(0)
    net = build_mlp(hidden) if hidden is not None else MNISTClassifier(arch="transformer").net
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # the step's memory traffic, weights unchanged
    # the second row: what the ceiling would gain from the copies (it trains with stock PyTorch)
    rows = {"ceiling rank (autograd)": (global_batch // 2, 1, None),
            "ceiling rank, re-strided": (global_batch // 2, 1, True)}
    for M in (1, 4, 8):
        rows[f"stage-like, M={M}"] = (global_batch, M, False)
        rows[f"stage-like, M={M}, re-strided"] = (global_batch, M, True)
    data = {n: (torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))) for n in {r[0] for r in rows.values()}}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for i in range(rounds + 1):
        for name, (n, M, padded) in rows.items():
            engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.ONE_F_ONE_B, 1, M, 1), 0, [0], world=None)
            if padded is None:
                engine.close()
            engine.padded.min_numel = PaddedWeights.min_numel if padded else 1 << 62
            net.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            engine.train_step(_PlainIO(*data[n], M))
            opt.step()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
            engine.close()
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ceiling = med["ceiling rank (autograd)"]
    model = f"MLP {hidden}" if hidden is not None else "transformer"
    print(f"## Per-sample cost at the pipeline's microbatch size: {model}, global batch {global_batch}, "
          f"1 thread; ms per step, median of {rounds}\n")
    print("| row | rows x microbatches | step ms | e = 2 x ceiling / step (ceiling rows: ceiling / step) |")
    print("|---|---|---:|---:|")
    for name, (n, M, _) in rows.items():
        e = ceiling / med[name] if name.startswith("ceiling") else 2 * ceiling / med[name]
        print(f"| {name} | {n // M} x {M} | {med[name]:.1f} | {e:.2f} |")


def record_cost(global_batch: int, rounds: int) -> None:
    """The ``--record`` table (module docstring): one stage holding the whole model, 1F1B."""
    from lightning_shm.models import MNISTClassifier

    models = {"MLP 512 x 8": {"arch": "mlp", "hidden_sizes": [512] * 8}, "transformer": {"arch": "transformer"}}
    print(f"## The activation-memory record: one stage, 1F1B, global batch {global_batch}, 1 thread; ms per step, "
          f"median of {rounds} alternating steps each\n")
    print("| model | M | saved tensors per microbatch | recorded | not recorded | the record's cost |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, kw in models.items():
        torch.manual_seed(0)
        net = MNISTClassifier(**kw).net
        x, y = torch.randn(global_batch, 1, 28, 28), torch.randint(0, 10, (global_batch,))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            net(x[:global_batch // 4])
        for M in (4, 8):
            engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.ONE_F_ONE_B, 1, M, 1), 0, [0], world=None)
            times: dict[bool, list[float]] = {True: [], False: []}
            try:
                for i in range(rounds + 1):
                    for track in (True, False) if i % 2 else (False, True):
                        engine.tracks_memory = track
                        net.zero_grad(set_to_none=True)
                        t0 = time.perf_counter()
                        engine.train_step(_PlainIO(x, y, M))
                        if i:  # the first round warms up
                            times[track].append(time.perf_counter() - t0)
            finally:
                engine.close()
            on, off = (statistics.median(times[t]) * 1e3 for t in (True, False))
            print(f"| {name} | {M} | {len(saved)} | {on:.2f} | {off:.2f} | {(on - off) / off:+.1%} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--bound", action="store_true", help="the per-sample cost table of the wide MLP (module docstring)")
    p.add_argument("--record", action="store_true", help="the activation-memory record's cost (module docstring)")
    p.add_argument("--transformer", action="store_true", help="--bound: the small transformer instead of the MLP")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.record:
        record_cost(64 if args.quick else 256, args.repeats or (2 if args.quick else 30))
        return
    if args.bound:
        hidden = None if args.transformer else [256, 64] if args.quick else [4096, 4096]
        microbatch_bound(hidden, 256, args.repeats or (2 if args.quick else 8))
        return
    shapes = [(256, 512, 64)] if args.quick else [(784, 256, 64), (1024, 1024, 64), (2048, 4096, 128),
                                                   (4096, 4096, 128)]
    repeats, steps = args.repeats or (2 if args.quick else 4), 2 if args.quick else 3
    print(f"## One pipeline stage, 1F1B, Linear(in, out) + ReLU + Linear(out, 10), 1 thread; ms per step, "
          f"{repeats} alternating repeats\n")
    print("| Linear | batch | M | " + " | ".join(f"{m} (each repeat)" for m in MODES)
          + " | per microbatch / gathered | autograd / gathered |")
    print("|---|---:|---:|---|---|---|---:|---:|")
    for d_in, d_out, batch in shapes:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU(), nn.Linear(d_out, 10))
        x, y = torch.randn(batch, d_in), torch.randint(0, 10, (batch,))
        for M in (4, 8):
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(repeats):
                for m in MODES:
                    times[m].append(step_ms(net, x, y, M, m, steps))
            med = {m: statistics.median(t) for m, t in times.items()}
            cells = " | ".join(" / ".join(f"{t:.1f}" for t in times[m]) for m in MODES)
            print(f"| ({d_in}, {d_out}) | {batch} | {M} | {cells} | {med['per microbatch'] / med['gathered']:.2f}x | "
                  f"{med['autograd'] / med['gathered']:.2f}x |")


if __name__ == "__main__":
    main()
