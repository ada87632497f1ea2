"""The engine on the bare runtime: parity with one process, measured timelines, activation memory."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_shm.models import build_mlp
from lightning_shm.parallel.pipeline import PipelineSchedule, Schedule
from lightning_shm.parallel.pipeline.driver import _PlainIO, reference_params, train_pipeline
from lightning_shm.parallel.pipeline.engine import PipelineEngine
from lightning_shm.parallel.pipeline.row_cut import apply_row_cuts, plan_cuts
from lightning_shm.parallel.pipeline.stage import PipelineStage
from lightning_shm.parallel.sequential import layers_of
from lightning_shm.runtime import launch

HIDDEN = [64, 32, 16]  # 11 layers: enough for 4 stages x 2 virtual chunks
RUNS = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 4, 2), ("zero_bubble", 4, 1)]


@pytest.fixture(scope="module")
def reference():
    return reference_params(HIDDEN, steps=3, batch=64)


def _params(results):
    merged = {}
    for r in results:
        merged.update(r.params)
    return merged


@pytest.mark.parametrize("schedule, M, v", RUNS, ids=[r[0] for r in RUNS])
@pytest.mark.parametrize("P", [2, 4])
def test_engine_equals_one_process(reference, schedule, M, v, P):
    results = launch(train_pipeline, P, HIDDEN, schedule, M, v, 3, 64, return_params=True, start_method="fork")
    got = _params(results)
    assert set(got) == set(reference)
    for k in reference:
        torch.testing.assert_close(got[k], reference[k], rtol=0, atol=1e-5)


# Fixed cuts: a split balanced by measured time changes from run to run, and with it what each stage
# saves -- a stage of only [Flatten, Linear] saves nothing but its input, checkpointed or not (the cause
# of this test once failing with "200704 < 200704").
SPLIT_P2 = [4]  # [Flatten, Linear, LayerNorm, ReLU] | the rest
SPLIT_P4 = [2, 5, 8]  # [Flatten, Linear] | [LN, ReLU, Linear] | [LN, ReLU, Linear] | [LN, ReLU, Linear]


def test_activation_checkpointing_equals_one_process_and_saves_memory(reference):
    """The first stage keeps only its chunks' inputs. The last chunk is never checkpointed -- the step runs
    around it, and its effects must happen once -- so the last stage holds what it holds without: under 1F1B
    one microbatch's activations between its F and its B, as a recomputation would."""
    plain = launch(train_pipeline, 2, HIDDEN, "1f1b", 4, 1, 3, 64, return_params=True, split_points=SPLIT_P2,
                   start_method="fork")
    ckpt = launch(train_pipeline, 2, HIDDEN, "1f1b", 4, 1, 3, 64, checkpointing=True, return_params=True,
                  split_points=SPLIT_P2, start_method="fork")
    got = _params(ckpt)
    for k in reference:
        torch.testing.assert_close(got[k], reference[k], rtol=0, atol=1e-5)
    assert ckpt[0].peak_activation_bytes < plain[0].peak_activation_bytes
    assert ckpt[1].peak_activation_bytes == plain[1].peak_activation_bytes


def _check_timeline(results, P, M, V):
    """No rank does two things at once; every dependency ends before its dependant starts. A chunk whose output
    needs no gradient (the MLP's lone Flatten in front of its first Linear, when balancing gives it a chunk of its
    own) receives none: its B waits for nothing."""
    starts = results[0].chunk_starts + [len(build_mlp(HIDDEN))]
    events = {}
    for res in results:
        spans = sorted((rec.start, rec.end) for rec in res.timeline)
        for (s0, e0), (s1, _) in zip(spans, spans[1:]):
            assert e0 <= s1, f"rank {res.rank} overlaps itself"
        for rec in res.timeline:
            events[(rec.kind, rec.mb, rec.chunk)] = rec
    for (kind, m, c), rec in events.items():
        if kind == "F" and c > 0:
            assert events[("F", m, c - 1)].end <= rec.start
        if kind == "B":
            assert events[("F", m, c)].end <= rec.start
            if c < V - 1 and starts[c + 1] > 1:  # layer 1 is the first with parameters
                assert events[("B", m, c + 1)].end <= rec.start
        if kind == "W":
            assert events[("B", m, c)].end <= rec.start
    assert {(k, m) for k, m, _ in events} >= {(k, m) for k, m in itertools.product("FB", range(M))}


@pytest.mark.parametrize("schedule, M, v", RUNS + [("1f1b", 8, 1)], ids=[r[0] for r in RUNS] + ["1f1b-M8"])
def test_timelines_are_consistent(schedule, M, v):
    P = 4
    results = launch(train_pipeline, P, HIDDEN, schedule, M, v, 2, 64, start_method="fork")
    for res in results:  # one timeline per step, each its own step's; ``timeline`` is the last
        assert len(res.timelines) == 2 and res.timeline is res.timelines[-1]
        assert max(t.end for t in res.timelines[0]) <= min(t.start for t in res.timelines[1])
    _check_timeline(results, P, M, P * v)
    kinds = {rec.kind for res in results for rec in res.timeline}
    assert kinds == ({"F", "B", "W"} if schedule == "zero_bubble" else {"F", "B"})


def _two_batches():
    data = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 784, generator=data), torch.randint(0, 10, (64,), generator=data)) for _ in range(2)]


def _frozen_front(world, schedule, checkpointing):
    """Two SGD steps of the MLP with its first stage ([Flatten, Linear, LayerNorm, ReLU]) frozen, as a fine-tuned
    model's backbone; returns the trained parameters and what each channel carried."""
    torch.manual_seed(0)
    seq = build_mlp(HIDDEN)
    seq[:SPLIT_P2[0]].requires_grad_(False)
    sched = PipelineSchedule(Schedule.parse(schedule), 2, 4, 1)
    layers, starts = apply_row_cuts(layers_of(seq), plan_cuts(seq, 2, SPLIT_P2, None, stages=2)[0])
    stage = PipelineStage(layers, starts, sched.chunks_of(world.rank))
    engine = PipelineEngine(stage.chunks, sched, world.rank, [0, 1], world, activation_checkpointing=checkpointing)
    trained = [p for p in stage.parameters() if p.requires_grad]  # none on the first stage
    opt = torch.optim.SGD(trained, lr=0.05) if trained else None
    for x, y in _two_batches():
        engine.train_step(_PlainIO(x, y, 4))
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    sent = {f"{kind}{c}": ch.bytes_sent for kind, chans in (("act", engine.act_out), ("grad", engine.grad_out))
            for c, ch in chans.items()}
    engine.close()
    return {n: p.detach().clone() for n, p in stage.named_parameters()}, sent


@pytest.mark.parametrize("schedule, checkpointing", [("1f1b", False), ("zero_bubble", False), ("1f1b", True)])
def test_a_stage_after_frozen_layers_sends_no_input_gradient(schedule, checkpointing):
    """In one process the layer after a frozen backbone computes no input gradient: nothing before it needs
    one. The second stage receives the activation as not requiring a gradient, so it computes none and sends
    none -- the gradient channel stays empty -- and the first stage waits for none. Training is unchanged."""
    results = launch(_frozen_front, 2, schedule, checkpointing, start_method="fork")
    (front, sent0), (back, sent1) = results
    assert sent0["act0"] == 4 * 2 * 64 // 4 * HIDDEN[0] * 4  # 4 microbatches x 2 steps of [16, 64] float32
    assert sent1 == {"grad1": 0}
    torch.manual_seed(0)
    ref = build_mlp(HIDDEN)
    ref[:SPLIT_P2[0]].requires_grad_(False)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    for x, y in _two_batches():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    want = dict(ref.named_parameters())
    got = {**front, **back}
    assert sorted(got) == sorted(want)
    for k, v in got.items():
        torch.testing.assert_close(v, want[k].detach(), rtol=0, atol=1e-6, msg=k)


def test_gpipe_holds_more_activations_than_1f1b():
    gp = launch(train_pipeline, 4, HIDDEN, "gpipe", 8, 1, 2, 128, split_points=SPLIT_P4, start_method="fork")
    ob = launch(train_pipeline, 4, HIDDEN, "1f1b", 8, 1, 2, 128, split_points=SPLIT_P4, start_method="fork")
    # stage 0 (Flatten, Linear) saves only views of the input batch: the same storage either way
    assert gp[0].peak_activation_bytes == ob[0].peak_activation_bytes
    for g, o in zip(gp[1:], ob[1:]):  # 8 microbatches alive vs at most P - stage
        assert g.peak_activation_bytes > 1.5 * o.peak_activation_bytes


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_activation_memory_is_recorded_only_by_an_engine_asked_to(schedule):
    """Recording what autograd saves hooks every saved tensor (a Python call in forward, another in backward):
    an engine built without ``track_activation_memory`` runs its chunks with no such hook, records nothing,
    refuses to report a peak it did not measure -- and computes the same gradients, bit for bit."""

    class Probe(_PlainIO):  # the last chunk runs inside the step: whatever hooks autograd has there
        def last_forward(self, mb, x, chunk):
            hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
            noted.append(len(engine._alive))  # what the step has noted so far for its peak
            return super().last_forward(mb, x, chunk)

    torch.manual_seed(0)
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    grads = {}
    for track in (True, False):
        torch.manual_seed(1)
        net = build_mlp([32, 16], in_features=20, num_classes=5)
        engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.parse(schedule), 1, 4, 1), 0, [0], world=None,
                                track_activation_memory=track)
        engine.in_place_min_numel = 0  # the weight-gradient rows are held too (counted only when tracked)
        hooked, noted = [], []
        engine.train_step(Probe(x, y, 4))
        assert hooked == [track] * 4 and (noted[-1] > 0) == track
        if track:
            assert engine.peak_activation_bytes > 0
        else:
            with pytest.raises(RuntimeError, match="track_activation_memory=True"):
                engine.peak_activation_bytes
            assert not engine._alive and not engine._saved and not engine._held_bytes  # nothing recorded
        grads[track] = [p.grad.clone() for p in net.parameters()]
        if not track:  # switched on between steps (as bench_stage_grads.py --record does): the next step records
            engine.tracks_memory = True
            hooked, noted = [], []
            net.zero_grad(set_to_none=True)
            engine.train_step(Probe(x, y, 4))
            assert hooked == [True] * 4 and noted[-1] > 0 and engine.peak_activation_bytes > 0
        engine.close()
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zero_bubble_weight_passes_free_their_stash_within_1f1b_memory():
    """ZB-H1 runs each W soon after its B (in the steady state): at most P microbatches are between
    their F and their W on any stage -- 1F1B's peak, which its first stage holds -- so the
    (input, output-gradient) pairs kept for deferred weight gradients never add up to all M
    microbatches' as in a schedule that runs every W after the last B (then: GPipe's memory)."""
    P, M = 2, 8
    zb, ob, gp = (launch(train_pipeline, P, HIDDEN, s, M, 1, 2, 128, split_points=SPLIT_P2, start_method="fork")
                  for s in ("zero_bubble", "1f1b", "gpipe"))
    for r, (z, o, g) in enumerate(zip(zb, ob, gp)):
        # 1F1B holds P - r microbatches on stage r, ZB-H1 at most P
        assert z.peak_activation_bytes <= o.peak_activation_bytes * P / (P - r) * 1.05, (r, z, o)
    assert zb[1].peak_activation_bytes < gp[1].peak_activation_bytes / 3  # 2 microbatches' stash, not 8
    kinds = [rec.kind for rec in sorted(zb[0].timeline, key=lambda rec: rec.start)]
    last_f = max(i for i, k in enumerate(kinds) if k == "F")
    assert "W" in kinds[:last_f]  # weight passes inside the steady state, not all after the last B


class _Bf16IO(_PlainIO):
    """The driver's microbatches (losses weighted to sum to the batch mean), each forward under bf16 autocast."""

    def forward_context(self):
        return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_linear_weight_gradients_accumulate_in_place_into_the_existing_grad(schedule, precision):
    """The engine takes the Linear layers' weight gradients (SinkLinear): the first microbatch's
    product becomes .grad, later ones are added into that same tensor (addmm_), and a .grad that was
    there before the step (gradient accumulation, a DDP bucket view) is added to, not replaced. Under
    autocast the products are taken in bf16 as autograd would, and .grad stays float32."""
    torch.manual_seed(0)
    net, ref = build_mlp([32, 16], in_features=20, num_classes=5), build_mlp([32, 16], in_features=20, num_classes=5)
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    bf16 = precision == "bf16"
    engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.parse(schedule), 1, 4, 1), 0, [0], world=None)
    engine.in_place_min_numel = 0  # these weights are small: take them all
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    before = {id(m.weight): torch.full_like(m.weight, 0.5) for m in linears[:1]}  # an earlier batch's gradient
    for m in linears[:1]:
        m.weight.grad = before[id(m.weight)]
    taken, take = [], engine.weight_grad
    engine.weight_grad = lambda p, xx, g: taken.append(id(p)) or take(p, xx, g)
    engine.train_step((_Bf16IO if bf16 else _PlainIO)(x, y, 4))
    engine.close()
    assert sorted(taken) == sorted([id(m.weight) for m in linears] * 4)  # every Linear, every microbatch
    first = linears[0].weight
    assert first.grad is before[id(first)]  # the same tensor, added to in place
    for mb in range(4):  # the reference: autograd, microbatch by microbatch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.cross_entropy(ref(x.chunk(4)[mb]), y.chunk(4)[mb]) / 4
        loss.backward()
    next(m for m in ref if isinstance(m, torch.nn.Linear)).weight.grad.add_(0.5)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)  # bf16 too: the same products


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_a_weight_with_a_hook_keeps_autograds_path(schedule):
    """Hooks on a weight must see its gradient: the engine leaves such a Linear to autograd."""
    torch.manual_seed(0)
    net = build_mlp([32, 16], in_features=20, num_classes=5)
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    seen, accumulated = [], []
    linears[0].weight.register_hook(lambda g: seen.append(g.shape))
    linears[1].weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.clone()))
    engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.parse(schedule), 1, 4, 1), 0, [0], world=None)
    engine.in_place_min_numel = 0
    taken, take = [], engine.weight_grad
    engine.weight_grad = lambda p, xx, g: taken.append(id(p)) or take(p, xx, g)
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    engine.train_step(_PlainIO(x, y, 4))
    engine.close()
    assert seen == [linears[0].weight.shape] * 4 and len(accumulated) == 4
    assert sorted(taken) == sorted([id(linears[2].weight)] * 4)  # only the weight without hooks
    torch.testing.assert_close(accumulated[-1], linears[1].weight.grad)


@pytest.mark.parametrize("schedule,taken_numels", [("1f1b", [1 << 20]), ("zero_bubble", [1 << 20, 16_384, 640])])
def test_only_large_weights_are_summed_in_place_unless_zero_bubble_defers_them(schedule, taken_numels):
    """Outside zero-bubble a weight under ``in_place_min_numel`` keeps autograd's path (the custom node
    would cost more than it saves); zero-bubble takes every Linear's weight, its W actions need them."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16),
                              torch.nn.Linear(16, 40))  # 2^20 weights: the smallest taken; 16,384 and 640: not
    engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.parse(schedule), 1, 2, 1), 0, [0], world=None)
    taken, take = [], engine.weight_grad
    engine.weight_grad = lambda p, xx, g: taken.append(p.numel()) or take(p, xx, g)
    x, y = torch.randn(4, 1024), torch.randint(0, 40, (4,))
    engine.train_step(_PlainIO(x, y, 2))
    engine.close()
    assert sorted(taken) == sorted(taken_numels * 2)  # once per microbatch


def _stage_step(fraction: float) -> tuple[torch.nn.Module, PipelineEngine, list[int], torch.Tensor, torch.Tensor]:
    """One 1F1B step (M=4, 16 rows) of Linear(1024, 1024) + ReLU + Linear(1024, 8) on one stage with
    ``stash_fraction``: returns the net, the engine, the row count of each weight-gradient product, x, y."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
    x, y = torch.randn(16, 1024), torch.randint(0, 8, (16,))
    engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.ONE_F_ONE_B, 1, 4, 1), 0, [0], world=None)
    engine.stash_fraction = fraction
    rows, add = [], engine._add_weight_grad
    engine._add_weight_grad = lambda p, xx, g: (rows.append(xx.shape[0]), add(p, xx, g))
    engine.train_step(_PlainIO(x, y, 4))
    engine.close()
    return net, engine, rows, x, y


@pytest.mark.parametrize("fraction,products,at_end", [(0.5, [16], 1), (12_000 / (1 << 20), [8, 8], 0),
                                                     (20_000 / (1 << 20), [12, 4], 1), (0.0, [4, 4, 4, 4], 0)])
def test_weight_gradients_are_taken_over_the_gathered_rows_of_several_microbatches(fraction, products, at_end):
    """Outside zero-bubble the engine keeps each large weight's (input, grad_output) rows across
    microbatches and takes one product over all of them -- at the step's end, or as soon as the rows
    would exceed ``stash_fraction`` of the weight (here 4 rows x (1024 + 1024) = 8,192 elements per
    microbatch: all four fit half the weight; 12,000 elements hold one, so every second B takes two;
    20,000 hold two, so the third B takes three and the step's end the last; 0: one per microbatch).
    The gradients equal autograd's, and the held rows count in the activation peak. (Under autocast
    each microbatch's product is taken at once: ``test_linear_weight_gradients_accumulate_...``.)"""
    net, engine, rows, x, y = _stage_step(fraction)
    assert rows == products  # only the 2^20 weight is the engine's; its products over these many rows
    assert [t.action.kind for t in engine.timeline].count("W") == at_end  # the step-end products, timed
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
    ref.load_state_dict(net.state_dict())
    for mb in range(4):
        (torch.nn.functional.cross_entropy(ref(x.chunk(4)[mb]), y.chunk(4)[mb]) / 4).backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    if fraction == 0.5:  # the last B ends with four microbatches' grad_output rows held (4 x 16 KiB storages)
        assert engine.peak_activation_bytes >= _stage_step(0.0)[1].peak_activation_bytes + 3 * 4 * 1024 * 4


def test_input_gradients_through_restrided_weight_copies_equal_autograds():
    """A weight whose rows lie a multiple of 8 KiB apart gives its input gradient through a copy with longer
    rows (linear_grads.PaddedWeights): one copy serves every microbatch of a step, the engine drops it at
    the step's end, and after an SGD step the next step's gradients still equal autograd's."""
    from torch import nn

    def make() -> nn.Sequential:
        return nn.Sequential(nn.Linear(16, 2048), nn.ReLU(), nn.Linear(2048, 24), nn.ReLU(), nn.Linear(24, 5))

    torch.manual_seed(0)
    net, ref = make(), make()
    ref.load_state_dict(net.state_dict())
    engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.ONE_F_ONE_B, 1, 4, 1), 0, [0], world=None)
    engine.in_place_min_numel = 0
    engine.padded.min_numel = 0  # the [24, 2048] weight (rows 8 KiB apart) is small: take it anyway
    calls, real = [], engine.padded.input_grad
    engine.padded.input_grad = lambda g, w: (real(g, w), calls.append((tuple(w.shape), len(engine.padded))))[0]
    for step in range(2):
        x, y = torch.randn(16, 16), torch.randint(0, 5, (16,))
        net.zero_grad(set_to_none=True)
        engine.train_step(_PlainIO(x, y, 4))
        assert len(engine.padded) == 0  # dropped at the step's end
        ref.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
        with torch.no_grad():
            for p, q in zip(net.parameters(), ref.parameters()):
                p.sub_(0.5 * p.grad)
                q.sub_(0.5 * q.grad)
    engine.close()
    assert [c for c in calls if c[0] == (24, 2048)] == [((24, 2048), 1)] * 8  # every microbatch, one copy per step
    assert {held for shape, held in calls if shape == (5, 24)} == {0, 1}  # outside the rule: never a copy of its own


def test_a_forward_hands_its_output_over_before_its_bookkeeping():
    """The next stage may be waiting for a forward's output: the engine sends it as soon as the chunk has
    run -- after the action's end is recorded (the hand-over is not the action's time), before the
    (input, output) stash and the peak-memory tally. Stage 0 of a 1F1B P=2, M=2 step with fake channels."""
    seen = []

    class FakeChannel:
        def __init__(self, name: str) -> None:
            self.name, self.sent = name, []

        def send_obj(self, t: torch.Tensor) -> None:
            m = len(self.sent)
            seen.append((m, (m, 0) in engine._store, engine.peak_activation_bytes,
                         [(r.kind, r.mb) for r in engine.timeline]))
            self.sent.append(t.clone())

        def recv_obj(self) -> torch.Tensor:  # stage 1's input gradient for the microbatch being back-propagated
            return torch.ones_like(channels["pp-act0"].sent[0])

    channels: dict[str, FakeChannel] = {}

    class FakeWorld:
        def channel(self, src: int, dst: int, name: str, cfg) -> FakeChannel:
            return channels.setdefault(name, FakeChannel(name))

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.ONE_F_ONE_B, 2, 2, 1), 0, [0, 1], FakeWorld())
    engine.train_step(_PlainIO(torch.randn(4, 8), torch.zeros(4, dtype=torch.long), 2))
    engine.close()
    assert [(m, stored) for m, stored, _, _ in seen] == [(0, False), (1, False)]
    assert seen[0][2] == 0  # nothing tallied yet at the first send
    assert seen[0][3] == [("F", 0)] and seen[1][3] == [("F", 0), ("F", 1)]
    assert engine.peak_activation_bytes > 0 and not engine._store
