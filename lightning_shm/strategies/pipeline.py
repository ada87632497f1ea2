"""``shm_pipeline``: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero-bubble) x data parallelism.

``devices = dp x pp``. In ``setup`` the model's ``nn.Sequential`` is cut into P*v chunks balanced by
measured layer time; each rank keeps only its chunks (a :class:`PipelineStage` takes the
Sequential's place). Each training step, the strategy splits the batch into microbatches and runs
the schedule: the first stage feeds the Sequential's input (captured from the module's own
``training_step``), the last stage calls ``training_step`` per microbatch on the received
activation to get the loss, backward passes flow back through channels. Values the module logs on
the last stage are combined over microbatches and logged on *every* rank, so the progress bar,
``callback_metrics``, checkpoint monitors and early stopping see them everywhere. Gradients of each
stage are then averaged over its data-parallel group.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shm.parallel.ddp import GradReducer
from lightning_shm.parallel.pipeline import (
    PipelineEngine,
    PipelineSchedule,
    PipelineStage,
    PipelineState,
    Schedule,
    plan_chunks,
)
from lightning_shm.parallel.pipeline.split import validate_split_points
from lightning_shm.parallel.sequential import find_sequential, replace_submodule
from lightning_shm.runtime import Group, ParallelGroups, Topology, World
from lightning_shm.strategies.base import ShardedStateStrategy, shm_ddp_bytes
from lightning_shm.strategies.pipeline_io import LightningStageIO

_ELEMENTWISE_FRONT = (nn.Flatten, nn.Identity, nn.Dropout, nn.ReLU)


class SHMPipeline(ShardedStateStrategy):
    """Pipeline parallelism over ``pipeline_parallel_size`` stages (times devices / pp data-parallel replicas).

    Args:
        pipeline_parallel_size: number of stages P; must divide ``devices``.
        microbatches: M microbatches per batch (the per-rank batch size must be divisible by M).
        schedule: "gpipe", "1f1b", "interleaved_1f1b" or "zero_bubble" (ZB-H1).
        virtual_stages: chunks per rank for interleaved_1f1b (default 2).
        split_points: explicit chunk start indices (P*v - 1 of them) into the Sequential.
        balance: "time" (measured forward+backward per layer) or "params" (parameter count).
        activation_checkpointing: keep only chunk inputs after forward and recompute in backward.
        sequential: attribute path of the nn.Sequential to split (default: the first top-level one).
        sample_input: an input of the Sequential for timing layers (default: ``example_input_array``,
            else inferred from the first Linear's in_features).
        **kwargs: see :class:`~lightning_shm.strategies.base.SHMStrategyBase`.
    """


    def __init__(self, *args: Any, pipeline_parallel_size: int = 2, microbatches: int = 4,
                 schedule: str = "1f1b", virtual_stages: Optional[int] = None,
                 split_points: Optional[Sequence[int]] = None, balance: str = "time",
                 activation_checkpointing: bool = False, sequential: Optional[str] = None,
                 sample_input: Optional[Tensor] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kind = Schedule.parse(schedule)
        if balance not in ("time", "params"):
            raise ValueError(f"balance must be 'time' or 'params', got {balance!r}")
        v = virtual_stages if virtual_stages is not None else (2 if kind == Schedule.INTERLEAVED_1F1B else 1)
        if not isinstance(pipeline_parallel_size, int) or pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive int, got {pipeline_parallel_size!r}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
        self.pipeline_schedule = PipelineSchedule(kind, pipeline_parallel_size, microbatches, v)  # validates
        self.split_points = list(split_points) if split_points is not None else None
        self.balance = balance
        self.activation_checkpointing = activation_checkpointing
        self.sequential = sequential
        self.sample_input = sample_input
        self.engine: Optional[PipelineEngine] = None
        self.stage: Optional[PipelineStage] = None
        self.chunk_starts: Optional[list[int]] = None
        self._groups: Optional[ParallelGroups] = None
        self._sync_grads = True
        self._warned_short = False
        self._fresh_grads: list[tuple[nn.Parameter, Optional[Tensor]]] = []

    @property
    def microbatches(self) -> int:
        return self.pipeline_schedule.microbatches

    # ------------------------------------------------------------------ grid
    def topology(self) -> Topology:
        return Topology.infer(max(self.num_processes, 1), pp=self.pipeline_schedule.stages)

    def attach_world(self, world: World) -> None:
        super().attach_world(world)
        self._groups = self.topology().groups(world)

    def data_parallel_group(self) -> Optional[Group]:
        return self._groups.dp if self._groups is not None else None

    @property
    def pp_group(self) -> Group:
        assert self._groups is not None
        return self._groups.pp

    def validate_model(self, module: "pl.LightningModule", trainer: Optional["pl.Trainer"] = None,
                       launch_args: Any = ()) -> None:
        if not module.automatic_optimization:
            raise ValueError("shm_pipeline runs forward and backward inside its schedule; manual optimization "
                             "(automatic_optimization = False) is not supported")
        if next(module.parameters(), None) is None:
            return
        _, seq = find_sequential(module, self.sequential)
        V = self.pipeline_schedule.chunks
        if V > len(seq):
            raise ValueError(f"{len(seq)} layers in the nn.Sequential cannot form {V} pipeline chunks "
                             f"(stages={self.pipeline_schedule.stages} x virtual_stages="
                             f"{self.pipeline_schedule.virtual}); use fewer stages")
        if self.split_points is not None:
            validate_split_points(self.split_points, len(seq), V)
        bs = _train_batch_size(trainer, launch_args)
        if bs is not None:
            per_rank = bs  # Lightning gives each data-parallel replica batches of the loader's batch size
            if per_rank % self.microbatches:
                raise ValueError(f"batch size {per_rank} is not divisible by microbatches={self.microbatches}")

    def shm_components(self, module: "pl.LightningModule") -> dict[str, int]:
        topo, sched = self.topology(), self.pipeline_schedule
        channel = PipelineEngine.channel_config(sched).segment_bytes()
        return {"gradient buckets (dp)": shm_ddp_bytes(module, topo.dp) if topo.dp > 1 else 0,
                "activation channels": topo.dp * 2 * (sched.chunks - 1) * channel}

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self._groups is not None and self._world is not None
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError("shm_pipeline does not support manual optimization")
        self.prepare_model(trainer)  # stages are cut from rank 0's initial weights
        assert self.model is not None
        plain_keys = list(module.state_dict())
        plain_params = [n for n, _ in module.named_parameters()]
        path, seq = find_sequential(module, self.sequential)
        sched = self.pipeline_schedule
        if self.global_rank == 0:  # measure once, everyone uses the same cut
            sample = self._sample(module, seq) if self.balance == "time" else None
            plan = plan_chunks(seq, sched.chunks, self.split_points, sample, stages=sched.stages)
        else:
            plan = None
        self.chunk_starts, split_method = self.group.broadcast_object(plan, src=0)
        rank_zero_info(f"shm_pipeline: {sched.chunks} chunks of {len(seq)} layers start at {self.chunk_starts} "
                       f"(split by {split_method}), schedule {sched.kind.value}, {sched.microbatches} microbatches")
        pp_index = self._groups.coords.pp
        self.stage = PipelineStage(seq, self.chunk_starts, sched.chunks_of(pp_index))
        replace_submodule(module, path, self.stage)
        self.engine = PipelineEngine(self.stage.chunks, sched, pp_index, list(self._groups.pp.ranks), self._world,
                                     tag=f"pp{self._groups.coords.dp}",
                                     activation_checkpointing=self.activation_checkpointing)
        self.state_manager = PipelineState(module, self._groups.pp, plain_keys, plain_params)
        module._example_input_array = None  # a stage cannot run the model's example input (ModelSummary)
        if trainer.state.fn == TrainerFn.FITTING:
            if self._groups.dp.size > 1:
                self._reducer = GradReducer(list(self.model.named_parameters()), self._groups.dp, tag="pp-dp",
                                            hooks=False)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.install_global_clipping(self._groups.pp)  # stages hold disjoint parameters
        self.attach_metrics()

    def _sample(self, module: nn.Module, seq: nn.Sequential) -> Optional[Tensor]:
        rows = 64
        if self.sample_input is not None:
            return self.sample_input
        example = getattr(module, "example_input_array", None)
        if isinstance(example, Tensor):
            return example.repeat(rows, *[1] * (example.dim() - 1)) if example.shape[0] == 1 else example
        for m in seq:  # Flatten/activations then a Linear: any [rows, in_features] tensor fits
            if isinstance(m, nn.Linear):
                return torch.randn(rows, m.in_features, dtype=m.weight.dtype)
            if not isinstance(m, _ELEMENTWISE_FRONT):
                break
        return None

    # ------------------------------------------------------------------ steps
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        assert self.engine is not None
        module = self.lightning_module
        io = LightningStageIO(self, "training_step", batch, batch_idx, self.microbatches, training=True)
        schedule = self._schedule_for(io.parts)
        # Lightning zero-grads *after* training_step and before backward; the schedule computes the
        # gradients inside training_step. Run it on fresh grads, hand them over in backward().
        params = [p for p in module.parameters() if p.requires_grad]
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        self.engine.train_step(io, schedule)
        self._fresh_grads = [(p, p.grad) for p in params]
        for p, g in zip(params, previous):
            p.grad = g
        last = self.pp_group.size - 1
        loss = io.total_loss() if self._groups.coords.pp == last else torch.zeros(())
        loss = self.pp_group.broadcast_object(loss, src=last)
        io.replay_logs(module)
        return loss

    def _schedule_for(self, parts: int) -> PipelineSchedule:
        sched = self.pipeline_schedule
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

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """The schedule already ran backward in training_step: add its gradients now (after Lightning's
        zero_grad), average them over the data-parallel group, keep Lightning's hooks around it."""
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        with torch.no_grad():
            for p, g in self._fresh_grads:
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
        self._fresh_grads = []
        if self._reducer is not None and self._sync_grads:
            self._reducer.synchronize()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    def _eval(self, step: str, batch: Any, batch_idx: int, *args: Any) -> Any:
        assert self.engine is not None
        if step != "predict_step":
            self.stop_point()
        io = LightningStageIO(self, step, batch, batch_idx, self.microbatches, training=False, extra=args)
        self.engine.eval_step(io, io.parts)
        last = self.pp_group.size - 1
        out = io.combined_output() if self._groups.coords.pp == last else None
        out = self.pp_group.broadcast_object(out, src=last)
        io.replay_logs(self.lightning_module)
        return out

    def validation_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        return self._eval("validation_step", batch, batch_idx, *args)

    def test_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        return self._eval("test_step", batch, batch_idx, *args)

    def predict_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        return self._eval("predict_step", batch, batch_idx, *args)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradient accumulation: average over the dp group only after the last micro-step."""
        self._sync_grads = False
        try:
            yield None
        finally:
            self._sync_grads = True

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        for name, method in (("shm_pipeline", "spawn"), ("shm_pipeline_fork", "fork")):
            strategy_registry.register(name, cls, description=f"shared-memory pipeline parallel (P=2, 1F1B), {method}",
                                       start_method=method, override=True)


def _train_batch_size(trainer: Optional["pl.Trainer"], launch_args: Any) -> Optional[int]:
    """The training batch size when the main process can know it without building data: the first
    DataLoader or LightningDataModule (with a ``batch_size``) among ``Trainer.fit``'s arguments."""
    from torch.utils.data import DataLoader

    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    args, kwargs = launch_args if launch_args else ((), {})
    for obj in list(args) + list(kwargs.values()):
        if isinstance(obj, (DataLoader, pl.LightningDataModule)) and isinstance(getattr(obj, "batch_size", None), int):
            return obj.batch_size
    return None
