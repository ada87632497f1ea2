"""A Linear whose weight gradient its owner takes, not autograd: the DDP reducer, the pipeline engine.

Why: autograd's weight gradient of ``F.linear`` is a fresh ``g^T @ x`` -- weight-sized memory written
for every backward, then copied where the owner keeps gradients (a DDP bucket) or, once ``.grad``
exists, added to it (write the product, read it and ``.grad``, write ``.grad``). One thread, a
[4096, 4096] float32 product over 64 rows, with the workers' malloc settings (freed memory kept),
three runs: fresh product 33-34 ms, fresh product + copy 46 ms, product written into existing
memory 33-34 ms. The owner knows the better destination: the DDP reducer writes the product
straight into the parameter's bucket region; the pipeline engine adds it in place or gathers
several microbatches' rows first.

Data movement of :class:`SinkLinear` (``x [..., in]``, ``g = dL/dy [..., out]``)::

    forward:  y = x @ W^T + b                     saves x and W (what F.linear's node saves)
    backward: dx = g @ W,  db = sum over rows of g   (dx through sink.padded: see PaddedWeights)
              dW = sink.weight_grad(W, x, g)       the sink computes or stashes g^T @ x; what it
                                                   returns (or None) is W's gradient for autograd,
                                                   so W's hooks and AccumulateGrad still run on it
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class PaddedWeights:
    """``dx = g @ W`` through a copy of ``W`` whose rows lie 64 bytes further apart, when ``W``'s rows are a
    multiple of 8 KiB apart: MKL's product in that layout (``W`` not transposed) slows down at such
    strides for up to 128 rows of ``g`` -- cache-set aliasing while it packs ``W``, presumably. One thread
    here, ms plain / through the copy (the copy alone): ``g[128, 2048] @ W[2048, 4096]`` 66.9 / 31.9 (8.9),
    ``g[32, 2048] @ W[2048, 4096]`` 21.4 / 11.0, ``W[2048, 2048]`` at 128 rows 34.1 / 14.5, at 256 rows
    the plain product is as fast (51.5 / 54.1); 12 and 20 KiB strides gain less, 4 KiB ones nothing; the
    forward's ``x @ W^T`` is unaffected.

    A copy serves every microbatch of a step (the pipeline) and is made again when ``W`` has changed in
    place since (its version counter). The owner calls :meth:`clear` at the end of each step: that holds
    the copies' memory (one weight each) only while it back-propagates, and it is what keeps a copy from
    outliving its weight's values where the version counter cannot see the change (a weight in shared
    memory that another process rewrites)."""

    min_numel = 1 << 20  # smaller weights: the copy costs what it saves
    max_rows = 128  # measured slow up to here; at 256 rows the plain product is as fast
    stride_multiple = 8192  # bytes between W's rows
    pad_bytes = 64

    def __init__(self) -> None:
        self._copies: dict[int, tuple[int, torch.Tensor]] = {}  # W's data_ptr -> (W's version, copy)

    def wanted(self, g: torch.Tensor, w: torch.Tensor) -> bool:
        return (w.dim() == 2 and w.stride(1) == 1 and w.numel() >= self.min_numel and g.dtype == w.dtype
                and (w.stride(0) * w.element_size()) % self.stride_multiple == 0
                and g.numel() // g.shape[-1] <= self.max_rows)

    def input_grad(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.wanted(g, w):
            return g.matmul(w)
        held = self._copies.get(w.data_ptr())
        if held is None or held[0] != w._version or held[1].shape != w.shape or held[1].dtype != w.dtype:
            pad = self.pad_bytes // w.element_size()
            copy = torch.empty(w.shape[0], w.shape[1] + pad, dtype=w.dtype)[:, :w.shape[1]]
            copy.copy_(w)
            held = self._copies[w.data_ptr()] = (w._version, copy)
        return g.reshape(-1, g.shape[-1]).mm(held[1]).view(*g.shape[:-1], w.shape[1])

    def clear(self) -> None:
        self._copies.clear()

    def __len__(self) -> int:
        return len(self._copies)


class WeightGradSink(Protocol):
    padded: PaddedWeights  # the input gradient's re-strided weights, cleared by the sink after each step

    def weight_grad(self, param: nn.Parameter, x: torch.Tensor, g: torch.Tensor) -> Optional[torch.Tensor]:
        """``param``'s gradient ``g^T @ x`` (rows flattened): returned for autograd, or taken (None)."""


class SinkLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradient ``sink`` takes. Autocast: backward runs under forward's
    autocast state (``custom_bwd``), so the sink gets operands of the dtype forward computed in."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                sink: WeightGradSink, param: nn.Parameter) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.param, ctx.has_bias = sink, param, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        gx = ctx.sink.padded.input_grad(g, weight) if ctx.needs_input_grad[0] else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gw = ctx.sink.weight_grad(ctx.param, x.detach().to(g.dtype), g.detach())
        return gx, gw, gb, None, None


LinearForward = Callable[[Any, Any, torch.Tensor], torch.Tensor]  # (module, owner, x) -> y


def route_linears(modules: Iterable[nn.Module], forward: LinearForward, owner: Any, attr: str = "forward",
                  kind: type = nn.Linear) -> None:
    """Run every ``kind`` module among ``modules`` through ``forward(module, owner, x)`` (installed as the
    instance attribute ``attr``), which decides per call between :class:`SinkLinear` and ``F.linear``. Not a
    subclass with its own ``attr`` (a scaled or LoRA Linear): ``F.linear`` would replace what it computes."""
    for m in modules:
        if routable(m, attr, kind):
            setattr(m, attr, functools.partial(forward, m, owner))


def routable(m: nn.Module, attr: str = "forward", kind: type = nn.Linear) -> bool:
    return isinstance(m, kind) and getattr(type(m), attr) is getattr(kind, attr)


def restore_linears(modules: Iterable[nn.Module], attr: str = "forward", kind: type = nn.Linear) -> None:
    """Undo :func:`route_linears`."""
    for m in modules:
        if routable(m, attr, kind):
            m.__dict__.pop(attr, None)
