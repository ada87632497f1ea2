"""Pipeline schedules as data: for every pipeline rank, the ordered list of actions it performs.

An action is ``F`` (forward of microbatch m through chunk c), ``B`` (backward; in zero-bubble only
the input gradient) or ``W`` (zero-bubble: the weight gradient of a B done earlier). P ranks,
M microbatches, v chunks per rank (V = P*v chunks, chunk c on rank c % P).

* ``gpipe``: every forward, then every backward. Activations of all M microbatches stay alive.
* ``1f1b``: warm-up of P-1-r forwards, then one forward / one backward in turn (steady state),
  then the remaining backwards (cool-down). At most P microbatches' activations alive on rank r.
* ``interleaved_1f1b`` (Megatron): each rank owns v non-adjacent chunks; microbatches travel in
  groups of P, so the warm-up bubble shrinks by v. Needs M divisible by P.
* ``zero_bubble`` (ZB-H1, Qi et al. 2023): 1F1B whose backward is split into B (input gradient,
  on the critical path) and W (weight gradient, off it). W passes run inside the steady state,
  filling the moments 1F1B spends waiting for gradients; no rank holds more than P microbatches
  between their F and their W -- the peak of 1F1B's first stage -- and the bubble shrinks from
  (P-1)(T_F+T_B+T_W) to (P-1)(T_F+T_B-T_W).

:func:`simulate` runs any schedule with given action costs and no communication delay: it checks
that the dependencies can be met (no deadlock) and gives the ideal bubble fraction. Given the delays a
run pays -- between an action and the one on another rank waiting for its output
(:func:`handover_delays`), and between two actions of a rank where nothing was waited for
(:func:`between_actions`) -- it says how much of a measured bubble those delays account for.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence


class Schedule(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"

    @classmethod
    def parse(cls, value: "str | Schedule") -> "Schedule":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"schedule must be one of {[s.value for s in cls]}, got {value!r}") from None


class Action(NamedTuple):
    kind: str  # "F" | "B" | "W"
    mb: int
    chunk: int


@dataclass(frozen=True)
class PipelineSchedule:
    """A validated schedule for ``stages`` ranks, ``microbatches`` and ``virtual`` chunks per rank."""

    kind: Schedule
    stages: int
    microbatches: int
    virtual: int = 1

    def __post_init__(self) -> None:
        P, M, v = self.stages, self.microbatches, self.virtual
        if P < 1 or M < 1 or v < 1:
            raise ValueError(f"stages, microbatches and virtual stages must be >= 1, got P={P}, M={M}, v={v}")
        if self.kind == Schedule.INTERLEAVED_1F1B:
            if v < 2:
                raise ValueError(f"interleaved_1f1b needs virtual_stages >= 2, got {v}")
            if M < P or M % P:
                raise ValueError(f"interleaved_1f1b needs microbatches to be a multiple of the {P} stages "
                                 f"(>= {P}), got microbatches={M}")
        elif v != 1 and self.kind != Schedule.GPIPE:
            raise ValueError(f"virtual_stages={v} only applies to interleaved_1f1b, not {self.kind.value}")
        if self.kind == Schedule.ZERO_BUBBLE and M < P:
            raise ValueError(f"zero_bubble (ZB-H1) needs at least as many microbatches as stages: "
                             f"microbatches={M} < stages={P}")

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def rank_of(self, chunk: int) -> int:
        return chunk % self.stages

    def chunks_of(self, rank: int) -> list[int]:
        return [rank + k * self.stages for k in range(self.virtual)]

    def actions(self, rank: int) -> list[Action]:
        P, M = self.stages, self.microbatches
        if not 0 <= rank < P:
            raise ValueError(f"pipeline rank {rank} outside 0..{P - 1}")
        if self.kind == Schedule.GPIPE:  # with v > 1 chunks (fallback for short batches): chunk by chunk
            mine = self.chunks_of(rank)
            return ([Action("F", m, c) for c in mine for m in range(M)]
                    + [Action("B", m, c) for c in reversed(mine) for m in range(M)])
        if self.kind == Schedule.ONE_F_ONE_B:
            return _one_f_one_b([Action("F", m, rank) for m in range(M)], [Action("B", m, rank) for m in range(M)],
                                min(P - 1 - rank, M))
        if self.kind == Schedule.INTERLEAVED_1F1B:
            v, total = self.virtual, M * self.virtual

            def unit(k: int, forward: bool) -> Action:
                local = (k // P) % v
                local = local if forward else v - 1 - local
                return Action("F" if forward else "B", (k // (P * v)) * P + k % P, rank + local * P)

            warm = min((P - rank - 1) * 2 + (v - 1) * P, total)
            return _one_f_one_b([unit(k, True) for k in range(total)], [unit(k, False) for k in range(total)], warm)
        return _zero_bubble_h1(P, M, rank)

    def ideal_bubble(self) -> float:
        """Idle fraction with uniform costs (F=1, B=2 per full layer stack; ZB: B=1, W=1)."""
        if self.kind == Schedule.ZERO_BUBBLE:
            costs = {"F": 1.0, "B": 1.0, "W": 1.0}
        else:
            costs = {"F": 1.0 / self.virtual, "B": 2.0 / self.virtual, "W": 0.0}
        return bubble_fraction(simulate(self, costs))

    def formula_bubble(self) -> float:
        """The textbook bubble: (p-1)/(m+p-1); interleaving divides the warm-up by v."""
        P, M, v = self.stages, self.microbatches, self.virtual
        if self.kind == Schedule.INTERLEAVED_1F1B:
            return (P - 1) / (v * M + P - 1)
        if self.kind == Schedule.ZERO_BUBBLE:
            return (P - 1) / (3 * M + P - 1)  # T_F = T_B = T_W: bubble (P-1)(T_F+T_B-T_W) vs work 3M
        return (P - 1) / (M + P - 1)


def _one_f_one_b(forwards: Sequence[Action], backwards: Sequence[Action], warm: int) -> list[Action]:
    acts = list(forwards[:warm])
    steady = len(forwards) - warm
    for i in range(steady):
        acts += [forwards[warm + i], backwards[i]]
    acts += list(backwards[steady:])
    return acts


def _zero_bubble_h1(P: int, M: int, rank: int) -> list[Action]:
    """ZB-H1 order, built by list scheduling with unit costs (F = B = W = 1).

    Each rank, whenever it is free, does a ready B first (it is on the critical path), else the
    next F if fewer than P microbatches are between their F and their W (1F1B's peak activation
    memory: its first stage holds P), else a pending W (off the critical path), else waits. The W
    passes land in the gaps where 1F1B would wait for gradients, and because a microbatch is only
    done with its W, they come back into the steady state as soon as P microbatches are in flight
    instead of piling up to the end. Makespan 3M + P - 1 at P = 2 (the paper's (P-1)(T_F+T_B-T_W)
    bubble), within 2 units of it at P = 4.
    """
    return _greedy_zb_orders(P, M)[rank]


def _greedy_zb_orders(P: int, M: int) -> dict[int, list[Action]]:
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * P
    next_f = [0] * P
    next_b = [0] * P
    w_done = [0] * P
    pending_w: list[list[int]] = [[] for _ in range(P)]
    orders: dict[int, list[Action]] = {r: [] for r in range(P)}

    def remaining(r: int) -> bool:
        return next_b[r] < M or bool(pending_w[r]) or next_f[r] < M

    blocked: set[int] = set()  # ranks that cannot act until another rank at the same time acts
    while any(remaining(r) for r in range(P)):
        candidates = [r for r in range(P) if remaining(r) and r not in blocked]
        if not candidates:
            raise RuntimeError(f"zero-bubble list scheduling stalled: P={P}, M={M}")
        r = min(candidates, key=lambda q: (free[q], q))
        t = free[r]

        def ready(key: tuple[str, int, int]) -> bool:
            return key in done and done[key] <= t

        m = next_b[r]
        act = None
        if m < next_f[r] and (r == P - 1 or ready(("B", m, r + 1))):
            act = Action("B", m, r)
            next_b[r] += 1
            pending_w[r].append(m)
        elif next_f[r] < M and next_f[r] - w_done[r] < P and (r == 0 or ready(("F", next_f[r], r - 1))):
            act = Action("F", next_f[r], r)
            next_f[r] += 1
        elif pending_w[r]:
            act = Action("W", pending_w[r].pop(0), r)
            w_done[r] += 1
        if act is None:  # wait for the next event anywhere
            later = [v for v in done.values() if v > t]
            later += [free[q] for q in range(P) if q != r and remaining(q) and free[q] > t]
            if later:
                free[r] = min(later)
            else:
                blocked.add(r)
            continue
        blocked.clear()
        done[(act.kind, act.mb, act.chunk)] = t + 1.0
        free[r] = t + 1.0
        orders[r].append(act)
    return orders


class Timed(NamedTuple):
    """One action on one pipeline rank, from ``start`` to ``end`` (simulated units or measured seconds)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def kind(self) -> str:
        return self.action.kind

    @property
    def mb(self) -> int:
        return self.action.mb

    @property
    def chunk(self) -> int:
        return self.action.chunk


def simulate(schedule: PipelineSchedule, costs: Mapping[Any, float], handover: float = 0.0,
             between: float = 0.0) -> list[Timed]:
    """Play every rank's action list with the given costs; raise if the schedule deadlocks.

    ``costs`` maps a kind (``"F"``) to its cost, or ``(chunk, kind)`` to one chunk's cost (measured
    per-stage times: the ideal of the schedule on *these* stages, whatever their imbalance).
    ``handover``: the delay from an action's end to the start of an action on another rank that needs
    its output; ``between``: the delay from a rank's action to its next one, whatever it waits for (both
    0: the ideal)."""
    V = schedule.chunks
    queues = {r: schedule.actions(r) for r in range(schedule.stages)}
    pos = {r: 0 for r in queues}
    free = {r: 0.0 for r in queues}
    done: dict[tuple[str, int, int], float] = {}
    out: list[Timed] = []
    while any(pos[r] < len(q) for r, q in queues.items()):
        progressed = False
        for r, q in queues.items():
            if pos[r] >= len(q):
                continue
            a = q[pos[r]]
            deps = _deps(a, V)
            if all(d in done for d in deps):
                start = max([free[r] + (between if pos[r] else 0.0)]
                            + [done[d] + (handover if schedule.rank_of(d[2]) != r else 0.0) for d in deps])
                cost = costs[(a.chunk, a.kind)] if (a.chunk, a.kind) in costs else costs[a.kind]
                end = start + cost
                done[(a.kind, a.mb, a.chunk)] = end
                free[r] = end
                out.append(Timed(r, a, start, end))
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: queues[r][pos[r]] for r in queues if pos[r] < len(queues[r])}
            raise RuntimeError(f"schedule {schedule.kind.value} deadlocks: waiting actions {stuck}")
    return out


def _deps(a: Action, chunks: int) -> list[tuple[str, int, int]]:
    if a.kind == "F":
        return [("F", a.mb, a.chunk - 1)] if a.chunk > 0 else []
    if a.kind == "B":
        deps = [("F", a.mb, a.chunk)]
        if a.chunk < chunks - 1:
            deps.append(("B", a.mb, a.chunk + 1))
        return deps
    return [("B", a.mb, a.chunk)]


def bubble_fraction(timeline: Sequence[Timed]) -> float:
    """1 - busy / (ranks x makespan): the share of rank-time spent idle."""
    if not timeline:
        return 0.0
    ranks = {t.rank for t in timeline}
    t0 = min(t.start for t in timeline)
    t1 = max(t.end for t in timeline)
    busy = sum(t.end - t.start for t in timeline)
    return 1.0 - busy / (len(ranks) * (t1 - t0)) if t1 > t0 else 0.0


def between_actions(schedule: PipelineSchedule, timeline: Sequence[Timed]) -> list[float]:
    """For each two consecutive actions of a rank where the second's inputs were there before the first ended:
    the time between them. Nothing was waited for, so it is the rank's own cost per action -- the first's
    bookkeeping and the send of its output, the receive (a copy) of the second's input -- which the
    simulated ideal does not pay."""
    end = {(t.kind, t.mb, t.chunk): t.end for t in timeline}
    out: list[float] = []
    for r in sorted({t.rank for t in timeline}):
        mine = sorted((t for t in timeline if t.rank == r), key=lambda t: t.start)
        for a, b in zip(mine, mine[1:]):
            if all(end.get(d, float("inf")) <= a.end for d in _deps(b.action, schedule.chunks)):
                out.append(b.start - a.end)
    return out


def measured_costs(timeline: Sequence[Timed]) -> dict[tuple[int, str], float]:
    """Median duration of each chunk's F / B / W in a measured timeline, as :func:`simulate` takes them."""
    durations: dict[tuple[int, str], list[float]] = {}
    for t in timeline:
        durations.setdefault((t.action.chunk, t.action.kind), []).append(t.end - t.start)
    return {k: statistics.median(v) for k, v in durations.items()}


def handover_delays(schedule: PipelineSchedule, timeline: Sequence[Timed]) -> list[float]:
    """For each action that waited on another rank: its start minus the end of the action it waited for.

    :func:`simulate` starts such an action the moment its dependency ends; a run pays the hand-over
    in between (the sender's copy into the channel, the receiver noticing it and copying it out,
    bookkeeping on both). An action whose own rank's previous action ended later is not counted:
    it did not wait on the channel."""
    end = {(t.kind, t.mb, t.chunk): t.end for t in timeline}
    out: list[float] = []
    previous_end: dict[int, float] = {}
    for t in sorted(timeline, key=lambda t: t.start):
        ready = max((end[d] for d in _deps(t.action, schedule.chunks) if d in end), default=None)
        if ready is not None and ready > previous_end.get(t.rank, float("-inf")):
            out.append(t.start - ready)
        previous_end[t.rank] = t.end
    return out
