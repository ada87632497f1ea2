"""The Lightning/torchmetrics-facing collectives on their own: reduce ops, all_gather, metric gathering."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_shm.runtime import ReduceOp, launch
from lightning_shm.strategies.collectives import all_gather, gather_all_tensors, reduce


def test_reduce_op_accepts_strings_and_torch_reduce_ops():
    assert ReduceOp.parse("avg") == ReduceOp.MEAN
    for op, ours in ((dist.ReduceOp.SUM, ReduceOp.SUM), (dist.ReduceOp.MAX, ReduceOp.MAX),
                     (dist.ReduceOp.MIN, ReduceOp.MIN), (dist.ReduceOp.AVG, ReduceOp.MEAN)):
        assert ReduceOp.parse(op) == ours


def _lightning_collectives(world):
    g = world.group()
    r = world.rank
    out = {
        "mean": float(reduce(g, torch.tensor(float(r)), "mean")),
        "sum_op": float(reduce(g, torch.tensor(float(r + 1)), dist.ReduceOp.SUM)),
        "int_mean": float(reduce(g, torch.tensor(r + 1), "mean")),  # integers average to a float
        "bool_sum": int(reduce(g, torch.tensor(True), "sum")),
        "not_a_tensor": reduce(g, "text", "sum"),
        "stacked": all_gather(g, torch.tensor([r, 10 * r])).tolist(),
        "scalar_stacked": all_gather(g, torch.tensor(float(r))).tolist(),
    }
    # torchmetrics' gather_all_tensors contract: one tensor per rank, shapes may differ per rank
    parts = gather_all_tensors(g, torch.full((r + 1, 2), float(r)))
    out["ragged"] = [tuple(p.shape) for p in parts]
    out["ragged_values"] = [float(p.mean()) for p in parts]
    return out


def test_reduce_all_gather_and_ragged_metric_states():
    res = launch(_lightning_collectives, 3, start_method="fork")
    for out in res:
        assert out["mean"] == 1.0 and out["sum_op"] == 6.0 and out["int_mean"] == 2.0 and out["bool_sum"] == 3
        assert out["not_a_tensor"] == "text"
        assert out["stacked"] == [[0, 0], [1, 10], [2, 20]] and out["scalar_stacked"] == [0.0, 1.0, 2.0]
        assert out["ragged"] == [(1, 2), (2, 2), (3, 2)] and out["ragged_values"] == [0.0, 1.0, 2.0]
