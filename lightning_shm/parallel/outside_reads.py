"""Parameters a loss reads by itself, outside the layers that own them.

A layer computes with its parameters inside its forward, where each parallelism gives it what one
process has (FSDP the gathered full parameters, tensor parallelism its slice with the collectives
around it, a pipeline stage its own layers). A loss term the step computes on the parameters directly
-- an L2 penalty over ``self.parameters()``, a norm of one weight -- reads what the rank holds: a row
block or a slice under shm_fsdp / shm_tp, which makes it another loss on every rank (a mean over a piece
is not the mean over the whole; measured, 0.029 off one process after 4 steps under shm_fsdp), or
another stage's parameters not at all. Such reads are found in the loss's autograd graph::

    loss ---> ... ---> [a layer's output]  --- inside the layer: legitimate, not walked
         \\--> pow --> sum --> AccumulateGrad(piece)  <- read outside: named

Boundaries are the outputs of the layers that own the parameters and, under FSDP, the gather edge
(``_GatherUnit``) a unit's forward reads its full parameters through. The walk does not go below a
boundary, so it finds what joins the graph after the layers -- a term added to the loss, the usual
case -- not a read feeding some layer's input. One check, on the first training step (automatic
optimization: under manual optimization backward runs inside the step). Where the step differentiates by
itself, the graph's backward nodes read parameters legitimately, so the walk looks instead for the gradients
the step took with respect to pieces (:func:`differentiations`): a gradient-norm penalty reads one outside
the layers (measured under tp2: 0.04 off one process after 2 Adam steps), MAML's inner step feeds it to them.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.overrides import TorchFunctionMode


def read_outside(loss: torch.Tensor, pieces: Mapping[int, str], boundary: set[Any],
                 grads: Mapping[tuple[Any, int], str] = {}) -> list[str]:
    """Names of the parameters in ``pieces`` (id -> name) that ``loss`` reaches without passing a node of
    ``boundary`` (or a gather edge of FSDP), in ``pieces``' order, then of those whose gradient in ``grads``
    (its autograd edge, ``(grad_fn, output_nr)`` -> the parameter's name: see :func:`differentiations`) it
    reaches so: walks the autograd graph from ``loss``."""
    found: dict[str, None] = {}
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen or fn in boundary or type(fn).__name__ == "_GatherUnitBackward":
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if var is not None and id(var) in pieces:
            found[pieces[id(var)]] = None
        for edge in fn.next_functions:
            if edge in grads:
                found[grads[edge]] = None
            todo.append(edge[0])
    return [n for n in dict.fromkeys([*pieces.values(), *grads.values()]) if n in found]


@contextlib.contextmanager
def output_nodes(modules: Iterable[nn.Module]) -> Iterator[tuple[set[Any], set[int]]]:
    """Inside, the autograd nodes of the ``modules``' outputs are collected into the first yielded set (after the
    model's own forward hooks: what the layer hands on), and the ids of the modules called into the second."""
    nodes: set[Any] = set()
    ran: set[int] = set()

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        ran.add(id(module))
        apply_to_collection(output, torch.Tensor, lambda t: nodes.add(t.grad_fn) if t.grad_fn is not None else None)

    handles = [m.register_forward_hook(keep) for m in modules]
    try:
        yield nodes, ran
    finally:
        for h in handles:
            h.remove()


# where gradients the step takes with respect to parameters are what one process takes
WHERE_GRADIENTS_WORK = (
    "shm_ddp gives each rank the gradient of its own batch, as Lightning's ddp does (MAML's per-task steps train "
    "there as one process); shm_tp too, where the gradient is used inside the layers (functional_call(self, "
    "{name: p - lr * g}, x)).")


@dataclass
class Differentiations:
    """What the step's own calls of ``torch.autograd.grad`` / ``backward`` did (:func:`differentiations`)."""

    called: bool = False
    grads: dict[tuple[Any, int], str] = field(default_factory=dict)  # a piece's gradient's autograd edge -> name


@contextlib.contextmanager
def differentiations(pieces: Mapping[int, str] = {},
                     refuse: Optional[Callable[[list[str]], None]] = None) -> Iterator[Differentiations]:
    """Inside, a call of ``torch.autograd.grad`` / ``backward`` (``Tensor.backward`` too) sets ``called``: a step
    that differentiates itself (a gradient penalty, ``create_graph=True``) builds graph nodes in backward that
    read the parameters legitimately, which the walk cannot tell from a step's own reads. A gradient taken with
    respect to one of ``pieces`` (id -> name) is what the rank holds -- a piece of the parameter's gradient:
    ``refuse`` (given the names) is called before it is taken; else the gradient's edge is kept in ``grads``
    (``create_graph=True``), for :func:`read_outside` to find whether the loss reads it outside the layers
    (a norm of the gradient: a piece's) or only through them (MAML's ``p - lr * g`` given to the layer)."""
    seen = Differentiations()
    autograd = torch.autograd
    originals = autograd.grad, autograd.backward

    def grad(*args: Any, **kwargs: Any) -> Any:
        seen.called = True
        inputs = kwargs["inputs"] if "inputs" in kwargs else args[1] if len(args) > 1 else ()
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        names = [pieces[id(t)] for t in inputs if id(t) in pieces]
        if names and refuse is not None:
            refuse(names)
        out = originals[0](*args, **kwargs)
        for t, g in zip(inputs, out):
            if id(t) in pieces and g is not None and g.grad_fn is not None:
                seen.grads[(g.grad_fn, g.output_nr)] = pieces[id(t)]
        return out

    def backward(*args: Any, **kwargs: Any) -> Any:
        seen.called = True
        return originals[1](*args, **kwargs)

    autograd.grad, autograd.backward = grad, backward
    try:
        yield seen
    finally:
        autograd.grad, autograd.backward = originals


class _PieceReads(TorchFunctionMode):
    """Records every piece (id in ``pieces``) a torch function takes while gradients are on, outside the forward of
    each module holding it (``holders``: piece id -> those modules' ids; ``open``: module id -> its forwards now
    open) -- a layer's own forward reads its piece legitimately; FSDP's gathered parameters are other tensors.
    Tensor properties (``.shape``) are not reads. For each such read, the innermost module whose ``forward`` is
    running: one of the piece's holders -- called directly, ``layer.forward(x)``, which runs no hooks -- goes
    into ``direct``; another module into ``readers`` (a block passing its child's weight to a function itself,
    as torchvision's Swin attention does with ``self.qkv.weight``)."""

    def __init__(self, pieces: Mapping[int, str], holders: Mapping[int, frozenset[int]],
                 open_: Mapping[int, int]) -> None:
        super().__init__()
        self.pieces, self.holders, self.open, self.found = pieces, holders, open_, dict[str, None]()
        self.direct, self.readers = dict[int, None](), dict[int, None]()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_grad_enabled() and getattr(func, "__name__", "") != "__get__":
            apply_to_collection((args, kwargs), torch.Tensor, self._note)
        return func(*args, **kwargs)

    def _note(self, t: torch.Tensor) -> None:
        holders = self.holders.get(id(t), frozenset())
        if id(t) not in self.pieces or any(self.open.get(h) for h in holders):
            return
        self.found[self.pieces[id(t)]] = None
        frame = sys._getframe()
        while frame is not None:
            module = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
            if isinstance(module, nn.Module):
                (self.direct if id(module) in holders else self.readers)[id(module)] = None
                return
            frame = frame.f_back


def pieces_read_by(step: Callable[[], Any], pieces: Mapping[int, str],
                   owners: Iterable[nn.Module]) -> tuple[list[str], list[int], list[int]]:
    """Run ``step`` again (it failed; its side effects no longer matter) and name the pieces it computed with
    outside the layers that own them, up to where it fails, with the ids of the modules in whose ``forward``
    it did so (:class:`_PieceReads`): holders called directly, and other modules. Why a second run: a read of a
    piece usually fails with some shape error deep in the step (``Expected input batch_size (72) to match
    target batch_size (144)``: a tied head's ``F.linear(h, self.wte.weight)`` on half the vocabulary) before
    the loss exists for :func:`read_outside` to walk, and watching every torch function of every first step
    would cost it (and a compiled model's tracing) for nothing."""
    open_: dict[int, int] = {}

    def enter(module: nn.Module, *_: Any) -> None:
        open_[id(module)] = open_.get(id(module), 0) + 1

    def leave(module: nn.Module, *_: Any) -> None:
        open_[id(module)] -= 1

    owners = list(owners)
    holders: dict[int, frozenset[int]] = {}
    for m in owners:
        for p in m._parameters.values():
            if p is not None and id(p) in pieces:
                holders[id(p)] = holders.get(id(p), frozenset()) | {id(m)}
    handles = [h for m in owners for h in (m.register_forward_pre_hook(enter, prepend=True),
                                           m.register_forward_hook(leave))]
    mode = _PieceReads(pieces, holders, open_)
    try:
        with mode:
            step()
    except Exception:  # noqa: BLE001 -- the failure already being reported; only the reads matter here
        pass
    finally:
        for h in handles:
            h.remove()
    return list(mode.found), list(mode.direct), list(mode.readers)


def explain_failure(error: BaseException, names: list[str], held: str, direct: Sequence[str] = (),
                    readers: Sequence[str] = ()) -> ValueError:
    """The error of a step that failed after reading pieces outside their layers, saying so; ``direct``: the
    modules holding them whose ``forward`` the step called itself; ``readers``: modules (of the model, below
    the LightningModule) whose own ``forward`` read them without calling their holders."""
    if direct:
        advice = (f"It called the forward of {list(direct[:4])} itself (layer.forward(x)), which runs none of the "
                  "hooks the layout gathers or splits the parameters in: call the module, layer(x).")
    elif readers:
        advice = (f"The forward of {list(readers[:4])} reads them itself, without calling the modules that hold "
                  "them (a block passing its child's weight to a function, as torchvision's Swin attention does "
                  "with self.qkv.weight): under shm_fsdp make such a block one unit (a unit_policy naming it, not "
                  "its children) or keep the default gather='view', whose step sees whole parameters; under tensor "
                  "parallelism leave its children out of the plan -- or use shm_ddp.")
    else:
        advice = ("Read a parameter through a module's forward -- for an output layer tied to the input embedding, "
                  "an nn.Linear holding its weight (self.lm_head.weight = self.wte.weight), which shm_fsdp gathers "
                  "around both -- or use shm_ddp.")
    return ValueError(
        f"{type(error).__name__}: {error}\n-- training_step computed with {names[:4]}"
        f"{' ...' if len(names) > 4 else ''} outside the forward of the modules holding them; here each rank holds "
        f"{held} of them, which is most likely why it failed. " + advice)


def refuse_outside_reads(names: list[str], held: str, never_called: Sequence[str] = ()) -> None:
    """``never_called``: the modules holding those parameters that the step never called as modules (their forward
    hooks did not run) -- it ran their ``forward`` itself, or used their weights."""
    if names:
        raise ValueError(
            f"training_step's loss reads parameters itself ({names[:4]}{' ...' if len(names) > 4 else ''}), not "
            f"through the layers that own them; here each rank holds {held} of them, so such a term (an L2 "
            "penalty over self.parameters(), a norm of one weight) would be computed on this rank's piece -- "
            "another loss on every rank than one process's. Use the optimizer's weight_decay, compute the term "
            "inside a layer's forward, or use shm_ddp." + (
                f" The step never called {list(never_called[:4])} as modules: if it runs their forward itself "
                "(layer.forward(x)), that skips the hooks the layout gathers or splits the parameters in -- call "
                "the module, layer(x)." if never_called else ""))


def refuse_gradient_reads(names: list[str], held: str) -> None:
    """The step's loss reads gradients it took itself with respect to ``names`` (``torch.autograd.grad(...,
    create_graph=True)``) other than through the layers: each is a piece here, as its parameter is."""
    if names:
        raise ValueError(
            f"training_step's loss reads gradients it took itself with respect to parameters ({names[:4]}"
            f"{' ...' if len(names) > 4 else ''}: torch.autograd.grad(..., create_graph=True)), not through the "
            f"layers that own them; here each rank holds {held} of those parameters and so of their gradients, so "
            "such a term (a penalty on the gradient's norm) would be computed on this rank's piece -- another loss "
            "on every rank than one process's. A gradient used inside the layers trains as one process (MAML's "
            "inner step: functional_call(self, {name: p - lr * g}, x)); for a term on the gradient itself use "
            "shm_ddp.")


def logged_reads(reads: Mapping[str, list[str]], held: str) -> Optional[str]:
    """What to tell the user about values the step logged (name -> the pieces each read outside the layers, found
    as a loss's are), or None. Not refused: training is right, the numbers are not."""
    reads = {name: names for name, names in reads.items() if names}
    if not reads:
        return None
    first = next(iter(reads.values()))
    return (f"lightning_shm: training_step logged {list(reads)[:4]}{' ...' if len(reads) > 4 else ''} computed from "
            f"parameters it read itself ({first[:4]}{' ...' if len(first) > 4 else ''}), not through the layers "
            f"that own them; here each rank holds {held} of them, so the values logged are of this rank's piece, "
            "not one process's (a weight's norm over a row block or a slice). lightning_shm.param_norm(self, 2) gives "
            "each parameter's norm as one process's under every layout; where parameters are whole the values are "
            "one process's too: shm_ddp, or shm_fsdp's default gather='view' reading a layer's weight by attribute "
            "(self.net[1].weight) in the step.")
