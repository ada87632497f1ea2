"""Random draws under tensor parallelism: a mask of each rank's own between its split layers, the
group's shared stream everywhere else (see lightning_shm/parallel/tp/rng.py).

One world per size runs every scenario; the tests read its results.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_shm.parallel.tp import TensorParallelState, check_plan, plan_for
from lightning_shm.runtime import launch

HIDDEN = 31  # uneven over 2 ranks (16, 15): the case where shared draws in the split region diverged
PLAN = {"0": "column", "3": "row"}


def _model(split_p: float, out_p: float = 0.5) -> nn.Sequential:
    """Dropout ``split_p`` on the split features, ``out_p`` on the replicated output. Tanh, not ReLU:
    a zero after the split dropout is its mask."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, HIDDEN), nn.Tanh(), nn.Dropout(split_p), nn.Linear(HIDDEN, 9),
                         nn.Dropout(out_p))


def _parallel(world, split_p: float, out_p: float = 0.5) -> nn.Sequential:
    m = _model(split_p, out_p)
    TensorParallelState(m, world.group(), check_plan(m, plan_for(m, PLAN, world.size), world.size))
    return m


def _scenarios(world):
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(1))
    out = {}

    # 1. dropout on the split features and on the replicated output
    m = _parallel(world, 0.5)
    masks = []
    m[2].register_forward_hook(lambda mod, inp, o: masks.append(o == 0))
    for _ in range(2):  # same seed twice: the same masks
        torch.manual_seed(5)
        out["y"] = m(x)
    out["split_masks"] = masks
    out["state_after"] = torch.get_rng_state()

    # ... and new masks at the next forward, even where nothing else draws from the shared stream
    only_split = _parallel(world, 0.5, out_p=0.0)
    next_masks = []
    only_split[2].register_forward_hook(lambda mod, inp, o: next_masks.append(o == 0))
    only_split(x), only_split(x)
    out["next_masks"] = next_masks

    # 2. torch.utils.checkpoint replays the same masks in backward
    grads = []
    for ckpt in (False, True):
        m.zero_grad()
        torch.manual_seed(6)
        xin = x.clone().requires_grad_(True)
        y = checkpoint(m, xin, use_reentrant=False) if ckpt else m(xin)
        y.pow(2).sum().backward()
        grads.append(torch.cat([xin.grad.reshape(-1)] + [p.grad.reshape(-1) for p in m.parameters()]))
    out["checkpoint_diff"] = float((grads[0] - grads[1]).abs().max())

    # 3. nothing random between the split layers: the shared stream is one process's
    m = _parallel(world, 0.0)
    torch.manual_seed(7)
    out["replicated_y"] = m(x)
    out["replicated_state"] = torch.get_rng_state()
    ref = _model(0.0)
    torch.manual_seed(7)
    out["reference_y"] = ref(x)
    out["reference_state"] = torch.get_rng_state()
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(_scenarios, 2, start_method="fork")


def test_ranks_draw_their_own_masks_between_split_layers(runs):
    r0, r1 = runs
    a, b = r0["split_masks"][0], r1["split_masks"][0]
    assert a.shape == (16, 16) and b.shape == (16, 15)
    n = b.numel()  # one stream's draws fill both masks in order: from the same state they were equal
    assert not torch.equal(a.reshape(-1)[:n], b.reshape(-1))
    assert 0.3 < float(torch.cat([a, b], 1).float().mean()) < 0.7
    for r in runs:
        assert torch.equal(r["split_masks"][0], r["split_masks"][1])  # reproducible from the seed
        assert not torch.equal(*r["next_masks"])  # new at the next forward


def test_replicated_activations_and_the_shared_stream_stay_equal_across_ranks(runs):
    r0, r1 = runs
    assert torch.equal(r0["y"], r1["y"])
    assert torch.equal(r0["state_after"], r1["state_after"])


def test_checkpointed_recomputation_sees_the_forward_masks(runs):
    for r in runs:
        assert r["checkpoint_diff"] == 0.0


def test_no_draw_between_split_layers_leaves_one_process_stream(runs):
    for r in runs:
        assert torch.equal(r["replicated_state"], r["reference_state"])
        torch.testing.assert_close(r["replicated_y"], r["reference_y"], rtol=0, atol=1e-6)
