"""The dp x tp x pp grid: which ranks form which group.

Rank layout (tp fastest, then dp, then pp -- Megatron's order, so a tensor-parallel group is a block
of neighbouring ranks)::

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

    W=8, pp=2, dp=2, tp=2:   stage 0: [0 1] [2 3]    stage 1: [4 5] [6 7]
                                      tp     tp               tp     tp
    tp groups {0,1} {2,3} {4,5} {6,7}; dp groups {0,2} {1,3} {4,6} {5,7}; pp groups {0,4} {1,5} {2,6} {3,7}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from lightning_shm.runtime.group import Group
    from lightning_shm.runtime.rail import Rail
    from lightning_shm.runtime.world import World


@dataclass(frozen=True)
class Coords:
    dp: int
    tp: int
    pp: int


@dataclass(frozen=True)
class Topology:
    """A validated grid; ``world_size`` must equal ``dp * tp * pp``."""

    world_size: int
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        sizes = {"world_size": self.world_size, "dp": self.dp, "tp": self.tp, "pp": self.pp}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
        if bad:
            raise ValueError(f"every grid size must be a positive int, got {bad} (all sizes: {sizes})")
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(
                f"world_size={self.world_size} must equal dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = "
                f"{self.dp * self.tp * self.pp}"
            )

    @classmethod
    def infer(cls, world_size: int, tp: int = 1, pp: int = 1) -> "Topology":
        """dp = world_size / (tp * pp); a clear error when it does not divide."""
        for name, v in (("world_size", world_size), ("tp", tp), ("pp", pp)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r} "
                                 f"(world_size={world_size}, tp={tp}, pp={pp})")
        if world_size % (tp * pp):
            raise ValueError(
                f"devices (world_size={world_size}) must be divisible by tp*pp = {tp}*{pp} = {tp * pp}"
            )
        return cls(world_size, world_size // (tp * pp), tp, pp)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coords(dp=dp, tp=tp, pp=pp)

    def rank_of(self, dp: int, tp: int, pp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def tp_ranks(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank_of(c.dp, t, c.pp) for t in range(self.tp)]

    def dp_ranks(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank_of(d, c.tp, c.pp) for d in range(self.dp)]

    def pp_ranks(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank_of(c.dp, c.tp, p) for p in range(self.pp)]

    def replica_ranks(self, rank: int) -> list[int]:
        """The ranks computing one model replica with ``rank`` (every tp member of every stage): they must
        compute on the same batch. Its first member is stage 0's first tp member."""
        c = self.coords(rank)
        return [self.rank_of(c.dp, t, p) for p in range(self.pp) for t in range(self.tp)]

    def groups(self, world: "World", rail: Optional["Rail"] = None) -> "ParallelGroups":
        """This rank's dp, tp and pp groups (each member calls; groups are created on first use).

        This grid is one node's. With a ``rail`` (several nodes) the world and the data-parallel groups
        span every node -- the same grid on each, replicas across -- while tp and pp stay inside it."""
        if world.size != self.world_size:
            raise ValueError(f"topology is for {self.world_size} ranks, world has {world.size}")
        r = world.rank
        node_world, node_dp = world.group(), world.group(self.dp_ranks(r))
        if rail is None:
            world_group, dp, nodes, node = node_world, node_dp, 1, 0
        else:
            from lightning_shm.runtime.hierarchy import NodeSpanningGroup

            world_group, dp = NodeSpanningGroup(node_world, rail), NodeSpanningGroup(node_dp, rail)
            nodes, node = rail.size, rail.index
        return ParallelGroups(
            topology=self,
            coords=self.coords(r),
            world=world_group,
            dp=dp,
            tp=world.group(self.tp_ranks(r)),
            pp=world.group(self.pp_ranks(r)),
            replica=world.group(self.replica_ranks(r)),
            node_dp=node_dp,
            rail=rail,
            nodes=nodes,
            node=node,
        )


@dataclass(frozen=True)
class ParallelGroups:
    """One rank's groups. ``world`` and ``dp`` span every node (``nodes`` > 1: node by node); ``node_dp`` is
    this node's part of ``dp``, ``rail`` this rank's link to the other nodes (None on one node)."""

    topology: Topology
    coords: Coords
    world: Any
    dp: Any
    tp: "Group"
    pp: "Group"
    replica: "Group"  # tp x pp: the ranks sharing one batch (the same group as tp or pp where the other is 1)
    node_dp: "Group"
    rail: Optional["Rail"] = None
    nodes: int = 1
    node: int = 0

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas over all nodes."""
        return self.topology.dp * self.nodes

    @property
    def dp_index(self) -> int:
        return self.node * self.topology.dp + self.coords.dp
