"""The worker-side handle of a run: rank, world size, groups, shared buffers, channels.

There is no global process group. A :class:`World` is created by the launcher in each worker and
passed to whatever needs it; a :class:`~lightning_shm.runtime.group.Group` is obtained from it and
passed on to reducers, layers and schedules.

Shared memory is requested from the main process, which alone creates and unlinks segments
(get-or-create by key): every member of a group asks for ``"group/0-1"`` and gets the same segment,
so groups, buffers and channels can be created at any time by just the ranks involved -- no world
collective, no pre-declared layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Optional, Sequence

from lightning_shm.runtime.deadlock import WaitBoard
from lightning_shm.runtime.group import Group, GroupConfig
from lightning_shm.runtime.messages import recv, send
from lightning_shm.runtime.p2p import Channel, ChannelConfig
from lightning_shm.runtime.segment import Segment
from lightning_shm.runtime.wait import Waiter, WaitPolicy

# The control segment (created by the main process), one 128-byte row per writer, one writer per word:
#   row 0      [abort code, stop request]   written by the main process
#   row 1 + r  [stop request of rank r,     written by worker r (it received SIGTERM itself)
#               whom rank r waits for]      (see deadlock.py)
#   after the rows, word r: 1 once rank r polls for stop requests  written by worker r
# A stop request is a signal number; workers agree on it at a safe point (see World.stop_requested).
CONTROL_ROW_WORDS = 16
ABORT_WORD = 0
STOP_WORD = 1


def polls_word(rank: int, world_size: int) -> int:
    """The control word rank ``rank`` sets the first time it polls for stop requests: before that it has no
    safe point to stop at (still starting: setup, a rendezvous, a hook before the first step)."""
    return (world_size + 1) * CONTROL_ROW_WORDS + rank


def control_bytes(world_size: int) -> int:
    return max(4096, polls_word(world_size, world_size) * 8)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def thread_budget(world_size: int) -> int:
    """Threads per worker: the user's ``OMP_NUM_THREADS`` if set, else ``cores // world_size`` (>= 1)."""
    user = os.environ.get("OMP_NUM_THREADS")
    if user and user.strip().isdigit() and int(user) > 0:
        return int(user)
    return max(1, available_cores() // world_size)


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything that sizes or times the runtime; validated once, before any process starts."""

    timeout_s: float = 300.0
    group: GroupConfig = field(default_factory=GroupConfig)
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    wait: Optional[WaitPolicy] = None  # None: derived from world size vs. cores
    keep_freed_memory: bool = True  # workers reuse freed large blocks instead of faulting in fresh pages

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    def wait_policy(self, world_size: int) -> WaitPolicy:
        return self.wait or WaitPolicy.for_world(world_size, available_cores(), self.timeout_s)


class World:
    """This process's view of the run. Created by the launcher; closed when the worker ends."""

    def __init__(self, rank: int, size: int, control: Segment, conn: Optional[Connection],
                 config: RuntimeConfig) -> None:
        self.rank = rank
        self.size = size
        self.config = config
        self._control = control
        self._polls = 0  # set in the control segment once (stop_requested)
        self._conn = conn
        self._segments: dict[str, Segment] = {}
        self.waiter = Waiter(control.words(), ABORT_WORD, config.wait_policy(size))
        self.waiter.board = WaitBoard(control.words(), [(r + 1) * CONTROL_ROW_WORDS for r in range(size)], rank,
                                      CONTROL_ROW_WORDS)
        self._groups: dict[tuple[tuple[int, ...], str], Group] = {}
        self._channels: dict[tuple[int, int, str], Channel] = {}

    # ------------------------------------------------------------------ memory
    def alloc(self, key: str, nbytes: int) -> Segment:
        """Get-or-create the segment ``key`` (created by the main process) and map it here."""
        seg = self._segments.get(key)
        if seg is not None:
            if seg.size < nbytes:
                raise ValueError(f"segment {key!r} exists with {seg.size} bytes, {nbytes} requested")
            return seg
        if self._conn is None:
            raise RuntimeError("this World has no main process to allocate shared memory from")
        send(self._conn, ("alloc", key, int(nbytes)))
        status, payload = recv(self._conn)
        if status != "ok":
            raise payload
        seg = Segment.attach(payload)
        self._segments[key] = seg
        return seg

    # ------------------------------------------------------------------ groups
    def group(self, ranks: Optional[Sequence[int]] = None, name: str = "") -> Group:
        """The group of ``ranks`` (default: all). Only its members call this, all with the same arguments."""
        members = tuple(sorted(set(range(self.size) if ranks is None else ranks)))
        if not members or members[0] < 0 or members[-1] >= self.size:
            raise ValueError(f"group ranks {list(members)} must be a non-empty subset of 0..{self.size - 1}")
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not a member of group {list(members)}")
        cached = self._groups.get((members, name))
        if cached is not None:
            return cached
        key = "group/" + "-".join(map(str, members)) + (f"/{name}" if name else "")
        seg = self.alloc(key, self.config.group.segment_bytes(len(members)))
        g = Group(members, self.rank, seg, self.waiter, self.alloc, key, self.config.group)
        self._groups[(members, name)] = g
        return g

    @property
    def world_group(self) -> Group:
        return self.group()

    def channel(self, src_rank: int, dst_rank: int, tag: str = "", config: Optional[ChannelConfig] = None) -> Channel:
        """The channel from global rank ``src_rank`` to ``dst_rank``; both ends call this with the same arguments."""
        src, dst = src_rank, dst_rank
        if src == dst or not (0 <= src < self.size and 0 <= dst < self.size):
            raise ValueError(f"channel ends must be two different ranks in 0..{self.size - 1}, got {src}->{dst}")
        cfg = config or self.config.channel
        cached = self._channels.get((src, dst, tag))
        if cached is not None:
            return cached
        seg = self.alloc(f"p2p/{src}-{dst}/{tag}/{cfg.slots}x{cfg.slot_bytes}", cfg.segment_bytes())
        ch = Channel(seg, src, dst, self.rank, self.waiter, cfg)
        self._channels[(src, dst, tag)] = ch
        return ch

    # ------------------------------------------------------------------ state
    def aborted(self) -> bool:
        return self.waiter.aborted()

    def request_stop(self, signum: int) -> None:
        """Ask the run to stop at its next safe point (this worker received ``signum`` itself)."""
        w = self._control.words()
        row = (self.rank + 1) * CONTROL_ROW_WORDS
        if not w[row]:
            w[row] = int(signum)

    def stop_requested(self) -> int:
        """The signal number of a pending stop request (the main process's or any rank's), else 0.

        Ranks see a request at different moments; they act on it only after agreeing through
        :meth:`Group.vote_max` at the same point of their program. The first call marks this rank as one that
        polls (:func:`polls_word`): the main process waits for a safe point only once every rank polls.
        """
        w = self._control.words()
        if not self._polls:
            w[polls_word(self.rank, self.size)] = 1
            self._polls = 1
        seen = w[STOP_WORD]
        for r in range(self.size):
            seen = max(seen, w[(r + 1) * CONTROL_ROW_WORDS])
        return seen

    def close(self) -> None:
        """Unmap everything (the main process unlinks). Views still held elsewhere stay valid until freed."""
        self._groups.clear()
        self._channels.clear()
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        self._control.close()

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size})"
