"""Point-to-point channel: one sender rank, one receiver rank, a ring of message slots.

Used by pipeline stages (activations forward, activation gradients backward). Unlike a barrier,
only the two ends synchronise, and the sender runs ahead by up to ``slots`` messages::

    words:  [head (sender) .. | tail (receiver) .. | slot headers: nbytes dtype ndim shape[6] frag group grad]
    data:   [slot 0 payload | slot 1 payload | ... ]

* send: wait until ``tail > count - slots`` (the slot was consumed), copy the payload, write the
  header, then store ``head = count + 1`` (publishes header and payload; same ordering argument
  as :mod:`lightning_shm.runtime.barrier`).
* recv: wait until ``head > count``, read header and payload into a new tensor, then store
  ``tail = count + 1`` (frees the slot).

A message that fits a slot is copied once each way, between the tensor and a view of the slot with
the message's dtype and shape (cut once per shape: a pipeline sends the same shapes every
microbatch). This is the hand-over between two stages, on the critical path of every schedule, so
it is three tensor operations on each end, not a byte view, a slice and a copy per fragment.

Each message carries its dtype and shape; a tensor larger than a slot travels as fragments through
consecutive slots, so any size works with a bounded segment. A tuple of tensors (:meth:`Channel.send_obj`)
travels as consecutive messages whose ``group`` word counts the parts still to come (a lone tensor: 0).

A message also says whether its tensor requires a gradient (``grad``); the received tensor is a leaf with the
same flag. Why: in one process a layer's input requires a gradient only if something before it does. A
pipeline stage that made every received activation require one would compute an input gradient no one uses
(a frozen backbone on the stage before), and a layer that looks at the flag would act otherwise than in one
process (a reentrant ``torch.utils.checkpoint`` gives its layers no gradient when no input requires one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_shm.runtime.deadlock import RECEIVE, SEND
from lightning_shm.runtime.ops import DTYPE_CODE, dtype_code
from lightning_shm.runtime.segment import Segment, align_up, normal_views
from lightning_shm.runtime.wait import Waiter

_HEAD, _TAIL, _HDR0, _HDR_WORDS, _MAX_DIMS = 0, 16, 32, 16, 6
_FRAG, _GROUP, _GRAD = 3 + _MAX_DIMS, 4 + _MAX_DIMS, 5 + _MAX_DIMS  # header words after the shape
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
        self._views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._last_group = 0  # the group word of the last message received
        self.bytes_sent = 0

    def send_obj(self, obj: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """A tensor, or a tuple of tensors (received as a tuple by :meth:`recv_obj`)."""
        if isinstance(obj, torch.Tensor):
            self.send(obj)
            return
        for i, t in enumerate(obj):
            self.send(t, group=len(obj) - i)

    def recv_obj(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        first = self.recv()
        if not self._last_group:
            return first
        return (first, *[self.recv() for _ in range(self._last_group - 1)])

    def send(self, tensor: torch.Tensor, group: int = 0) -> None:
        if not self._is_sender:
            raise RuntimeError(f"rank {self.dst_rank} is the receiving end of channel {self.src_rank}->{self.dst_rank}")
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"channel messages support up to {_MAX_DIMS} dims, got shape {tuple(tensor.shape)}")
        t = tensor.detach() if tensor.requires_grad else tensor
        nbytes = t.numel() * t.element_size()
        if nbytes > self.config.slot_bytes:
            self._send_fragments(t.contiguous().view(-1).view(torch.uint8), tensor, group)
            return
        c = self._count  # one slot: copied straight into a view of the slot shaped like the message
        self._wait_slot_free(c)
        slot = c % self.config.slots
        if nbytes:
            self._view(slot, t.dtype, t.shape).copy_(t)
        self._publish(c, slot, nbytes, tensor, 0, group)
        self.bytes_sent += nbytes

    def recv(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Next message as a new tensor requiring a gradient if the sent one did (or copied into ``out``, which
        must match its shape/dtype and keeps its own flag)."""
        if self._is_sender:
            raise RuntimeError(f"rank {self.src_rank} is the sending end of channel {self.src_rank}->{self.dst_rank}")
        w, c = self._w, self._count
        if w[_HEAD] < c + 1:
            self._waiter.wait_ge(w, _HEAD, c + 1, lambda: self._timeout("recv", c), lambda: [self.src_rank],
                                     kind=RECEIVE)
        slot = c % self.config.slots
        h = _HDR0 + slot * _HDR_WORDS
        nbytes, dtype, self._last_group = w[h], _DTYPE_OF[w[h + 1]], w[h + _GROUP]
        shape = tuple(w[h + 3 + d] for d in range(w[h + 2]))
        grad = out is None and w[h + _GRAD] == 1
        if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous()):
            raise ValueError(f"recv: message is {shape} {dtype}, out is {tuple(out.shape)} {out.dtype}")
        if nbytes > self.config.slot_bytes:
            out = torch.empty(shape, dtype=dtype) if out is None else out
            self._recv_fragments(out.view(-1).view(torch.uint8), nbytes)
            return out.requires_grad_() if grad else out
        if nbytes == 0:
            out = torch.empty(shape, dtype=dtype) if out is None else out
        else:  # a copy out of the slot (never a view of it: the slot is reused once freed)
            view = self._view(slot, dtype, shape)
            out = view.clone() if out is None else out.copy_(view)
        w[_TAIL] = c + 1  # slot free again
        self._count = c + 1
        return out.requires_grad_() if grad else out

    # ------------------------------------------------------------------ plumbing
    def _view(self, slot: int, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """Slot ``slot``'s first bytes as a contiguous ``dtype`` tensor of ``shape``. A pipeline sends the
        same few shapes every microbatch, so views are cut once (bounded, like the group's cuts)."""
        key = (slot, dtype, tuple(shape))
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 64:
                self._views.clear()
            numel = math.prod(shape)
            with normal_views():
                view = self._views[key] = self._payload[slot].view(dtype)[:numel].view(shape)
        return view

    def _wait_slot_free(self, c: int) -> None:
        w = self._w
        if w[_TAIL] < c - self.config.slots + 1:
            self._waiter.wait_ge(w, _TAIL, c - self.config.slots + 1, lambda: self._timeout("send", c),
                                 lambda: [self.dst_rank], kind=SEND)

    def _publish(self, c: int, slot: int, nbytes: int, t: torch.Tensor, frag: int, group: int) -> None:
        """Header first, then ``head``: a reader that sees the new head sees header and payload. ``t`` is the
        tensor as sent (its ``requires_grad`` is the message's ``grad`` word)."""
        w, h = self._w, _HDR0 + slot * _HDR_WORDS
        w[h] = nbytes
        w[h + 1] = dtype_code(t.dtype)
        w[h + 2] = t.dim()
        for d, size in enumerate(t.shape):
            w[h + 3 + d] = size
        w[h + _FRAG] = frag
        w[h + _GROUP] = group
        w[h + _GRAD] = int(t.requires_grad)
        w[_HEAD] = c + 1  # publish
        self._count = c + 1

    def _send_fragments(self, raw: torch.Tensor, t: torch.Tensor, group: int) -> None:
        """A message larger than a slot: its bytes through consecutive slots, one fragment each."""
        nbytes, sb, S = raw.numel(), self.config.slot_bytes, self.config.slots
        for f in range(math.ceil(nbytes / sb)):
            c = self._count
            self._wait_slot_free(c)
            L = min(sb, nbytes - f * sb)
            self._payload[c % S][:L].copy_(raw[f * sb:f * sb + L])
            self._publish(c, c % S, nbytes, t, f, group)
        self.bytes_sent += nbytes

    def _recv_fragments(self, raw: torch.Tensor, nbytes: int) -> None:
        w, S, sb = self._w, self.config.slots, self.config.slot_bytes
        for f in range(math.ceil(nbytes / sb)):
            c = self._count
            if w[_HEAD] < c + 1:
                self._waiter.wait_ge(w, _HEAD, c + 1, lambda: self._timeout("recv", c), lambda: [self.src_rank],
                                     kind=RECEIVE)
            L = min(sb, nbytes - f * sb)
            raw[f * sb:f * sb + L].copy_(self._payload[c % S][:L])
            w[_TAIL] = c + 1  # slot free again
            self._count = c + 1

    def _timeout(self, what: str, count: int) -> str:
        peer = self.dst_rank if what == "send" else self.src_rank
        return (f"channel {self.src_rank}->{self.dst_rank}: {what} of message #{count} timed out after "
                f"{self._waiter.policy.timeout_s:g} s waiting for rank {peer}")
