"""A barrier made of per-rank generation counters, with a descriptor of the collective being entered.

Layout (int64 words, one 128-byte row per member so no two ranks ever write the same cache line
or its prefetch neighbour; everything a row publishes sits in its first 64 bytes, so a peer's
arrival and descriptor come in one cache-line transfer)::

    row i:  [gen | key numel arg (even gens) | key numel arg (odd gens) | unused ...]
             0     1   2     3                 4   5     6
    key = seq << 16 | coll << 8 | dtype      (seq: the group's collective counter)

Protocol for member ``i`` entering generation ``g = previous + 1``:

1. write its descriptor of the collective into the slot of parity ``g % 2`` of row ``i``;
2. store ``g`` into ``row[i].gen`` -- the only write that publishes anything;
3. wait until every other row's ``gen >= g``; then read their descriptors for parity ``g % 2`` and
   compare with its own.

Ordering argument. Every word has exactly one writer (its row's rank), so there are no write
races. A rank writes its data (scratch slots, descriptors) *before* its ``gen`` store, and readers
load ``gen`` *before* they load the data. x86-64 keeps stores in program order and loads in program
order (TSO), and every load/store here is a separate C call the compiler cannot reorder, so a reader
that sees ``gen >= g`` also sees everything written before it. (On weakly ordered CPUs, e.g. ARM,
this protocol would need explicit fences; the runtime targets x86-64.)

Why two descriptor slots: a peer can be at most one generation ahead (to reach ``g + 2`` it needs
everyone at ``g + 1``), so parity-indexed slots are never overwritten while still being read.
The same argument makes double-buffered scratch safe in :mod:`lightning_shm.runtime.group`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from lightning_shm.runtime.deadlock import FAILED, collective
from lightning_shm.runtime.errors import CollectiveMismatchError, PeerAbortedError
from lightning_shm.runtime.ops import Coll, arg_name, barrier_reason, dtype_name, op_name, reason_name
from lightning_shm.runtime.wait import Waiter

ROW_WORDS = 16
DESC_FIELDS = ("seq", "coll", "dtype", "numel", "arg")  # arg: the collective's own argument (reduce op, source)
_DESC_BASE = (1, 4)  # word offset of the descriptor slot for even / odd generations
_FIELD_WORD = {"numel": 1, "arg": 2}  # word of a descriptor field after the key
# the reason of the barrier a member enters after an error of its own (:meth:`Group.agree_failed`)
FAILED_REASON = barrier_reason("a rank failed and waits for the others to fail at the same point")


def _unkey(key: int) -> tuple[int, int, int]:
    return key >> 16, (key >> 8) & 0xFF, key & 0xFF


class Barrier:
    """Generation-counter barrier for the members ``ranks`` whose rows start at ``base_word``."""

    def __init__(self, words: memoryview, base_word: int, ranks: Sequence[int], index: int, waiter: Waiter,
                 label: str) -> None:
        size = len(ranks)
        if not 0 <= index < size:
            raise ValueError(f"member index {index} outside group of size {size}")
        self._ranks = list(ranks)
        self._w = words
        self._rows = [base_word + j * ROW_WORDS for j in range(size)]
        self._me = self._rows[index]
        self._peers = [(j, r) for j, r in enumerate(self._rows) if j != index]
        self._index = index
        self._waiter = waiter
        self._label = label
        self.gen = words[self._me]  # 0 on a fresh segment

    def wait(self, seq: int, coll: int, dtype: int, numel: int, arg: int, check_numel: bool = True,
             check: bool = True, check_arg: bool = True, timeout_s: Optional[float] = None) -> int:
        """Enter the next generation announcing (seq, coll, dtype, numel, arg); return the generation.
        ``timeout_s``: how long to wait for the others (default: the waiter's policy)."""
        w = self._w
        g = self.gen + 1
        self.gen = g
        d = self._me + _DESC_BASE[g & 1]
        key = (seq << 16) | (coll << 8) | dtype  # the layout's key (inlined: the hot path)
        w[d] = key
        w[d + 1] = numel
        w[d + 2] = arg
        w[self._me] = g  # publish: everything above is visible to whoever sees this
        for j, row in self._peers:
            if w[row] < g:
                self._waiter.wait_ge(w, row, g, lambda: self._timeout_message(g, seq, coll, timeout_s),
                                     lambda: self.missing(g), timeout_s,
                                     FAILED if arg == FAILED_REASON and coll == Coll.BARRIER else collective(coll))
        if check:
            base = _DESC_BASE[g & 1]
            for j, row in self._peers:
                p = row + base
                if w[p] != key or (check_numel and w[p + 1] != numel) or \
                        (w[p + 2] != arg and (check_arg or w[p + 2] == FAILED_REASON)):  # (any barrier but that one)
                    self._mismatch(j, p, (seq, coll, dtype, numel, arg))
        return g

    def peer_field(self, member: int, g: int, field: str) -> int:
        """A field of ``member``'s descriptor for generation ``g`` (valid right after ``wait``)."""
        d = self._rows[member] + _DESC_BASE[g & 1]
        if field in _FIELD_WORD:
            return self._w[d + _FIELD_WORD[field]]
        return _unkey(self._w[d])[("seq", "coll", "dtype").index(field)]

    def _mismatch(self, j: int, p: int, mine_fields: tuple[int, int, int, int, int]) -> None:
        w = self._w
        mine = dict(zip(DESC_FIELDS, mine_fields))
        theirs = dict(zip(DESC_FIELDS, (*_unkey(w[p]), w[p + 1], w[p + 2])))
        if _failed(theirs) and not _failed(mine):  # the consequence of its error, which the launcher reports
            raise PeerAbortedError(f"{self._label}: rank {self._ranks[j]} failed (it stopped at its error while rank "
                                   f"{self._ranks[self._index]} entered {_fmt(mine)})")
        raise CollectiveMismatchError(
            f"{self._label}: rank {self._ranks[self._index]} entered {_fmt(mine)} but rank "
            f"{self._ranks[j]} entered "
            f"{_fmt(theirs)}. Every rank of a group must call the same collectives in the same "
            f"order with matching dtypes and sizes.", mine, theirs, self._ranks[j]
        )

    def missing(self, g: int) -> list[int]:
        """Global ranks that have not entered generation ``g``."""
        return [self._ranks[j] for j, row in self._peers if self._w[row] < g]

    def _timeout_message(self, g: int, seq: int, coll: int, timeout_s: Optional[float] = None) -> str:
        missing = self.missing(g)
        waited = self._waiter.policy.timeout_s if timeout_s is None else timeout_s
        return (
            f"{self._label}: {op_name(coll)} (collective #{seq}, generation {g}) timed out after "
            f"{waited:g} s on rank {self._ranks[self._index]}: rank(s) {missing} "
            f"did not arrive"
        )


def _failed(d: dict) -> bool:
    return d["coll"] == Coll.BARRIER and d["arg"] == FAILED_REASON


def _fmt(d: dict) -> str:
    if d["coll"] == Coll.VOTE:  # its descriptor: the reason where others carry a size, the value as its argument
        why = f", why: {reason_name(d['numel'])}" if d["numel"] else ""
        return f"vote(collective #{d['seq']}{why}, value={d['arg']})"
    return (f"{op_name(d['coll'])}(collective #{d['seq']}, dtype={dtype_name(d['dtype'])}, numel={d['numel']}, "
            f"{arg_name(d['coll'], d['arg'])})")
