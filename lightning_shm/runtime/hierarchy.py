"""A process group spanning nodes: shared memory inside each node, one rail per rank between them.

Members are ordered node by node (member ``node * L_g + i`` is member ``i`` of the group's part on
``node``), so everything above sees one group with the same interface as :class:`Group`. Each
collective runs inside the node first and crosses nodes once per rank, on its rail::

    all_reduce (large)   shm reduce-scatter: member i of the node holds part i summed over the node
                         -> rail all-reduce of part i with the same member of every other node
                         -> shm all-gather: every member holds the global sum       (one pass each)
    all_reduce (small)   shm all-reduce, then each member's rail all-reduces the whole small tensor
    barrier              shm barrier, then the rail's: every rank of every node has arrived
    broadcast            over the rail of the source's local member, then shm from that member
    all_gather(_object)  inside the node, then of the node's results over the rail

With W ranks on each of N nodes, a data-parallel gradient all-reduce sends about 2(N-1)/N of the
gradient per node in total over the network, where running gloo on every rank sends that per rank.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from lightning_shm.runtime.group import Group, SharedBuffer
from lightning_shm.runtime.ops import ReduceOp, check_reducible, divide_
from lightning_shm.runtime.rail import Rail


class NodeSpanningGroup:
    """``local`` (this node's members, shared memory) x ``rail`` (this rank's peers on the other nodes)."""

    def __init__(self, local: Group, rail: Rail) -> None:
        self.local, self.rail = local, rail
        self.nodes, self.node = rail.size, rail.index
        L = rail.layout.local_size
        self.size = local.size * self.nodes
        self.index = self.node * local.size + local.index
        self.ranks = tuple(n * L + r for n in range(self.nodes) for r in local.ranks)
        self.global_rank = local.global_rank + self.node * L
        self.traffic = local.traffic

    def __repr__(self) -> str:
        return f"NodeSpanningGroup(ranks={list(self.ranks)}, index={self.index})"

    def __deepcopy__(self, memo: dict) -> "NodeSpanningGroup":
        return self

    # ------------------------------------------------------------------ shared buffers: the node's
    def alloc_shared(self, numel: int, dtype: torch.dtype = torch.float32, tag: str = "buf") -> SharedBuffer:
        return self.local.alloc_shared(numel, dtype, tag)

    def release_shared(self, buf: SharedBuffer) -> None:
        self.local.release_shared(buf)

    def alloc_common(self, numel: int, dtype: torch.dtype = torch.float32, tag: str = "common") -> torch.Tensor:
        return self.local.alloc_common(numel, dtype, tag)

    # ------------------------------------------------------------------ collectives
    def barrier(self, untimed: bool = False, why: int = 0) -> None:
        self.local.barrier(untimed, why)
        self.rail.barrier(untimed)

    def vote_max(self, value: int, why: int = 0) -> int:
        mine = torch.tensor([self.local.vote_max(value, why)], dtype=torch.int64)
        self.rail.all_reduce(mine, ReduceOp.MAX)
        return int(mine)

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        op = ReduceOp.parse(op)
        check_reducible(tensor.dtype, op)
        node_op = ReduceOp.SUM if op in (ReduceOp.SUM, ReduceOp.MEAN) else op
        self.local.all_reduce(tensor, node_op, across=lambda part: self.rail.all_reduce(part, node_op))
        if op == ReduceOp.MEAN:
            divide_(tensor, self.size)
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, op: Any = "sum", out: Optional[torch.Tensor] = None,
                       sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
        raise NotImplementedError("a reduce-scatter over several nodes is not used: FSDP shards inside each node "
                                  "and all-reduces its part across nodes (HSDP)")

    def broadcast(self, tensor: torch.Tensor, src_member: int = 0) -> torch.Tensor:
        src_node, src_local = divmod(src_member, self.local.size)
        if self.local.index == src_local:
            flat = tensor if tensor.is_contiguous() else tensor.contiguous()
            self.rail.broadcast(flat, src_node)
            if flat is not tensor:
                tensor.copy_(flat)
        return self.local.broadcast(tensor, src_member=src_local)

    def broadcast_object(self, obj: Any, src_member: int = 0, why: int = 0) -> Any:
        src_node, src_local = divmod(src_member, self.local.size)
        if self.local.index == src_local:
            obj = self.rail.broadcast_object(obj, src_node)
        return self.local.broadcast_object(obj, src_member=src_local, why=why)

    def all_gather(self, tensor: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        node_part = self.local.all_gather(tensor)  # [local size, ...]
        full = self.rail.all_gather(node_part).reshape(self.size, *tensor.shape)  # node by node
        if out is not None:
            out.copy_(full)
            return out
        return full

    def all_gather_v(self, tensor: torch.Tensor, why: int = 0) -> list[torch.Tensor]:
        return [t for part in self.rail.all_gather_object(self.local.all_gather_v(tensor, why)) for t in part]

    def all_gather_object(self, obj: Any, why: int = 0) -> list[Any]:
        return [o for part in self.rail.all_gather_object(self.local.all_gather_object(obj, why)) for o in part]
