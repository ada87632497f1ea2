"""A pipeline rank's share of the model.

:class:`PipelineStage` replaces the model's ``nn.Sequential`` on every rank. It holds only this
rank's layers, registered under their original names (``net.1.weight`` stays ``net.1.weight``),
so the rank's state dict is a subset of the plain one (merged over the stages by
:class:`~lightning_shm.parallel.state.ModelState`) and the optimizer sees only local parameters.

The model's own step code still calls ``self.net(x)``; what that call does depends on the context
the engine's caller opened:

* :meth:`PipelineStage.capturing_input` (first chunk): raise :class:`CapturedInput` carrying ``x``
  -- the engine learns the Sequential's input without knowing how the step builds it from the batch;
* :meth:`PipelineStage.running_chunk` (last chunk): ignore ``x`` and return ``chunk(activation
  received from the previous stage)``, so the step computes its loss and logs as usual.

Called outside both it raises: one stage cannot compute the whole model.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from lightning_shm.parallel.outside_reads import read_outside
from lightning_shm.parallel.pipeline import activation as act
from lightning_shm.parallel.sequential import layers_of


class CapturedInput(BaseException):
    """Carries the Sequential's input out of the user's step (BaseException: user ``except Exception`` can't eat it)."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__("pipeline input captured")
        self.x = x


class PipelineStage(nn.Module):
    """The layers of ``seq`` in this rank's chunks. ``starts`` are the V chunk start indices.

    ``seq`` may also be a list of ``(name, layer)``: the Sequential's layers with a Linear cut by rows
    (:mod:`.row_cut`), whose head and tail share the Linear's name and never sit on the same rank."""

    def __init__(self, seq: nn.Sequential | Sequence[tuple[str, nn.Module]], starts: Sequence[int],
                 chunk_ids: Sequence[int]) -> None:
        super().__init__()
        children = layers_of(seq) if isinstance(seq, nn.Module) else list(seq)
        bounds = list(starts) + [len(children)]
        names: dict[int, list[str]] = {}
        for c in chunk_ids:
            named = children[bounds[c]:bounds[c + 1]]
            for name, module in named:
                if name in self._modules:
                    raise ValueError(f"pipeline stage holds two layers named {name!r}: both pieces of a cut "
                                     f"Linear on one rank (chunk starts {list(starts)})")
                self.add_module(name, module)
            names[c] = [name for name, _ in named]
        object.__setattr__(self, "chunk_names", names)
        object.__setattr__(self, "layer_ranges", {c: (bounds[c], bounds[c + 1]) for c in chunk_ids})
        object.__setattr__(self, "positions", {i: children[i][0] for c in chunk_ids
                                               for i in range(bounds[c], bounds[c + 1])})
        object.__setattr__(self, "total", len(children))
        object.__setattr__(self, "kinds", [type(m) for _, m in children])  # every layer's class, held here or not
        object.__setattr__(self, "_looked_up", None)  # inside :meth:`looking_up`: the indices the code asked for
        self.refresh_chunks()
        self._run: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def refresh_chunks(self) -> None:
        """(Re)build each chunk from the stage's current layers, after a layer was swapped (tensor parallelism).
        Chunks are not registered submodules: the layers keep their single, original names."""
        chunks = {c: nn.Sequential(OrderedDict((n, getattr(self, n)) for n in names))
                  for c, names in self.chunk_names.items()}
        object.__setattr__(self, "chunks", chunks)

    @contextlib.contextmanager
    def capturing_input(self) -> Iterator[None]:
        """Inside: calling this module raises :class:`CapturedInput` with its argument."""
        with self._running(_capture):
            yield

    @contextlib.contextmanager
    def running_chunk(self, chunk: nn.Module, activation: torch.Tensor) -> Iterator[None]:
        """Inside: calling this module returns ``chunk(activation)``, whatever it is called with -- once. The
        first stage fed the pipeline the input of the step's first call; a second call (two augmented views,
        test-time flips) would silently get the first one's output, so it raises."""
        calls: list[int] = []

        def once(x: Any) -> Any:
            if calls:
                raise RuntimeError(
                    "the step called the pipelined nn.Sequential a second time. A pipeline runs it once per step: "
                    "the first stage feeds the schedule the input of the step's first call, and a later call would "
                    "get that call's output back. Join the inputs into one batch and call it once (e.g. "
                    "out = self.net(torch.cat([x1, x2])), then split out), or use a strategy without "
                    "pipeline_parallel_size.")
            calls.append(1)
            return chunk(activation)

        with self._running(once):
            yield

    @contextlib.contextmanager
    def _running(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
        self._run = fn
        try:
            yield
        finally:
            self._run = None

    @contextlib.contextmanager
    def looking_up(self) -> Iterator[set[int]]:
        """Inside, the indices of the layers the code asks for (``self.net[i]``, ``for layer in self.net``) are
        collected into the yielded set."""
        looked: set[int] = set()
        object.__setattr__(self, "_looked_up", looked)
        try:
            yield looked
        finally:
            object.__setattr__(self, "_looked_up", None)

    # ------------------------------------------------------------------ the Sequential's indexing
    def __getitem__(self, index: int | slice) -> nn.Module:
        """``self.net[i]`` / ``self.net[a:b]`` in the module's code, as on the Sequential: a layer this stage
        holds, or -- for one another stage holds -- a stand-in without parameters (freezing a backbone by
        index then freezes this stage's part of it; running the stand-in raises)."""
        if isinstance(index, slice):
            return nn.Sequential(*[self[i] for i in range(self.total)[index]])
        i = index + self.total if index < 0 else index
        if not 0 <= i < self.total:
            raise IndexError(f"index {index} is out of range for the pipelined nn.Sequential of {self.total} layers")
        if self._looked_up is not None:
            self._looked_up.add(i)
        return getattr(self, self.positions[i]) if i in self.positions else LayerElsewhere(i)

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[nn.Module]:
        return (self[i] for i in range(self.total))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._run is None:
            raise RuntimeError("this module is one stage of a pipeline (shm_pipeline); it only runs inside the "
                               "pipeline schedule -- call the LightningModule's step through the Trainer")
        return self._run(x)


class LayerElsewhere(nn.Module):
    """Stands for layer ``index`` of the pipelined Sequential on a stage that does not hold it."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: Any) -> Any:
        raise RuntimeError(
            f"layer {self.index} of the pipelined nn.Sequential is held by another pipeline stage: a pipeline cuts "
            "the Sequential between stages and runs it as one call inside its schedule (self.net(x)), so code "
            "running its layers one by one (for layer in self.net: x = layer(x); self.net[i](x)) cannot be "
            "pipelined. Call the Sequential whole, or use a strategy without pipeline_parallel_size.")

    def extra_repr(self) -> str:
        return f"layer {self.index}, on another stage"


def parameters_read_outside(loss: torch.Tensor, output: Any, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the ``named`` parameters (a stage's) that ``loss`` reaches other than through ``output``
    (what the stage's last chunk returned to the step): the step read them itself -- an L2 penalty over
    ``self.parameters()``, say (:func:`~lightning_shm.parallel.outside_reads.read_outside`)."""
    boundary = {t.grad_fn for t in act.tensors_in(output) if t.grad_fn is not None}
    return read_outside(loss, {id(p): n for n, p in named}, boundary)


@contextlib.contextmanager
def layer_ends(layers: Mapping[str, nn.Module]) -> Iterator[dict[str, tuple[set[Any], set[Any]]]]:
    """Inside, each of ``layers``' calls adds the autograd nodes of its inputs and of its outputs to the yielded
    ``{name: (input nodes, output nodes)}`` -- the ends of what its forward computed, for
    :func:`layers_used_besides_output`."""
    ends: dict[str, tuple[set[Any], set[Any]]] = {name: (set(), set()) for name in layers}

    def nodes(into: set[Any], value: Any) -> None:
        into.update(t.grad_fn for t in act.tensors_in(value) if t.grad_fn is not None)

    handles = []
    for name, layer in layers.items():
        handles.append(layer.register_forward_pre_hook(lambda m, args, name=name: nodes(ends[name][0], args)))
        handles.append(layer.register_forward_hook(lambda m, args, out, name=name: nodes(ends[name][1], out)))
    try:
        yield ends
    finally:
        for h in handles:
            h.remove()


def layers_used_besides_output(loss: torch.Tensor, output: Any, ends: Mapping[str, tuple[set[Any], set[Any]]]
                               ) -> list[str]:
    r"""The layers (of ``ends``, from :func:`layer_ends`) whose forward computed something ``loss`` uses other than
    through ``output`` (what the chunk returned to the step): an auxiliary loss a layer kept (an MoE router's
    load-balancing loss), a feature it stored. A parameter the loss reads itself is not the layer's computation
    (:func:`parameters_read_outside` looks at those)::

        loss ---> ce ---> [output]                              stops there
            \--> aux ---> relu (computed in layer 3) ---> ...   layer 3 used besides the output
    """
    reached = _computed(loss.grad_fn, {t.grad_fn for t in act.tensors_in(output) if t.grad_fn is not None})
    used = []
    for name, (inputs, outputs) in ends.items():
        inside: set[Any] = set()
        for fn in outputs:
            inside |= _computed(fn, inputs)
        if inside & reached:
            used.append(name)
    return used


def _computed(start: Any, stop: set[Any]) -> set[Any]:
    """The autograd nodes from ``start`` back to ``stop``, leaves' (a parameter's AccumulateGrad) and FSDP's gather
    edges (a unit's full parameter) left out: what was computed, not what was read."""
    seen: set[Any] = set()
    todo = [start]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen or fn in stop or hasattr(fn, "variable") \
                or type(fn).__name__ == "_GatherUnitBackward":
            continue
        seen.add(fn)
        todo.extend(edge[0] for edge in fn.next_functions)
    return seen


def _capture(x: torch.Tensor) -> torch.Tensor:
    raise CapturedInput(x)
