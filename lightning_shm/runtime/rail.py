"""Between machines: a "rail" of torch.distributed (gloo) connecting the ranks with the same local rank.

Inside a node every byte moves through shared memory. Across nodes, rank ``k`` of every node forms
rail ``k`` (global ranks ``k, L + k, 2L + k, ...`` for L ranks per node): a hierarchical collective
first combines inside the node, then each rank exchanges only its own share over its rail, so a
node puts about one copy of the data on the network instead of one per rank::

    node 0: ranks 0 1 2 3   --rail 0: 0 <-> 4--  node 1: ranks 4 5 6 7
                            --rail 1: 1 <-> 5--
                            ...

Each worker of a run that spans several nodes creates its own rail's gloo process group directly
(a ``ProcessGroupGloo`` over a prefix of one TCP store), never torch.distributed's default group:
with that initialised, Lightning and torchmetrics would start running collectives of their own
over it (Lightning broadcasts a SIGTERM flag over all ranks every training batch). Every rail
operation turns a failure of the other side (a peer whose node stopped: connection closed,
timeout) into :class:`~lightning_shm.runtime.errors.NodeStoppedError` naming the node.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from lightning_shm.runtime.errors import NodeStoppedError
from lightning_shm.runtime.ops import ReduceOp


@dataclass(frozen=True)
class NodeLayout:
    """``nodes`` machines of ``local_size`` ranks each; this process is ``local_rank`` on ``node``."""

    nodes: int
    node: int
    local_size: int
    local_rank: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or not 0 <= self.node < self.nodes or not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"bad node layout {self}")

    @property
    def global_rank(self) -> int:
        return self.node * self.local_size + self.local_rank

    @property
    def world_size(self) -> int:
        return self.nodes * self.local_size


class Rail:
    """This rank's rail: the same local rank on every node, over its own gloo process group."""

    def __init__(self, layout: NodeLayout, pg: Any, store: Any = None, untimed_pg: Any = None) -> None:
        self.layout, self._pg, self._untimed_pg = layout, pg, untimed_pg if untimed_pg is not None else pg
        self._store = store  # kept alive with the rail (on global rank 0 it serves every rank's rendezvous)
        self.size, self.index = layout.nodes, layout.node
        self.ranks = [n * layout.local_size + layout.local_rank for n in range(layout.nodes)]
        self.bytes_sent = 0  # bytes handed to gloo collectives (what crosses the network, before the algorithm)

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as e:  # gloo: connection closed / reset / timed out by a peer that is gone
            others = [n for n in range(self.size) if n != self.index]
            raise NodeStoppedError(
                f"node {others[0] if len(others) == 1 else others} stopped: the {what} on rail "
                f"{self.layout.local_rank} (global ranks {self.ranks}) failed on node {self.index}: {e}"
            ) from None

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX,
                         ReduceOp.MIN: dist.ReduceOp.MIN}[op]
        self.bytes_sent += tensor.numel() * tensor.element_size()
        with self._guard("all_reduce"):
            self._pg.allreduce([tensor], opts).wait()

    def broadcast(self, tensor: torch.Tensor, src_node: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src_node, 0
        if self.index == src_node:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        with self._guard("broadcast"):
            self._pg.broadcast([tensor], opts).wait()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.bytes_sent += tensor.numel() * tensor.element_size()
        with self._guard("all_gather"):
            self._pg.allgather([out], [tensor.contiguous()]).wait()
        return torch.stack(out)

    def barrier(self, untimed: bool = False) -> None:
        """``untimed``: on the rail's second process group, whose timeout is 10,000 days (Lightning's infinite
        barrier): a gloo wait cannot outlast its group's timeout, and a group cannot be made when needed (its
        rendezvous would wait on the store's timeout for the late node). A peer that stops still ends it."""
        with self._guard("barrier"):
            (self._untimed_pg if untimed else self._pg).barrier().wait()

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([data.numel()], dtype=torch.int64)).view(-1).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        parts = self.all_gather(padded)
        return [pickle.loads(parts[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]

    def broadcast_object(self, obj: Any, src_node: int) -> Any:
        return self.all_gather_object(obj if self.index == src_node else None)[src_node]


def connect_rail(layout: NodeLayout, address: str, port: int, timeout_s: float,
                 say: Callable[[str], None] = lambda _: None, every_s: float = 30.0) -> Rail:
    """This rank's rail: a gloo process group with the same local rank of every node, rendezvous through
    the TCP store that global rank 0 hosts at ``address:port`` (one store, one key prefix per rail).

    The rendezvous waits up to ``timeout_s`` (the strategies': 30 minutes) for every node's ranks: a node not
    started (``num_nodes=2`` given to a run started once), another address or port. ``say`` hears where this
    rank waits, every ``every_s`` while it still does, and a timeout's error carries the same note -- a silent
    half hour before torch's "Timed out after 1801 seconds waiting for clients" was all there was."""
    timeout = datetime.timedelta(seconds=timeout_s)
    where = (f"{address}:{port}, the TCP store global rank 0 hosts (MASTER_ADDR / MASTER_PORT); every node runs "
             f"this script with its NODE_RANK, 0 to {layout.nodes - 1}")
    say(f"node {layout.node} of {layout.nodes}: meeting the other nodes' ranks at {where}")
    start, met = time.monotonic(), threading.Event()

    def remind() -> None:
        while not met.wait(every_s):
            waited = time.monotonic() - start
            say(f"node {layout.node} of {layout.nodes}: still waiting for the other nodes ({waited:.0f} s; the "
                f"timeout is {timeout_s:.0f} s) at {where}")

    threading.Thread(target=remind, name="lightning_shm-rail-reminder", daemon=True).start()
    try:
        store = dist.TCPStore(address, port, layout.world_size, layout.global_rank == 0, timeout=timeout)
        prefix = f"lightning_shm/rail{layout.local_rank}"
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), layout.node, layout.nodes, timeout)
        untimed = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/untimed", store), layout.node, layout.nodes,
                                        datetime.timedelta(days=10000))
    except Exception as e:
        e.add_note(f"node {layout.node} of {layout.nodes} did not meet the other nodes within {timeout_s:.0f} s at "
                   f"{where}.")
        raise
    finally:
        met.set()
    return Rail(layout, pg, store, untimed)
