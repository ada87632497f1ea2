"""Point-to-point channels (pipeline transport), the dp x tp x pp grid, and the thread budget."""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch

from lightning_shm.runtime import BarrierTimeoutError, ChannelConfig, RuntimeConfig, Topology, launch
from lightning_shm.runtime.launcher import _fork_safe_threads
from lightning_shm.runtime.world import thread_budget

SMALL_CH = RuntimeConfig(channel=ChannelConfig(slots=2, slot_bytes=4096))


def _ping_pong(world):
    fwd = world.channel(0, 1, "act")
    bwd = world.channel(1, 0, "grad")
    shapes = [(), (0,), (3,), (2, 3, 4), (5000,), (7, 1000)]  # 0-d, empty, multi-fragment (>4 KiB slots)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    received = []
    for i, shape in enumerate(shapes):
        for dt in dtypes:
            t = (torch.arange(int(torch.tensor(shape).prod()) if shape else 1) % 3 + i).reshape(shape).to(dt)
            if world.rank == 0:
                fwd.send(t)
                back = bwd.recv()
                received.append(torch.equal(back, t * 2 if dt != torch.bool else t))
            else:
                got = fwd.recv()
                received.append(got.shape == t.shape and got.dtype == dt and torch.equal(got, t))
                bwd.send(got * 2 if dt != torch.bool else got)
    return received


def test_channels_carry_shape_dtype_and_any_size():
    r0, r1 = launch(_ping_pong, 2, start_method="fork", runtime=SMALL_CH)
    assert all(r0) and all(r1) and len(r0) == 24


def _objects(world):
    """Tuples arrive as tuples (a 1-tuple too), lone tensors as tensors, a part larger than a slot in
    fragments, with lone tensors before and after on the same channel. Some require a gradient (one with a
    graph behind it, one in fragments); the received copy into ``out`` keeps ``out``'s flag."""
    ch = world.channel(0, 1, "objects")
    w = torch.ones(2, 2, requires_grad=True)
    sent = [torch.ones(3), (torch.arange(5000.0, requires_grad=True), torch.tensor([1, 0, 1])), (w * 3,),
            (torch.full((4,), 7.0), torch.tensor(True), torch.empty(0)), torch.tensor(2.5, requires_grad=True),
            torch.ones(3, requires_grad=True)]
    if world.rank == 0:
        for obj in sent:
            ch.send_obj(obj)
        return [tuple(t.detach().requires_grad_(t.requires_grad) for t in o) if isinstance(o, tuple)
                else o.detach().requires_grad_(o.requires_grad) for o in sent]
    got = [ch.recv_obj() for _ in sent[:-1]]
    return got + [ch.recv(out=torch.zeros(3))]


def test_channels_carry_tuples_of_tensors_as_tuples_and_whether_each_requires_a_gradient():
    sent, got = launch(_objects, 2, start_method="fork", runtime=SMALL_CH)
    assert [type(o) for o in got] == [type(o) for o in sent]
    flags = []
    for a, b in zip(sent[:-1], got[:-1]):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert x.dtype == y.dtype and torch.equal(x, y)
            assert y.requires_grad == x.requires_grad and y.is_leaf
            flags.append(y.requires_grad)
    assert flags == [False, True, False, True, False, False, False, True]
    assert torch.equal(got[-1], sent[-1].detach()) and not got[-1].requires_grad
    assert [len(o) for o in got if isinstance(o, tuple)] == [2, 1, 3]


def _stream(world):
    """The sender runs ahead by up to `slots` messages: no lock-step, no world barrier."""
    ch = world.channel(0, 1, "stream")
    n = 500
    if world.rank == 0:
        for i in range(n):
            ch.send(torch.full((10,), float(i)))
        return ch.bytes_sent
    return [float(ch.recv()[0]) for _ in range(n)]


def test_channel_preserves_order_under_streaming():
    sent, got = launch(_stream, 2, start_method="fork", runtime=SMALL_CH)
    assert got == [float(i) for i in range(500)] and sent == 500 * 40


class _Twice(torch.autograd.Function):
    """x * 2 whose graph node can be watched with a weakref."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _reuse(world):
    """Messages of one shape through a ring of 2 slots: each slot is reused while earlier messages are held.
    A message that is part of a graph (as a stage's output is) must not tie that graph to the slot: it arrives as
    a new leaf requiring a gradient (``out`` keeps its own flag)."""
    ch = world.channel(0, 1, "reuse")
    n = 6
    if world.rank == 0:
        graphs = []
        for i in range(n):
            t = torch.arange(12.0).reshape(3, 4) + 100 * i
            if i % 3 == 1:
                t = t.t().contiguous().t()  # same values, column-major: not contiguous
            elif i % 3 == 2:
                t = _Twice.apply((t / 2).requires_grad_(True))
                graphs.append(weakref.ref(t.grad_fn))
            ch.send(t)
            del t
        gc.collect()
        return [g() is None for g in graphs]  # each graph freed once the caller dropped it
    held = [ch.recv() for _ in range(n - 1)]
    out = torch.empty(3, 4)
    last = ch.recv(out=out)
    return [torch.equal(h.detach(), torch.arange(12.0).reshape(3, 4) + 100 * i) and h.is_contiguous() and h.is_leaf
            and h.requires_grad == (i % 3 == 2 and h is not last) for i, h in enumerate(held + [last])] + [last is out]


def test_received_messages_are_copies_that_outlive_the_slot():
    """recv copies out of a view of the slot cut once per shape; what it returns must never be that view
    (the sender refills the slot two messages later). send keeps no graph alive through the slot's view."""
    freed, got = launch(_reuse, 2, start_method="fork", runtime=SMALL_CH)
    assert got == [True] * 7
    assert freed == [True, True]


def _same_slot_other_header(world):
    """Messages through one slot whose headers differ from the slot's previous message in one word only: the
    sender keeps a slot's header when its last message wrote the same words, so a header left stale would show
    here as a wrong shape, dtype, tuple or gradient flag."""
    ch = world.channel(0, 1, "headers", ChannelConfig(slots=1, slot_bytes=4096))
    base = torch.arange(12.0).reshape(3, 4)
    sent = [base, base.reshape(4, 3), base.reshape(12), base.view(torch.int32).reshape(3, 4),
            base.clone().requires_grad_(True), (base, base + 1), base + 2,
            torch.arange(3000.0), base + 3, torch.empty(0, 4), base + 4, base.to(torch.float64)[:2]]
    if world.rank == 0:
        for obj in sent:
            ch.send_obj(obj)
        return None
    got = [ch.recv_obj() for _ in sent]
    ok = []
    for a, b in zip(sent, got):
        a = a if isinstance(a, tuple) else (a,)
        b = b if isinstance(b, tuple) else (b,)
        ok.append(len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.detach(), y)
                                           and x.requires_grad == y.requires_grad for x, y in zip(a, b)))
    return ok


def test_a_slot_reused_by_a_message_with_another_header_delivers_that_message():
    _, ok = launch(_same_slot_other_header, 2, start_method="fork", runtime=RuntimeConfig(timeout_s=5.0))
    assert ok == [True] * 12


def _many_kinds(world):
    """More kinds of message than an end keeps plans for: each end's cache stays bounded (emptied when full and
    refilled), and every message still arrives as sent."""
    ch = world.channel(0, 1, "kinds", ChannelConfig(slots=2, slot_bytes=4096))
    sent = [torch.arange(float(k)).reshape(1, k) if k % 2 else torch.arange(k) for k in range(1, 150)]
    sent += sent[:5]
    if world.rank == 0:
        for t in sent:
            ch.send(t)
        return len(ch._sends), []
    ok = [torch.equal(ch.recv(), t) for t in sent]
    return len(ch._recvs), ok


def test_channels_keep_a_bounded_plan_per_kind_of_message_and_deliver_them_all():
    (sends, _), (recvs, ok) = launch(_many_kinds, 2, start_method="fork", runtime=RuntimeConfig(timeout_s=5.0))
    assert ok == [True] * 154
    assert 0 < sends <= 64 and 0 < recvs <= 64, (sends, recvs)


def _wrong_end(world):
    """Each end calls the other end's method: both must refuse at once, before touching the ring."""
    ch = world.channel(0, 1)
    t0 = time.monotonic()
    try:
        ch.recv() if world.rank == 0 else ch.send(torch.ones(1))
    except BarrierTimeoutError as e:  # a missing guard would wait for a message that never comes
        return f"waited: {e}", time.monotonic() - t0
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_channel_wrong_end_raises_on_both_ends():
    (m0, t0), (m1, t1) = launch(_wrong_end, 2, start_method="fork", runtime=RuntimeConfig(timeout_s=2.0))
    assert m0 == "rank 0 is the sending end of channel 0->1" and t0 < 1.0
    assert m1 == "rank 1 is the receiving end of channel 0->1" and t1 < 1.0


def test_topology_layout_and_groups():
    topo = Topology(world_size=8, dp=2, tp=2, pp=2)
    assert topo.tp_ranks(5) == [4, 5]
    assert topo.dp_ranks(5) == [5, 7]
    assert topo.pp_ranks(5) == [1, 5]
    assert [topo.rank_of(**vars(topo.coords(r))) for r in range(8)] == list(range(8))
    assert Topology.infer(4, tp=2) == Topology(4, dp=2, tp=2, pp=1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=4, dp=2, tp=3, pp=1), r"world_size=4 must equal dp\*tp\*pp = 2\*3\*1 = 6"),
        (dict(world_size=4, dp=0, tp=2, pp=2), r"positive int.*'dp': 0"),
    ],
)
def test_bad_grid_names_every_size(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_infer_rejects_indivisible_devices():
    with pytest.raises(ValueError, match=r"devices \(world_size=6\) must be divisible by tp\*pp = 4\*1 = 4"):
        Topology.infer(6, tp=4)


def _groups(world):
    pg = Topology(world_size=4, dp=2, tp=2).groups(world)
    x = torch.tensor([float(world.rank)])
    pg.tp.all_reduce(x)
    y = torch.tensor([float(world.rank)])
    pg.dp.all_reduce(y)
    return pg.coords, float(x), float(y)


def test_topology_groups_reduce_over_the_right_ranks():
    res = launch(_groups, 4, start_method="fork")
    assert [r[1] for r in res] == [1.0, 1.0, 5.0, 5.0]  # tp groups {0,1} {2,3}
    assert [r[2] for r in res] == [2.0, 4.0, 2.0, 4.0]  # dp groups {0,2} {1,3}


def _threads(world):
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_thread_budget_is_cores_over_world_unless_user_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert [thread_budget(w) for w in (1, 2, 4)] == [max(1, cores // w) for w in (1, 2, 4)]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert thread_budget(2) == 3
    assert launch(_threads, 2, start_method="spawn") == [(3, "3")] * 2


def _probe(world):
    return os.environ.get("LSHM_PROBE"), torch.get_num_threads()


def test_fork_server_workers_see_the_environment_of_each_launch_and_use_threads(monkeypatch):
    """The fork server (started once, by whichever launch came first) has an old environment; each
    launch's workers must see the main process's environment as it is then (Lightning passes the
    seed as PL_GLOBAL_SEED), and -- unlike forked workers -- their full thread budget."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    for value in ("first", "second"):
        monkeypatch.setenv("LSHM_PROBE", value)
        assert launch(_probe, 2, start_method="forkserver") == [(value, 2)] * 2


def test_forked_workers_are_single_threaded(monkeypatch):
    """libgomp hangs in a child forked after the parent's OpenMP pool started (seen: a mul kernel)."""
    assert _fork_safe_threads(4) == 1 and _fork_safe_threads(1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    (torch.randn(4_000_000) * 2).sum()  # start the parent's OpenMP pool
    assert launch(_threads, 1, start_method="fork") == [(1, "1")]
