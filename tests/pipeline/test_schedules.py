"""Schedules as data: complete, dependency-respecting, deadlock-free, with the textbook bubbles."""

from __future__ import annotations

import itertools

import pytest
from torch import nn

from lightning_shm.models import build_mlp
from lightning_shm.parallel.pipeline import (
    Action,
    PipelineSchedule,
    Schedule,
    Timed,
    balanced_split,
    between_actions,
    bubble_fraction,
    handover_delays,
    measured_costs,
    plan_chunks,
    simulate,
)

CASES = [(k, P, M, 2 if k == Schedule.INTERLEAVED_1F1B else 1)
         for k, P, M in itertools.product(Schedule, (1, 2, 3, 4), (4, 6, 8))
         if not (k == Schedule.INTERLEAVED_1F1B and (M % P or P == 1))]


@pytest.mark.parametrize("kind, P, M, v", CASES, ids=[f"{k.value}-P{P}-M{M}" for k, P, M, v in CASES])
def test_every_action_exactly_once_and_no_deadlock(kind, P, M, v):
    s = PipelineSchedule(kind, P, M, v)
    kinds = ("F", "B", "W") if kind == Schedule.ZERO_BUBBLE else ("F", "B")
    seen = [a for r in range(P) for a in s.actions(r)]
    assert sorted(seen) == sorted((k, m, c) for k in kinds for m in range(M) for c in range(P * v))
    for r in range(P):
        assert all(s.rank_of(a.chunk) == r for a in s.actions(r))
    simulate(s, {"F": 1.0, "B": 2.0, "W": 1.0})  # raises on deadlock


@pytest.mark.parametrize("P, M", [(2, 4), (2, 8), (4, 4), (4, 8), (3, 6)])
def test_ideal_bubbles_match_the_formulas(P, M):
    for kind in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        s = PipelineSchedule(kind, P, M)
        assert s.ideal_bubble() == pytest.approx(s.formula_bubble())
    zb = PipelineSchedule(Schedule.ZERO_BUBBLE, P, M)
    span = 3 * M + P - 1  # ZB-H1's makespan with T_F = T_B = T_W = 1: bubble (P-1)(T_F+T_B-T_W)
    if P == 2:
        assert zb.ideal_bubble() == pytest.approx(zb.formula_bubble())
    else:  # within two unit actions of it, while never holding more than P microbatches (next test)
        assert zb.ideal_bubble() <= 1 - 3 * M / (span + 2) + 1e-9
    inter = PipelineSchedule(Schedule.INTERLEAVED_1F1B, P, M, 2)
    assert inter.ideal_bubble() == pytest.approx(inter.formula_bubble())
    one = PipelineSchedule(Schedule.ONE_F_ONE_B, P, M).ideal_bubble()
    assert one == pytest.approx((P - 1) / (M + P - 1))
    assert inter.ideal_bubble() < one and PipelineSchedule(Schedule.ZERO_BUBBLE, P, M).ideal_bubble() < one


def test_1f1b_keeps_at_most_p_microbatches_alive():
    P, M = 4, 8
    s = PipelineSchedule(Schedule.ONE_F_ONE_B, P, M)
    for r in range(P):
        alive = peak = 0
        for a in s.actions(r):
            alive += 1 if a.kind == "F" else -1
            peak = max(peak, alive)
        assert peak == P - r
    gpipe = PipelineSchedule(Schedule.GPIPE, P, M)
    assert max(sum(1 for a in gpipe.actions(0)[:i] if a.kind == "F") for i in range(2 * M)) == M


@pytest.mark.parametrize("P, M", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_zero_bubble_runs_weight_passes_in_the_steady_state_within_1f1b_memory(P, M):
    """ZB-H1: every rank holds at most P microbatches between their F and their W (1F1B's first stage
    holds P between F and B), so W passes cannot pile up to the end as in a schedule that defers them all."""
    s = PipelineSchedule(Schedule.ZERO_BUBBLE, P, M)
    for r in range(P):
        acts = s.actions(r)
        seen_b: set[int] = set()
        in_flight = peak = 0
        for a in acts:
            if a.kind == "W":
                assert a.mb in seen_b, f"rank {r}: W{a.mb} before its B"
            seen_b |= {a.mb} if a.kind == "B" else set()
            in_flight += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, in_flight)
        assert peak <= P
        last_f = max(i for i, a in enumerate(acts) if a.kind == "F")
        assert any(a.kind == "W" for a in acts[:last_f]), f"rank {r}: no W before the last F"
    # the paper's pattern at P=2: the first stage fills its waits with W, the last one does B then W
    assert [f"{a.kind}{a.mb}" for a in PipelineSchedule(Schedule.ZERO_BUBBLE, 2, 4).actions(0)] == \
        "F0 F1 B0 W0 B1 F2 W1 F3 B2 W2 B3 W3".split()


@pytest.mark.parametrize(
    "kind, P, M, v, match",
    [
        (Schedule.INTERLEAVED_1F1B, 4, 6, 2, "multiple of the 4 stages"),
        (Schedule.INTERLEAVED_1F1B, 2, 4, 1, "needs virtual_stages >= 2"),
        (Schedule.ZERO_BUBBLE, 4, 2, 1, "microbatches=2 < stages=4"),
        (Schedule.ONE_F_ONE_B, 2, 4, 2, "only applies to interleaved"),
        (Schedule.GPIPE, 2, 0, 1, "must be >= 1"),
    ],
)
def test_invalid_schedules(kind, P, M, v, match):
    with pytest.raises(ValueError, match=match):
        PipelineSchedule(kind, P, M, v)


def test_balanced_split_minimises_the_slowest_chunk():
    assert balanced_split([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_split([10, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert balanced_split([1, 5, 1, 1, 5, 1], 3, required=[False, True, False, False, True, True]) == [0, 2, 5]
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4"):
        balanced_split([1, 1, 1], 4)


def test_reference_mlp_split_by_measured_time_gives_every_rank_parameters():
    import torch

    seq = build_mlp()
    starts, how = plan_chunks(seq, 4, sample=torch.randn(64, 784), stages=4)
    assert how == "measured time" and starts[0] == 0 and len(starts) == 4
    starts, _ = plan_chunks(seq, 6, stages=3)  # interleaved P=3, v=2: 8 layers, 5 with parameters
    bounds = starts + [len(seq)]
    for r in range(3):
        assert any(any(True for _ in seq[i].parameters()) for c in (r, r + 3) for i in range(bounds[c], bounds[c + 1]))
    assert plan_chunks(seq, 2, split_points=[3])[0] == [0, 3]
    with pytest.raises(ValueError, match="strictly increasing"):
        plan_chunks(seq, 3, split_points=[4, 2])
    with pytest.raises(ValueError, match="need 1 split points"):
        plan_chunks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2, split_points=[1, 1])


def test_a_sample_that_does_not_run_through_the_sequential_is_named_and_leaves_no_trace():
    """Timing runs the user's layers on a sample: one that a layer refuses is named (layer, shape, error),
    and a run that fails half-way still leaves the BatchNorm statistics and the random stream as they were."""
    import torch

    from lightning_shm.models.transformer import Block
    from lightning_shm.parallel.pipeline.split import layer_costs_by_time, why_sample_fails

    seq = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), Block(16, 4), nn.Linear(16, 10))
    seq.train()
    why = why_sample_fails(seq, torch.randn(64, 8))  # Block wants [B, T, D]
    assert why.startswith("layer 3 (Block) on an input of shape [64, 16]: ValueError: not enough values to unpack")
    assert why_sample_fails(nn.Sequential(nn.Linear(8, 16), Block(16, 4)), torch.randn(4, 5, 8)) is None
    x = torch.randn(64, 8)
    before = seq[1].running_mean.clone(), seq[1].num_batches_tracked.clone(), torch.random.get_rng_state()
    why_sample_fails(seq, x)
    after = seq[1].running_mean, seq[1].num_batches_tracked, torch.random.get_rng_state()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match=r"does not run through the Sequential: layer 3 \(Block\) on an input of "
                                         r"shape \[64, 16\].*sample_input=.*balance='params'"):
        layer_costs_by_time(seq, torch.randn(64, 8))


def test_simulate_takes_measured_per_chunk_costs():
    """The ideal of a schedule on unequal stages: GPipe P=2 with stage 1 three times stage 0
    (F 1 / 3, B 2 / 6). Stage 1 runs back to back once stage 0's first F is done, then stage 0's
    last B follows: makespan f0 + M (f1 + b1) + b0 = 39 for M=4, busy 48 of 2 x 39."""
    s = PipelineSchedule(Schedule.GPIPE, 2, 4)
    costs = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 3.0, (1, "B"): 6.0}
    timeline = simulate(s, costs)
    assert max(t.end for t in timeline) == pytest.approx(39.0)
    assert bubble_fraction(timeline) == pytest.approx(1 - 48 / 78)
    assert s.ideal_bubble() == pytest.approx(0.2)  # uniform costs: the textbook 1/5
    # measured_costs: median per (chunk, kind) of a timeline -- here the simulated one gives back its costs
    assert measured_costs(timeline) == costs
    jittered = [Timed(t.rank, t.action, t.start, t.end + (0.5 if t.action.mb == 0 else 0.0)) for t in timeline]
    assert measured_costs(jittered) == costs  # one slow microbatch does not move the median


def test_simulate_pays_the_hand_overs_and_the_time_between_actions_a_run_pays():
    """GPipe P=2, M=1 by hand (F and B cost 1): stage 1's F starts a hand-over h after stage 0's F, its B a
    between-actions b after its own F, and stage 0's B h after stage 1's B (stage 0's F ended long before):
    makespan 4 + 2h + b. What :func:`between_actions` reads off a timeline is the b of every action whose
    inputs were there when the rank's previous action ended, in every schedule."""
    s = PipelineSchedule(Schedule.GPIPE, 2, 1)
    h, b = 0.25, 0.125
    timeline = simulate(s, {"F": 1.0, "B": 1.0}, handover=h, between=b)
    assert {(t.rank, t.kind): t.start for t in timeline} == pytest.approx(
        {(0, "F"): 0.0, (1, "F"): 1 + h, (1, "B"): 2 + h + b, (0, "B"): 3 + 2 * h + b})
    assert max(t.end for t in timeline) == pytest.approx(4 + 2 * h + b)
    assert between_actions(s, timeline) == pytest.approx([b])  # stage 0's B waited for stage 1: not counted
    for kind in Schedule:
        sched = PipelineSchedule(kind, 2, 4, 2 if kind == Schedule.INTERLEAVED_1F1B else 1)
        costs = {"F": 1.0, "B": 2.0, "W": 1.0}
        gaps = between_actions(sched, simulate(sched, costs, between=b))
        assert len(gaps) >= 4 and gaps == pytest.approx([b] * len(gaps)), kind
        ideal = bubble_fraction(simulate(sched, costs))
        assert bubble_fraction(simulate(sched, costs, handover=h, between=b)) > ideal
        assert bubble_fraction(simulate(sched, costs, handover=0.0, between=0.0)) == pytest.approx(ideal)


def test_handover_delays_are_the_waits_on_another_rank_beyond_the_ideal():
    """GPipe P=2, M=1 by hand: stage 1's F starts 0.5 after stage 0's F ended, stage 0's B 0.2 after
    stage 1's B; stage 1's B follows its own F (no channel) and is not counted."""
    s = PipelineSchedule(Schedule.GPIPE, 2, 1)
    timeline = [Timed(0, Action("F", 0, 0), 0.0, 1.0), Timed(1, Action("F", 0, 1), 1.5, 2.5),
                Timed(1, Action("B", 0, 1), 2.5, 4.0), Timed(0, Action("B", 0, 0), 4.2, 5.0)]
    assert handover_delays(s, timeline) == pytest.approx([0.5, 0.2])
    # the simulated ideal hands over instantly: every wait on another rank is 0
    for kind in Schedule:
        sched = PipelineSchedule(kind, 2, 4, 2 if kind == Schedule.INTERLEAVED_1F1B else 1)
        delays = handover_delays(sched, simulate(sched, {"F": 1.0, "B": 2.0, "W": 1.0}))
        assert delays and max(map(abs, delays)) < 1e-12
