"""The barrier's descriptor layout, driven by two threads on one anonymous mapping (no processes).

What a member publishes (generation + the collective's descriptor, for both parities) must sit in
the first 64 bytes of its row -- one cache line per arrival -- and decode back exactly, with
collective counters far beyond 32 bits.
"""

from __future__ import annotations

import mmap
import threading

import pytest
import torch

from lightning_shm.runtime.barrier import ROW_WORDS, Barrier
from lightning_shm.runtime.errors import CollectiveMismatchError
from lightning_shm.runtime.ops import Coll, ReduceOp, dtype_code
from lightning_shm.runtime.wait import Waiter, WaitPolicy

BIG = 2 ** 40  # collective counters of a very long run


def _pair() -> tuple[memoryview, list[Barrier]]:
    words = memoryview(mmap.mmap(-1, 4096)).cast("q")
    waiter = Waiter(words, 2 * ROW_WORDS, WaitPolicy(timeout_s=20, spin_iters=10))  # an abort word past the rows
    return words, [Barrier(words, 0, [0, 1], i, waiter, "test pair") for i in (0, 1)]


def _both(fn) -> list:
    """Run ``fn(member)`` for members 0 and 1 at once; return results or raise the first error."""
    out: list = [None, None]

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def test_descriptors_of_both_parities_decode_exactly_and_fit_one_cache_line():
    words, bars = _pair()

    def member(i: int) -> list[dict[str, int]]:
        seen = []
        for k in range(4):  # generations 1..4: both descriptor slots, twice
            seq, numel, arg = BIG + k, 10 ** 12 + k, 37 * k + i  # arg differs per member (like a vote)
            g = bars[i].wait(seq, Coll.VOTE, dtype_code(torch.bfloat16), numel, arg, check_arg=False)
            peer = 1 - i
            seen.append({f: bars[i].peer_field(peer, g, f) for f in ("seq", "coll", "dtype", "numel", "arg")})
            bars[i].wait(BIG + 100 + k, Coll.BARRIER, 0, 0, 0)  # nobody overwrites a slot still being read
        return seen

    for i, seen in enumerate(_both(member)):
        assert seen == [{"seq": BIG + k, "coll": Coll.VOTE, "dtype": dtype_code(torch.bfloat16),
                         "numel": 10 ** 12 + k, "arg": 37 * k + 1 - i} for k in range(4)]
    for row in (0, ROW_WORDS):  # everything a row published lies in its first 8 words (64 bytes)
        assert words[row] == 8  # the generation
        assert list(words[row + 8:row + ROW_WORDS]) == [0] * (ROW_WORDS - 8)


@pytest.mark.parametrize("field", ["dtype", "numel", "arg"])
def test_a_mismatch_names_both_descriptors_with_their_values(field):
    _, bars = _pair()
    mine = {"seq": BIG + 5, "coll": Coll.ALL_REDUCE, "dtype": dtype_code(torch.float32), "numel": 4,
            "arg": ReduceOp.SUM}
    theirs = dict(mine)
    theirs[field] = {"dtype": dtype_code(torch.int64), "numel": 5, "arg": ReduceOp.MAX}[field]

    def member(i: int) -> None:
        d = mine if i == 0 else theirs
        bars[i].wait(d["seq"], d["coll"], d["dtype"], d["numel"], d["arg"])

    with pytest.raises(CollectiveMismatchError) as info:
        _both(member)
    msg = str(info.value)
    assert f"all_reduce(collective #{BIG + 5}, dtype=float32, numel=4, reduce=sum)" in msg
    other = {"dtype": "dtype=int64, numel=4, reduce=sum", "numel": "dtype=float32, numel=5, reduce=sum",
             "arg": "dtype=float32, numel=4, reduce=max"}[field]
    assert f"all_reduce(collective #{BIG + 5}, {other})" in msg
