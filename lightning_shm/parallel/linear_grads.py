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
    backward: dx = g @ W,  db = sum over rows of g
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


class WeightGradSink(Protocol):
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
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        gw = ctx.sink.weight_grad(ctx.param, x.detach().to(g.dtype), g.detach())
        return gx, gw, gb, None, None


LinearForward = Callable[[Any, Any, torch.Tensor], torch.Tensor]  # (module, owner, x) -> y


def route_linears(modules: Iterable[nn.Module], forward: LinearForward, owner: Any, attr: str = "forward",
                  kind: type = nn.Linear) -> None:
    """Run every ``kind`` module among ``modules`` through ``forward(module, owner, x)`` (installed as the
    instance attribute ``attr``), which decides per call between :class:`SinkLinear` and ``F.linear``."""
    for m in modules:
        if isinstance(m, kind):
            setattr(m, attr, functools.partial(forward, m, owner))


def restore_linears(modules: Iterable[nn.Module], attr: str = "forward", kind: type = nn.Linear) -> None:
    """Undo :func:`route_linears`."""
    for m in modules:
        if isinstance(m, kind):
            m.__dict__.pop(attr, None)
