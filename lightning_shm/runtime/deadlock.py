"""Ranks waiting for each other in a cycle: a deadlock, reported in seconds instead of at the timeout.

Why: when ranks take different paths -- one enters a collective the other skips, and the other waits in a
pipeline's receive from it -- descriptors cannot tell (they are compared only inside one group's collective),
and both would wait for the run's whole timeout (30 minutes by default) before anyone says anything.

How: every blocking wait of the runtime goes through :meth:`Waiter.wait_ge`, which knows whom it waits for
(a barrier's ranks that have not arrived, a channel's other end). Once a wait reaches its sleep phase, the
rank writes that into its row of the control segment, which every worker maps::

    control row 1 + r (rank r; word 0 is its stop request, see world.py):
        [1] version  -- +1 whenever what follows changes: a rank that waits on and on keeps it
        [2] kind     -- 0 not waiting, 1 a collective (+ 16 x its op code), 2 a receive, 3 a send,
                        4 a rank that failed, waiting for the others to fail too (Group.agree_failed)
        [3..15]      -- the ranks it waits for, a bit each (62 per word)

and every ``check_s`` it follows those edges from itself. For these waits a cycle is a deadlock: a rank in a
barrier goes on only once every missing rank arrives, a receive only once its sender sends, and each rank on
the cycle is blocked behind the next one. A cycle is reported only after it has stood unchanged -- the same
version on every rank of it -- for ``deadlock_s``, seen at checks all along: a rank whose peer has just
satisfied its wait may not have woken up yet (at most one back-off sleep, ~1 ms, plus the scheduler), and for
that instant the cycle is only apparent; after the whole run was stopped (SIGSTOP, a suspended VM), one late
check must not count for the time stopped. Ranks that wait outside the runtime (user code, another node's
gloo) publish nothing, so they never make a cycle: the check can miss a deadlock (the timeout then reports
it), never invent one.
"""

from __future__ import annotations

from typing import Optional, Sequence

from lightning_shm.runtime.errors import BarrierTimeoutError
from lightning_shm.runtime.ops import op_name

VERSION, KIND, MASK0 = 1, 2, 3  # words of a rank's control row
BITS = 62  # per mask word (signed int64 words: stay clear of the sign bit)
COLLECTIVE, RECEIVE, SEND, FAILED = 1, 2, 3, 4
KIND_NAMES = {COLLECTIVE: "a collective", RECEIVE: "a receive", SEND: "a send", FAILED: "its error's handling"}


def collective(coll: int) -> int:
    """The kind word of a wait in collective ``coll`` (an op code of :mod:`.ops`)."""
    return COLLECTIVE | coll << 4


def kind_name(kind: int) -> str:
    if kind & 15 == COLLECTIVE and kind >> 4:
        return f"a collective ({op_name(kind >> 4)})"
    return KIND_NAMES.get(kind & 15, "a wait")

Snapshot = dict[int, tuple[int, int, frozenset[int]]]  # rank -> (version, kind, ranks it waits for)


class DeadlockError(BarrierTimeoutError):
    """Ranks wait for each other in a cycle (``missing``: the others on it). A :class:`BarrierTimeoutError`
    reported early: the launcher adds where each rank on the cycle was, as it does for a timeout."""


class WaitBoard:
    """This rank's published wait, and the cycle check over every rank's. ``rows[r]``: rank r's control row."""

    def __init__(self, words: memoryview, rows: Sequence[int], rank: int, row_words: int) -> None:
        self._w, self._rows, self.rank = words, list(rows), rank
        self._mask_words = row_words - MASK0
        if len(self._rows) > self._mask_words * BITS:
            raise ValueError(f"a control row holds the waits of {self._mask_words * BITS} ranks, not {len(rows)}")
        self._published: Optional[tuple[int, tuple[int, ...]]] = None

    def publish(self, kind: int, waited: Sequence[int]) -> None:
        """This rank waits in ``kind`` for ``waited`` (global ranks); writes only what changed."""
        masks = [0] * self._mask_words
        for r in waited:
            masks[r // BITS] |= 1 << (r % BITS)
        state = (kind, tuple(masks))
        if state == self._published:
            return
        w, row = self._w, self._rows[self.rank]
        w[row + KIND] = kind
        for i, m in enumerate(masks):
            w[row + MASK0 + i] = m
        w[row + VERSION] += 1
        self._published = state

    def clear(self) -> None:
        if self._published is not None:
            w, row = self._w, self._rows[self.rank]
            w[row + KIND] = 0
            w[row + VERSION] += 1
            self._published = None

    def wait_of(self, rank: int) -> Optional[tuple[int, int, frozenset[int]]]:
        """(version, kind, ranks) of ``rank``'s wait, or None if it is not waiting (or was caught mid-write)."""
        w, row = self._w, self._rows[rank]
        version, kind = w[row + VERSION], w[row + KIND]
        if not kind:
            return None
        ranks = frozenset(i * BITS + b for i in range(self._mask_words) if (m := w[row + MASK0 + i])
                          for b in range(BITS) if m >> b & 1)
        if w[row + VERSION] != version:
            return None
        return version, kind, ranks

    def failed(self, ranks: Sequence[int]) -> list[int]:
        """Those of ``ranks`` that failed and wait for the others to fail too (kind ``FAILED``)."""
        return [r for r in ranks if 0 <= r < len(self._rows) and self._w[self._rows[r] + KIND] == FAILED]

    def cycle(self) -> Optional[Snapshot]:
        """The waits of the ranks on a cycle through this rank (depth-first along the published edges)."""
        seen: Snapshot = {}
        path: list[int] = []

        def visit(r: int) -> bool:
            wait = self.wait_of(r)
            if wait is None:
                return False
            seen[r] = wait
            path.append(r)
            for nxt in sorted(wait[2]):
                if nxt == self.rank or (nxt not in seen and 0 <= nxt < len(self._rows) and visit(nxt)):
                    return True
            path.pop()
            return False

        return {r: seen[r] for r in path} if visit(self.rank) else None


def deadlock_message(cycle: Snapshot, waited_s: float) -> str:
    ranks = sorted(cycle)
    parts = [f"rank {r} waits in {kind_name(k)} for rank(s) {sorted(w)}" for r, (_, k, w) in sorted(cycle.items())]
    return (f"deadlock: ranks {ranks} wait for each other ({'; '.join(parts)}) and have for {waited_s:.1f} s: none "
            "of them can go on. The ranks took different paths -- a collective, or a send or receive, that some "
            "ranks call and the others do not reach (e.g. a collective in a branch taken on some ranks only, or a "
            "pipeline stage skipping a collective the other stages make). Where each rank was follows.")
