"""The gradient reducer on the bare runtime (no Trainer): buckets, hooks, no_sync, unused parameters."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from lightning_shm.models import build_mlp
from lightning_shm.parallel.ddp import GradReducer, broadcast_module_state
from lightning_shm.runtime import launch


def _counting(group):
    calls = []
    orig = group.all_reduce

    def counted(t, op="sum"):
        calls.append(t.numel())
        return orig(t, op)

    group.all_reduce = counted
    return calls


def _mean_grads(world, bucket_cap_mb):
    torch.manual_seed(world.rank)  # different init per rank: the broadcast must fix it
    model = build_mlp()
    g = world.group()
    broadcast_module_state(model, g)
    reducer = GradReducer(list(model.named_parameters()), g, bucket_cap_mb=bucket_cap_mb)
    calls = _counting(g)
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(100 + world.rank))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(200 + world.rank))
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    reducer.post_backward()
    views_ok = all(p.grad.data_ptr() == reducer._views[p].data_ptr() for p in model.parameters())
    grads = [p.grad.clone() for p in model.parameters()]
    # the reference: every rank recomputes the mean gradient over all ranks' samples locally
    ref_model = build_mlp()
    ref_model.load_state_dict(model.state_dict())
    ref_grads = [torch.zeros_like(p) for p in ref_model.parameters()]
    for r in range(world.size):
        xr = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(100 + r))
        yr = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(200 + r))
        ref_model.zero_grad()
        nn.functional.cross_entropy(ref_model(xr), yr).backward()
        for acc, p in zip(ref_grads, ref_model.parameters()):
            acc += p.grad / world.size
    ok = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads))
    return ok, views_ok, len(reducer.buckets), calls


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.05])
def test_bucket_views_average_gradients(bucket_cap_mb):
    results = launch(_mean_grads, 3, bucket_cap_mb, start_method="fork")
    for ok, views_ok, n_buckets, calls in results:
        assert ok and views_ok
        assert len(calls) == n_buckets  # one all-reduce per bucket, no more
    # 50 KiB cap: [last Linear + 2nd LayerNorm + 2nd Linear bias] [256x64 weight] [LN1 + Linear1 bias] [784x256 weight]
    assert results[0][2] == (1 if bucket_cap_mb == 25.0 else 4)


def _accumulate(world, set_to_none):
    torch.manual_seed(0)
    model = build_mlp([16])
    ref = build_mlp([16])
    ref.load_state_dict(model.state_dict())
    g = world.group()
    reducer = GradReducer(list(model.named_parameters()), g)
    calls = _counting(g)
    xs = [torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(r)) for r in range(world.size)]
    for step in range(2):  # two optimizer steps' worth, zeroing in between like Lightning
        model.zero_grad(set_to_none=set_to_none)
        for micro in range(3):
            ctx = reducer.no_sync() if micro < 2 else contextlib.nullcontext()
            with ctx:
                model(xs[world.rank] * (micro + 1)).sum().backward()
                reducer.post_backward()
            if micro == 1:
                after_no_sync = len(calls)
    # reference: mean over ranks of the gradient summed over the three micro-steps
    ref.zero_grad()
    for x in xs:
        for micro in range(3):
            (ref(x * (micro + 1)).sum() / world.size).backward()
    ok = all(torch.allclose(p.grad, q.grad, atol=1e-5) for p, q in zip(model.parameters(), ref.parameters()))
    return after_no_sync, len(calls), ok


@pytest.mark.parametrize("set_to_none", [True, False])
def test_no_sync_accumulates_locally_and_syncs_once(set_to_none):
    results = launch(_accumulate, 2, set_to_none, start_method="fork")
    for after_no_sync, total, ok in results:
        assert after_no_sync == 1  # step 1's two no_sync micro-steps communicated nothing (1 = step 0's sync)
        assert total == 2 and ok


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x, use_b):
        return self.a(x) + (self.b(x) if use_b else 0)


def _unused(world, find_unused):
    torch.manual_seed(0)
    model = TwoHeads()
    g = world.group()
    reducer = GradReducer(list(model.named_parameters()), g, find_unused_parameters=find_unused)
    model.zero_grad(set_to_none=True)
    x = torch.ones(3, 4) * (world.rank + 1)
    model(x, use_b=world.rank == 0).sum().backward()  # rank 1 never touches head b
    reducer.post_backward()
    return model.b.weight.grad.clone(), model.a.weight.grad.clone()


def test_unused_parameters_raise_naming_them():
    with pytest.raises(RuntimeError, match=r"received no gradient.*'b\.(weight|bias)'.*find_unused_parameters=True"):
        launch(_unused, 2, False, start_method="fork")


def test_find_unused_parameters_takes_zero_gradient():
    (b0, a0), (b1, a1) = launch(_unused, 2, True, start_method="fork")
    torch.testing.assert_close(b0, b1)
    torch.testing.assert_close(b0, torch.full_like(b0, 3 / 2))  # rank 0's grad 3 (1*3 rows), rank 1's zero
    torch.testing.assert_close(a0, torch.full_like(a0, (3 + 6) / 2))


class _Tied(nn.Module):
    """Nested Linear layers, one of them applied twice (its two products meet in autograd's input buffer)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(self.block(self.block(h)))


def _direct(world):
    torch.manual_seed(0)
    model, ref = _Tied(), _Tied()
    ref.load_state_dict(model.state_dict())
    g = world.group()
    reducer = GradReducer(list(model.named_parameters()), g)
    reducer.route_linears(model.modules())  # the default limit (2^20 weights): these small layers stay as they are
    untouched = all("forward" not in m.__dict__ for m in model.modules())
    reducer.direct_min_numel = 0  # every Linear writes its weight gradient into the bucket
    reducer.route_linears(model.modules())
    reducer.padded.min_numel, reducer.padded.stride_multiple = 0, 32  # input gradients of the 8-wide layers too
    copies, product = [], reducer.padded.input_grad
    reducer.padded.input_grad = lambda g, w: (product(g, w), copies.append(len(reducer.padded)))[0]
    adopted, adopt = [], reducer._adopt
    reducer._adopt = lambda p: adopted.append(p) or adopt(p)
    hook_saw = []
    model.out.weight.register_hook(lambda grad: hook_saw.append(grad.data_ptr()))
    xs = [torch.randn(5, 6, generator=torch.Generator().manual_seed(r)) for r in range(world.size)]
    first_step_adopted = None
    for step in range(2):  # two optimizer steps of three micro-steps, zero_grad(set_to_none=True) in between
        model.zero_grad(set_to_none=True)
        for micro in range(3):
            with reducer.no_sync() if micro < 2 else contextlib.nullcontext():
                model(xs[world.rank] * (micro + 1)).square().sum().backward()
                reducer.post_backward()
                assert len(reducer.padded) == 0 or micro < 2  # the copies dropped when the synced backward ends
            if step == 0 and micro == 0:
                first_step_adopted = {id(p) for p in adopted}
    in_bucket = all(p.grad.data_ptr() == reducer._views[p].data_ptr() for p in model.parameters())
    ref.zero_grad()
    for x in xs:
        for micro in range(3):
            (ref(x * (micro + 1)).square().sum() / world.size).backward()
    err = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    reducer.close()
    restored = all("forward" not in m.__dict__ for m in model.modules())
    named = {id(p): n for n, p in model.named_parameters()}
    assert max(copies) > 0  # the re-strided copies were used
    return err, sorted(named[i] for i in first_step_adopted), hook_saw, reducer._views[model.out.weight].data_ptr(), \
        in_bucket, untouched and restored


def test_linear_weight_gradients_are_written_into_the_buckets():
    """route_linears: a Linear's weight gradient is computed straight into its bucket region and autograd
    adopts that region as .grad -- nothing is copied in (the biases, autograd's, are). Gradients equal
    autograd's through gradient accumulation (later micro-steps add autograd's product to the bucket) and a
    layer applied twice (the second product must not overwrite the first in the lent region), with the input
    gradients through re-strided weight copies (dropped after each synced backward); a hook on a
    routed weight still sees its gradient (in the bucket); layers under the size limit are not rerouted at
    all; close() restores the layers."""
    for err, adopted, hook_saw, out_ptr, in_bucket, restored in launch(_direct, 2, start_method="fork"):
        assert err < 1e-5
        assert "inp.weight" not in adopted and "out.weight" not in adopted  # used once: written in place
        assert "inp.bias" in adopted and "out.bias" in adopted  # autograd's fresh gradients, copied in
        assert len(hook_saw) == 6 and hook_saw[0] == out_ptr  # every micro-step; the first one in the bucket
        assert in_bucket and restored


def _rewritten_through_data(world, set_to_none):
    """Two steps of a hook rewriting each gradient through ``.data`` (the first step's: those the reducer attached
    when it was built), the optimizer zeroing gradients in place or to None; each step's reduced gradients."""
    torch.manual_seed(0)
    model = build_mlp()
    reducer = GradReducer(list(model.named_parameters()), world.group())
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(100 + world.rank))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(200 + world.rank))
    steps = []
    for _ in range(2):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.data = p.grad.data * 0.5
        model.zero_grad(set_to_none=set_to_none)
        nn.functional.cross_entropy(model(x), y).backward()
        reducer.post_backward()
        steps.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return steps


@pytest.mark.parametrize("set_to_none", [False, True])
def test_gradients_rewritten_through_data_are_still_averaged(set_to_none):
    """Each rank has its own samples: averaged, every rank holds the same gradient. When ``p.grad`` was the
    reducer's own view of the bucket, ``.data =`` took it out of the bucket: each rank kept its own."""
    rank0, rank1 = launch(_rewritten_through_data, 2, set_to_none, start_method="fork")
    for step0, step1 in zip(rank0, rank1):
        assert step0.abs().sum() > 0
        torch.testing.assert_close(step0, step1, rtol=0, atol=0)
