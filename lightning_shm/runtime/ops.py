"""Reduction operators, collective/dtype codes and the elementwise fold every reduction uses.

The fold always combines contributions in member order ``0, 1, ..., W-1``. Floating-point addition
is not associative, so a rank-dependent order would leave replicas differing in the last bits and
drifting apart over training; with one canonical order every rank computes bit-identical results.
"""

from __future__ import annotations

import enum
import zlib
from typing import Sequence, Union

import torch


class ReduceOp(enum.IntEnum):
    SUM = 1
    MEAN = 2
    MAX = 3
    MIN = 4

    @classmethod
    def parse(cls, op: Union[str, "ReduceOp", object]) -> "ReduceOp":
        """Accept "sum"/"mean"/"avg"/"max"/"min", our enum, or ``torch.distributed.ReduceOp``."""
        if op.__class__ is cls:  # the hot path (small collectives): no isinstance, no enum attribute lookups
            return op  # type: ignore[return-value]
        known = _PARSED.get(op) if op.__class__ is str else None
        if known is not None:
            return known
        if isinstance(op, str):
            key = op.lower()
        else:  # torch.distributed.ReduceOp / RedOpType without importing torch.distributed
            key = str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()
        aliases = {"sum": cls.SUM, "mean": cls.MEAN, "avg": cls.MEAN, "max": cls.MAX, "min": cls.MIN}
        if key not in aliases:
            raise ValueError(f"unsupported reduce op {op!r}; use one of {sorted(aliases)}")
        return aliases[key]


_PARSED = {"sum": ReduceOp.SUM, "mean": ReduceOp.MEAN, "avg": ReduceOp.MEAN, "max": ReduceOp.MAX,
           "min": ReduceOp.MIN}
# an enum member looked up through its class costs ~0.2 us, on every small collective
_MEAN, _MAX = ReduceOp.MEAN, ReduceOp.MAX
_ADDITIVE = (ReduceOp.SUM, ReduceOp.MEAN)


class Coll(enum.IntEnum):
    """Codes written into barrier descriptors, so mismatched calls are named in errors."""

    BARRIER = 1
    ALL_REDUCE = 2
    REDUCE_SCATTER = 3
    ALL_GATHER = 4
    ALL_GATHER_V = 5
    BROADCAST = 6
    BROADCAST_OBJECT = 7
    VOTE = 8


_DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.bfloat16, torch.float16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,  # complex weights (spectral layers): summed and averaged, never ordered
]
DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_BOOL = torch.bool


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODE[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by the shared-memory collectives") from None


def dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else f"<none:{code}>"


def op_name(code: int) -> str:
    try:
        return Coll(code).name.lower()
    except ValueError:
        return f"<op {code}>"


# A collective's own argument in its barrier descriptor: the reduce op (or source member), plus SHARED_FLAG when
# the zero-copy path is taken, plus a reduce-scatter's caller site in multiples of SITE (group.py adds them).
SHARED_FLAG = 16
SITE = 32


def site_of(arg: int) -> int:
    """The caller site a descriptor's argument carries (0: none given)."""
    return arg // SITE


# Why a barrier waits, for the message of a rank that meets it in another collective: a code in the barrier's
# descriptor (crc32 of the text: the same in every process) and the text registered under it where it is defined.
_WHY: dict[int, str] = {}


def barrier_reason(text: str) -> int:
    """The code of ``text`` for ``Group.barrier(why=...)``; register it at import, so every process can say it."""
    code = zlib.crc32(text.encode()) & 0x7FFFFFFF or 1
    _WHY[code] = text
    return code


def reason_name(code: int) -> str:
    """What a barrier's or vote's reason code stands for (its registered text)."""
    return _WHY.get(code, f"<reason {code}>")


# An object broadcast's argument: its source member plus its reason times this (sources < 2**20).
OBJECT_WHY = 1 << 20


def arg_name(coll: int, arg: int) -> str:
    """A collective's own argument, as its descriptor carries it (reduce op, source member, a barrier's or an
    object collective's reason)."""
    if coll in (Coll.BARRIER, Coll.ALL_GATHER_V) and arg in _WHY:
        return f"why: {_WHY[arg]}"
    if coll == Coll.BROADCAST_OBJECT:
        why = arg // OBJECT_WHY
        return f"src_member={arg % OBJECT_WHY}" + (f", why: {reason_name(why)}" if why else "")
    if coll in (Coll.ALL_REDUCE, Coll.REDUCE_SCATTER):
        try:
            name = f"reduce={ReduceOp(arg % SHARED_FLAG).name.lower()}"
        except ValueError:
            return f"reduce=<{arg}>"
        where = f", site={site_of(arg)}" if site_of(arg) else ""
        return name + (", zero-copy" if arg % SITE >= SHARED_FLAG else "") + where
    if coll in (Coll.BROADCAST, Coll.BROADCAST_OBJECT):
        return f"src_member={arg % SHARED_FLAG}"
    return f"arg={arg}"


def check_reducible(dtype: torch.dtype, op: ReduceOp) -> None:
    if dtype is _BOOL:
        raise TypeError("reductions of bool tensors are not supported; convert to uint8/int64 first")
    if op is _MEAN and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"mean of an integer tensor ({dtype}) is not defined; reduce with 'sum' and divide")
    if dtype.is_complex and op not in _ADDITIVE:
        raise TypeError(f"{op.name.lower()} of a complex tensor ({dtype}) is not defined: complex numbers have no "
                        "order; reduce with 'sum' or 'mean'")


def even_split(n: int, parts: int) -> list[int]:
    """Boundaries of ``n`` elements split into ``parts`` contiguous pieces, the first ``n % parts`` one longer.

    Same sizes as ``torch.tensor_split``; returns ``parts + 1`` offsets.
    """
    q, r = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return bounds


def divide_(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t /= size`` in place: a mean's last step. ``size`` a power of two: ``t *= 1 / size`` instead -- the
    same bits (the reciprocal is exact, and both operations round the same exact quotient, subnormals
    included), and on cached data the multiplication takes about half the division's time: one thread
    here, half of the reference MLP's gradient bucket (109,349 float32), add then scale: 49-58 us with
    the division, 34-40 us with the multiplication (the add alone 20-28). Other sizes and complex tensors
    divide."""
    if size & (size - 1) == 0 and t.is_floating_point():
        return t.mul_(1.0 / size)
    return t.div_(size)


def fold_onto_own(op: ReduceOp, srcs: Sequence[torch.Tensor], own: int, out: torch.Tensor) -> None:
    """:func:`fold` into ``out`` that already holds ``srcs[own]`` (this member's contribution): the
    one-shot all-reduce's last step.

    Why a second entry: at W=2 a sum needs one in-place add, ``out += srcs[1 - own]`` (~2 us on
    4 KiB), where ``torch.add(..., out=)`` costs ~5 us. Still bit-identical on every rank: IEEE
    addition is commutative, so member 1's ``x1 + x0`` equals member 0's ``x0 + x1``, and later
    sources are added in member order on every rank. (Only a NaN's payload may differ.) Max/min
    (which of +0 / -0 wins depends on the operand order) and low precision take :func:`fold`.
    """
    if own < 2 and len(srcs) > 1 and op in _ADDITIVE and out.dtype not in _LOW_PRECISION:
        out.add_(srcs[1 - own])
        for s in srcs[2:]:
            out.add_(s)
        if op is _MEAN:
            divide_(out, len(srcs))
    else:
        fold(op, srcs, out, len(srcs))


def fold(op: ReduceOp, srcs: Sequence[torch.Tensor], out: torch.Tensor, size: int) -> None:
    """``out = srcs[0] (op) srcs[1] (op) ...`` in member order; ``mean`` divides by ``size``.

    ``out`` may alias ``srcs[0]`` or ``srcs[1]`` (elementwise, read-before-write per index) but
    no later source. bfloat16/float16 accumulate in float32 and round once, like ``torch.sum``.
    """
    if len(srcs) == 1:
        if out.data_ptr() != srcs[0].data_ptr():
            out.copy_(srcs[0])
        return
    if out.dtype in _LOW_PRECISION and op in _ADDITIVE:
        acc = srcs[0].float()
        for s in srcs[1:]:
            acc.add_(s)
        if op is _MEAN:
            divide_(acc, size)
        out.copy_(acc)
        return
    if op in _ADDITIVE:
        torch.add(srcs[0], srcs[1], out=out)
        for s in srcs[2:]:
            out.add_(s)
        if op is _MEAN:
            divide_(out, size)
    elif op is _MAX:
        torch.maximum(srcs[0], srcs[1], out=out)
        for s in srcs[2:]:
            torch.maximum(out, s, out=out)
    else:
        torch.minimum(srcs[0], srcs[1], out=out)
        for s in srcs[2:]:
            torch.minimum(out, s, out=out)
