"""Shared-memory communication runtime: segments, barrier, collectives, channels, topology, launcher.

Knows nothing of Lightning; every strategy of :mod:`lightning_shm` runs on it.
"""

from lightning_shm.runtime.deadlock import DeadlockError
from lightning_shm.runtime.errors import (
    BarrierTimeoutError,
    CollectiveMismatchError,
    NodeStoppedError,
    PeerAbortedError,
    PeerFailedError,
    SharedMemoryFullError,
    SHMRuntimeError,
    WorkerDiedError,
    WorkerTraceback,
)
from lightning_shm.runtime.group import Group, GroupConfig, SharedBuffer
from lightning_shm.runtime.hierarchy import NodeSpanningGroup
from lightning_shm.runtime.launcher import LaunchConfig, Launcher, launch
from lightning_shm.runtime.ops import ReduceOp, even_split
from lightning_shm.runtime.p2p import Channel, ChannelConfig
from lightning_shm.runtime.rail import NodeLayout, Rail, connect_rail
from lightning_shm.runtime.segment import Segment, sweep_stale
from lightning_shm.runtime.topology import Coords, ParallelGroups, Topology
from lightning_shm.runtime.wait import WaitPolicy
from lightning_shm.runtime.world import RuntimeConfig, World

__all__ = [
    "BarrierTimeoutError", "Channel", "ChannelConfig", "CollectiveMismatchError", "Coords", "DeadlockError", "Group",
    "GroupConfig", "LaunchConfig", "Launcher", "NodeLayout", "NodeSpanningGroup", "NodeStoppedError", "ParallelGroups",
    "PeerAbortedError", "PeerFailedError", "Rail", "ReduceOp", "RuntimeConfig",
    "SHMRuntimeError", "Segment", "SharedBuffer", "SharedMemoryFullError", "Topology", "WaitPolicy",
    "WorkerDiedError", "WorkerTraceback", "World", "connect_rail", "even_split", "launch", "sweep_stale",
]
