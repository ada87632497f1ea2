"""Oversubscription: W=4 (and 8) processes on 2 cores must neither deadlock nor collapse."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_shm.runtime import GroupConfig, RuntimeConfig, launch

CFG = RuntimeConfig(timeout_s=120, group=GroupConfig(slot_bytes=64 << 10, oneshot_max_bytes=4 << 10))


def _mixed(world, n_ops):
    """Every check depends on the other ranks' data, so a collective that does nothing fails it."""
    g = world.group()
    sub = world.group([r for r in range(world.size) if r % 2 == world.rank % 2])  # two disjoint subgroups
    seen = g.alloc_shared(1, torch.int64, tag="arrivals")  # each rank's count of barriers passed
    rng = random.Random(1234)  # same sequence of ops on every rank
    checks = 0
    for i in range(n_ops):
        kind = rng.choice(["ar", "ar_big", "bc", "ag", "rs", "bar", "sub", "obj"])
        n = rng.choice([1, 17, 3000, 40_000])
        if kind == "ar":
            x = torch.full((n,), float(world.rank + 1))
            g.all_reduce(x)
            checks += bool((x == world.size * (world.size + 1) / 2).all())
        elif kind == "ar_big":
            x = torch.full((50_000,), float(world.rank + 1))
            g.all_reduce(x, "mean")
            checks += bool((x == (world.size + 1) / 2).all())
        elif kind == "bc":
            x = torch.full((n,), float(world.rank))
            g.broadcast(x, src_member=i % world.size)
            checks += bool((x == i % world.size).all())
        elif kind == "ag":
            out = g.all_gather(torch.full((n,), world.rank, dtype=torch.int64))
            checks += bool((out[:, 0] == torch.arange(world.size)).all())
        elif kind == "rs":
            out = g.reduce_scatter(torch.ones(n * world.size), "sum")
            checks += bool((out == world.size).all())
        elif kind == "bar":  # after a barrier every rank has announced its arrival at it
            seen.local += 1
            g.barrier()
            checks += all(int(seen.region(j)) >= int(seen.local) for j in range(world.size))
            g.barrier()  # nobody announces the next arrival before everyone has checked this one
        elif kind == "sub":
            x = torch.ones(n)
            sub.all_reduce(x)
            checks += bool((x == sub.size).all())
        else:
            src = i % world.size
            checks += g.broadcast_object((i, world.rank), src_member=src) == (i, src)
    return checks


@pytest.mark.parametrize("world_size", [4, 8])
def test_thousand_mixed_collectives_oversubscribed(world_size):
    n_ops = 1000
    assert launch(_mixed, world_size, n_ops, start_method="fork", runtime=CFG) == [n_ops] * world_size
