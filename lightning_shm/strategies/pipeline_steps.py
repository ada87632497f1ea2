"""Lightning's steps through a pipeline schedule, on one rank.

Each training step the batch is cut into microbatches and the schedule runs: the first stage feeds
the Sequential's input (captured from the module's own ``training_step``), the last stage calls
``training_step`` per microbatch on the received activation to get the loss, backward passes flow
back through channels. All of it happens inside Lightning's ``training_step`` call, which returns
the batch loss; the gradients are handed over in ``backward`` (Lightning zeroes gradients between
the two). Values the module logs on the last stage are combined over microbatches and logged on
*every* rank. Under FSDP a stage's units are gathered once for the whole step and their summed
gradient is reduce-scattered when the gradients are handed over.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_shm.parallel.compose import ParallelState
from lightning_shm.parallel.pipeline import PipelineSchedule, Schedule
from lightning_shm.parallel.replaced import accumulate_grad, parameter_hooks_suspended
from lightning_shm.runtime.ops import barrier_reason
from lightning_shm.strategies.pipeline_io import LightningStageIO, StagePosition
from lightning_shm.strategies.step_randomness import call_seed

_SEED_BASE = barrier_reason("the replica's base seed for its steps' draws")


class PipelineSteps:
    """The training and evaluation steps of ``module`` on the stage ``parallel`` holds."""

    def __init__(self, module: pl.LightningModule, parallel: ParallelState, precision: Precision) -> None:
        assert parallel.engine is not None and parallel.stage is not None
        self.module, self.parallel, self.precision = module, parallel, precision
        self.engine, self.stage, self.schedule = parallel.engine, parallel.stage, parallel.engine.schedule
        self.position = StagePosition(parallel.groups.pp, parallel.groups.coords.pp)
        self._fresh_grads: list[tuple[nn.Parameter, Optional[Tensor]]] = []
        self._warned_short = False
        self.sync_grads = True  # False inside Lightning's gradient-accumulation micro-steps
        self._reads_checked = False
        # the step's draws alike on every stage and tp member of the replica (see step_randomness): a base they
        # agree on, a step count
        self._seed_base = parallel.groups.replica.broadcast_object(torch.initial_seed(), src_member=0,
                                                                   why=_SEED_BASE)
        self._steps_run = 0

    # ------------------------------------------------------------------ training
    def training_step(self, batch: Any, batch_idx: int, accumulate: int, skip_backward: bool,
                      fetched_from: Optional[int] = None) -> Tensor:
        """Run the schedule; return the batch loss (the same on every rank of the pipeline). ``fetched_from``:
        the step takes ``dataloader_iter`` and the strategy fetched ``batch`` from that loader index."""
        if skip_backward:  # e.g. SWA's BatchNorm pass: forward in training mode, nothing else
            io = self._io("training_step", batch, batch_idx, training=False, context=self.precision.train_step_context,
                          fetched_from=fetched_from)
            self.engine.eval_step(io, io.parts)
            return io.finish(self.position, io.eval_output() if self.position.is_last else None)
        io = self._io("training_step", batch, batch_idx, training=True, loss_scale=1.0 / accumulate,
                      context=self.precision.train_step_context, fetched_from=fetched_from)
        io.check_reads, self._reads_checked = not self._reads_checked, True  # the first step's loss: once
        # Lightning zero-grads *after* training_step and before backward; the schedule computes the
        # gradients inside training_step. Run it on fresh grads, hand them over in backward().
        params = [p for p in self.module.parameters() if p.requires_grad]
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        # the microbatches are one batch: the model's gradient hooks run once, on the step's gradient (hand-over)
        with self._held_units(), parameter_hooks_suspended(params):
            self.engine.train_step(io, self._schedule_for(io.parts))
        self._fresh_grads = [(p, p.grad) for p in params]
        for p, g in zip(params, previous):
            p.grad = g
        return io.finish(self.position, io.training_output() if self.position.is_last else None)

    @contextlib.contextmanager
    def _held_units(self) -> Iterator[None]:
        """FSDP: gather the stage's units once for all microbatches of the step."""
        if self.parallel.fsdp is not None:
            self.parallel.fsdp.hold()
        yield

    def hand_over_grads(self) -> None:
        """After Lightning's zero_grad: add the step's gradients, reduce them over the data-parallel group."""
        with torch.no_grad():
            for p, g in self._fresh_grads:
                if g is not None:
                    accumulate_grad(p, g)
        self._fresh_grads = []
        if self.parallel.fsdp is not None:
            self.parallel.fsdp.release()  # one reduce-scatter per parameter of the summed gradient
        if self.parallel.reducer is not None and self.sync_grads:
            self.parallel.reducer.synchronize()
        if self.parallel.outside is not None and self.sync_grads:
            self.parallel.outside.sum_grads()  # each stage used them in part: one gradient for every copy

    def _schedule_for(self, parts: int) -> PipelineSchedule:
        sched = self.schedule
        if parts == sched.microbatches:
            return sched
        try:
            return PipelineSchedule(sched.kind, sched.stages, parts, sched.virtual)
        except ValueError:
            if not self._warned_short:
                rank_zero_warn(f"a batch split into {parts} microbatches does not fit schedule {sched.kind.value}; "
                               "it runs as GPipe (seen for a short last batch)")
                self._warned_short = True
            return PipelineSchedule(Schedule.GPIPE, sched.stages, parts, sched.virtual)

    @property
    def ran_short_batch_as_gpipe(self) -> bool:
        return self._warned_short

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, step: str, batch: Any, batch_idx: int, *extra: Any, fetched_from: Optional[int] = None) -> Any:
        contexts = {"validation_step": self.precision.val_step_context, "test_step": self.precision.test_step_context,
                    "predict_step": self.precision.predict_step_context}
        io = self._io(step, batch, batch_idx, training=False, extra=extra, context=contexts[step],
                      fetched_from=fetched_from)
        self.engine.eval_step(io, io.parts)
        return io.finish(self.position, io.eval_output() if self.position.is_last else None)

    def _io(self, step: str, batch: Any, batch_idx: int, training: bool, context: Callable[[], Any],
            extra: tuple = (), loss_scale: float = 1.0, fetched_from: Optional[int] = None) -> LightningStageIO:
        self._steps_run += 1
        return LightningStageIO(self.module, self.stage, step, batch, batch_idx, self.schedule.microbatches,
                                training=training, extra=extra, loss_scale=loss_scale, forward_context=context,
                                seed=call_seed(self._seed_base, self._steps_run), fetched_from=fetched_from)
