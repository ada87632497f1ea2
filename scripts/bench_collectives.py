"""All-reduce and barrier of the shared-memory runtime vs torch.distributed gloo, side by side in one run.

    python scripts/bench_collectives.py            # W=2 and W=4, 4 KiB .. 64 MiB, 3 interleaved rounds
    python scripts/bench_collectives.py --quick    # W=2, five sizes, under a minute

Columns (per message size N, float32, in-place sum):

* ``shm``: ``Group.all_reduce`` on a private tensor, copied through scratch (one-shot up to 64 KiB; above,
  reduce-scatter + all-gather, except in a group of two, which stays one-shot in 1 MiB chunks);
* ``shm RS+AG`` (W=2): the same with ``GroupConfig(pair_oneshot=False)``: reduce-scatter + all-gather
  above 64 KiB, what a pair did before 2026-12-05 (timed in the same processes right before or after
  ``shm``, the order alternating from round to round);
* ``shm zero-copy``: the tensor already lives in shared memory (how DDP gradient buckets are reduced),
  rewritten by its owner before each timed call (untimed, then a barrier), as a backward writes a
  bucket: the part of a peer's buffer a rank reduces comes out of the other core's cache. (Reduced
  again unchanged, each rank's parts stay in its own cache and no byte crosses between the cores:
  2026-12-05, 1 MiB 55 us that way against 113 us written.)
* ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend on the same machine;
* ``channel round trip``: a message of N bytes from rank 0 to rank 1 through a point-to-point
  :class:`~lightning_shm.runtime.p2p.Channel` and back (what pipeline stages hand each other);
* ``algbw``: N / time (GB/s), as NCCL reports it;
* ``bound``: the memory-traffic lower bound -- every rank must at least read its N input bytes and
  write its N result bytes, i.e. one memcpy of N bytes at the single-core copy bandwidth measured
  here for that size; ``of bound`` = bound / shm time (1.0 = at the bound), for the private tensor
  and for the zero-copy path. A private tensor must also be copied into shared memory and its
  result copied out, twice the traffic of the zero-copy path. Either can pass 1.0 where the W ranks'
  cores together copy faster than one: each rank handles only its 1/W of the data.
* ``floor`` (W=2, sizes up to a slot): what any all-reduce of a private tensor costs a member at least, the sum
  of three medians timed in the same processes -- its N bytes copied into shared memory, one barrier, and the
  peer's N bytes read across the cores right after the peer wrote them (:func:`pair_floors`); ``of floor`` =
  floor / shm time; ``bound / floor`` = the most "of bound" any algorithm reaches on this machine: reading
  from the other core's cache is slower than the single-core copy the bound counts. ``zero-copy floor``: the
  same without the copy in (the tensor is in shared memory already), against the zero-copy column.

Ours and gloo are measured in alternating rounds and the medians are reported, so a shared noisy
machine affects both alike. The last line is machine-readable::

    summary: allreduce_4KiB_us=... allreduce_1MiB_us=... allreduce_64MiB_ms=... speedup_vs_gloo_1MiB=...
             speedup_vs_gloo_64MiB=... barrier_us=... channel_roundtrip_64KiB_us=... fraction_of_bound_64MiB=...
             fraction_of_bound_1MiB=...
             zero_copy_of_bound_64MiB=... zero_copy_of_bound_1MiB=... rsag_vs_oneshot_1MiB=...
             floor_4KiB_us=... floor_1MiB_us=... of_floor_1MiB=... bound_over_floor_1MiB=...
             zero_copy_of_floor_1MiB=... bound_over_zero_copy_floor_1MiB=... barrier_w4_us=...
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_shm.runtime import launch  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
FULL_SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]


def fmt_size(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"


def parse_size(s: str) -> int:
    s = s.strip().lower()
    for suffix, mult in (("mib", MiB), ("kib", KiB), ("m", MiB), ("k", KiB)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def reps_for(nbytes: int, quick: bool) -> int:
    budget = 0.15 if quick else 0.4  # seconds of shm time per size and round, roughly
    est = 20e-6 + nbytes / 5e9
    return int(max(5, min(2000, budget / est)))


def _time_ops(fn: Callable[[], Any], reps: int, before: Optional[Callable[[], None]] = None) -> float:
    """Median seconds of one ``fn()``; ``before()``, if given, runs untimed before each call."""
    for _ in range(min(3, reps)):
        if before is not None:
            before()
        fn()
    ts = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ---------------------------------------------------------------------- workers
def shm_worker(world: Any, sizes: list[int], quick: bool, turn: int = 0) -> dict[str, Any]:
    g = world.group()
    out: dict[str, Any] = {"barrier": _time_ops(g.barrier, 2000 if quick else 10000)}
    # a pair also times reduce-scatter + all-gather on the same tensor, in the same processes: measured in
    # separate processes the two differed by 14-37% at sizes where both take the same path
    default = g.config
    paths = [("private", default)]
    if g.size == 2:
        paths.append(("rsag", replace(default, pair_oneshot=False)))
    if turn % 2:  # alternate which goes first from round to round
        paths.reverse()
    for n in sizes:
        x = torch.ones(n // 4)
        for key, config in paths:
            g.config = config  # every member switches at the same point: the path is chosen alike
            g.barrier()
            out[(key, n)] = _time_ops(lambda: g.all_reduce(x), reps_for(n, quick))
        g.config = default
        buf = g.alloc_shared(n // 4, torch.float32, tag=f"bench{n}")
        src = torch.ones(n // 4)

        def written() -> None:  # as a backward writes a bucket: the peer's part comes out of the other core's cache
            buf.local.copy_(src)
            g.barrier()

        out[("zero_copy", n)] = _time_ops(lambda: g.all_reduce(buf.local), reps_for(n, quick), before=written)
        if g.size == 2 and n <= g.config.slot_bytes:
            floors = pair_floors(g, buf, src, reps_for(n, quick), out["barrier"])
            out[("floor", n)], out[("zero_copy_floor", n)] = floors
        g.release_shared(buf)
    for n in sizes:  # point-to-point: a message from rank 0 to rank 1 and back (a pipeline's hand-over, twice)
        out[("channel", n)] = 0.0
        g.barrier()
        if world.rank < 2:
            me, peer = world.rank, 1 - world.rank
            tx, rx = world.channel(me, peer, "bench"), world.channel(peer, me, "bench")
            x = torch.ones(n // 4)
            step = (lambda: (tx.send(x), rx.recv())) if me == 0 else (lambda: tx.send(rx.recv()))
            out[("channel", n)] = _time_ops(step, reps_for(n, quick))
    return out


def pair_floors(g: Any, buf: Any, src: torch.Tensor, reps: int, barrier_s: float) -> tuple[float, float]:
    """What any all-reduce of ``src``'s size costs a member of a pair at least, for a private tensor and for one
    already in shared memory (zero-copy). Both need one barrier (``barrier_s``, timed alone) and the peer's N
    bytes read across the cores just after the peer wrote them: each member needs N bytes' worth of the peer's
    contribution, raw or partly reduced, and they sit in the other core's cache. A private tensor's N bytes
    must first be copied into shared memory (timed warm, into this member's region of ``buf``). Returns
    (copy in + barrier + cross-core read, barrier + cross-core read), sums of medians. Measured for sizes up
    to a slot (one chunk), where the copies stay in cache as the one-shot's do; ``bound / floor`` is then the
    most "of bound" any algorithm can reach on this machine.
    """
    peer = buf.region(1 - g.index)
    dst = torch.empty_like(src)
    copy_in = _time_ops(lambda: buf.local.copy_(src), reps)

    def written() -> None:  # the peer's bytes come out of the other core's cache, as after its copy-in
        buf.local.copy_(src)
        g.barrier()

    cross_read = _time_ops(lambda: dst.copy_(peer), reps, before=written)
    return copy_in + barrier_s + cross_read, barrier_s + cross_read


def gloo_worker(world: Any, sizes: list[int], quick: bool, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size)
    try:
        out: dict[str, Any] = {"barrier": _time_ops(dist.barrier, 300 if quick else 2000)}
        for n in sizes:
            x = torch.ones(n // 4)
            dist.barrier()
            out[("private", n)] = _time_ops(lambda: dist.all_reduce(x), max(3, reps_for(n, quick) // 4))
        return out
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memcpy_times(sizes: list[int]) -> dict[int, float]:
    """Single-core copy time of N bytes (the unit of the traffic bound)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for n in sizes:
            src, dst = torch.ones(n // 4), torch.empty(n // 4)
            out[n] = _time_ops(lambda: dst.copy_(src), reps_for(n, quick=True) * 2)
        return out
    finally:
        torch.set_num_threads(prev)


# ---------------------------------------------------------------------- driver
def measure(world_size: int, sizes: list[int], rounds: int, quick: bool) -> dict[str, Any]:
    shm_runs, gloo_runs = [], []
    for turn in range(rounds):  # alternate so that machine noise hits both
        shm_runs.append(max_over_ranks(launch(shm_worker, world_size, sizes, quick, turn, start_method="fork")))
        gloo_runs.append(max_over_ranks(launch(gloo_worker, world_size, sizes, quick, free_port(),
                                               start_method="fork")))
    return {"shm": median_runs(shm_runs), "gloo": median_runs(gloo_runs)}


def max_over_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """A collective is as slow as its slowest rank."""
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]}


def median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def table(world_size: int, sizes: list[int], res: dict[str, Any], copy: dict[int, float]) -> str:
    shm, gloo = res["shm"], res["gloo"]
    lines = [
        f"W={world_size}: barrier {shm['barrier'] * 1e6:.1f} us (shm) vs {gloo['barrier'] * 1e6:.1f} us (gloo)",
        "",
        "| size | shm | shm RS+AG | shm zero-copy | gloo | speed-up vs gloo | shm algbw GB/s | memcpy GB/s | bound "
        "| of bound | floor | of floor | bound / floor | zero-copy of bound | zero-copy floor | zero-copy of floor "
        "| bound / zero-copy floor | channel round trip (rank 0 -> 1 -> 0) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        t, z, g = shm[("private", n)], shm[("zero_copy", n)], gloo[("private", n)]
        rs = fmt_t(shm[("rsag", n)]) if ("rsag", n) in shm else "--"
        floor, zfloor = (_floor_cells(shm.get((key, n)), took, copy[n]) for key, took in
                         (("floor", t), ("zero_copy_floor", z)))
        lines.append(
            f"| {fmt_size(n)} | {fmt_t(t)} | {rs} | {fmt_t(z)} | {fmt_t(g)} | {g / t:.1f}x | {n / t / 1e9:.2f} | "
            f"{n / copy[n] / 1e9:.1f} | {fmt_t(copy[n])} | {copy[n] / t:.2f} | {floor} | {copy[n] / z:.2f} | "
            f"{zfloor} | {fmt_t(shm[('channel', n)])} |"
        )
    return "\n".join(lines)


def _floor_cells(floor: Optional[float], took: float, bound: float) -> str:
    """A floor, the time against it (1.0 = at the floor) and the most "of bound" it allows; "--" where unmeasured."""
    return "-- | -- | --" if floor is None else f"{fmt_t(floor)} | {floor / took:.2f} | {bound / floor:.2f}"


def fmt_t(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def plot(path: Path, sizes: list[int], results: dict[int, dict[str, Any]], copy: dict[int, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [n / KiB for n in sizes]
    for w, res in sorted(results.items()):
        ax.plot(xs, [res["shm"][("private", n)] * 1e6 for n in sizes], "o-", label=f"shm W={w}")
        ax.plot(xs, [res["shm"][("zero_copy", n)] * 1e6 for n in sizes], "^--", label=f"shm zero-copy W={w}")
        ax.plot(xs, [res["gloo"][("private", n)] * 1e6 for n in sizes], "s-", label=f"gloo W={w}")
    ax.plot(xs, [copy[n] * 1e6 for n in sizes], "k:", label="traffic bound (1 memcpy)")
    floors = [(n / KiB, res["shm"][("floor", n)] * 1e6) for w, res in results.items() for n in sizes
              if ("floor", n) in res["shm"]]
    if floors:
        ax.plot(*zip(*floors), "kx", label="floor of a private tensor, W=2 (copy in + barrier + cross-core read)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (KiB, float32)")
    ax.set_ylabel("all_reduce time (us)")
    ax.set_title(f"all_reduce on {os.cpu_count()} cores: shared memory vs gloo")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="W=2, five sizes, one round: under a minute")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None)
    p.add_argument("--sizes", type=parse_size, nargs="+", default=None, help="e.g. 4KiB 1MiB 64MiB")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--out-dir", type=Path, default=Path("outputs/bench_collectives"))
    args = p.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    worlds = args.world_sizes or ([2] if args.quick else [2, 4])
    rounds = args.rounds or (1 if args.quick else 3)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    t0 = time.time()
    copy = memcpy_times(sizes)
    results = {w: measure(w, sizes, rounds, args.quick) for w in worlds}
    report = [f"# all_reduce (float32 sum) and barrier: shared memory vs gloo -- {os.cpu_count()} cores, "
              f"{rounds} round(s), medians\n"]
    for w in worlds:
        report.append(table(w, sizes, results[w], copy))
        report.append("")
    text = "\n".join(report)
    (args.out_dir / "collectives.md").write_text(text)
    plot(args.out_dir / "collectives.png", sizes, results, copy)
    print(text)
    print(f"(tables and plot in {args.out_dir}/; {time.time() - t0:.0f} s)")

    ref = results.get(2) or results[worlds[0]]
    shm, gloo = ref["shm"], ref["gloo"]

    def at(size: int, key: str = "private", src: dict = shm) -> float:
        return src.get((key, size), float("nan"))

    summary = {
        "allreduce_4KiB_us": at(4 * KiB) * 1e6,
        "allreduce_1MiB_us": at(MiB) * 1e6,
        "allreduce_64MiB_ms": at(64 * MiB) * 1e3,
        "speedup_vs_gloo_1MiB": at(MiB, src=gloo) / at(MiB),
        "speedup_vs_gloo_64MiB": at(64 * MiB, src=gloo) / at(64 * MiB),
        "barrier_us": shm["barrier"] * 1e6,
        "channel_roundtrip_64KiB_us": at(64 * KiB, "channel") * 1e6,
        "fraction_of_bound_64MiB": copy.get(64 * MiB, float("nan")) / at(64 * MiB),
        "fraction_of_bound_1MiB": copy.get(MiB, float("nan")) / at(MiB),
        "zero_copy_of_bound_64MiB": copy.get(64 * MiB, float("nan")) / at(64 * MiB, "zero_copy"),
        "zero_copy_of_bound_1MiB": copy.get(MiB, float("nan")) / at(MiB, "zero_copy"),
        "rsag_vs_oneshot_1MiB": at(MiB, "rsag") / at(MiB),
        "floor_4KiB_us": at(4 * KiB, "floor") * 1e6,
        "floor_1MiB_us": at(MiB, "floor") * 1e6,
        "of_floor_1MiB": at(MiB, "floor") / at(MiB),
        "bound_over_floor_1MiB": copy.get(MiB, float("nan")) / at(MiB, "floor"),
        "zero_copy_of_floor_1MiB": at(MiB, "zero_copy_floor") / at(MiB, "zero_copy"),
        "bound_over_zero_copy_floor_1MiB": copy.get(MiB, float("nan")) / at(MiB, "zero_copy_floor"),
    }
    if 4 in results:
        summary["barrier_w4_us"] = results[4]["shm"]["barrier"] * 1e6
    print("summary: " + " ".join(f"{k}={v:.3g}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
