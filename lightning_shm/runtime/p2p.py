"""Point-to-point channel: one sender rank, one receiver rank, a ring of message slots.

Used by pipeline stages (activations forward, activation gradients backward). Unlike a barrier,
only the two ends synchronise, and the sender runs ahead by up to ``slots`` messages::

    words:  [head (sender) .. | tail (receiver) .. | slot headers: nbytes dtype ndim shape[6] frag]
    data:   [slot 0 payload | slot 1 payload | ... ]

* send: wait until ``tail > count - slots`` (the slot was consumed), copy the payload, write the
  header, then store ``head = count + 1`` (publishes header and payload; same ordering argument
  as :mod:`lightning_shm.runtime.barrier`).
* recv: wait until ``head > count``, read header and payload into a new tensor, then store
  ``tail = count + 1`` (frees the slot).

Each message carries its dtype and shape; a tensor larger than a slot travels as fragments through
consecutive slots, so any size works with a bounded segment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_shm.runtime.ops import DTYPE_CODE, dtype_code
from lightning_shm.runtime.segment import Segment, align_up
from lightning_shm.runtime.wait import Waiter

_HEAD, _TAIL, _HDR0, _HDR_WORDS, _MAX_DIMS = 0, 16, 32, 16, 6
_DTYPE_OF = {code: dt for dt, code in DTYPE_CODE.items()}


@dataclass(frozen=True)
class ChannelConfig:
    slots: int = 4
    slot_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"a channel needs at least 1 slot, got {self.slots}")
        if self.slot_bytes < 64 or self.slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {self.slot_bytes}")

    def segment_bytes(self) -> int:
        return self._data_offset() + self.slots * self.slot_bytes

    def _data_offset(self) -> int:
        return align_up((_HDR0 + self.slots * _HDR_WORDS) * 8, 4096)


class Channel:
    """One direction between global ranks ``src_rank`` and ``dst_rank``: only the first sends,
    only the second receives."""

    def __init__(self, segment: Segment, src_rank: int, dst_rank: int, me: int, waiter: Waiter,
                 config: ChannelConfig) -> None:
        if me not in (src_rank, dst_rank):
            raise ValueError(f"rank {me} is neither end of channel {src_rank}->{dst_rank}")
        self.src_rank, self.dst_rank, self.config = src_rank, dst_rank, config
        self._is_sender = me == src_rank
        self._w = segment.words()
        self._waiter = waiter
        base = config._data_offset()
        self._payload = [segment.tensor(torch.uint8, base + s * config.slot_bytes, config.slot_bytes)
                         for s in range(config.slots)]
        self._count = self._w[_HEAD] if self._is_sender else self._w[_TAIL]
        self.bytes_sent = 0

    def send(self, tensor: torch.Tensor) -> None:
        if not self._is_sender:
            raise RuntimeError(f"rank {self.dst_rank} is the receiving end of channel {self.src_rank}->{self.dst_rank}")
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"channel messages support up to {_MAX_DIMS} dims, got shape {tuple(tensor.shape)}")
        t = tensor.detach().contiguous()
        raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        nbytes, sb, S, w = raw.numel(), self.config.slot_bytes, self.config.slots, self._w
        for f in range(max(1, math.ceil(nbytes / sb))):
            c = self._count
            if w[_TAIL] < c - S + 1:
                self._waiter.wait_ge(w, _TAIL, c - S + 1, lambda: self._timeout("send", c),
                                     lambda: [self.dst_rank])
            slot = c % S
            L = min(sb, nbytes - f * sb)
            if L:
                self._payload[slot][:L].copy_(raw[f * sb:f * sb + L])
            h = _HDR0 + slot * _HDR_WORDS
            w[h] = nbytes
            w[h + 1] = dtype_code(t.dtype)
            w[h + 2] = t.dim()
            for d, size in enumerate(t.shape):
                w[h + 3 + d] = size
            w[h + 3 + _MAX_DIMS] = f
            w[_HEAD] = c + 1  # publish
            self._count = c + 1
        self.bytes_sent += nbytes

    def recv(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Next message as a new tensor (or copied into ``out``, which must match its shape/dtype)."""
        if self._is_sender:
            raise RuntimeError(f"rank {self.src_rank} is the sending end of channel {self.src_rank}->{self.dst_rank}")
        w, S, sb = self._w, self.config.slots, self.config.slot_bytes
        c = self._count
        if w[_HEAD] < c + 1:
            self._waiter.wait_ge(w, _HEAD, c + 1, lambda: self._timeout("recv", c), lambda: [self.src_rank])
        h = _HDR0 + (c % S) * _HDR_WORDS
        nbytes, dtype = w[h], _DTYPE_OF[w[h + 1]]
        shape = tuple(w[h + 3 + d] for d in range(w[h + 2]))
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"recv: message is {shape} {dtype}, out is {tuple(out.shape)} {out.dtype}")
        raw = out.view(-1).view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8)
        for f in range(max(1, math.ceil(nbytes / sb))):
            c = self._count
            if w[_HEAD] < c + 1:
                self._waiter.wait_ge(w, _HEAD, c + 1, lambda: self._timeout("recv", c), lambda: [self.src_rank])
            L = min(sb, nbytes - f * sb)
            if L:
                raw[f * sb:f * sb + L].copy_(self._payload[c % S][:L])
            w[_TAIL] = c + 1  # slot free again
            self._count = c + 1
        return out

    def _timeout(self, what: str, count: int) -> str:
        peer = self.dst_rank if what == "send" else self.src_rank
        return (f"channel {self.src_rank}->{self.dst_rank}: {what} of message #{count} timed out after "
                f"{self._waiter.policy.timeout_s:g} s waiting for rank {peer}")
