"""What flows between the layers of a pipelined Sequential, and between its stages: a tensor, or a
flat tuple of tensors (a layer that hands ``(hidden, skip)`` or ``(hidden, mask)`` to the next, as
``nn.Sequential`` allows in one process). These helpers treat both alike, keeping the structure. The
Sequential's own output, which only the step reads, may have any structure (:func:`tensors_in`)."""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch
from lightning_utilities.core.apply_func import apply_to_collection

Activation = Union[torch.Tensor, tuple[torch.Tensor, ...]]


def parts(a: Activation) -> tuple[torch.Tensor, ...]:
    if isinstance(a, torch.Tensor):
        return (a,)
    if isinstance(a, tuple) and all(isinstance(t, torch.Tensor) for t in a):
        return a
    inner = f" holding {sorted({type(t).__name__ for t in a})}" if isinstance(a, (tuple, list)) else ""
    raise TypeError(f"a pipeline hands a tensor or a tuple of tensors from layer to layer and stage to stage; "
                    f"a layer returned a {type(a).__name__}{inner}")


def checked(a: Any) -> Activation:
    """``a`` itself, once known to be what a channel carries: a tensor or a flat tuple of tensors."""
    parts(a)
    return a


def tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors of the Sequential's own output, which goes to the step and may have any structure (a dict or
    namedtuple of logits and features, as model heads return): it never crosses a stage boundary."""
    found: list[torch.Tensor] = []
    apply_to_collection(out, torch.Tensor, found.append)
    return found


def like(a: Activation, new: Sequence[torch.Tensor]) -> Activation:
    """``new`` in the structure of ``a`` (a lone tensor stays a tensor)."""
    return new[0] if isinstance(a, torch.Tensor) else tuple(new)


def detached(a: Activation) -> Activation:
    return like(a, [t.detach() for t in parts(a)])


def leaves(a: Activation, grad: bool = True) -> Activation:
    """New leaves of ``a``'s values (a measured layer's input, a checkpointed chunk's output on its way to the
    next stage), requiring a gradient -- if ``grad`` -- for their floating-point and complex parts."""
    return like(a, [t.detach().requires_grad_(grad and (t.is_floating_point() or t.is_complex())) for t in parts(a)])


class _Entry(torch.autograd.Function):
    """A leaf's values as a tensor of its own on the same memory, whose gradient goes to the leaf. In one process
    a stage's input is the previous layer's output, which a first ``nn.ReLU(inplace=True)`` changes in place (as
    torchvision's models do after every norm layer); autograd refuses that on a leaf, and on a view of one
    ("a leaf Variable that requires grad is being used in an in-place operation"). Not a view either (a tensor
    ``set_`` on the storage, with a version counter of its own), so an in-place change of it is checked against
    what autograd saved of it, as in one process."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage(), x.storage_offset(),
                                                                   x.size(), x.stride())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def entries(a: Activation) -> Activation:
    """What a chunk (or a timed layer) is called with: the parts of its input leaves that need a gradient as
    :class:`_Entry` tensors, which its first layer may change in place. The leaves keep the input gradient."""
    return like(a, [_Entry.apply(t) if t.requires_grad else t for t in parts(a)])


def copied(a: Any) -> Any:
    """``a`` with every tensor in it cloned, in any structure (a sample the planner times the layers on may be a
    dict the first layer takes)."""
    return apply_to_collection(a, torch.Tensor, torch.clone)


def backward(out: Activation, grad: Activation | None) -> None:
    """Back-propagate ``grad`` (None: ``out`` is a scalar loss) through the parts of ``out`` that need it."""
    if grad is None:
        torch.autograd.backward(out)
        return
    pairs = [(o, g) for o, g in zip(parts(out), parts(grad)) if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def input_grads(x: Activation) -> Activation:
    """The gradient of each part of a stage's input (zeros where none flowed: it goes back all the same)."""
    return like(x, [t.grad if t.grad is not None else torch.zeros_like(t) for t in parts(x)])


def requires_grad(a: Activation) -> bool:
    if isinstance(a, torch.Tensor):  # the common case, asked twice per backward between two actions
        return a.requires_grad
    return any(t.requires_grad for t in parts(a))
