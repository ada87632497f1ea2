"""Pipeline training without Lightning: the engine driven by a plain loop (benchmarks, timelines, tests).

Runs in each worker of :func:`lightning_shm.runtime.launch`: builds the MLP from the same seed on
every rank, keeps this rank's chunks, and trains a few steps on synthetic data with cross-entropy,
returning every step's timeline (``timelines``; ``timeline`` is the last) and the measured step times.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shm.models import build_mlp
from lightning_shm.parallel.pipeline.engine import PipelineEngine
from lightning_shm.parallel.pipeline.row_cut import apply_row_cuts, plan_cuts
from lightning_shm.parallel.pipeline.schedules import PipelineSchedule, Schedule, Timed
from lightning_shm.parallel.pipeline.stage import PipelineStage
from lightning_shm.parallel.sequential import layers_of
from lightning_shm.runtime import World


@dataclass
class DriverResult:
    rank: int
    timelines: list[list[Timed]]  # every step's, in order
    step_seconds: list[float]
    peak_activation_bytes: int
    chunk_starts: list[int]
    params: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def timeline(self) -> list[Timed]:
        """The last step's."""
        return self.timelines[-1] if self.timelines else []


class _PlainIO:
    def __init__(self, x: torch.Tensor, y: torch.Tensor, parts: int) -> None:
        self.xs, self.ys = torch.tensor_split(x, parts), torch.tensor_split(y, parts)
        self.n = x.shape[0]

    def forward_context(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def first_input(self, mb: int) -> torch.Tensor:
        return self.xs[mb]

    def last_forward(self, mb: int, x: torch.Tensor, chunk: nn.Module) -> Optional[torch.Tensor]:
        return F.cross_entropy(chunk(x), self.ys[mb]) * (self.xs[mb].shape[0] / self.n)


def train_pipeline(world: World, hidden: list[int], schedule: str, microbatches: int, virtual: int = 1,
                   steps: int = 5, batch: int = 256, lr: float = 0.05, checkpointing: bool = False,
                   seed: int = 0, return_params: bool = False,
                   split_points: Optional[list[int]] = None, split_linear: bool = False,
                   balance: str = "time") -> DriverResult:
    """Train ``steps`` SGD steps of the MLP pipelined over all ranks of ``world`` (pp = world size).

    ``split_points``: fixed chunk starts; default: balanced by ``balance`` -- "time", the layers' measured
    time, which varies from run to run (use fixed points where a test compares per-stage measurements), or
    "params", their parameter counts (the same plan every run). ``split_linear``: a boundary may fall inside
    a Linear (:mod:`.row_cut`)."""
    if balance not in ("time", "params"):
        raise ValueError(f"balance must be 'time' or 'params', got {balance!r}")
    P = world.size
    sched = PipelineSchedule(Schedule.parse(schedule), P, microbatches, virtual)
    torch.manual_seed(seed)
    seq = build_mlp(hidden)
    g = world.group()
    sample = torch.randn(64, 784) if balance == "time" else None
    cuts = plan_cuts(seq, sched.chunks, split_points, sample, stages=P, split_linear=split_linear)[0] \
        if world.rank == 0 else None
    layers, starts = apply_row_cuts(layers_of(seq), g.broadcast_object(cuts, src_member=0))
    stage = PipelineStage(layers, starts, sched.chunks_of(world.rank))
    engine = PipelineEngine(stage.chunks, sched, world.rank, list(range(P)), world, tag=f"drv-{schedule}",
                            activation_checkpointing=checkpointing)
    opt = torch.optim.SGD(stage.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed + 1)
    times: list[float] = []
    timelines: list[list[Timed]] = []
    peak = 0
    for _ in range(steps):
        x = torch.randn(batch, 784, generator=data)
        y = torch.randint(0, 10, (batch,), generator=data)
        g.barrier()  # start every step together so timelines line up
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        engine.train_step(_PlainIO(x, y, microbatches))
        opt.step()
        times.append(time.perf_counter() - t0)
        timelines.append(engine.timeline)  # train_step starts a new list each step
        peak = max(peak, engine.peak_activation_bytes)
    params = {n: p.detach().clone() for n, p in stage.named_parameters()} if return_params else {}
    engine.close()
    return DriverResult(world.rank, timelines, times, peak, list(starts), params)


def reference_params(hidden: list[int], steps: int = 5, batch: int = 256, lr: float = 0.05,
                     seed: int = 0) -> dict[str, Any]:
    """The same training in one process, for parity checks."""
    torch.manual_seed(seed)
    seq = build_mlp(hidden)
    opt = torch.optim.SGD(seq.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(batch, 784, generator=data)
        y = torch.randint(0, 10, (batch,), generator=data)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(seq(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in seq.named_parameters()}
