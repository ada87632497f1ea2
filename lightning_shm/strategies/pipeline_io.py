"""The pipeline engine's view of a Lightning step: microbatches, the user's step on the stages, logs.

The first stage calls the module's own step only to capture the input of its ``nn.Sequential``
(see :class:`~lightning_shm.parallel.pipeline.stage.PipelineStage`); the last stage calls it per
microbatch on the received activation to get the loss and the values the module logs. Those
``self.log`` calls are recorded, combined over microbatches (weighted by microbatch size for
means; sum / max / min as ``reduce_fx`` says) and replayed with the real ``LightningModule.log`` on
*every* rank of the pipeline, so monitors, the progress bar and ``callback_metrics`` see them
everywhere. A torchmetrics object logged on the last stage is replayed as each rank's own copy of
that metric, after its state was copied from the last stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_shm.parallel.pipeline import CapturedInput, split_batch
from lightning_shm.parallel.pipeline.stage import batch_size as batch_size_of

if TYPE_CHECKING:
    from lightning_shm.strategies.pipeline import SHMPipeline


class MetricRef:
    """Stands for a torchmetrics object logged on the last stage; resolved to each rank's own copy."""

    def __init__(self, path: str) -> None:
        self.path = path


class LightningStageIO:
    """The engine's view of one Lightning step: microbatch inputs, the step on the last stage, logs."""

    def __init__(self, strategy: "SHMPipeline", step: str, batch: Any, batch_idx: int, microbatches: int,
                 training: bool, extra: Sequence[Any] = ()) -> None:
        self.strategy, self.step, self.batch_idx, self.training, self.extra = strategy, step, batch_idx, training, extra
        module = strategy.lightning_module
        self.module, self.stage = module, strategy.stage
        size = batch_size_of(batch) or 1
        self.parts = max(1, min(microbatches, size))
        self.micro = split_batch(batch, self.parts)
        sizes = [batch_size_of(m) or 0 for m in self.micro]
        self.weights = [s / max(size, 1) for s in sizes]
        self.records: list[tuple[str, Any, tuple, dict, float]] = []
        self.outputs: dict[int, Any] = {}
        self.losses: dict[int, Tensor] = {}

    def _call_step(self, mb: int, sink: Optional[list], weight: float) -> Any:
        module = self.module

        def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if sink is not None:
                sink.append((name, value, args, kwargs, weight))

        module.log = record  # type: ignore[method-assign]  # log_dict goes through log as well
        try:
            return getattr(module, self.step)(self.micro[mb], self.batch_idx, *self.extra)
        finally:
            del module.log

    def first_input(self, mb: int) -> Tensor:
        assert self.stage is not None
        self.stage.mode = ("capture", None)
        try:
            self._call_step(mb, None, 0.0)
        except CapturedInput as captured:
            return captured.x
        finally:
            self.stage.mode = None
        raise RuntimeError(f"{type(self.module).__name__}.{self.step} returned without calling the pipelined "
                           "nn.Sequential; the pipeline cannot find its input")

    def last_forward(self, mb: int, x: Tensor, chunk: nn.Module, recompute: bool = False) -> Optional[Tensor]:
        assert self.stage is not None
        self.stage.mode = ("last", (x, chunk))
        try:
            out = self._call_step(mb, None if recompute else self.records, self.weights[mb])
        finally:
            self.stage.mode = None
        if not self.training:
            self.outputs[mb] = out
            return None
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise ValueError(f"shm_pipeline needs training_step to return the loss tensor (or a dict with 'loss'); "
                             f"got {type(out).__name__}")
        if not recompute:
            self.losses[mb] = loss.detach() * self.weights[mb]
        return loss * self.weights[mb]

    # ------------------------------------------------------------------ results
    def total_loss(self) -> Tensor:
        return torch.stack(list(self.losses.values())).sum()

    def combined_output(self) -> Any:
        outs = [self.outputs[m] for m in sorted(self.outputs)]
        if not outs or outs[0] is None:
            return None
        if isinstance(outs[0], Tensor) and outs[0].dim() > 0:
            return torch.cat(outs)
        if isinstance(outs[0], Tensor):
            return torch.stack([o * w for o, w in zip(outs, self.weights)]).sum()
        return outs

    def replay_logs(self, module: pl.LightningModule) -> None:
        """Combine the last stage's per-microbatch logs and log them on every rank of the pp group."""
        strategy = self.strategy
        last = strategy.pp_group.size - 1
        payload = None
        if strategy._groups.coords.pp == last:  # type: ignore[union-attr]
            payload = _aggregate(self.records, module)
        payload = strategy.pp_group.broadcast_object(payload, src=last)
        for name, value, args, kwargs, metric_state in payload:
            if isinstance(value, MetricRef):
                metric = module.get_submodule(value.path)
                _load_metric_state(metric, metric_state)
                value = metric
            module.log(name, value, *args, **kwargs)


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
            out.append((name, MetricRef(paths[id(value)]), args, kwargs, _metric_state(value)))
            continue
        vals = torch.stack([torch.as_tensor(v).detach().double() for v, *_ in items])
        ws = torch.tensor([w for *_, w in items], dtype=torch.float64)
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


def _metric_state(metric: Any) -> dict[str, Any]:
    return {"states": {k: getattr(metric, k) for k in metric._defaults},
            "update_count": metric._update_count, "forward_cache": metric._forward_cache}


def _load_metric_state(metric: Any, state: dict[str, Any]) -> None:
    for k, v in state["states"].items():
        setattr(metric, k, v)
    metric._update_count = state["update_count"]
    metric._forward_cache = state["forward_cache"]
    metric._computed = None
