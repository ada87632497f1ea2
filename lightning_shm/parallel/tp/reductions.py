"""A block's own code reducing over a column layer's split features: stopped, naming the call.

Between a column layer and its row layer a rank holds its share of the features (``[B, T, F_r]`` of ``F``).
Elementwise code runs on it as on the whole (an activation, dropout, a gate's product); a reduction over
the features does not -- ``F.normalize(h, dim=-1)``, ``F.layer_norm(h, h.shape[-1:])``, ``h.softmax(-1)``,
``h.pow(2).mean(-1)`` -- each rank reduces over its own features only, and the model trains otherwise than
in one process without an error (tp2, float64 Adam, 2 steps: 4.0e-2 off for either of the first two, a local
probe). Norm *modules* there are planned ``"between"`` (or refused by :mod:`.check` and the pre-hooks of
:mod:`.apply`); a call in a block's ``forward`` is seen only when it runs. So the first forward of each
module holding a column layer (outside an ``nn.Sequential``, whose children are checked by the plan) runs
under a :class:`~torch.overrides.TorchFunctionMode` that follows the column layer's output::

    h = fc1(x)        fc1 column: h is split along its last dim (a convolution's: dim 1)
    h = F.gelu(h)     elementwise: the result is split alike
    h = h.view(...)   any other op: no longer followed (heads viewed apart are reduced over legitimately)
    h.mean(-1)        a reduction over the split dim of a followed tensor: ValueError naming it
    h @ h.mT          a product contracting it too (single-head attention on split q and k; einsum alike)

Calls inside the tensor-parallel modules themselves (a distributed LayerNorm sums over its features and
all-reduces) are not looked at. After that first forward the hooks are removed: nothing is watched later.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

T = torch.Tensor
# elementwise functions: their output is split as their split input is (same shape)
_ELEMENTWISE = {
    torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.square, torch.sqrt, torch.rsqrt, torch.abs, torch.neg,
    torch.clamp, torch.where, torch.mul, torch.add, torch.sub, torch.div, torch.pow, torch.erf,
    F.relu, F.gelu, F.silu, F.mish, F.leaky_relu, F.elu, F.selu, F.celu, F.softplus, F.hardswish, F.hardsigmoid,
    F.relu6, F.hardtanh, F.dropout, F.sigmoid, F.tanh,
    T.__mul__, T.__rmul__, T.__add__, T.__radd__, T.__sub__, T.__rsub__, T.__truediv__, T.__rtruediv__,
    T.__pow__, T.__neg__, T.__iadd__, T.__imul__, T.mul, T.add, T.sub, T.div, T.pow, T.relu, T.sigmoid, T.tanh,
    T.exp, T.square, T.sqrt, T.rsqrt, T.abs, T.neg, T.clamp, T.float, T.double, T.to, T.type_as, T.contiguous,
    T.clone,
}
# reductions: (position of the dim argument counting the tensor, its default; None: every dim)
_DIM_AT: dict[Callable[..., Any], tuple[int, Any]] = {
    **{f: (1, None) for f in (torch.mean, torch.sum, torch.var, torch.std, torch.amax, torch.amin, torch.prod,
                              torch.nansum, torch.nanmean, torch.argmax, torch.argmin, torch.max, torch.min,
                              T.mean, T.sum, T.var, T.std, T.amax, T.amin, T.prod, T.nansum, T.nanmean, T.argmax,
                              T.argmin, T.max, T.min)},
    **{f: (1, "required") for f in (torch.logsumexp, torch.cumsum, torch.cumprod, torch.softmax, torch.log_softmax,
                                    T.logsumexp, T.cumsum, T.cumprod, T.softmax, T.log_softmax, F.softmax,
                                    F.log_softmax, F.softmin)},
    **{f: (2, None) for f in (torch.norm, T.norm, torch.linalg.vector_norm)},
    torch.topk: (2, -1), T.topk: (2, -1), torch.sort: (1, -1), T.sort: (1, -1), F.normalize: (2, 1),
}
_LAST_DIMS = (F.layer_norm, F.rms_norm)  # over the last len(normalized_shape) dims
# products: the first operand's last dim against the second's (second to last; a vector's only)
_PRODUCTS = {torch.matmul, torch.mm, torch.bmm, T.matmul, T.mm, T.bmm, T.__matmul__, T.__rmatmul__}


def _reduced_dims(func: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any], ndim: int) -> Optional[set[int]]:
    """The dims ``func`` reduces its first argument (of ``ndim`` dims) over; None: not a reduction here."""
    if func in _LAST_DIMS:
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
        return set(range(ndim - len(shape), ndim))
    if func is F.group_norm:
        return {1}
    if func not in _DIM_AT:
        return None
    at, default = _DIM_AT[func]
    dim = kwargs.get("dim", args[at] if len(args) > at else default)
    if isinstance(dim, (bool, torch.Tensor)) or dim == "required":  # var(x, True); max(x, other): elementwise
        return None
    if dim is None:
        return set(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return {d % ndim for d in dims if isinstance(d, int)} if ndim else set()


def _reductions(func: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> list[tuple[Any, set[int]]]:
    """Each tensor argument ``func`` reduces (or contracts) and the dims it reduces it over."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if func in _PRODUCTS and len(tensors) == 2:
        a, b = (tensors[1], tensors[0]) if func is T.__rmatmul__ else tensors
        return [(a, {a.dim() - 1}), (b, {max(b.dim() - 2, 0)})]
    if func is torch.einsum and args and isinstance(args[0], str):
        return _einsum(args[0], args[1:] if len(args) != 2 or isinstance(args[1], torch.Tensor) else args[1])
    if func is F.cosine_similarity and len(tensors) == 2:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 1)
        return [(x, {dim % x.dim()}) for x in tensors]
    if not args or not isinstance(args[0], torch.Tensor):
        return []
    dims = _reduced_dims(func, args, kwargs, args[0].dim())
    return [] if dims is None else [(args[0], dims)]


def _einsum(equation: str, operands: Any) -> list[tuple[Any, set[int]]]:
    """The dims of each operand whose letter the output of ``equation`` drops (an ellipsis: not followed)."""
    inputs, _, output = equation.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if not output and "->" not in equation:  # implicit output: the letters seen once, in order
        letters = "".join(terms)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return [(x, {i for i, c in enumerate(term) if c not in output}) for term, x in zip(terms, operands)
            if isinstance(x, torch.Tensor) and "." not in term]


class _Follow(TorchFunctionMode):
    """Follows the split tensors (id -> (the tensor, its split dim, the column layer)) through elementwise calls
    and raises on a reduction over a split dim."""

    def __init__(self, owner: str) -> None:
        super().__init__()
        self.owner, self.split, self.inside = owner, {}, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for x, reduced in _reductions(func, args, kwargs) if self.inside == 0 and self.split else ():
            held = self.split.get(id(x))
            if held is not None and held[0] is x:
                _, dim, column, sizes = held
                if dim in reduced:
                    raise ValueError(
                        f"'{self.owner}''s forward runs {_name(func)} over dim {dim} of the output of column layer "
                        f"'{column}', which tensor parallelism splits {list(sizes)} along that dim: each rank would "
                        "reduce over its own features only and train otherwise than one process. Plan "
                        f"'{column}' 'column_gathered' (its row layer then 'row_split_input'), or leave the pair "
                        "replicated")
        out = func(*args, **kwargs)
        if self.inside == 0 and func in _ELEMENTWISE and isinstance(out, torch.Tensor):
            for a in (*args, *kwargs.values()):
                held = self.split.get(id(a)) if isinstance(a, torch.Tensor) else None
                if held is not None and held[0] is a and a.shape == out.shape:
                    self.split[id(out)] = (out, *held[1:])
                    break
        return out


def _name(func: Any) -> str:
    """``torch.nn.functional.normalize``, ``Tensor.mean``, ``torch.mean``: how the model's code calls it."""
    name = getattr(func, "__name__", str(func))
    module = getattr(func, "__module__", None)
    if module is None:
        return f"Tensor.{name}"
    return f"{'torch' if module.startswith('torch._C') or module in ('torch', 'torch.functional') else module}.{name}"


def watch_split_reductions(local: Mapping[str, nn.Module], columns: Mapping[str, tuple[int, ...]],
                           replaced: Mapping[str, nn.Module]) -> None:
    """Arm the first forward of each module (of ``local``, not an ``nn.Sequential``) holding a column layer of
    ``columns`` (name -> sizes, the layers already replaced by ``replaced``'s): see the module docstring."""
    owners: dict[str, list[str]] = {}
    for col in columns:
        parent = col.rpartition(".")[0]
        if parent in local and not isinstance(local[parent], nn.Sequential):
            owners.setdefault(parent, []).append(col)
    for owner, cols in owners.items():
        _arm(owner, local[owner], {c: (replaced[c], columns[c]) for c in cols},
             [m for n, m in replaced.items() if n.startswith(f"{owner}.")])


def _arm(owner: str, module: nn.Module, cols: Mapping[str, tuple[nn.Module, tuple[int, ...]]],
         parallel: list[nn.Module]) -> None:
    mode = _Follow(owner or "<root>")
    handles: list[Any] = []
    state = {"armed": True, "entered": False}

    def enter(m: nn.Module, args: Any) -> None:
        if state["armed"]:
            mode.__enter__()
            state["entered"] = True

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        if not state["entered"]:
            return
        mode.__exit__(None, None, None)
        state["armed"] = state["entered"] = False
        mode.split.clear()
        if sys.exc_info()[0] is None:  # torch iterates the module's hook dict itself after an error in forward
            for h in handles:
                h.remove()

    def inside(m: nn.Module, args: Any) -> None:
        mode.inside += 1

    def outside(m: nn.Module, args: Any, out: Any) -> None:
        mode.inside -= 1

    def split(name: str, sizes: tuple[int, ...]) -> Callable[..., None]:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            if state["entered"] and isinstance(out, torch.Tensor) and out.dim() > 1:
                mode.split[id(out)] = (out, 1 if isinstance(m, nn.modules.conv._ConvNd) else out.dim() - 1, name,
                                       sizes)
        return hook

    handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    for m in parallel:
        handles += [m.register_forward_pre_hook(inside), m.register_forward_hook(outside, always_call=True)]
    for name, (m, sizes) in cols.items():
        handles.append(m.register_forward_hook(split(name, sizes)))
