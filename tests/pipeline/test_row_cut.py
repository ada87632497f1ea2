"""A pipeline boundary inside a Linear: the planner, the two pieces, parity on the bare runtime, zero-bubble."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_shm.models import build_mlp
from lightning_shm.parallel.pipeline import PipelineEngine, PipelineSchedule, Schedule
from lightning_shm.parallel.pipeline.driver import reference_params, train_pipeline
from lightning_shm.parallel.pipeline.row_cut import LinearRows, apply_row_cuts, plan_cuts, plan_row_cuts
from lightning_shm.parallel.pipeline.split import layer_costs_by_params
from lightning_shm.runtime import launch

WIDE = [256, 256]  # by parameters, no layer boundary balances two stages (as in the benchmark's wide MLP)
ROWS = [512, 64]  # Linear(784, 512) holds ~92% of the work, measured or counted: always cut


def test_the_planner_cuts_inside_the_dominant_linear_and_balances_the_stages():
    seq = build_mlp(WIDE)
    layers, costs = list(seq), layer_costs_by_params(seq)
    cuts = plan_row_cuts(layers, costs, 2, stages=2)
    assert cuts is not None and cuts[0] == (0, 0)
    (layer, row), = cuts[1:]
    n = layers[layer].out_features
    assert isinstance(layers[layer], nn.Linear) and 0 < row < n
    a = sum(costs[:layer]) + costs[layer] * row / n  # the head's stage; the Linear's cost shared by rows
    b = sum(costs) - a
    assert abs(a - b) < costs[layer] / n  # within a row of even
    layer_only = max(sum(costs[:4]), sum(costs[4:]))  # the best boundary cut of this MLP
    assert max(a, b) < 0.8 * layer_only


@pytest.mark.parametrize("hook", ["forward", "state_dict"])
def test_a_linear_with_the_models_hooks_is_not_cut(hook):
    """Its hooks expect the whole layer: a forward hook its whole output, a state-dict hook (one saving ``weight``
    under another key) its whole entries -- the head and tail would run neither."""
    seq = build_mlp(WIDE)
    layers, costs = list(seq), layer_costs_by_params(seq)
    (layer, _), = plan_row_cuts(layers, costs, 2, stages=2)[1:]
    if hook == "forward":
        layers[layer].register_forward_hook(lambda m, args, out: out)
    else:
        layers[layer]._register_state_dict_hook(lambda m, state_dict, prefix, meta: None)
    cuts = plan_row_cuts(layers, costs, 2, stages=2)
    assert cuts is None or all(row == 0 for _, row in cuts)


def test_the_planner_keeps_layer_boundaries_where_they_balance():
    costs = [1.0, 10.0, 1.0, 1.0, 10.0, 1.0]
    layers = [nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.ReLU(), nn.Linear(4, 4), nn.ReLU()]
    assert plan_row_cuts(layers, costs, 2) is None  # [0, 3) | [3, 6) is already even


def test_plan_cuts_without_split_linear_is_the_layer_plan():
    seq = build_mlp(WIDE)
    cuts, how = plan_cuts(seq, 2, stages=2)
    assert all(row == 0 for _, row in cuts) and "rows" not in how
    assert "split_linear=True would cut inside layer 1" in how  # the log line tells the user
    cuts, how = plan_cuts(seq, 2, stages=2, split_linear=True)
    assert any(row for _, row in cuts) and "cut by rows" in how


def test_head_and_tail_compute_the_linear():
    torch.manual_seed(0)
    lin = nn.Linear(12, 7)
    x = torch.randn(5, 12, requires_grad=True)
    named, starts = apply_row_cuts([("0", nn.Identity()), ("1", lin)], [(0, 0), (1, 3)])
    assert starts == [0, 2] and [n for n, _ in named] == ["0", "1", "1"]
    head, tail = named[1][1], named[2][1]
    assert isinstance(head, LinearRows) and head.is_head and (head.lo, head.hi, tail.lo, tail.hi) == (0, 3, 3, 7)
    z = head(x)
    assert z.shape == (5, 12 + 3)  # the layer's input travels with the head's rows
    y = tail(z)
    torch.testing.assert_close(y, lin(x))
    g = torch.randn(5, 7)
    y.backward(g)
    torch.testing.assert_close(x.grad, g @ lin.weight)
    torch.testing.assert_close(torch.cat([head.weight.grad, tail.weight.grad]), g.t() @ x.detach())
    torch.testing.assert_close(torch.cat([head.bias.grad, tail.bias.grad]), g.sum(0))


def test_only_a_linear_can_be_cut_and_only_into_a_head_and_a_tail():
    with pytest.raises(ValueError, match=r"layer 0 \(0: ReLU\) is not an nn.Linear"):
        apply_row_cuts([("0", nn.ReLU()), ("1", nn.Linear(2, 2))], [(0, 0), (0, 1)])
    for lo, hi in ((0, 4), (1, 3), (2, 2)):  # the whole layer, a middle slice, nothing
        with pytest.raises(ValueError, match=rf"rows \[{lo}, {hi}\) are not the head or tail"):
            LinearRows(nn.Linear(3, 4), lo, hi)


@pytest.mark.parametrize("schedule, M, v, P", [("1f1b", 4, 1, 2), ("zero_bubble", 4, 1, 2),
                                                ("interleaved_1f1b", 4, 2, 2), ("gpipe", 4, 1, 3)])
def test_engine_with_a_cut_linear_equals_one_process(schedule, M, v, P):
    """Balanced by parameter counts: the plan is the same every run. By measured time a slow moment of this
    machine once left the cut out (the timed costs moved enough that no row cut gained)."""
    reference = reference_params(ROWS, steps=3, batch=64)
    results = launch(train_pipeline, P, ROWS, schedule, M, v, 3, 64, return_params=True, split_linear=True,
                     balance="params", start_method="fork")
    pieces: dict[str, list[torch.Tensor]] = {}
    for r in sorted(results, key=lambda r: r.rank):
        for k, t in r.params.items():
            pieces.setdefault(k, []).append(t)
    assert any(len(ts) == 2 for ts in pieces.values()), "no Linear was cut"
    chunks = PipelineSchedule(Schedule.parse(schedule), P, M, v).chunks
    [(layer, row)] = [c for c in plan_cuts(build_mlp(ROWS), chunks, stages=P, split_linear=True)[0] if c[1]]
    assert [t.shape[0] for t in pieces[f"{layer}.weight"]] == [row, ROWS[0] - row]  # the parameter-count plan
    got = {k: torch.cat(ts) for k, ts in pieces.items()}
    assert set(got) == set(reference)
    for k in reference:
        torch.testing.assert_close(got[k], reference[k], rtol=0, atol=1e-5)


def test_the_driver_refuses_an_unknown_balance():
    with pytest.raises(ValueError, match="balance must be 'time' or 'params', got 'flops'"):
        train_pipeline(None, ROWS, "1f1b", 4, balance="flops")  # before it touches the world


class _OneChunkIO:
    def __init__(self, x, y):
        self.xs, self.ys = x.chunk(2), y.chunk(2)

    def forward_context(self):
        return contextlib.nullcontext()

    def first_input(self, mb):
        return self.xs[mb]

    def last_forward(self, mb, x, chunk):
        return F.cross_entropy(chunk(x), self.ys[mb]) / 2


def test_zero_bubble_defers_the_weight_gradient_of_a_cut_linear():
    """The pieces' weight gradients wait for the W pass, like a plain Linear's."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 6)
    named, _ = apply_row_cuts([("0", lin)], [(0, 0), (0, 2)])
    net = nn.Sequential(named[0][1], named[1][1])
    ref = nn.Linear(8, 6)
    ref.load_state_dict(lin.state_dict())
    engine = PipelineEngine({0: net}, PipelineSchedule(Schedule.ZERO_BUBBLE, 1, 2, 1), 0, [0], world=None)
    deferred = []
    defer = engine.weight_grad
    engine.weight_grad = lambda p, x, g: deferred.append(p) or defer(p, x, g)
    x, y = torch.randn(4, 8), torch.randint(0, 6, (4,))
    engine.train_step(_OneChunkIO(x, y))
    engine.close()
    # each piece's weight, once per microbatch (B runs the tail's backward first)
    assert sorted(map(id, deferred)) == sorted([id(net[0].weight), id(net[1].weight)] * 2)
    F.cross_entropy(ref(x), y).backward()
    torch.testing.assert_close(torch.cat([net[0].weight.grad, net[1].weight.grad]), ref.weight.grad)
    torch.testing.assert_close(torch.cat([net[0].bias.grad, net[1].bias.grad]), ref.bias.grad)
    assert "linear" not in net[0].__dict__  # close() restored the pieces
