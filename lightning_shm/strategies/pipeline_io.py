"""The pipeline engine's view of a Lightning step: microbatches, the user's step on the stages, logs.

The first stage calls the module's own step only to capture the input of its ``nn.Sequential``
(see :class:`~lightning_shm.parallel.pipeline.stage.PipelineStage`); the last stage calls it per
microbatch on the received activation to get the loss and the values the module logs (evaluation
steps: once per batch, on the microbatches' outputs joined). Those
``self.log`` calls are recorded, combined over microbatches (means weighted by microbatch size, or by the
``batch_size`` the call passes, which the batch's value then carries summed; sum / max / min as ``reduce_fx``
says) and replayed with the real ``LightningModule.log`` on
*every* rank of the pipeline, so monitors, the progress bar and ``callback_metrics`` see them
everywhere. A torchmetrics object logged on the last stage is replayed as each rank's own copy of
that metric, after its state was copied from the last stage. What the step appended to a list the
module keeps (Lightning's ``self.validation_step_outputs.append(...)`` pattern, also per key of a
dict of lists) is appended on every stage too, so an epoch-end hook that stacks it runs everywhere.
Calls only rank 0 makes (a logger's, ``self.print``) are made there (:mod:`.rank_zero_calls`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Mapping, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection, is_namedtuple
from torch import Tensor, nn

from lightning_shm.parallel.outside_reads import WHERE_GRADIENTS_WORK, differentiations
from lightning_shm.parallel.pipeline import CapturedInput, PipelineStage, split_batch
from lightning_shm.parallel.pipeline.microbatches import batch_size as batch_size_of
from lightning_shm.parallel.pipeline.stage import (
    LayerElsewhere,
    layer_ends,
    layers_used_besides_output,
    parameters_read_outside,
)
from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason
from lightning_shm.strategies.loader_iter import OneMicrobatch
from lightning_shm.strategies.metric_state import export_state, import_state
from lightning_shm.strategies.module_log import logging_through
from lightning_shm.strategies.rank_zero_calls import Call, recording_rank_zero_calls, replay
from lightning_shm.strategies.step_randomness import call_seed, seed_streams

_STEP_OUTCOME = barrier_reason("a pipeline step's outcome (result, logs, stop), from the last stage")
_SKIPPED = (" It returned None: skipping a training_step that way is not supported in distributed training "
            "(Lightning refuses it under every other strategy too).")
LogRecord = tuple[str, Any, tuple, dict, float]  # name, value, args, kwargs, microbatch weight


class MetricRef:
    """Stands for a torchmetrics object logged on the last stage; resolved to each rank's own copy."""

    def __init__(self, path: str) -> None:
        self.path = path


@dataclass(frozen=True)
class StagePosition:
    """Where this rank sits in its pipeline: the group of its stages and the index of the last one."""

    pp_group: Group
    index: int

    @property
    def last(self) -> int:
        return self.pp_group.size - 1

    @property
    def is_last(self) -> bool:
        return self.index == self.last


@contextlib.contextmanager
def recording_logs(module: pl.LightningModule, sink: Optional[list[LogRecord]], weight: float) -> Iterator[None]:
    """Inside, ``module.log`` (and ``log_dict``, which calls it) appends to ``sink`` (None: drops) instead
    of logging: a microbatch's values are combined with the others' before Lightning sees them."""

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if sink is not None:
            sink.append((name, _as_logged(value), args, kwargs, weight))

    with logging_through(module, record):
        yield


def _as_logged(value: Any) -> Any:
    """A number or an integer tensor in the dtype ``LightningModule.log`` would give it here and now: the
    default dtype of the step's precision context (float64 under "64-true"), at least float32."""
    if isinstance(value, Tensor) and value.is_floating_point() or not isinstance(value, (Tensor, int, float, bool)):
        return value
    dtype = torch.get_default_dtype()
    return torch.as_tensor(value).to(dtype if dtype in (torch.float32, torch.float64) else torch.float32)


_ENUMERATIONS = {"named_parameters": "parameters", "named_modules": "modules", "named_children": "modules"}


@contextlib.contextmanager
def _iterations(flags: dict[str, list[bool]], *modules: nn.Module) -> Iterator[None]:
    """Inside, iterating the parameters of ``modules`` (``self.parameters()``, ``self.net.named_parameters()``)
    appends to ``flags["parameters"]``, their submodules (``self.modules()``, ``self.net.children()``) to
    ``flags["modules"]``: the step enumerated them, and on a stage it sees only the stage's."""
    def watched(module: nn.Module, method: str) -> Any:
        def enumerate_(*args: Any, **kwargs: Any) -> Any:
            flags[_ENUMERATIONS[method]].append(True)
            return getattr(type(module), method)(module, *args, **kwargs)
        return enumerate_

    for m in modules:
        for method in _ENUMERATIONS:
            m.__dict__[method] = watched(m, method)
    try:
        yield
    finally:
        for m in modules:
            for method in _ENUMERATIONS:
                m.__dict__.pop(method, None)


@dataclass
class _Seen:
    """What the first training step's call did (:func:`_watching`)."""

    enumerated: dict[str, list[bool]] = field(default_factory=lambda: {"parameters": [], "modules": []})
    looked: set[int] = field(default_factory=set)  # the stage's layers it looked up, by index
    ends: dict[str, tuple[set[Any], set[Any]]] = field(default_factory=dict)  # the chunk's layers' autograd ends


@contextlib.contextmanager
def _watching(seen: _Seen, module: nn.Module, stage: PipelineStage, chunk: nn.Module) -> Iterator[None]:
    """Inside, into ``seen``: what the step enumerates, which layers it looks up, what each of ``chunk``'s layers
    computes."""
    with _iterations(seen.enumerated, module, stage), stage.looking_up() as looked, \
            layer_ends(dict(chunk.named_children())) as ends:
        seen.looked, seen.ends = looked, ends
        yield


def _refuse_reads(names: list[str]) -> None:
    """Only the last stage runs the step's loss, and it enumerates only its own layers' parameters: a term
    the step computes over ``self.parameters()`` (an L2 penalty) reaches those layers only -- silently
    another loss for every other stage's. Refused when the step enumerated parameters and its loss reads
    some of the stage's other than through the Sequential's output (reusing a layer it holds is fine)."""
    if names:
        raise ValueError(f"training_step's loss reads parameters of the pipelined nn.Sequential itself ({names[:4]}"
                         f"{' ...' if len(names) > 4 else ''}), not only through the Sequential's output. Under "
                         "shm_pipeline each stage holds its own layers and only the last stage computes the loss, "
                         "so such a term (an L2 penalty over self.parameters(), say) would reach the last stage's "
                         "layers only. Use the optimizer's weight_decay, or keep such parameters outside the "
                         "Sequential.")


def _refuse_layer_terms(module: nn.Module, stage: PipelineStage, start: int, end: int, used: list[str]) -> None:
    """The step went through the model's layers (``for layer in self.net``, ``self.modules()``) and its loss uses
    values some of the last chunk's layers computed besides the Sequential's output -- an auxiliary loss each
    layer keeps (an MoE router's load-balancing loss), summed by the step. The step runs on the last chunk only:
    the same terms of the layers of those classes that other chunks run would be left out, silently. Refused
    where such layers exist (a term only the last chunk's layers make trains as in one process)."""
    names = {stage.positions[i]: i for i in range(start, end)}
    kinds = {stage.kinds[names[n]] for n in used if n in names}
    elsewhere = [i for i in range(stage.total) if not start <= i < end and stage.kinds[i] in kinds]
    if elsewhere:
        path = next((f"{n}." for n, m in module.named_modules() if m is stage and n), "")
        used = [f"{path}{n}" for n in used]
        shown = sorted({k.__name__ for k in kinds})
        raise ValueError(
            f"training_step's loss uses values that layers {used[:4]}{' ...' if len(used) > 4 else ''} of the "
            "pipelined nn.Sequential computed inside, besides the Sequential's output (an auxiliary loss each layer "
            "keeps, as an MoE router's load-balancing loss), and the step went through the model's layers to "
            f"gather them. Under shm_pipeline the step runs on the last stage with the layers of the last chunk: "
            f"the same terms of the {', '.join(shown)} layers {elsewhere[:8]} other chunks run would be left out, "
            "silently. Carry such terms through the Sequential instead (each layer takes and returns (x, aux), "
            "the loss adds the aux that comes out), or use a strategy without pipeline_parallel_size.")


def _refuse_gradients(names: list[str]) -> None:
    """The step asked ``torch.autograd.grad`` for gradients of the stage's layers: the schedule's to take."""
    raise ValueError(
        f"training_step takes gradients with respect to parameters of the pipelined nn.Sequential ({names[:4]}"
        f"{' ...' if len(names) > 4 else ''}) itself (torch.autograd.grad: MAML's inner step, a penalty on the "
        "gradient's norm). A pipeline computes those gradients in its schedule -- each stage its own layers', "
        "microbatch by microbatch -- and the step runs on the last stage, which holds only its own layers and one "
        f"microbatch: they cannot be taken in it. {WHERE_GRADIENTS_WORK}")


_NOT_SET_HERE = (
    "shm_pipeline: each stage runs only its own layers of the Sequential, and the step's loss runs on the last "
    "stage: an attribute set while another stage's layers run -- by them, or by a forward hook on them (an inner "
    "layer's activation kept for the loss) -- is never set there. A loss on an inner activation cannot be "
    "pipelined: compute it from the Sequential's output, or use shm_ddp / shm_fsdp / shm_tp.")


def _held_elsewhere(index: int, name: str) -> str:
    """The step read ``.name`` of a layer this stage does not hold (a weight for a logged norm, a loss term)."""
    return (f"shm_pipeline: layer {index} of the pipelined nn.Sequential is held by another pipeline stage, and the "
            "step runs on the last stage, which holds only its own layers: it cannot read that layer's "
            f"'{name}' (a weight whose norm it logs, a term of its loss) -- no stage holds every layer. For norms, "
            "lightning_shm.param_norm(self, 2) (called on every stage: in on_before_optimizer_step, say) gives each "
            "parameter's as one process's; otherwise read it in shm_ddp, or in shm_fsdp's default gather='view' by "
            "attribute (self.net[i].weight is the whole parameter inside a step there).")


_NOT_FROM_THE_INPUT = (
    "shm_pipeline: on the last stage the step's batch is not what the Sequential computes from -- the first "
    "stage feeds it, and this stage runs its layers on the activation it receives (in evaluation the "
    "Sequential's output arrives with no graph at all) -- so a gradient with respect to the input (a gradient "
    "penalty, a saliency map) cannot be taken in a pipeline; use shm_ddp / shm_fsdp / shm_tp.")


class LightningStageIO:
    """The engine's view of one Lightning step: microbatch inputs, the step on the last stage, logs.

    Args:
        module, stage: the LightningModule and the :class:`PipelineStage` standing in for its Sequential.
        step: "training_step", "validation_step", "test_step" or "predict_step".
        loss_scale: multiplies each microbatch's loss for backward (``1 / accumulate_grad_batches``:
            Lightning divides the loss by it before backward, and the schedule runs backward itself).
        forward_context: opened around every forward of a chunk (the precision plugin's autocast).
        check_reads: refuse a loss that reads the stage's parameters other than through its output
            (checked once, on the first microbatch: see :func:`_refuse_reads`).
        seed: this pipeline step's seed, the same on every stage: each call of the step starts from streams
            seeded from it and the microbatch (:mod:`.step_randomness`); None leaves the streams alone.
        fetched_from: the step takes ``dataloader_iter`` (:mod:`.loader_iter`) and ``batch`` came from this
            loader index: each call gets an iterator of its (micro)batch instead of ``batch, batch_idx``.
    """

    def __init__(self, module: pl.LightningModule, stage: PipelineStage, step: str, batch: Any, batch_idx: int,
                 microbatches: int, training: bool, extra: Sequence[Any] = (), loss_scale: float = 1.0,
                 forward_context: Any = contextlib.nullcontext, check_reads: bool = False,
                 seed: Optional[int] = None, fetched_from: Optional[int] = None) -> None:
        self.module, self.stage, self.step, self.batch_idx, self.training = module, stage, step, batch_idx, training
        self.extra, self.loss_scale, self._forward_context = extra, loss_scale, forward_context
        self.check_reads, self.seed, self.fetched_from = check_reads, seed, fetched_from
        size = batch_size_of(batch) or 1
        self.parts = max(1, min(microbatches, size))
        self.batch = batch
        self.micro = split_batch(batch, self.parts)
        sizes = [batch_size_of(m) or 0 for m in self.micro]
        self.sizes = sizes
        self.weights = [s / max(size, 1) for s in sizes]
        self.records: list[LogRecord] = []
        self.calls: list[Call] = []  # the last stage's rank-zero-only calls, made on rank 0 in finish()
        self.finals: dict[int, Any] = {}  # evaluation: the Sequential's output per microbatch
        self.losses: dict[int, Tensor] = {}
        self.extras: dict[int, dict[str, Any]] = {}  # training: what the step returned beside the loss
        self.lists = _list_lengths(module)  # before the step: what it appends goes to every stage
        self._whole_input: Optional[list[Any]] = None  # evaluation, first stage: the batch's input, cut
        # training: the stage's parameters of the Sequential (id -> name), which only the schedule differentiates
        # (named here, before any call of the step: its enumerations of parameters are watched)
        held = {id(p) for p in stage.parameters()} if training else set()
        self._own = {id(p): n for n, p in module.named_parameters() if id(p) in held} if held else {}

    def _seed(self, mb: int) -> None:
        """The streams for the step's call on microbatch ``mb`` (-1: the whole batch), alike on every stage."""
        if self.seed is not None:
            seed_streams(call_seed(self.seed, mb))

    def forward_context(self) -> ContextManager[Any]:
        return self._forward_context()

    def _call_step(self, mb: int, sink: Optional[list[LogRecord]], weight: float, batch: Any = None) -> Any:
        """The module's step on microbatch ``mb`` (or on ``batch``, with the streams of ``mb``; -1: the whole
        batch's), its logs into ``sink`` (None: dropped)."""
        # rank-zero calls (a logger's, print) are kept from the last stage's first microbatch only: one per batch
        calls = self.calls if sink is not None and mb == 0 else []
        self._seed(mb)
        own = differentiations(self._own, _refuse_gradients) if self.training else contextlib.nullcontext()
        with recording_logs(self.module, sink, weight), recording_rank_zero_calls(self.module, calls), own:
            try:
                return self._run_step(self.micro[mb] if batch is None else batch)
            except AttributeError as e:
                if isinstance(getattr(e, "obj", None), LayerElsewhere):
                    e.add_note(_held_elsewhere(e.obj.index, e.name))  # type: ignore[attr-defined]
                elif isinstance(getattr(e, "obj", None), nn.Module):
                    e.add_note(_NOT_SET_HERE)
                raise
            except RuntimeError as e:
                if "appears to not have been used in the graph" in str(e):
                    e.add_note(_NOT_FROM_THE_INPUT)
                raise

    def _run_step(self, batch: Any) -> Any:
        """The module's step on ``batch`` (a microbatch or the whole batch); a step that fetches its batches
        (``dataloader_iter``) gets an iterator holding only ``batch``."""
        if self.fetched_from is None:
            return getattr(self.module, self.step)(batch, self.batch_idx, *self.extra)
        one = OneMicrobatch(batch, self.batch_idx, self.fetched_from, self.step, self.parts)
        return getattr(self.module, self.step)(one)

    def first_input(self, mb: int) -> Tensor:
        if not self.training:  # evaluation: the step runs once on the whole batch, on the last stage as here
            if self._whole_input is None:
                self._whole_input = self._whole_batch_input()
            if self._whole_input:
                return self._whole_input[mb]
        try:
            with self.stage.capturing_input():
                out = self._call_step(mb, None, 0.0)
        except CapturedInput as captured:
            return captured.x
        skipped = _SKIPPED if out is None and self.training else ""
        raise RuntimeError(f"{type(self.module).__name__}.{self.step} returned without calling the pipelined "
                           f"nn.Sequential; the pipeline cannot find its input.{skipped}")

    def _whole_batch_input(self) -> list[Any]:
        """The Sequential's input for the whole batch, cut into the microbatches' -- so that what the step draws
        before it is what the last stage's single call over the whole batch draws. Empty if that input's dim 0
        is not the batch's -- its size differs, or the first microbatch's input is not that microbatch's size
        (a time-major ``[T, B, ...]`` input with T == B) -- then each microbatch's step gives its own."""
        whole = self._captured(self.batch)
        if whole is None or batch_size_of(whole) != batch_size_of(self.batch):
            return []
        if self.parts > 1:
            first = self._captured(self.micro[0])
            if first is None or batch_size_of(first) != self.sizes[0]:
                return []
        return split_batch(whole, self.parts)

    def _captured(self, batch: Any) -> Any:
        """The Sequential's input when the step runs on ``batch`` (streams seeded for the whole batch; what it
        logs is dropped, as for every call of the step up to the Sequential)."""
        try:
            with self.stage.capturing_input():
                self._call_step(-1, None, 0.0, batch)
        except CapturedInput as captured:
            return captured.x
        return None

    def last_forward(self, mb: int, x: Tensor, chunk: nn.Module) -> Optional[Tensor]:
        if not self.training:  # the step runs once over the whole batch: :meth:`eval_output`
            self.finals[mb] = chunk(x)
            return None
        produced: list[Any] = []

        def run(activation: Any) -> Any:
            produced.append(chunk(activation))
            return produced[-1]

        seen = _Seen()
        watch = _watching(seen, self.module, self.stage, chunk) if self.check_reads else contextlib.nullcontext()
        with self.stage.running_chunk(run, x), watch:
            out = self._call_step(mb, self.records, self.weights[mb])
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise ValueError(f"shm_pipeline needs training_step to return the loss tensor (or a dict with 'loss'); "
                             f"got {type(out).__name__}.{_SKIPPED if out is None else ''}")
        self.losses[mb] = loss.detach() * self.weights[mb]
        if isinstance(out, Mapping):
            self.extras[mb] = {k: v for k, v in out.items() if k != "loss"}
        if self.check_reads and produced and loss.grad_fn is not None:  # (nothing trainable: no graph to walk)
            if seen.enumerated["parameters"]:
                held = {id(p) for p in self.stage.parameters()}
                named = [(n, p) for n, p in self.module.named_parameters() if id(p) in held]
                _refuse_reads(parameters_read_outside(loss, produced[0], named))
            start, end = self.stage.layer_ranges[max(self.stage.layer_ranges)]  # the last chunk's, which runs here
            if seen.enumerated["modules"] or seen.looked - set(range(start, end)):
                _refuse_layer_terms(self.module, self.stage, start, end,
                                    layers_used_besides_output(loss, produced[0], seen.ends))
            self.check_reads = False
        return loss * (self.weights[mb] * self.loss_scale)

    # ------------------------------------------------------------------ results
    def training_output(self) -> Any:
        """The batch's loss; with a dict from the step, also its other entries over the batch: per-sample
        tensors and lists (``logits``, a batch's names: a first dimension of the microbatch's size) joined along
        it; floating values (an accuracy, a per-class mean) averaged by microbatch size as the loss is; integer
        ones (a count of correct predictions, of samples, per class) summed. Anything else (a string, a bool, a
        bool tensor) is the batch's value where every microbatch returned the same -- whether it is a tag or a
        per-batch flag (all finite, any skipped), one process's batch would give it too -- and is left out where
        they differ: no batch value can be formed from them. A dict of such entries is formed entry by entry."""
        loss = torch.stack(list(self.losses.values())).sum()
        if not self.extras:
            return loss
        parts = [self.extras[m] for m in sorted(self.extras)]
        sizes = [self.sizes[m] for m in sorted(self.extras)]
        out: dict[str, Any] = {"loss": loss}
        for key in parts[0]:
            value = _over_microbatches([p.get(key) for p in parts], sizes, self.weights)
            if value is not None:
                out[key] = value
        return out

    def eval_output(self) -> Any:
        """Evaluation on the last stage: the module's step called once on the whole batch, its Sequential
        returning the microbatches' outputs joined along the batch -- so the step's output (a dict, a tuple,
        a sum, a list of strings) and what it logs are one process's, whatever their structure; only the
        layers ran per microbatch."""
        parts = [self.finals[m] for m in sorted(self.finals)]
        joined = _join(parts)
        self._seed(-1)
        with self.stage.running_chunk(lambda whole: whole, joined), self.forward_context(), \
                recording_logs(self.module, self.records, 1.0), recording_rank_zero_calls(self.module, self.calls):
            try:
                return self._run_step(self.batch)
            except RuntimeError as e:
                if "does not require grad and does not have a grad_fn" in str(e):
                    e.add_note(_NOT_FROM_THE_INPUT)
                raise

    def finish(self, position: StagePosition, result: Any) -> Any:
        """The last stage's ``result`` (the loss, the step's output) on every rank of the pp group, its
        per-microbatch logs combined and logged on every rank, and a ``trainer.should_stop`` the step set
        (without it the other stages would start the next step and wait for the last one forever) -- in
        one broadcast."""
        module = self.module
        trainer = module._trainer
        stop = bool(trainer is not None and trainer.should_stop)
        payload = ((result, _aggregate(self.records, module), stop, _appended(module, self.lists), self.calls)
                   if position.is_last else None)
        result, logs, stop, appended, calls = position.pp_group.broadcast_object(
            payload, src_member=position.last, why=_STEP_OUTCOME)
        replay(module, calls)
        if stop and trainer is not None:
            trainer.should_stop = True
        if not position.is_last:
            _append(module, appended)
        for name, value, args, kwargs, metric_state in logs:
            if isinstance(value, MetricRef):
                metric = module.get_submodule(value.path)
                import_state(metric, metric_state)
                value = metric
            module.log(name, value, *args, **kwargs)
        return result


def _over_microbatches(values: list[Any], sizes: list[int], weights: list[float]) -> Any:
    """One batch value of a training step's output entry from its microbatches' values (see
    :meth:`LightningStageIO.training_output`), or None where none can be formed."""
    if all(isinstance(v, Tensor) for v in values):
        values = [v.detach() for v in values]
        first = values[0]
        if first.dim() > 0 and all(v.shape[0] == n for v, n in zip(values, sizes)):
            return torch.cat(values)
        if any(v.shape != first.shape for v in values):  # (a bincount without minlength)
            return None
        if first.is_floating_point() or first.is_complex():
            return sum(v * w for v, w in zip(values, weights))
        if first.dtype != torch.bool:
            return torch.stack(values).sum(0)
        return first if all(torch.equal(v, first) for v in values) else None  # a flag: the batch's if all agree
    if all(type(v) is int for v in values):
        return sum(values)
    if all(type(v) is float for v in values):
        return sum(v * w for v, w in zip(values, weights))
    if all(isinstance(v, list) and len(v) == n for v, n in zip(values, sizes)):  # per sample (a batch's names)
        return [item for v in values for item in v]
    if all(isinstance(v, dict) and v.keys() == values[0].keys() for v in values):  # {"stats": {...}}: per entry
        entries = {k: _over_microbatches([v[k] for v in values], sizes, weights) for k in values[0]}
        return {k: v for k, v in entries.items() if v is not None}
    return values[0] if all(_same(v, values[0]) for v in values) else None  # a tag, a flag: the batch's if all agree


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == is not a bool (an array)
        return False


_ListKey = tuple[str, Any]  # (attribute, None) for a list; (attribute, key) for a list in a dict


def _list_lengths(module: nn.Module) -> dict[_ListKey, tuple[int, int]]:
    """The lists ``module`` keeps in public attributes, directly or as values of a dict: ``(id, length)``."""
    out: dict[_ListKey, tuple[int, int]] = {}
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if isinstance(value, list):
            out[(name, None)] = (id(value), len(value))
        elif isinstance(value, dict):
            out.update(((name, k), (id(v), len(v))) for k, v in value.items() if isinstance(v, list))
    return out


def _appended(module: nn.Module, before: Mapping[_ListKey, tuple[int, int]]) -> dict[_ListKey, tuple[int, list]]:
    """On the last stage after the step, per list it grew: ``(start, the items from start)``; per list it created
    or replaced (``self.buf = self.buf[-9:] + [x]``): ``(0, all its items)``. Tensors detached."""
    out = {}
    for key, (ident, n) in _list_lengths(module).items():
        was = before.get(key)
        start = was[1] if was is not None and was[0] == ident else 0
        if n > start or start == 0 and was is not None and was[0] != ident:
            lst = getattr(module, key[0]) if key[1] is None else getattr(module, key[0])[key[1]]
            out[key] = (start, apply_to_collection(lst[start:], Tensor, lambda t: t.detach()))
    return out


def _append(module: nn.Module, appended: Mapping[_ListKey, tuple[int, list]]) -> None:
    """On the other stages: each list as the last stage left it -- cut at ``start`` (dropping what this stage's
    partial run of the step appended) and extended with the last stage's items."""
    for (name, key), (start, items) in appended.items():
        holder = getattr(module, name, None)
        if key is None and not isinstance(holder, list):
            setattr(module, name, list(items))  # created by the step itself
            continue
        if key is not None:
            if not isinstance(holder, dict):
                continue
            holder = holder.setdefault(key, [])
        del holder[start:]
        holder.extend(items)


def _join(parts: Sequence[Any]) -> Any:
    """Microbatch outputs of the Sequential (tensors, or tuples, namedtuples or dicts of them) -> the batch's,
    along dim 0, in the same structure."""
    first = parts[0]
    if isinstance(first, Mapping):
        return type(first)({k: _join([p[k] for p in parts]) for k in first})
    if isinstance(first, tuple):
        joined = [_join([p[i] for p in parts]) for i in range(len(first))]
        return type(first)(*joined) if is_namedtuple(first) else tuple(joined)
    if isinstance(first, Tensor) and first.dim() > 0:
        return torch.cat(list(parts)) if len(parts) > 1 else first
    if len(parts) == 1:
        return first
    raise TypeError(f"the pipelined nn.Sequential returned a {type(first).__name__}"
                    f"{' of 0 dimensions' if isinstance(first, Tensor) else ''} per microbatch: evaluation "
                    "cannot join it into the batch's output. Return per-sample values from the Sequential.")


def _aggregate(records: list[tuple[str, Any, tuple, dict, float]], module: nn.Module) -> list[tuple]:
    from torchmetrics import Metric

    paths = {id(m): n for n, m in module.named_modules()}
    order: list[str] = []
    grouped: dict[str, list[tuple[Any, tuple, dict, float]]] = {}
    for name, value, args, kwargs, w in records:
        if name not in grouped:
            order.append(name)
            grouped[name] = []
        grouped[name].append((value, args, kwargs, w))
    out = []
    for name in order:
        items = grouped[name]
        value, args, kwargs, _ = items[-1]
        if isinstance(value, Metric):
            out.append((name, MetricRef(paths[id(value)]), args, kwargs, export_state(value)))
            continue
        vals = torch.stack([torch.as_tensor(v).detach().double() for v, *_ in items])
        ws = torch.tensor([w for *_, w in items], dtype=torch.float64)
        sizes = [kw.get("batch_size") for _, _, kw, _ in items]
        if all(n is not None for n in sizes):  # each value is a mean over the units ``batch_size`` counts (tokens)
            ws = torch.tensor([float(n) for n in sizes], dtype=torch.float64)
            kwargs = {**kwargs, "batch_size": sum(sizes)}  # the batch's, as one process's step passes it
        fx = kwargs.get("reduce_fx", "mean")
        fx = getattr(fx, "__name__", fx)
        if fx == "sum":
            combined = vals.sum(0)
        elif fx == "max":
            combined = vals.max(0).values
        elif fx == "min":
            combined = vals.min(0).values
        else:  # mean over the batch = microbatch means weighted by microbatch size
            combined = (vals * ws.view(-1, *[1] * (vals.dim() - 1))).sum(0) / ws.sum()
        dtype = value.dtype if isinstance(value, Tensor) and value.is_floating_point() else torch.float32
        out.append((name, combined.to(dtype), args, kwargs, None))
    return out
