"""A process group on shared memory: barrier and every collective the strategies use.

This is where the all-reduce happens (:meth:`Group.all_reduce`).

Memory of a group of ``W`` members (one segment, created by the main process on first request)::

    [ W barrier rows | scratch buffer 0: W slots of slot_bytes | scratch buffer 1: W slots ]

Member ``i`` is the only writer of slot ``i``; everyone reads every slot. Collectives on tensors
that do not fit a slot run in rounds of at most one slot each. Rounds alternate between the two
buffers, which makes one barrier per round enough: before a rank writes a buffer again it has
passed the next round's barrier, which every rank reaches only after it finished reading that
buffer (see :mod:`lightning_shm.runtime.barrier` for the ordering argument).

``all_reduce`` picks one of three paths (all give bit-identical results on every rank, because
the fold runs in member order):

* **one-shot** (``nbytes <= oneshot_max_bytes``): publish the whole tensor, one barrier, every rank
  folds all W slots onto its own copy (members 0 and 1 add the other's slot to theirs: one in-place
  op at W=2, see :func:`~lightning_shm.runtime.ops.fold_onto_own`). Cheapest in latency, so small
  tensors take it even inside a shared buffer.
  A group of two (``pair_oneshot``) reduces private tensors of any size this way, in slot-sized
  chunks with one barrier each. At W=2 as many bytes cross between the two cores as on the path
  below (the peer's whole contribution), in two tensor operations and one barrier per chunk instead
  of four and two (measured: README, "One-shot pairs"). Chunk k's buffer is written again by chunk
  k+2, after chunk k+1's barrier, which a member passes only once it has folded chunk k.
* **reduce-scatter + all-gather** (larger private tensors, W > 2): per round, rank ``r`` publishes only
  the parts the others reduce, folds its own 1/W part (its own contribution read in place), posts
  the result in its slot, and after the second barrier copies the other parts' results. Each rank
  reduces 1/W of the data instead of all of it: one-shot would read W - 1 whole contributions. A
  node-spanning group's pair takes it too, so that each rank sends half the tensor between nodes.
* **zero-copy** (larger tensors living in a :class:`SharedBuffer` of this group, e.g. DDP gradient buckets):
  nothing is copied in or out; rank ``r`` folds part ``r`` straight from the W members' buffers and
  writes the result back into all of them. Per rank this reads N bytes and writes N bytes, the
  memory-traffic minimum.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_shm.runtime.barrier import FAILED_REASON, ROW_WORDS, Barrier
from lightning_shm.runtime.errors import BarrierTimeoutError, CollectiveMismatchError, PeerAbortedError
from lightning_shm.runtime.ops import (
    OBJECT_WHY,
    Coll,
    ReduceOp,
    check_reducible,
    dtype_code,
    even_split,
    fold,
    fold_onto_own,
)
from lightning_shm.runtime.ops import SHARED_FLAG as _SHARED_FLAG
from lightning_shm.runtime.ops import SITE as _SITE
from lightning_shm.runtime.segment import Segment, align_up, normal_views
from lightning_shm.runtime.wait import Waiter

_PAGE = 4096
# plain ints for the small collectives' hot path (an enum member looked up through its class costs ~0.2 us)
_ALL_REDUCE, _ALL_GATHER, _BARRIER = int(Coll.ALL_REDUCE), int(Coll.ALL_GATHER), int(Coll.BARRIER)


@dataclass(frozen=True)
class GroupConfig:
    """Scratch sizing and the all-reduce's paths. ``slot_bytes`` bounds memory: a group uses
    ``2 * W * slot_bytes``. ``pair_oneshot``: a group of two reduces private tensors of any size one-shot
    (False: reduce-scatter + all-gather above ``oneshot_max_bytes``, as larger groups do)."""

    slot_bytes: int = 1 << 20
    oneshot_max_bytes: int = 64 << 10
    pair_oneshot: bool = True

    def __post_init__(self) -> None:
        if self.slot_bytes < 4096 or self.slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a multiple of 64 and >= 4096, got {self.slot_bytes}")
        if not 0 <= self.oneshot_max_bytes <= self.slot_bytes:
            raise ValueError(
                f"oneshot_max_bytes must be in [0, slot_bytes={self.slot_bytes}], got {self.oneshot_max_bytes}"
            )

    def segment_bytes(self, size: int) -> int:
        return align_up(size * ROW_WORDS * 8, _PAGE) + 2 * size * self.slot_bytes


class SharedBuffer:
    """``numel`` elements per member, each member's copy readable and writable by all members.

    ``local`` is this rank's copy (e.g. a gradient bucket whose views are ``param.grad``);
    collectives on tensors inside ``local`` take the zero-copy path.
    """

    def __init__(self, segment: Segment, dtype: torch.dtype, numel: int, size: int, index: int) -> None:
        self.segment = segment
        self.dtype = dtype
        self.numel = numel
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._stride = align_up(max(numel * itemsize, 1), _PAGE)
        self._regions = [segment.tensor(dtype, j * self._stride, numel) for j in range(size)]
        self.local = self._regions[index]
        self._lo = self.local.data_ptr()
        self._hi = self._lo + numel * itemsize
        self._itemsize = itemsize

    @staticmethod
    def segment_bytes(dtype: torch.dtype, numel: int, size: int) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return size * align_up(max(numel * itemsize, 1), _PAGE)

    def region(self, member: int) -> torch.Tensor:
        return self._regions[member]

    def offset_of(self, t: torch.Tensor) -> Optional[int]:
        """Element offset of contiguous ``t`` inside ``local``, or None if it is not inside."""
        if t.dtype != self.dtype:
            return None
        p = t.data_ptr()
        if self._lo <= p and p + t.numel() * self._itemsize <= self._hi:
            return (p - self._lo) // self._itemsize
        return None


class Group:
    """Collectives among ``ranks`` (global ranks, sorted); member index = position in ``ranks``.

    ``src_member`` arguments are member indices (positions in ``ranks``), never global ranks. Every
    member must call the same collectives in the same
    order; a mismatch raises :class:`CollectiveMismatchError` on every member instead of corrupting
    data or hanging.
    """

    def __init__(self, ranks: Sequence[int], global_rank: int, segment: Segment, waiter: Waiter,
                 alloc: Callable[[str, int], Segment], key: str, config: GroupConfig) -> None:
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.index = self.ranks.index(global_rank)
        self.global_rank = global_rank
        self.key = key
        self.config = config
        self._alloc = alloc
        self._waiter = waiter
        self._barrier = Barrier(segment.words(), 0, self.ranks, self.index, waiter, f"group {list(self.ranks)}")
        self._seq = 0
        self._buf = 0
        scratch0 = align_up(self.size * ROW_WORDS * 8, _PAGE)
        sb = config.slot_bytes
        # buffer b: the W members' slots back to back, [W, slot_bytes] (one view reads every slot in one op)
        self._blocks = [segment.tensor(torch.uint8, scratch0 + b * self.size * sb, self.size * sb).view(self.size, sb)
                        for b in (0, 1)]
        self._raw = [list(block.unbind(0)) for block in self._blocks]
        self._typed: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._cuts: dict[tuple[int, torch.dtype, int], tuple[list[torch.Tensor], torch.Tensor]] = {}
        self._shared: list[SharedBuffer] = []
        self.traffic: dict[str, int] = {}  # bytes this member contributed, per collective (for benchmarks)

    def __repr__(self) -> str:
        return f"Group(ranks={list(self.ranks)}, index={self.index})"

    def __deepcopy__(self, memo: dict) -> "Group":
        return self  # a process resource: modules holding a group (TP layers) may be deep-copied

    # ------------------------------------------------------------------ plumbing
    def _slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Typed views of the next scratch buffer's W slots (alternates buffers)."""
        b = self._buf
        self._buf ^= 1
        return self._typed_slots(b, dtype)

    def _typed_slots(self, b: int, dtype: torch.dtype) -> list[torch.Tensor]:
        views = self._typed.get((b, dtype))
        if views is None:
            with normal_views():
                views = [raw.view(dtype) for raw in self._raw[b]]
            self._typed[(b, dtype)] = views
        return views

    def _cut(self, b: int, dtype: torch.dtype, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Buffer ``b``'s slots cut to ``n`` elements: one per member, and all of them as ``[W, n]``.
        The same small collectives repeat every step, so the views are cut once (bounded: a user's
        variable-length gathers would otherwise add an entry per size)."""
        key = (b, dtype, n)
        cut = self._cuts.get(key)
        if cut is None:
            if len(self._cuts) >= 64:
                self._cuts.clear()
            with normal_views():
                cut = ([s[:n] for s in self._typed_slots(b, dtype)], self._blocks[b].view(dtype)[:, :n])
            self._cuts[key] = cut
        return cut

    def _cap(self, dtype: torch.dtype) -> int:
        return self.config.slot_bytes // dtype.itemsize

    def _sync(self, coll: int, dtype: int, numel: int, arg: int, check: bool, check_numel: bool = True) -> int:
        """The barrier of collective ``coll``; ``arg`` is its own argument (the reduce op, the source member)."""
        return self._barrier.wait(self._seq, coll, dtype, numel, arg, check_numel=check_numel, check=check)

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.traffic[kind] = self.traffic.get(kind, 0) + t.numel() * t.element_size()

    def _find_shared(self, flat: torch.Tensor) -> Optional[tuple[SharedBuffer, int]]:
        for buf in self._shared:
            off = buf.offset_of(flat)
            if off is not None:
                return buf, off
        return None

    # ------------------------------------------------------------------ shared buffers
    def alloc_shared(self, numel: int, dtype: torch.dtype = torch.float32, tag: str = "buf") -> SharedBuffer:
        """Collectively allocate a :class:`SharedBuffer` (every member calls with the same arguments)."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        key = f"{self.key}/{tag}/{numel}/{str(dtype).replace('torch.', '')}"
        seg = self._alloc(key, SharedBuffer.segment_bytes(dtype, numel, self.size))
        buf = SharedBuffer(seg, dtype, numel, self.size, self.index)
        self._shared.append(buf)
        return buf

    def release_shared(self, buf: SharedBuffer) -> None:
        """Stop routing collectives on ``buf`` through the zero-copy path (memory is freed at exit)."""
        self._shared = [b for b in self._shared if b is not buf]

    def alloc_common(self, numel: int, dtype: torch.dtype = torch.float32, tag: str = "common") -> torch.Tensor:
        """Collectively allocate one flat tensor of ``numel`` elements that every member maps: each
        reads all of it and writes the parts the caller's rule gives it (FSDP's full parameters, a
        rank's rows one slice of each). Unlike a :class:`SharedBuffer` it has no per-member regions,
        so collectives on tensors inside it take the ordinary (copying) path."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        key = f"{self.key}/common/{tag}/{numel}/{str(dtype).replace('torch.', '')}"
        return self._alloc(key, align_up(max(numel * itemsize, 1), _PAGE)).tensor(dtype, 0, numel)

    # ------------------------------------------------------------------ barrier
    def barrier(self, untimed: bool = False, why: int = 0) -> None:
        """Wait until every member arrives: at most the world's timeout, or with ``untimed`` as long as it takes
        (a member that fails still aborts it). ``why``: a code of :func:`~.ops.barrier_reason`, which a member
        meeting this barrier in another collective names in its error (any two barriers still match)."""
        self._seq += 1
        self._barrier.wait(self._seq, _BARRIER, 0, 0, why, check_arg=False, timeout_s=math.inf if untimed else None)

    def vote_max(self, value: int, why: int = 0) -> int:
        """The largest of every member's ``value`` (an int >= 0), for the price of one barrier: each
        value travels in its member's barrier descriptor. Members use it to agree, at the same point
        of their programs, on something each saw at a different moment (a stop request). ``why``: a code
        of :func:`~.ops.barrier_reason`; votes of different reasons do not match -- a member voting on one
        thing must not read another's vote on something else as its answer."""
        if value < 0:
            raise ValueError(f"vote_max takes ints >= 0, got {value}")
        if self.size == 1:
            return value
        self._seq += 1
        g = self._barrier.wait(self._seq, Coll.VOTE, 0, why, value, check_arg=False)
        return max(self._barrier.peer_field(j, g, "arg") for j in range(self.size))

    def agree_failed(self, step: int, timeout_s: float) -> bool:
        """Called by a member after an error of its own: True if every member failed too, at the same ``step`` (an
        int >= 0 the caller counts alike on every member), and arrived here within ``timeout_s`` -- then they
        stand at the same point and may still run collectives together (a checkpoint of the state at the
        error). False otherwise, and the caller reports its error at once. A member that meets this barrier in
        another collective raises :class:`PeerAbortedError` there: this member's error is the cause, and the
        launcher reports that one; one waiting for this member elsewhere (another group's collective, a channel)
        raises :class:`PeerFailedError` within its wait policy's ``check_s`` -- from a channel it may join here.
        A member computing on without a collective leaves this one waiting ``timeout_s`` at most."""
        if self.size == 1:
            return True
        self._seq += 1
        try:
            self._barrier.wait(self._seq, _BARRIER, 0, step, FAILED_REASON, timeout_s=timeout_s)
        except (BarrierTimeoutError, CollectiveMismatchError, PeerAbortedError):
            return False
        self._waiter.agreed_failed = True  # the others' marks of waiting here may outlive it (a rank not yet awake)
        return True

    # ------------------------------------------------------------------ all-reduce
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum",
                   across: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        """In-place reduction of ``tensor`` over the group; returns ``tensor``.

        ``across(part)``, if given, is applied in place to each reduced part before it is shared with
        the other members -- a multi-node group combines each part with the other nodes' there
        (:class:`~lightning_shm.runtime.hierarchy.NodeSpanningGroup`).
        """
        op = ReduceOp.parse(op)
        check_reducible(tensor.dtype, op)
        if self.size == 1:
            if across is not None:
                across(tensor.view(-1) if tensor.is_contiguous() else tensor)
            return tensor
        flat, contiguous = _flat(tensor)
        nbytes = flat.nbytes
        self._seq += 1
        self.traffic["all_reduce"] = self.traffic.get("all_reduce", 0) + nbytes
        if nbytes <= self.config.oneshot_max_bytes:  # also inside a SharedBuffer: one barrier beats two
            self._all_reduce_oneshot(flat, op)
            if across is not None:  # every member holds the whole (small) result: each combines it
                across(flat)
        else:
            hit = self._find_shared(flat) if contiguous else None
            if hit is not None:
                self._all_reduce_shared(flat, hit[0], hit[1], op, across)
            elif self.size == 2 and across is None and self.config.pair_oneshot:
                self._all_reduce_oneshot_chunks(flat, op)
            else:
                self._all_reduce_rsag(flat, op, across)
        if not contiguous:
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def _all_reduce_oneshot(self, flat: torch.Tensor, op: ReduceOp, numel: int = -1, check: bool = True) -> None:
        """``flat`` (at most a slot) into my slot, one barrier, all W slots folded onto ``flat``. ``numel``: the
        whole tensor's, which the barrier announces, when ``flat`` is a chunk of it."""
        n, b, r = flat.numel(), self._buf, self.index
        self._buf ^= 1
        views = self._cut(b, flat.dtype, n)[0]
        views[r].copy_(flat)
        self._barrier.wait(self._seq, _ALL_REDUCE, dtype_code(flat.dtype), n if numel < 0 else numel, op,
                           check=check)
        fold_onto_own(op, views, r, flat)  # flat still holds this member's contribution

    def _all_reduce_oneshot_chunks(self, flat: torch.Tensor, op: ReduceOp) -> None:
        n, cap = flat.numel(), self._cap(flat.dtype)
        for c0 in range(0, n, cap):
            self._all_reduce_oneshot(flat[c0:c0 + cap], op, n, check=c0 == 0)

    def _all_reduce_rsag(self, flat: torch.Tensor, op: ReduceOp,
                         across: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        W, r, n = self.size, self.index, flat.numel()
        dc, cap = dtype_code(flat.dtype), self._cap(flat.dtype)
        for c0 in range(0, n, cap):
            L = min(cap, n - c0)
            xc = flat[c0:c0 + L]
            slots = self._slots(flat.dtype)
            mine = slots[r]
            b = even_split(L, W)
            lo, hi = b[r], b[r + 1]
            if lo > 0:  # publish the parts other ranks reduce
                mine[:lo].copy_(xc[:lo])
            if hi < L:
                mine[hi:L].copy_(xc[hi:])
            self._sync(Coll.ALL_REDUCE, dc, n, int(op), check=c0 == 0)
            if hi > lo:  # reduce my part (own contribution read in place), post the result in my slot
                pub = mine[lo:hi]
                fold(op, [xc[lo:hi] if j == r else slots[j][lo:hi] for j in range(W)], pub, W)
                if across is not None:
                    across(pub)
                xc[lo:hi].copy_(pub)
            self._sync(Coll.ALL_REDUCE, dc, n, int(op), check=False)
            for k in range(W):  # collect the other parts' results
                if k != r and b[k] < b[k + 1]:
                    xc[b[k]:b[k + 1]].copy_(slots[k][b[k]:b[k + 1]])

    def _all_reduce_shared(self, flat: torch.Tensor, buf: SharedBuffer, off: int, op: ReduceOp,
                           across: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        n, W, r = flat.numel(), self.size, self.index
        dc = dtype_code(flat.dtype)
        self._sync(Coll.ALL_REDUCE, dc, n, int(op) + _SHARED_FLAG, check=True)  # everyone's data is final
        b = even_split(n, W)
        lo, hi = off + b[r], off + b[r + 1]
        if hi > lo:
            parts = [buf.region(j)[lo:hi] for j in range(W)]
            fold(op, parts, parts[0], W)
            if across is not None:
                across(parts[0])
            for p in parts[1:]:
                p.copy_(parts[0])
        self._sync(Coll.ALL_REDUCE, dc, n, int(op) + _SHARED_FLAG, check=False)  # every result written

    # ------------------------------------------------------------------ reduce-scatter
    def reduce_scatter(self, tensor: torch.Tensor, op: Any = "sum", out: Optional[torch.Tensor] = None,
                       sizes: Optional[Sequence[int]] = None,
                       across: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        """Reduce ``tensor`` (flattened, n elements) and return this member's part.

        Parts follow ``sizes`` (elements per member, summing to n; e.g. whole rows of a matrix), by
        default :func:`even_split` (the first ``n % W`` members get one element more).
        ``out`` must not overlap ``tensor``. ``across(part)`` is then applied to the part in place.
        """
        out = self._reduce_scatter_many([tensor], op, [out], [sizes])[0]
        if across is not None:  # e.g. HSDP: this member's part, combined with the other nodes' replicas
            across(out.view(-1))
        return out

    def reduce_scatter_coalesced(self, tensors: Sequence[torch.Tensor], op: Any = "sum",
                                 sizes: Optional[Sequence[Optional[Sequence[int]]]] = None,
                                 across: Optional[Callable[[torch.Tensor], None]] = None,
                                 site: int = 0) -> list[torch.Tensor]:
        """Several reduce-scatters as one collective: this member's part of every tensor.

        Same as ``[reduce_scatter(t, op, sizes=s) for t, s in zip(tensors, sizes)]`` (bit for bit),
        but each round of the scratch buffer carries every tensor's parts -- one barrier per round
        instead of one per tensor and round: what an FSDP unit of several small parameters needs.
        Tensors must share a dtype. Through member k's slot go, in tensor order, the parts of every
        tensor that member k reduces::

            slot of member j, round c:  [ dest 0: t0 part 0 | t1 part 0 ...  | dest 1: t0 part 1 | t1 part 1 ... ]
                                          (a window of cap/W elements of each destination's sequence)

        ``site`` (an int >= 0, the same on every member) names the call site in the collective's descriptor:
        members entering it from different sites raise :class:`CollectiveMismatchError` even when kinds,
        dtypes and sizes agree -- two FSDP units of equal sizes reduced in a different order would
        otherwise exchange each other's gradients.
        """
        if site < 0:
            raise ValueError(f"reduce_scatter_coalesced: site must be >= 0, got {site}")
        if not tensors:
            return []
        sizes = sizes if sizes is not None else [None] * len(tensors)
        if len(sizes) != len(tensors):
            raise ValueError(f"reduce_scatter_coalesced: {len(tensors)} tensors but {len(sizes)} size lists")
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError(f"reduce_scatter_coalesced: tensors must share a dtype, got "
                             f"{sorted(str(t.dtype) for t in tensors)}")
        outs = self._reduce_scatter_many(list(tensors), op, [None] * len(tensors), list(sizes), site)
        if across is not None:
            for out in outs:
                across(out.view(-1))
        return outs

    def _reduce_scatter_many(self, tensors: list[torch.Tensor], op: Any, outs: list[Optional[torch.Tensor]],
                             sizes: list[Optional[Sequence[int]]], site: int = 0) -> list[torch.Tensor]:
        op = ReduceOp.parse(op)
        check_reducible(tensors[0].dtype, op)
        W, r = self.size, self.index
        flats, bounds, results = [], [], []
        for tensor, out, sz in zip(tensors, outs, sizes):
            flat, contiguous = _flat(tensor)
            n = flat.numel()
            if sz is None:
                b = even_split(n, W)
            else:
                if len(sz) != W or sum(sz) != n or min(sz) < 0:
                    raise ValueError(f"reduce_scatter: sizes {list(sz)} must be {W} counts >= 0 summing to {n}")
                b = [0]
                for k in sz:
                    b.append(b[-1] + k)
            mine_n = b[r + 1] - b[r]
            if out is None:
                out = torch.empty(mine_n, dtype=flat.dtype)
            elif out.numel() != mine_n or out.dtype != flat.dtype or not out.is_contiguous():
                raise ValueError(
                    f"reduce_scatter: out must be a contiguous {flat.dtype} tensor of {mine_n} elements "
                    f"(member {r} of {W}, input numel {n}), got {tuple(out.shape)} {out.dtype}"
                )
            flats.append((flat, contiguous))
            bounds.append(b)
            results.append(out)
        if W == 1:
            for (flat, _), out in zip(flats, results):
                out.view(-1).copy_(flat)
            return results
        self._seq += 1
        for flat, _ in flats:
            self._count("reduce_scatter", flat)
        dc, total = dtype_code(tensors[0].dtype), sum(f.numel() for f, _ in flats)
        hit = self._find_shared(flats[0][0]) if len(flats) == 1 and flats[0][1] else None
        if hit is not None:
            buf, off = hit
            b, o = bounds[0], results[0].view(-1)
            self._sync(Coll.REDUCE_SCATTER, dc, total, int(op) + _SHARED_FLAG + site * _SITE, check=True)
            if b[r + 1] > b[r]:
                fold(op, [buf.region(j)[off + b[r]:off + b[r + 1]] for j in range(W)], o, W)
            # nobody may overwrite its input while others still read it
            self._sync(Coll.REDUCE_SCATTER, dc, total, int(op) + _SHARED_FLAG + site * _SITE, check=False)
            return results
        # destination k's sequence: tensor 0's part k, tensor 1's part k, ...; start[i][k] = where tensor i's begins
        start = [[0] * W for _ in flats]
        for k in range(W):
            acc = 0
            for i, b in enumerate(bounds):
                start[i][k] = acc
                acc += b[k + 1] - b[k]
        length = [sum(b[k + 1] - b[k] for b in bounds) for k in range(W)]
        cp = max(self._cap(tensors[0].dtype) // W, 1)  # elements of each destination per round
        for c in range(max(1, math.ceil(max(length) / cp))):
            w0, w1 = c * cp, (c + 1) * cp  # this round's window of every destination's sequence
            slots = self._slots(tensors[0].dtype)
            mine = slots[r]
            for k in range(W):
                if k == r:
                    continue
                for (flat, _), b, st in zip(flats, bounds, start):
                    a, e = max(w0, st[k]), min(w1, st[k] + b[k + 1] - b[k])
                    if e > a:
                        mine[k * cp + a - w0:k * cp + e - w0].copy_(flat[b[k] + a - st[k]:b[k] + e - st[k]])
            self._sync(Coll.REDUCE_SCATTER, dc, total, int(op) + site * _SITE, check=c == 0)
            for (flat, _), b, st, out in zip(flats, bounds, start, results):
                a, e = max(w0, st[r]), min(w1, st[r] + b[r + 1] - b[r])
                if e > a:
                    srcs = [flat[b[r] + a - st[r]:b[r] + e - st[r]] if j == r else
                            slots[j][r * cp + a - w0:r * cp + e - w0] for j in range(W)]
                    fold(op, srcs, out.view(-1)[a - st[r]:e - st[r]], W)
        return results

    # ------------------------------------------------------------------ all-gather
    def all_gather(self, tensor: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stack every member's equally shaped ``tensor``: returns ``[W, *tensor.shape]``."""
        flat, _ = _flat(tensor)
        W, r, n = self.size, self.index, flat.numel()
        if out is None:
            out = torch.empty((W, *tensor.shape), dtype=tensor.dtype)
        elif out.shape != (W, *tensor.shape) or out.dtype != tensor.dtype or not out.is_contiguous():
            raise ValueError(f"all_gather: out must be contiguous {(W, *tensor.shape)} {tensor.dtype}, "
                             f"got {tuple(out.shape)} {out.dtype}")
        o = out.view(W, n)
        if W == 1:
            o[0].copy_(flat)
            return out
        self._seq += 1
        self._count("all_gather", flat)
        dc, cap = dtype_code(flat.dtype), self._cap(flat.dtype)
        if n <= cap:  # one round (statistics, batch shares): two copies around the barrier, views cut once
            self._all_gather_one_round(flat, o, dc)
            return out
        for c0 in range(0, n, cap):
            L = min(cap, n - c0)
            slots = self._slots(flat.dtype)
            slots[r][:L].copy_(flat[c0:c0 + L])
            self._sync(Coll.ALL_GATHER, dc, n, 0, check=c0 == 0)
            for j in range(W):
                o[j, c0:c0 + L].copy_(flat[c0:c0 + L] if j == r else slots[j][:L])
        return out

    def _all_gather_one_round(self, flat: torch.Tensor, o: torch.Tensor, dc: int) -> None:
        b = self._buf
        self._buf ^= 1
        slots, block = self._cut(b, flat.dtype, flat.numel())
        slots[self.index].copy_(flat)
        self._barrier.wait(self._seq, _ALL_GATHER, dc, flat.numel(), 0)
        o.copy_(block)  # every member's slot, own included (it holds what flat holds)

    def all_gather_v(self, tensor: torch.Tensor, why: int = 0) -> list[torch.Tensor]:
        """Gather 1-D tensors of *different* lengths: returns one tensor per member.

        Lengths travel in the barrier descriptors, so no extra round is needed to learn them. Lengths may differ,
        so two gathers of the same dtype always matched: ``why`` (a code of :func:`~.ops.barrier_reason`, checked
        like a reduce op) tells gathers of different things apart -- a member gathering one rank's state pieces
        while another gathers its sample indices, having taken another path, gets a ``CollectiveMismatchError``
        naming both, not the other's bytes to unpickle.
        """
        flat, _ = _flat(tensor)
        W, r, n = self.size, self.index, flat.numel()
        if W == 1:
            return [flat.clone()]
        self._seq += 1
        self._count("all_gather", flat)
        dc, cap = dtype_code(flat.dtype), self._cap(flat.dtype)
        outs: list[torch.Tensor] = []
        c0, rounds, c = 0, 1, 0
        while c < rounds:
            slots = self._slots(flat.dtype)
            L = max(0, min(cap, n - c0))
            slots[r][:L].copy_(flat[c0:c0 + L])
            g = self._sync(Coll.ALL_GATHER_V, dc, n, why, check=c == 0, check_numel=False)
            if c == 0:
                sizes = [n if j == r else self._barrier.peer_field(j, g, "numel") for j in range(W)]
                outs = [torch.empty(s, dtype=flat.dtype) for s in sizes]
                rounds = max(1, math.ceil(max(sizes) / cap))
            for j in range(W):
                Lj = max(0, min(cap, outs[j].numel() - c0))
                if Lj:
                    outs[j][c0:c0 + Lj].copy_(flat[c0:c0 + Lj] if j == r else slots[j][:Lj])
            c0 += cap
            c += 1
        return outs

    # ------------------------------------------------------------------ broadcast
    def broadcast(self, tensor: torch.Tensor, src_member: int = 0) -> torch.Tensor:
        """Copy member ``src_member``'s ``tensor`` into every member's ``tensor`` (in place)."""
        if not 0 <= src_member < self.size:
            raise ValueError(f"broadcast src_member must be a member index in [0, {self.size}), got {src_member}")
        if self.size == 1:
            return tensor
        flat, contiguous = _flat(tensor)
        n, r = flat.numel(), self.index
        self._seq += 1
        if r == src_member:
            self._count("broadcast", flat)
        dc = dtype_code(flat.dtype)
        hit = self._find_shared(flat) if contiguous else None
        if hit is not None:
            buf, off = hit
            self._sync(Coll.BROADCAST, dc, n, src_member + _SHARED_FLAG, check=True)
            if r != src_member:
                flat.copy_(buf.region(src_member)[off:off + n])
            # the source may not modify its buffer before everyone has copied it
            self._sync(Coll.BROADCAST, dc, n, src_member + _SHARED_FLAG, check=False)
        else:
            cap = self._cap(flat.dtype)
            for c0 in range(0, max(n, 1), cap):
                L = min(cap, n - c0)
                slots = self._slots(flat.dtype)
                if r == src_member:
                    slots[src_member][:L].copy_(flat[c0:c0 + L])
                self._sync(Coll.BROADCAST, dc, n, src_member, check=c0 == 0)
                if r != src_member:
                    flat[c0:c0 + L].copy_(slots[src_member][:L])
        if not contiguous and r != src_member:
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    # ------------------------------------------------------------------ python objects
    def broadcast_object(self, obj: Any, src_member: int = 0, why: int = 0) -> Any:
        """Pickle ``obj`` on member ``src_member`` and return it on every member (any size); ``why`` as for
        :meth:`all_gather_v`."""
        if not 0 <= src_member < self.size:
            raise ValueError(f"broadcast_object src_member must be a member index in [0, {self.size}), "
                             f"got {src_member}")
        if self.size == 1:
            return obj
        r, cap = self.index, self.config.slot_bytes
        self._seq += 1
        dc = dtype_code(torch.uint8)
        data = _to_bytes_tensor(obj) if r == src_member else None
        n = data.numel() if data is not None else -1
        c0, rounds, c = 0, 1, 0
        recv: Optional[torch.Tensor] = None
        while c < rounds:
            slots = self._slots(torch.uint8)
            if data is not None:
                L = min(cap, n - c0)
                slots[src_member][:L].copy_(data[c0:c0 + L])
            g = self._sync(Coll.BROADCAST_OBJECT, dc, n, src_member + why * OBJECT_WHY, check=c == 0,
                           check_numel=False)
            if c == 0:
                n = self._barrier.peer_field(src_member, g, "numel") if data is None else n
                rounds = max(1, math.ceil(n / cap))
                recv = torch.empty(n, dtype=torch.uint8) if data is None else None
            if recv is not None:
                L = min(cap, n - c0)
                recv[c0:c0 + L].copy_(slots[src_member][:L])
            c0 += cap
            c += 1
        return obj if recv is None else pickle.loads(recv.numpy().tobytes())

    def all_gather_object(self, obj: Any, why: int = 0) -> list[Any]:
        """Every member's picklable ``obj``, in member order; ``why`` as for :meth:`all_gather_v`."""
        if self.size == 1:
            return [obj]
        parts = self.all_gather_v(_to_bytes_tensor(obj), why)
        return [pickle.loads(p.numpy().tobytes()) for p in parts]


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A 1-D view of ``t`` if contiguous, else a contiguous copy (caller writes it back)."""
    if t.is_contiguous():
        return (t if t.dim() == 1 else t.view(-1)), True
    return t.contiguous().view(-1), False


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
