"""Tensor-parallel layers against the unsharded layers: forward output and *every* gradient.

Each rank rebuilds the full layers from the same seed, runs the reference on the full input, runs
the parallel layers on its shard, and compares its slice of every result.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_shm.parallel.tp import ColumnParallelLinear, RowParallelLinear, ShardedLayerNorm, distributed_layer_norm
from lightning_shm.parallel.tp.layers import even_split_sizes
from lightning_shm.runtime import launch


def _slice(t, dim, sizes, i):
    return t.narrow(dim, sum(sizes[:i]), sizes[i])


def _block(world, hidden, dtype):
    """column -> sharded LayerNorm -> ReLU -> row, as in the reference MLP."""
    g = world.group()
    torch.manual_seed(0)
    lin1, ln, lin2 = nn.Linear(20, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, 7)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    for m in (lin1, ln, lin2):
        m.to(dtype)
    x = torch.randn(6, 20, dtype=dtype, requires_grad=True)
    ref = lin2(torch.relu(ln(lin1(x))))
    ref.pow(2).sum().backward()

    col, sln, row = ColumnParallelLinear(lin1, g), None, RowParallelLinear(lin2, g)
    sln = ShardedLayerNorm(ln, g, col.sizes)
    xp = x.detach().clone().requires_grad_(True)
    out = row(torch.relu(sln(col(xp))))
    out.pow(2).sum().backward()
    s, i = col.sizes, g.index
    checks = {
        "output": (out, ref),
        "input grad": (xp.grad, x.grad),
        "column weight grad": (col.weight.grad, _slice(lin1.weight.grad, 0, s, i)),
        "column bias grad": (col.bias.grad, _slice(lin1.bias.grad, 0, s, i)),
        "layernorm weight grad": (sln.weight.grad, _slice(ln.weight.grad, 0, s, i)),
        "layernorm bias grad": (sln.bias.grad, _slice(ln.bias.grad, 0, s, i)),
        "row weight grad": (row.weight.grad, _slice(lin2.weight.grad, 1, s, i)),
        "row bias grad": (row.bias.grad, lin2.bias.grad),
    }
    return {k: float((a.double() - b.double()).abs().max()) for k, (a, b) in checks.items()}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("hidden", [32, 30])  # 30 over 4 ranks: uneven shards 8, 8, 7, 7
def test_column_layernorm_row_match_unsharded_reference(world_size, hidden):
    for errors in launch(_block, world_size, hidden, torch.float32, start_method="fork"):
        assert max(errors.values()) < 1e-5, errors


def _gathered(world, hidden):
    """A gathered column layer on a [batch, tokens, features] input, then replicated LayerNorm and Linear.

    The input needs a gradient, so the copy_to_tp all-reduce runs backward; the gathered output's
    gradient is taken locally (every rank holds the whole of it)."""
    g = world.group()
    torch.manual_seed(0)
    lin1, ln, lin2 = nn.Linear(20, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, 7)
    x = torch.randn(3, 5, 20, requires_grad=True)
    ref = lin2(torch.relu(ln(lin1(x))))
    ref.pow(2).sum().backward()
    col = ColumnParallelLinear(lin1, g, gather_output=True)
    ln2, lin3 = nn.LayerNorm(hidden), nn.Linear(hidden, 7)
    ln2.load_state_dict(ln.state_dict())
    lin3.load_state_dict(lin2.state_dict())
    xp = x.detach().clone().requires_grad_(True)
    before = dict(g.traffic)
    out = lin3(torch.relu(ln2(col(xp))))
    out.pow(2).sum().backward()
    traffic = {k: v - before.get(k, 0) for k, v in g.traffic.items() if v != before.get(k, 0)}
    with torch.no_grad():  # inference: gathered without an autograd node
        inference = col(x.detach())
    s, i = col.sizes, g.index
    checks = {
        "output": (out, ref),
        "inference output": (inference, lin1(x).detach()),
        "input grad": (xp.grad, x.grad),
        "column weight grad": (col.weight.grad, _slice(lin1.weight.grad, 0, s, i)),
        "column bias grad": (col.bias.grad, _slice(lin1.bias.grad, 0, s, i)),
        "replicated LayerNorm weight grad": (ln2.weight.grad, ln.weight.grad),
        "replicated Linear weight grad": (lin3.weight.grad, lin2.weight.grad),
    }
    return {k: float((a.double() - b.double()).abs().max()) for k, (a, b) in checks.items()}, traffic


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hidden", [24, 31])  # 31 over 3 ranks: uneven shards 11, 10, 10 (all_gather_v)
def test_gathered_column_matches_unsharded_reference(world_size, hidden):
    for errors, traffic in launch(_gathered, world_size, hidden, start_method="fork"):
        assert max(errors.values()) < 1e-5, errors
        # forward: one gather of this rank's [3, 5, H_r] output; backward: only the input gradient's all-reduce
        mine = 3 * 5 * even_split_sizes(hidden, world_size)[0] * 4
        gathered = traffic.pop("all_gather", 0) + traffic.pop("all_gather_v", 0)
        assert gathered >= 3 * 5 * min(even_split_sizes(hidden, world_size)) * 4 and gathered <= mine, traffic
        assert traffic == {"all_reduce": 3 * 5 * 20 * 4}, traffic


def _layernorm(world, offset, n_features):
    g = world.group()
    sizes = even_split_sizes(n_features, world.size)
    torch.manual_seed(1)
    # round to float32 first: the reference sees exactly the values our float32 path sees
    x = (torch.randn(5, 3, n_features, dtype=torch.float64) * 2 + offset).float().double()
    w, b = torch.rand(n_features, dtype=torch.float64) + 0.5, torch.randn(n_features, dtype=torch.float64)
    dy = torch.randn_like(x)
    ref_ln = nn.LayerNorm(n_features, dtype=torch.float64)
    with torch.no_grad():
        ref_ln.weight.copy_(w)
        ref_ln.bias.copy_(b)
    xr = x.clone().requires_grad_(True)
    (ref_ln(xr) * dy).sum().backward()
    # ours, in float32 (what training uses), against the float64 reference
    lo, n = sum(sizes[: g.index]), sizes[g.index]
    xs = x[..., lo:lo + n].float().clone().requires_grad_(True)
    ws = w[lo:lo + n].float().clone().requires_grad_(True)
    bs = b[lo:lo + n].float().clone().requires_grad_(True)
    y = distributed_layer_norm(xs, ws, bs, 1e-5, g, sizes)
    (y * dy[..., lo:lo + n].float()).sum().backward()
    # torch's own float32 LayerNorm on the full input, for scale
    t32 = nn.functional.layer_norm(x.float(), (n_features,), w.float(), b.float(), 1e-5)
    return {
        "forward": float((y.double() - ref_ln(x)[..., lo:lo + n]).abs().max()),
        "input grad": float((xs.grad.double() - xr.grad[..., lo:lo + n]).abs().max()),
        "weight grad": float((ws.grad.double() - ref_ln.weight.grad[lo:lo + n]).abs().max()),
        "bias grad": float((bs.grad.double() - ref_ln.bias.grad[lo:lo + n]).abs().max()),
        "torch float32 forward": float((t32.double() - ref_ln(x)).abs().max()),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("offset", [0.0, 1e4], ids=["zero-mean", "mean-1e4"])
def test_distributed_layernorm_matches_nn_layernorm(world_size, offset):
    for errors in launch(_layernorm, world_size, offset, 37, start_method="fork"):
        # float32 outputs vs a float64 reference: 1e-6 in forward and backward, offset or not
        assert max(errors[k] for k in ("forward", "input grad", "weight grad", "bias grad")) < 1e-6, errors
        # the merge of per-rank statistics is no worse than torch's own float32 LayerNorm
        assert errors["forward"] <= max(errors["torch float32 forward"], 1e-6), errors


def _no_grad_input(world):
    """The first column layer's input (pixels) needs no gradient: no backward all-reduce for it."""
    g = world.group()
    torch.manual_seed(0)
    col = ColumnParallelLinear(nn.Linear(8, 4), g)
    row = RowParallelLinear(nn.Linear(4, 3), g)
    before = dict(g.traffic)
    row(col(torch.randn(2, 8))).sum().backward()
    return {k: v - before.get(k, 0) for k, v in g.traffic.items()}


def test_backward_all_reduce_is_skipped_when_input_needs_no_grad():
    traffic = launch(_no_grad_input, 2, start_method="fork")[0]
    assert traffic == {"all_reduce": 2 * 3 * 4}  # only the row layer's forward output [2, 3] float32


_CONV_DIMS = {  # convolution, its BatchNorm, max pooling, an input [4, 3, ...]
    1: (nn.Conv1d, nn.BatchNorm1d, nn.functional.max_pool1d, (12,)),
    2: (nn.Conv2d, nn.BatchNorm2d, nn.functional.max_pool2d, (10, 10)),
    3: (nn.Conv3d, nn.BatchNorm3d, nn.functional.max_pool3d, (6, 6, 6)),
}


def _conv_block(world, out_channels, dims):
    """column conv -> sliced BatchNorm -> ReLU -> MaxPool -> row conv (1-, 2- or 3-d), against the unsharded block."""
    import copy

    from lightning_shm.parallel.tp import sliced_batchnorm
    from lightning_shm.parallel.tp.layers import COLUMN_CONV, ROW_CONV

    conv, norm, pool, space = _CONV_DIMS[dims]
    g = world.group()
    torch.manual_seed(0)
    c1, bn = conv(3, out_channels, 3, padding=1).double(), norm(out_channels).double()
    c2 = conv(out_channels, 5, 3, padding="same").double()  # float64: the bias before BatchNorm has ~0 gradient
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    s = even_split_sizes(out_channels, g.size)
    col, row = COLUMN_CONV[conv](c1, g, s), ROW_CONV[conv](c2, g, s)
    assert isinstance(col, conv) and isinstance(row, conv)  # code classifying modules by type sees its layers
    sbn = sliced_batchnorm(copy.deepcopy(bn), g, s)
    x = torch.randn(4, 3, *space, dtype=torch.float64, requires_grad=True)
    ref = c2(pool(torch.relu(bn(c1(x))), 2))
    ref.pow(2).sum().backward()
    xp = x.detach().clone().requires_grad_(True)
    out = row(pool(torch.relu(sbn(col(xp))), 2))
    out.pow(2).sum().backward()
    i = g.index
    checks = {
        "output": (out, ref),
        "input grad": (xp.grad, x.grad),
        "column weight grad": (col.weight.grad, _slice(c1.weight.grad, 0, s, i)),
        "column bias grad": (col.bias.grad, _slice(c1.bias.grad, 0, s, i)),
        "batchnorm weight grad": (sbn.weight.grad, _slice(bn.weight.grad, 0, s, i)),
        "running mean": (sbn.running_mean, _slice(bn.running_mean, 0, s, i)),
        "running var": (sbn.running_var, _slice(bn.running_var, 0, s, i)),
        "row weight grad": (row.weight.grad, _slice(c2.weight.grad, 1, s, i)),
        "row bias grad": (row.bias.grad, c2.bias.grad),
    }
    # relative to each reference's largest entry: the summed-square loss makes gradients large
    return {k: float((a.double() - b.double()).abs().max() / max(1.0, float(b.abs().max())))
            for k, (a, b) in checks.items()}


@pytest.mark.parametrize("world_size, channels, dims", [(2, 8, 2), (3, 8, 2), (2, 8, 1), (3, 8, 3)])  # 3 ranks: 3, 3, 2
def test_conv_column_batchnorm_row_match_unsharded_block(world_size, channels, dims):
    for errors in launch(_conv_block, world_size, channels, dims, start_method="fork"):
        assert max(errors.values()) < 1e-12, errors
