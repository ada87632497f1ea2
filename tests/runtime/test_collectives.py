"""Every collective x sizes x W x dtypes against a torch reference computed from all ranks' inputs.

Small scratch slots (64 KiB) force the one-shot, multi-round and reduce-scatter/all-gather paths
with modest sizes; each rank regenerates every other rank's input from its seed for the reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_shm.runtime import GroupConfig, RuntimeConfig, launch
from lightning_shm.runtime.ops import divide_, even_split

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.complex128]  # complex: sums and means only
SMALL = RuntimeConfig(timeout_s=60, group=GroupConfig(slot_bytes=64 << 10, oneshot_max_bytes=4 << 10))


def sizes_for(world: int) -> list[int]:
    # 0, 1, odd, not divisible by W, one-shot limit +- 1, several rounds of a 64 KiB slot
    return [0, 1, 7, world * 3 + 1, 1023, 1025, 50_001, 3 * 16384 + 5]


def make(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype.is_complex:
        return (torch.randn(n, generator=g, dtype=torch.complex128) * 4).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    if a.shape != b.shape:
        return False
    if dtype.is_complex:
        return torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    if not dtype.is_floating_point:
        return torch.equal(a, b)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2 ** -7}[dtype]
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


def reference(op: str, parts: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack([p.double() if p.is_floating_point() else p for p in parts])
    if op == "sum":
        return stacked.sum(0)
    if op == "mean":
        return stacked.mean(0)
    if op == "max":
        return stacked.max(0).values
    return stacked.min(0).values


def check_all_reduce(world) -> list[str]:
    g, errors = world.group(), []
    for dtype in DTYPES:
        for op in ("sum", "mean") if dtype.is_complex else ("sum", "mean", "max", "min"):
            if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
                continue
            for n in sizes_for(world.size):
                x = make(world.rank, n, dtype)
                g.all_reduce(x, op)
                ref = reference(op, [make(r, n, dtype) for r in range(world.size)]).to(dtype)
                if not close(x, ref, dtype):
                    errors.append(f"all_reduce {op} {dtype} n={n}")
    return errors


def check_all_reduce_shared(world) -> list[str]:
    """Zero-copy path: the tensor lives in a SharedBuffer of the group (like DDP gradient buckets).
    Up to the one-shot limit (4 KiB here) it is still copied through scratch: one barrier, not two."""
    g, errors = world.group(), []
    for dtype in DTYPES:
        for n in sizes_for(world.size):
            buf = g.alloc_shared(n + 3, dtype, tag="t")
            view = buf.local[3:3 + n]  # an offset inside the buffer, as for a bucket
            view.copy_(make(world.rank, n, dtype))
            gen = g._barrier.gen
            g.all_reduce(view, "sum")
            barriers, small = g._barrier.gen - gen, n * view.element_size() <= (4 << 10)
            ref = reference("sum", [make(r, n, dtype) for r in range(world.size)]).to(dtype)
            if not close(view, ref, dtype):
                errors.append(f"shared all_reduce {dtype} n={n}")
            if world.size > 1 and barriers != (1 if small else 2):
                errors.append(f"shared all_reduce {dtype} n={n}: {barriers} barriers")
            g.release_shared(buf)
    return errors


def check_common(world) -> list[str]:
    """Group.alloc_common: one tensor every member maps; each writes its part, all read the whole. A
    collective on a slice of it takes the ordinary path (member r's slice lies where no per-member
    region is: the zero-copy path would read the wrong bytes)."""
    g, errors = world.group(), []
    for dtype in (torch.float32, torch.int64):
        for n in (1, 7, 50_001):
            common = g.alloc_common(n * world.size, dtype, tag=f"c{n}")
            common[g.index * n:(g.index + 1) * n].copy_(make(world.rank, n, dtype))
            g.barrier()
            whole = torch.cat([make(r, n, dtype) for r in range(world.size)])
            if not torch.equal(common, whole):
                errors.append(f"common {dtype} n={n}: a member's part is not visible to all")
            g.barrier()  # everyone has read the parts before anyone reduces in place
            mine = common[g.index * n:(g.index + 1) * n]
            g.all_reduce(mine, "sum")
            if not close(mine, reference("sum", [make(r, n, dtype) for r in range(world.size)]).to(dtype), dtype):
                errors.append(f"all_reduce on a slice of a common tensor {dtype} n={n}")
    return errors


def check_reduce_scatter(world) -> list[str]:
    g, errors = world.group(), []
    for dtype in DTYPES:
        for op in ("sum", "mean") if dtype.is_complex else ("sum", "max"):
            for n in sizes_for(world.size):
                out = g.reduce_scatter(make(world.rank, n, dtype), op)
                b = even_split(n, world.size)
                ref = reference(op, [make(r, n, dtype) for r in range(world.size)]).to(dtype)
                if not close(out, ref[b[g.index]:b[g.index + 1]], dtype):
                    errors.append(f"reduce_scatter {op} {dtype} n={n}")
    return errors


def check_reduce_scatter_coalesced(world) -> list[str]:
    """Several tensors in one collective: bit for bit what one reduce_scatter per tensor gives, with
    parts of any sizes (zeros included), and one barrier per round of the scratch buffer in all."""
    import math

    g, errors, W = world.group(), [], world.size
    ns = [n for n in sizes_for(W) if n < 60_000]  # 0 .. several rounds of the 64 KiB slot

    def parts_of(i: int, n: int) -> list[int]:
        """Tensor i's elements per member: even_split, all to the last member, or whole rows of 3."""
        if i % 3 == 1:
            return [0] * (W - 1) + [n]
        b = even_split(n // 3, W) if i % 3 == 2 and n % 3 == 0 else even_split(n, W)
        scale = 3 if i % 3 == 2 and n % 3 == 0 else 1
        return [scale * (b[k + 1] - b[k]) for k in range(W)]

    parts = [parts_of(i, n) for i, n in enumerate(ns)]
    sizes = [None if i % 3 == 0 else p for i, p in enumerate(parts)]  # None: the default even_split
    per_member = [sum(p[k] for p in parts) for k in range(W)]
    for dtype in DTYPES:
        for op in ("sum", "mean") if dtype.is_complex else ("sum", "mean", "max") if dtype.is_floating_point else \
                ("sum", "max"):
            xs = [make(world.rank, n, dtype) for n in ns]
            gen = g._barrier.gen
            got = g.reduce_scatter_coalesced([x.clone() for x in xs], op, sizes=sizes)
            barriers = g._barrier.gen - gen
            singles = [g.reduce_scatter(x.clone(), op, sizes=sz) for x, sz in zip(xs, sizes)]
            if not all(torch.equal(a, b) for a, b in zip(got, singles)):
                errors.append(f"reduce_scatter_coalesced {op} {dtype}: differs from one call per tensor")
            for n, p, out in zip(ns, parts, got):
                lo = sum(p[:g.index])
                ref = reference(op, [make(r, n, dtype) for r in range(W)]).to(dtype)
                if not close(out, ref[lo:lo + p[g.index]], dtype):
                    errors.append(f"reduce_scatter_coalesced {op} {dtype} n={n}")
            cp = (64 << 10) // torch.empty((), dtype=dtype).element_size() // W  # elements per member per round
            if W > 1 and barriers != max(1, math.ceil(max(per_member) / cp)):
                errors.append(f"reduce_scatter_coalesced {dtype}: {barriers} barriers for {per_member} per member")
    return errors


def check_all_gather(world) -> list[str]:
    g, errors = world.group(), []
    for dtype in DTYPES:
        for n in sizes_for(world.size):
            out = g.all_gather(make(world.rank, n, dtype).view(1, n) if n else make(world.rank, n, dtype))
            ref = torch.stack([make(r, n, dtype) for r in range(world.size)])
            if not torch.equal(out.reshape(world.size, n), ref):
                errors.append(f"all_gather {dtype} n={n}")
            # unequal sizes: rank r sends n + r elements
            parts = g.all_gather_v(make(world.rank, n + world.rank, dtype))
            if [p.numel() for p in parts] != [n + r for r in range(world.size)] or not all(
                torch.equal(p, make(r, n + r, dtype)) for r, p in enumerate(parts)
            ):
                errors.append(f"all_gather_v {dtype} n={n}")
    # the same small gather every step (a LayerNorm's statistics): the one-round path reuses views of
    # the two alternating scratch buffers -- each call must return its own data, never an earlier call's
    out = torch.empty(world.size, 3, 5)
    for step in range(5):
        x = torch.full((3, 5), float(10 * step + world.rank))
        got = g.all_gather(x, out=out) if step % 2 else g.all_gather(x)
        ref = torch.stack([torch.full((3, 5), float(10 * step + r)) for r in range(world.size)])
        if not torch.equal(got, ref):
            errors.append(f"all_gather step {step}: {got[:, 0, 0].tolist()}")
    # many distinct sizes (variable-length gathers): results stay right, the cache of cut views stays bounded
    for n in range(1, 100):
        got = g.all_gather(make(world.rank, n, torch.float32))
        if not torch.equal(got, torch.stack([make(r, n, torch.float32) for r in range(world.size)])):
            errors.append(f"all_gather of {n} after many sizes")
    if len(g._cuts) > 64:
        errors.append(f"{len(g._cuts)} cached slot views")
    return errors


def check_broadcast(world) -> list[str]:
    g, errors = world.group(), []
    for dtype in DTYPES:
        for n in sizes_for(world.size):
            for src in {0, world.size - 1}:
                x = make(world.rank, n, dtype)
                g.broadcast(x, src_member=src)
                if not torch.equal(x, make(src, n, dtype)):
                    errors.append(f"broadcast {dtype} n={n} src={src}")
    big = {"rank": world.rank, "blob": b"x" * 200_000, "t": torch.arange(5)}
    got = g.broadcast_object(big if world.rank == world.size - 1 else None, src_member=world.size - 1)
    if got["rank"] != world.size - 1 or got["blob"] != big["blob"] or not torch.equal(got["t"], big["t"]):
        errors.append("broadcast_object")
    objs = g.all_gather_object({"r": world.rank, "pad": "y" * (70_000 * world.rank)})
    if [o["r"] for o in objs] != list(range(world.size)) or [len(o["pad"]) for o in objs] != [
        70_000 * r for r in range(world.size)
    ]:
        errors.append("all_gather_object")
    return errors


CHECKS = {
    "all_reduce": check_all_reduce,
    "all_reduce_shared": check_all_reduce_shared,
    "common": check_common,
    "reduce_scatter": check_reduce_scatter,
    "reduce_scatter_coalesced": check_reduce_scatter_coalesced,
    "all_gather": check_all_gather,
    "broadcast": check_broadcast,
}


def _run(world, name):
    return CHECKS[name](world)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_collective_matches_torch_reference(name, world_size):
    results = launch(_run, world_size, name, start_method="fork", runtime=SMALL)
    errors = [f"rank {r}: {e}" for r, errs in enumerate(results) for e in errs]
    assert not errors, errors


def _default_config_large(world):
    g = world.group()
    n = (3 << 20) + 3  # 12 MiB of float32: several rounds of the default 1 MiB slot
    x = make(world.rank, n, torch.float32)
    g.all_reduce(x, "mean")
    ref = reference("mean", [make(r, n, torch.float32) for r in range(world.size)]).float()
    return bool(torch.allclose(x, ref, rtol=1e-5, atol=1e-6))


def test_large_all_reduce_with_default_config():
    assert launch(_default_config_large, 2, start_method="fork") == [True, True]


def _barriers_and_result(world, g, n):
    """One all_reduce of a private tensor of ``n`` float32 elements: the barriers it took, and whether it is right."""
    x = make(world.rank, n, torch.float32)
    gen = g._barrier.gen
    g.all_reduce(x, "sum")
    right = close(x, reference("sum", [make(r, n, torch.float32) for r in range(world.size)]).float(), torch.float32)
    return g._barrier.gen - gen, right


def _one_large_all_reduce(world, n):
    """:func:`_barriers_and_result`, then one all_reduce with an ``across`` step (a node-spanning group's): its
    barriers and the sizes the ``across`` step was given."""
    g = world.group()
    barriers, right = _barriers_and_result(world, g, n)
    seen = []
    gen = g._barrier.gen
    g.all_reduce(make(world.rank, n, torch.float32), "sum", across=lambda part: seen.append(part.numel()))
    return barriers, right, g._barrier.gen - gen, seen


@pytest.mark.parametrize("world_size, pair_oneshot, per_round", [(2, True, 1), (2, False, 2), (3, True, 2)])
def test_a_pair_reduces_a_tensor_of_any_size_one_shot_a_barrier_per_slot(world_size, pair_oneshot, per_round):
    """W=2: a private tensor larger than the one-shot limit goes one-shot all the same, a slot-sized chunk per
    barrier; with ``pair_oneshot=False`` and in larger groups, reduce-scatter + all-gather meets twice a round.
    With an ``across`` step every size takes reduce-scatter + all-gather: each rank passes on its own part of a
    round, as a node-spanning group's rail must (one-shot would send the whole tensor from every rank)."""
    config = RuntimeConfig(timeout_s=60, group=GroupConfig(slot_bytes=64 << 10, oneshot_max_bytes=4 << 10,
                                                           pair_oneshot=pair_oneshot))
    n = 5 * 16384 + 7  # five 64 KiB slots of float32 and 7 elements: six chunks (rounds)
    results = launch(_one_large_all_reduce, world_size, n, start_method="fork", runtime=config)
    for r, (barriers, right, across_barriers, seen) in enumerate(results):
        assert right and barriers == 6 * per_round, (r, barriers)
        parts = [even_split(min(16384, n - c0), world_size) for c0 in range(0, n, 16384)]
        assert across_barriers == 12 and seen == [b[r + 1] - b[r] for b in parts], (r, across_barriers, seen)


def _switched_paths(world, n):
    g = world.group()
    out = []
    for pair_oneshot in (False, True, False):
        g.config = dataclasses.replace(g.config, pair_oneshot=pair_oneshot)
        out.append(_barriers_and_result(world, g, n))
    return out


def test_a_config_set_on_the_group_between_calls_picks_the_next_all_reduces_path():
    """``bench_collectives`` times one-shot and reduce-scatter + all-gather in the same processes by setting
    ``group.config`` on every member between calls: each call must take the path of the config it finds."""
    n = 5 * 16384 + 7  # six 64 KiB chunks: 6 barriers one-shot, 12 as reduce-scatter + all-gather
    for r, got in enumerate(launch(_switched_paths, 2, n, start_method="fork", runtime=SMALL)):
        assert got == [(12, True), (6, True), (12, True)], (r, got)


def _bitwise_identical(world):
    """Every rank must get the *same bits* (canonical fold order), else replicas drift apart.

    Compared as integers: ``torch.equal`` takes -0.0 for +0.0. The one-shot sizes matter most: there
    members 0 and 1 add the other's contribution onto their own (``x1 + x0`` on member 1), which is
    only safe for a commutative operation; max/min of +0.0 and -0.0 depend on the operand order, so
    every member's input holds zeros of its own sign.
    """
    g = world.group()
    out = []
    for dtype, bits in ((torch.float32, torch.int32), (torch.float64, torch.int64)):
        for op in ("sum", "mean", "max", "min"):
            for n in (5, 1000, 3000, 70_000):  # one-shot (<= 4 KiB here; a pair's in 64 KiB chunks) and RS + AG
                x = make(world.rank, n, dtype)
                x[::3] = 0.0 if world.rank % 2 == 0 else -0.0
                g.all_reduce(x, op)
                out.append((dtype, op, n, x.view(bits)))
    return out


@pytest.mark.parametrize("world_size, pair_oneshot", [(2, True), (2, False), (3, True), (4, True)])
def test_results_are_bitwise_identical_on_every_rank(world_size, pair_oneshot):
    config = RuntimeConfig(timeout_s=60, group=GroupConfig(slot_bytes=64 << 10, oneshot_max_bytes=4 << 10,
                                                           pair_oneshot=pair_oneshot))
    results = launch(_bitwise_identical, world_size, start_method="fork", runtime=config)
    for r in range(1, world_size):
        for (dtype, op, n, a), (_, _, _, b) in zip(results[0], results[r]):
            assert torch.equal(a, b), (r, dtype, op, n)


@pytest.mark.parametrize("dtype, bits", [(torch.float32, torch.int32), (torch.float64, torch.int64),
                                         (torch.bfloat16, torch.int16), (torch.float16, torch.int16)])
def test_a_mean_divides_by_a_power_of_two_to_the_same_bits_as_a_division(dtype, bits):
    """``divide_`` multiplies by ``1 / size`` where that is exact (a power of two) and divides otherwise: every
    bit pattern of the dtype -- subnormals, infinities, signed zeros, the largest values -- must come out as
    ``x / size`` does (NaNs as NaN). At sizes 3, 5, 6, 7 a multiplication would differ in the last bit."""
    g = torch.Generator().manual_seed(0)
    info = torch.iinfo(bits)
    x = torch.randint(info.min, info.max, (200_000,), generator=g, dtype=torch.int64).to(bits).view(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), torch.finfo(dtype).max, torch.finfo(dtype).tiny,
                             torch.finfo(dtype).tiny / 3, -torch.finfo(dtype).tiny / 7], dtype=dtype)
    x = torch.cat([x, specials])
    for size in range(1, 9):
        got, want = divide_(x.clone(), size), x / size
        assert torch.equal(got.isnan(), want.isnan()), size
        keep = ~want.isnan()
        assert torch.equal(got[keep].view(bits), want[keep].view(bits)), (dtype, size)


def _non_contiguous(world):
    g = world.group()
    x = make(world.rank, 60, torch.float32).view(6, 10).t()  # non-contiguous
    g.all_reduce(x, "sum")
    ref = reference("sum", [make(r, 60, torch.float32) for r in range(world.size)]).float().view(6, 10).t()
    return bool(torch.allclose(x, ref))


def test_non_contiguous_tensor_is_reduced_in_place():
    assert launch(_non_contiguous, 2, start_method="fork") == [True, True]


def _errors(world):
    g = world.group()
    out = []
    for call in (lambda: g.all_reduce(torch.arange(3), "mean"),
                 lambda: g.all_reduce(torch.ones(3), "median"),
                 lambda: g.broadcast(torch.ones(3), src_member=5),
                 lambda: g.reduce_scatter(torch.ones(10), out=torch.empty(2)),
                 lambda: g.all_reduce(torch.ones(3, dtype=torch.complex64), "max")):
        try:
            call()
            out.append("no error")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    return out


def test_bad_arguments_raise_before_communicating():
    msgs = launch(_errors, 2, start_method="fork")[0]
    assert "mean of an integer tensor" in msgs[0]
    assert "median" in msgs[1]
    assert "src_member must be a member index in [0, 2), got 5" in msgs[2]
    assert "5 elements" in msgs[3]
    assert "max of a complex tensor (torch.complex64) is not defined: complex numbers have no order" in msgs[4]


def _inference_first(world):
    """Collectives and a channel first used under ``torch.inference_mode`` (Lightning's validation), then in
    training: the views of shared memory they cut and keep must stay writable outside it. Same sizes both
    times (the views are kept per size), large enough not to travel inline, several channel slots."""
    g = world.group()
    r, n = world.rank, 4096

    def use(late, ch):
        out = [g.all_gather_object({"r": r}), g.all_reduce(torch.ones(n) * (r + 1)), late.broadcast(torch.zeros(n) + r),
               g.all_reduce(torch.ones(3) * (r + 1)), g.all_gather(torch.zeros(2) + r)]
        for i in range(6):
            if r == 0:
                ch.send(torch.arange(float(n)) + i)
            else:
                out.append(ch.recv())
        return out

    with torch.inference_mode():
        late, ch = world.group(name="made-in-validation"), world.channel(0, 1, tag="val")
        first = use(late, ch)
    return first, use(late, ch)


def test_shared_views_cut_under_inference_mode_stay_writable_after_it():
    """Until 2026-12-03 the second use failed: "Inplace update to inference tensor outside InferenceMode"."""
    for first, later in launch(_inference_first, 2, start_method="fork"):
        for out in (first, later):
            assert out[0] == [{"r": 0}, {"r": 1}] and torch.equal(out[1], torch.full((4096,), 3.0))
            assert torch.equal(out[2], torch.zeros(4096)) and torch.equal(out[3], torch.full((3,), 3.0))
            assert torch.equal(out[4], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert [torch.equal(m, torch.arange(4096.0) + i) for i, m in enumerate(later[5:])] == [True] * 6
