"""``shm_model_parallel``: data (replicated or sharded) x tensor x pipeline parallelism, one strategy.

The four named strategies are presets of this one (``shm_ddp`` = dp replicate, ``shm_fsdp`` = dp
shard, ``shm_tp`` = tp x dp, ``shm_pipeline`` = pp x dp), so one code path serves them all. The
mechanics live in :mod:`lightning_shm.parallel.compose`; this class adapts them to Lightning:

``setup`` (each worker)
    1. rank 0's weights on every rank (accelerator, precision, device, broadcast)
    2. the full model's summary taken for ModelSummary, before it is cut
    3. :func:`~lightning_shm.parallel.compose.parallelize`: SyncBatchNorm -> pipeline stage -> tp
       plan -> dp reducer or FSDP units -> one ``ModelState`` for checkpoints
    4. optimizers (FSDP: each step ends with the barrier before shards are read), precision,
       global-norm clipping, metrics synced over the dp group, SWA averaging in the same layout
steps
    training: drop FSDP leftovers, rank 0's buffers (BatchNorm statistics) over the dp group, then
    Lightning's step -- or the pipeline schedule (:mod:`.pipeline_steps`); validation / test /
    predict likewise; a step taking ``dataloader_iter`` gets its batches through :mod:`.loader_iter`.
    ``sync_dist`` and torchmetrics combine over the data-parallel group only: tp and
    pp ranks hold the same data.
checkpoints
    plain keys and a plain single-process optimizer state, from any layout, to any layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import AbstractSet, Any, ContextManager, Iterator, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, ModelPruning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from lightning_shm.parallel.clip import clip_grad_norm_, torch_clipping_over
from lightning_shm.parallel.compose import ParallelConfig, ParallelState, idle_arguments, parallelize, validate
from lightning_shm.parallel.ddp import broadcast_module_state, broadcast_tensors
from lightning_shm.parallel.fsdp import UnitPolicy
from lightning_shm.parallel.fsdp.policy import PolicyFn
from lightning_shm.parallel.init import initialised_as_whole
from lightning_shm.parallel.optimizers import replicas_loss
from lightning_shm.parallel.outside_reads import (
    differentiations,
    explain_failure,
    logged_reads,
    output_nodes,
    pieces_read_by,
    read_outside,
    refuse_gradient_reads,
    refuse_outside_reads,
)
from lightning_shm.parallel.pipeline import PipelineEngine
from lightning_shm.parallel.pipeline.split import attributes_kept, why_sample_fails
from lightning_shm.parallel.replicas import parted
from lightning_shm.parallel.state_copies import consolidate_copies, localize_copies
from lightning_shm.parallel.tp.inputs import MODES, broadcast_from_first, check_same
from lightning_shm.parallel.tp.loading import (
    check_replica_samplers,
    is_group_batch,
    split_loader,
    stream_loader,
    why_not_splittable,
)
from lightning_shm.runtime import Group, ParallelGroups, Topology, World
from lightning_shm.strategies.base import SHMStrategyBase
from lightning_shm.strategies.collective_calls import SAVE, noted
from lightning_shm.strategies.collectives import MetricSync
from lightning_shm.strategies.grad_norm import GradNormLogs, split_norm, whole_param_norm
from lightning_shm.strategies.lightning_args import refuse_lightning_only
from lightning_shm.strategies.loader_iter import PreparedBatches, takes_loader_iter
from lightning_shm.strategies.module_log import logging_through
from lightning_shm.strategies.piece_saves import piece_saves_warned
from lightning_shm.strategies.pipeline_steps import PipelineSteps
from lightning_shm.strategies.prediction_writers import mute_writers, unmute_writers
from lightning_shm.strategies.summary import full_model_summary
from lightning_shm.strategies.swa import adapt_swa
from lightning_shm.strategies.torch_distributed import user_stacklevel
from lightning_shm.strategies.whole_loads import whole_loads_explained

_ELEMENTWISE_FRONT = (nn.Flatten, nn.Identity, nn.Dropout, nn.ReLU)


_FUNC_TRANSFORMS = (
    "lightning_shm: torch.func transforms (vmap, grad: per-sample gradients, DP-SGD) cannot run through this "
    "layout's layers: shm_fsdp's and shm_tp's layers communicate in autograd Functions torch.func does not "
    "transform, a pipeline stage runs only its own layers, and named_parameters() gives the rank's pieces, which "
    "functional_call would compute with. Under shm_ddp every layer is whole and they run as in one process (average "
    "a gradient set by hand over the ranks: p.grad = self.trainer.strategy.reduce(p.grad, reduce_op='mean')).")


def _from_func_transforms(e: BaseException) -> bool:
    """Whether torch.func (functorch) raised ``e``, or the error it wraps (a failed first step's explanation)."""
    while e is not None:
        if "functorch" in str(e) or "TensorWrapper" in str(e):
            return True
        e = e.__cause__  # type: ignore[assignment]
    return False


class SHMModelParallel(SHMStrategyBase):
    """dp x tp x pp on W CPU processes through shared memory (``devices`` = dp x tp x pp).

    Args:
        data_parallel_size: replicas seeing different data; "auto" = devices / (tp x pp).
        tensor_parallel_size: ranks splitting each planned layer (see ``plan``).
        pipeline_parallel_size: stages the model's ``nn.Sequential`` is cut into.
        data_parallel: "replicate" (gradients averaged, shm_ddp) or "shard" (FSDP units, ZeRO-3).
        plan: tensor-parallel plan (the styles of :class:`~lightning_shm.strategies.tp.SHMTensorParallel`'s);
            default: the module's ``tp_plan`` attribute, else derived for its Sequential.
        sequential: attribute path of the ``nn.Sequential`` to pipeline / derive a plan from.
        microbatches, schedule, virtual_stages, split_points, balance, split_linear, sample_input: the pipeline
            (see :class:`~lightning_shm.strategies.pipeline.SHMPipeline`).
        activation_checkpointing: a set of module classes (``{Block}``, what Lightning's
            ``FSDPStrategy(activation_checkpointing_policy=...)`` takes): each instance keeps only its inputs
            in forward and runs again in backward, under every layout (:mod:`lightning_shm.parallel.checkpointing`);
            True: a pipeline's chunks (see :class:`~lightning_shm.strategies.pipeline.SHMPipeline`).
        unit_policy, gather, reshard_after_forward, prefetch: FSDP units (see
            :class:`~lightning_shm.strategies.fsdp.SHMFSDPStrategy`).
        bucket_cap_mb, find_unused_parameters: the gradient reducer (see
            :class:`~lightning_shm.strategies.ddp.SHMDDPStrategy`).
        broadcast_buffers: rank 0's buffers (BatchNorm running statistics) to every data-parallel
            replica before every training step and at the start of evaluation, as torch DDP does.
        tp_batch: the ranks of one model replica -- the tp members, and the pipeline stages: the last
            computes the loss on its batch's targets for the input the first stage took from its own --
            must compute on the same batch (see :mod:`lightning_shm.parallel.tp.inputs`; the name predates
            the stages' use of it): ``"split"`` has each rank load only its share of
            every batch's rows and all-gathers them (needs a plain ``DataLoader`` over a map-style
            dataset); ``"broadcast"`` has every rank load the whole batch and use the first member's
            (as Megatron does); ``"auto"`` (default) splits where that is exact -- a plain DataLoader
            with a ``BatchSampler`` and torch's ``default_collate`` -- and broadcasts otherwise;
            ``"check"`` compares fingerprints every step and raises if they differ (a data pipeline
            seeded per rank); ``"off"`` trusts the data.
        **kwargs: see :class:`~lightning_shm.strategies.base.SHMStrategyBase` (start_method, timeout, ...).
    """

    def __init__(self, *args: Any, data_parallel_size: Union[int, str] = "auto", tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, data_parallel: str = "replicate",
                 plan: Optional[Mapping[str, Any]] = None, sequential: Optional[str] = None, microbatches: int = 4,
                 schedule: str = "1f1b", virtual_stages: Optional[int] = None,
                 split_points: Optional[Sequence[int]] = None, balance: str = "time", split_linear: bool = False,
                 activation_checkpointing: Union[bool, AbstractSet[type]] = False,
                 sample_input: Optional[Tensor] = None,
                 unit_policy: Union[None, int, PolicyFn, UnitPolicy, AbstractSet[type]] = None,
                 reshard_after_forward: bool = True, prefetch: bool = False, gather: str = "view",
                 bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 tp_batch: str = "auto",
                 **kwargs: Any) -> None:
        refuse_lightning_only(type(self).__name__, kwargs)
        super().__init__(*args, **kwargs)
        self.parallel_config = ParallelConfig(
            data_parallel_size, tensor_parallel_size, pipeline_parallel_size, data_parallel,
            dict(plan) if plan is not None else None, sequential, microbatches, schedule, virtual_stages,
            list(split_points) if split_points is not None else None, balance, activation_checkpointing,
            unit_policy, reshard_after_forward, prefetch, bucket_cap_mb, find_unused_parameters,
            split_linear=split_linear, gather=gather)
        idle = idle_arguments(self.parallel_config)
        if idle is not None:
            warnings.warn(idle, stacklevel=user_stacklevel())
        self.sample_input = sample_input
        self.broadcast_buffers = broadcast_buffers
        if tp_batch not in MODES:
            raise ValueError(f"tp_batch must be one of {MODES}, got {tp_batch!r}")
        self.tp_batch = tp_batch
        self.parallel: Optional[ParallelState] = None
        self.pipeline: Optional[PipelineSteps] = None
        self._groups: Optional[ParallelGroups] = None
        self._exit: Optional[contextlib.ExitStack] = None  # what setup patched for the run (ModelSummary)
        self._buffer_owners: Optional[list[tuple[nn.Module, str]]] = None
        self._in_stage_step = False
        self._warned_step_gather = False
        self._eval_calls = 0  # validation and test steps so far (stop points of steps given no batch_idx)
        self._fetches: dict[Any, bool] = {}  # a step's function: it takes dataloader_iter
        self._muted_writers: list[BasePredictionWriter] = []
        self._grads_split = False  # some rank holds a gradient that is not every rank's whole one (setup)
        self._reads_checked = False  # the first training step's loss was checked for reads of pieces
        self._replicas_checked = False  # the ranks' whole copies were compared after the first optimizer step
        self._norm_logs = GradNormLogs(self._layout)

    # ------------------------------------------------------------------ grid
    def topology(self) -> Topology:
        return self.parallel_config.topology(max(self.num_processes, 1))

    @property
    def microbatches(self) -> int:
        return self.parallel_config.microbatches

    def attach_world(self, world: World) -> None:
        super().attach_world(world)
        self._groups = self.topology().groups(world, self._rail)

    def data_parallel_group(self) -> Optional[Group]:
        return self._groups.dp if self._groups is not None else None

    def replica_group(self) -> Optional[Group]:
        return self._groups.replica if self._groups is not None else None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints are plain: cut into this rank's pieces once the pieces exist

    def validate_model(self, module: "pl.LightningModule", trainer: Optional["pl.Trainer"] = None,
                       launch_args: Any = ()) -> None:
        batch = _train_batch_size(trainer, launch_args) if self.topology().pp > 1 else None
        validate(module, self.parallel_config, max(self.num_processes, 1), batch, module.automatic_optimization)
        topo = self.topology()
        pieces = topo.tp > 1 or topo.pp > 1 or (self.parallel_config.shard and topo.dp > 1)
        pruning = [type(cb).__name__ for cb in (trainer.callbacks if trainer is not None else [])
                   if isinstance(cb, ModelPruning)]
        if pieces and pruning:
            raise ValueError(f"{pruning[0]} prunes the module's tensors as whole ones, and under this layout "
                             f"({self._layout()}) a rank holds pieces of them: not supported. Prune under shm_ddp, "
                             "or prune the trained model in one process.")

    def shm_components(self, module: "pl.LightningModule") -> dict[str, int]:
        topo, cfg = self.topology(), self.parallel_config
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        parts = {}
        if topo.dp > 1:
            parts["parameter shards" if cfg.shard else "gradient buckets"] = params if cfg.shard else topo.dp * params
        if topo.pp > 1:
            channel = PipelineEngine.channel_config(cfg.pipeline).segment_bytes()
            parts["activation channels"] = topo.dp * topo.tp * 2 * (cfg.pipeline.chunks - 1) * channel
        return parts

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self._world is not None and self._groups is not None and self.model is not None
        self.accelerator.setup(trainer)  # type: ignore[union-attr]
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        broadcast_module_state(self.model, self.group)  # rank 0's weights everywhere; every piece is cut from them
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._exit = contextlib.ExitStack()
        report_share = self._exit.enter_context(full_model_summary(trainer, module, self.global_rank))
        config = dataclasses.replace(self.parallel_config, sync_batchnorm=self._layer_sync is not None)
        self.parallel = parallelize(module, config, self._world, self._groups, training=fitting,
                                    sample_input=self._sample(module, config), log=rank_zero_info)
        if self.parallel.engine is not None:
            module._example_input_array = None  # a stage cannot run the model's example input
            self.pipeline = PipelineSteps(module, self.parallel, self.precision_plugin)
        report_share(self._layout())
        self._buffer_owners = None
        if fitting:
            self._setup_optimizers_naming_a_frozen_stage(trainer)
            self.parallel.watch([o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers])
            if self.parallel.state.placements or self.parallel.state.stages is not None:
                adapt_swa(trainer, module, self.parallel.state)
        self.setup_precision_plugin()
        state, W = self.parallel.state, self.world_size
        # agreed on by every rank: clipping is collective where it is split, and a pipeline stage may hold only
        # parameters every rank holds (layers the module also keeps under a second name, a tied embedding)
        self._grads_split = bool(self.group.vote_max(int(not all(state.copies(p) == W for p in module.parameters()))))
        self._install_clipping()
        if self._grads_split:  # a hook initialising parameters again draws as one process (pieces) or says why not
            def warn(message: str) -> None:
                if self.global_rank == 0:
                    warnings.warn(message, stacklevel=user_stacklevel())

            self._exit.enter_context(initialised_as_whole(state, self.parallel.stage, warn))
            self._exit.enter_context(whole_loads_explained(module, self._layout()))
            self._exit.enter_context(piece_saves_warned(state, self._layout(), self.global_rank))
        self.attach_metrics()

    def _setup_optimizers_naming_a_frozen_stage(self, trainer: "pl.Trainer") -> None:
        """The module's ``configure_optimizers`` runs on every stage over that stage's parameters; on a stage
        holding only frozen layers, one built over ``requires_grad`` parameters has none -- say so."""
        try:
            self.setup_optimizers(trainer)
        except ValueError as e:
            stage = self.parallel.stage if self.parallel is not None else None
            if stage is None or any(p.requires_grad for p in self.lightning_module.parameters()):
                raise
            layers = sorted(stage.layer_ranges.values())
            raise ValueError(f"pipeline rank {self._groups.coords.pp} holds layers {layers} (start, end) of the "
                             f"nn.Sequential, none of them trainable, and configure_optimizers failed on them: {e}. "
                             "An optimizer over self.parameters() skips frozen parameters; or give split_points "
                             "that put a trainable layer on every stage.") from e

    def _layout(self) -> str:
        t = self.topology()
        parts = [f"dp={t.dp} ({self.parallel_config.data_parallel})", f"tp={t.tp}", f"pp={t.pp}"]
        return " x ".join(parts)

    def _sample(self, module: nn.Module, config: ParallelConfig) -> Optional[Tensor]:
        """An input of the pipelined Sequential, for timing its layers, in the dtype the precision plugin gives
        the step's batches (``64-true``: float64; a float32 ``example_input_array`` refused by float64 layers sent
        the planner to parameter counts)."""
        if config.pipeline_parallel_size == 1 or config.balance != "time":
            return None
        if self.sample_input is not None:  # the user's: a layer that refuses it raises, naming the layer
            return self.precision_plugin.convert_input(self.sample_input)
        from lightning_shm.parallel.sequential import find_sequential

        rows = 64
        _, seq = find_sequential(module, config.sequential)
        example = getattr(module, "example_input_array", None)
        if isinstance(example, Tensor):  # the LightningModule's input: the Sequential's only if forward is net(x)
            sample, source = (example.repeat(rows, *[1] * (example.dim() - 1)) if example.shape[0] == 1
                              else example), "example_input_array"
            sample = self.precision_plugin.convert_input(sample)
        else:
            first = next((m for m in seq if not isinstance(m, _ELEMENTWISE_FRONT)), None)
            if not isinstance(first, nn.Linear):
                return None
            # Flatten/activations then a Linear: a [rows, in_features] matrix fits an MLP, not a sequence model;
            # the parameters' dtype: ``first.weight`` may be computed (weight_norm) and not yet converted
            sample, source = torch.randn(rows, first.in_features, dtype=next(first.parameters()).dtype), \
                f"an input guessed from the first Linear's in_features ({first.in_features})"
        with attributes_kept(module):  # the sample runs the user's forward hooks too
            why = why_sample_fails(seq, sample)
        if why is not None:
            rank_zero_warn(f"balance='time' times the pipeline's layers on {source}, which does not run through "
                           f"the Sequential ({why}); the stages are balanced by parameter count instead. Pass "
                           "sample_input=<a batch of the Sequential's input> to balance by measured time, or "
                           "balance='params' to say so.")
            return None
        return sample

    def _install_clipping(self) -> None:
        """``gradient_clip_val`` (norm), and ``torch.nn.utils.clip_grad_norm_`` called by the module, clip by
        the norm over every rank's gradient pieces, each element once: Lightning's own clipping would use
        each rank's local norm, different where gradients are split. Where every rank holds every gradient
        (pure data parallelism) Lightning's is that norm."""
        if not self._grads_split:
            return
        state, world = self.parallel.state, self.group

        def clip_grad_by_norm(optimizer: Any, clip_val: Union[int, float]) -> None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            clip_grad_norm_(params, float(clip_val), world, state.copies)

        self.precision_plugin.clip_grad_by_norm = clip_grad_by_norm  # instance attribute: this strategy's plugin
        held = {id(p) for p in self.lightning_module.parameters()}
        assert self._exit is not None
        self._exit.enter_context(torch_clipping_over(world, lambda p: state.copies(p) if id(p) in held else world.size,
                                                     self.lightning_module.parameters))

    def grad_norm(self, module: nn.Module, norm_type: Union[float, int, str],
                  group_separator: str = "/") -> dict[str, Tensor]:
        """Lightning's ``grad_norm`` for ``module`` (the LightningModule or a submodule this rank holds) with one
        process's values: per parameter over every rank's pieces (collective where gradients are split)."""
        if self.parallel is None or not self._grads_split:
            return lightning_grad_norm(module, norm_type, group_separator)
        return self._norm_logs.record(split_norm(module, self.lightning_module, self.parallel.state,
                                                 self.group, norm_type, group_separator))

    def param_norm(self, module: nn.Module, norm_type: Union[float, int, str],
                   group_separator: str = "/") -> dict[str, Tensor]:
        """Each parameter's norm (:func:`~lightning_shm.strategies.grad_norm.param_norm`) for ``module``, one
        process's values: over every rank's pieces where a rank holds pieces (collective there)."""
        if self.parallel is None or not self._grads_split:
            return whole_param_norm(module, norm_type, group_separator)
        return split_norm(module, self.lightning_module, self.parallel.state, self.group, norm_type,
                          group_separator, of_params=True)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's, watching what ``on_before_optimizer_step`` logs where gradients are split; an optimizer
        deciding from its closure's loss (LBFGS) gets the replicas' mean loss, as one process's."""
        closure = replicas_loss(optimizer, closure, self.data_parallel_group())
        if self.parallel is None or not self._grads_split:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        with self._norm_logs.watching(self.lightning_module):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ------------------------------------------------------------------ steps
    def process_dataloader(self, dataloader: object) -> object:
        """With ``tp_batch`` "split" (or "auto" where exact), each rank of a replica loads only its rows; unless
        "off", the replica's ranks first check that a DistributedSampler the module built gives them the same
        samples; under "auto" a plain loader over an IterableDataset compares its first batches every pass."""
        replica = self._groups.replica if self._groups is not None else None
        if self.tp_batch == "off" or replica is None or replica.size == 1:
            return dataloader
        check_replica_samplers(dataloader, replica, self.distributed_sampler_kwargs)
        if self.tp_batch not in ("auto", "split"):
            return dataloader
        reason = why_not_splittable(dataloader, auto=self.tp_batch == "auto")
        if reason is None:
            return split_loader(dataloader, replica)  # type: ignore[arg-type]
        if self.tp_batch == "split":
            raise ValueError(f"tp_batch='split' cannot split this loader's batches over the ranks of a replica "
                             f"(tp members and pipeline stages): {reason}. Use tp_batch='broadcast'.")
        if type(dataloader) is DataLoader and isinstance(dataloader.dataset, IterableDataset):
            return stream_loader(dataloader, replica)  # compares its first batches, then broadcast as below
        return dataloader  # auto: batch_to_device broadcasts member 0's batch

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if self.parallel is not None and trainer is not None and trainer.training:
            self.parallel.begin_batch()  # the batch's hooks come next, and may write parameters
        return self._same_on_replica(batch)

    def _same_on_replica(self, batch: Any) -> Any:
        """``batch`` as every rank of the model replica (tp members, pipeline stages) must compute on it:
        member 0's (``tp_batch`` "auto" / "broadcast"), or checked to be the same ("check")."""
        replica = self._groups.replica if self._groups is not None else None
        if self.tp_batch == "off" or replica is None or replica.size == 1:
            return batch
        tensors: list[Tensor] = []
        apply_to_collection(batch, Tensor, tensors.append)
        if self.tp_batch == "check":
            check_same(tensors, replica)
            return batch
        if is_group_batch(tensors):  # gathered by a split loader: already the same on every member
            return batch
        replaced = iter(broadcast_from_first(tensors, replica))
        return apply_to_collection(batch, Tensor, lambda _: next(replaced))

    def _before_forward(self) -> None:
        assert self.parallel is not None
        self.parallel.begin_step()
        self._sync_buffers()

    def _sync_buffers(self) -> None:
        """Rank 0's buffers (e.g. BatchNorm running statistics) on every data-parallel replica, like
        torch DDP's ``broadcast_buffers``: all replicas evaluate with the same statistics. Buffers are
        looked up by owner and name each time: a callback may replace them (SWA resets BatchNorm)."""
        dp = self.data_parallel_group()
        if not (self.broadcast_buffers and dp is not None and dp.size > 1):
            return
        if self._buffer_owners is None:
            self._buffer_owners = [(m, n) for m in self.lightning_module.modules() for n, b in m._buffers.items()
                                   if b is not None and b.numel()]
        if self._buffer_owners:
            broadcast_tensors([m._buffers[n] for m, n in self._buffer_owners], dp)

    def _fetching(self, step: str, args: tuple) -> Optional[PreparedBatches]:
        """A step that takes ``dataloader_iter`` (:mod:`.loader_iter`): its iterator, handing out each batch as
        ``batch_to_device`` would (Lightning moves none in that flavor); None for a step given its batch."""
        if len(args) != 1:  # (batch, batch_idx, ...): the usual flavor
            return None
        # keyed by the function itself (held, so never another's id): a new module's or a rebound step is read anew.
        # A signature's inspection costs tens of us: once per function
        fn = getattr(self.lightning_module, step, None)
        key = getattr(fn, "__func__", fn)
        if key not in self._fetches:
            self._fetches[key] = takes_loader_iter(self.lightning_module, step)
        if not self._fetches[key]:
            return None
        return PreparedBatches(args[0], self._fetched_on_replica)

    def _fetched_on_replica(self, batch: Any) -> Any:
        """A batch the step fetched itself, as the replica computes on it; loaded inside the step, after the step's
        streams were shared (:meth:`ParallelState.share_streams`), so they are shared again."""
        batch = self._same_on_replica(batch)
        if self.parallel is not None:
            self.parallel.share_streams()
        return batch

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._replicas_checked and self.lightning_module.trainer.global_step >= 1:
            self._replicas_checked = True
            self._check_replicas()
        try:
            return self._training_step(*args, **kwargs)
        except Exception as e:
            if (self._grads_split or self.pipeline is not None) and _from_func_transforms(e):
                e.add_note(_FUNC_TRANSFORMS)
            raise

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        fetching = self._fetching("training_step", args)
        if fetching is not None:
            args = (fetching,)
            if self.parallel is not None:  # no batch_to_device: the fence before a batch's writes comes here
                self.parallel.begin_batch()
        self._before_forward()
        if self.pipeline is not None:
            trainer = self.lightning_module.trainer
            batch, batch_idx, fetched_from = next(fetching) if fetching is not None else (args[0], args[1], None)
            with self._stage_step():
                return self.pipeline.training_step(batch, batch_idx, trainer.accumulate_grad_batches,
                                                   trainer.fit_loop._skip_backward, fetched_from=fetched_from)
        assert self.parallel is not None
        with self.parallel.step_scope():
            if self._reads_checked or not self._grads_split or not self.lightning_module.automatic_optimization:
                return super().training_step(*args, **kwargs)
            self._reads_checked = True
            return self._step_checking_reads(*args, **kwargs)

    def _check_replicas(self) -> None:
        """Once, at the first training step after an optimizer step: the ranks' copies of every parameter they all
        hold whole are still equal (:mod:`lightning_shm.parallel.replicas`), or the user hears why not. Not in a
        pipeline: its stages hold different parameters, so no list of them is every rank's."""
        if self.parallel is None or self.pipeline is not None or self.world_size == 1:
            return
        state, W = self.parallel.state, self.world_size
        names = parted([(n, p) for n, p in self.lightning_module.named_parameters() if state.copies(p) == W],
                       self.group)
        if names:
            rank_zero_warn(
                f"lightning_shm: after the first optimizer step the ranks' copies of {names[:4]}"
                f"{' ...' if len(names) > 4 else ''} differ: some rank stepped with a gradient that was not averaged "
                "over the ranks -- one set outside backward (p.grad = ...: DP-SGD's clipped per-sample gradients, "
                "gradients combined from torch.autograd.grad) or changed on one rank -- and from here each rank "
                "trains its own model (as under Lightning's ddp, which saves rank 0's). Average such a gradient over "
                "the ranks before the step: p.grad = self.trainer.strategy.reduce(p.grad, reduce_op='mean')."
                + (" Under tensor parallelism a module with whole parameters that the forward runs on the rank's "
                   "heads -- qk-norm's LayerNorm(head_dim) on q and k after their column layers -- does so too: each "
                   "rank's gradient comes from its heads only. Plan it 'on_heads'." if self.topology().tp > 1
                   else ""))

    def _step_checking_reads(self, *args: Any, **kwargs: Any) -> Any:
        """The first training step, whose loss's graph shows what it reads: parameters this rank holds pieces of,
        read by the step itself, are refused (:mod:`lightning_shm.parallel.outside_reads`)."""
        assert self.parallel is not None
        module, state, W = self.lightning_module, self.parallel.state, self.world_size
        pieces = {id(p): n for n, p in module.named_parameters() if state.copies(p) < W}
        owners = [m for m in module.modules() if any(id(p) in pieces for p in m._parameters.values() if p is not None)]
        held = "only a piece (a row block under FSDP, a slice under tensor parallelism)"
        where = {id(m): n for n, m in module.named_modules()}
        logged: list[tuple[str, Tensor]] = []  # values logged with a graph: what they read is found as the loss's is
        log = module.log

        def keeping(name: str, value: Any, *a: Any, **kw: Any) -> None:
            if isinstance(value, Tensor) and value.grad_fn is not None:
                logged.append((name, value))
            log(name, value, *a, **kw)

        try:
            with output_nodes(owners) as (boundary, ran), differentiations(pieces) as differentiated, \
                    logging_through(module, keeping):
                out = super().training_step(*args, **kwargs)
        except Exception as e:
            again = (args[0].replay(),) if isinstance(args[0], PreparedBatches) else args  # the same batches
            names, direct, readers = pieces_read_by(
                lambda: super(SHMModelParallel, self).training_step(*again, **kwargs), pieces, owners)
            # a module reading its children's pieces in its own forward (not the LightningModule's: a tied head)
            inner = [where[i] for i in readers if where.get(i) and any(n.startswith(where[i] + ".") for n in names)]
            if names:
                raise explain_failure(e, names, held, [where[i] for i in direct], inner) from e
            raise
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if isinstance(loss, Tensor) and loss.grad_fn is not None:
            if differentiated.called:
                refuse_gradient_reads(read_outside(loss, {}, boundary, differentiated.grads), held)
            else:
                names = read_outside(loss, pieces, boundary)
                never_called = [where[id(m)] for m in owners if id(m) not in ran
                                and any(f"{where[id(m)]}.{a}".lstrip(".") in names for a in m._parameters)]
                refuse_outside_reads(names, held, never_called)
        message = logged_reads({name: read_outside(value, pieces, boundary) for name, value in logged}, held)
        if message is not None:
            rank_zero_warn(message)
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", args, kwargs)

    def _eval_step(self, step: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        fetching = self._fetching(step, args)
        # never in predict, nor where replicas evaluate different numbers of batches (eval_stop_points)
        if step != "predict_step" and self.eval_stop_points:
            # a step fetching its batches takes no batch_idx: count the calls (every rank makes as many)
            self.stop_point(args[1] if fetching is None else self._eval_calls)
            self._eval_calls += 1
        if self.pipeline is not None:
            with self._stage_step():
                if fetching is None:
                    return self.pipeline.eval_step(step, *args)
                batch, batch_idx, fetched_from = next(fetching)
                return self.pipeline.eval_step(step, batch, batch_idx, fetched_from=fetched_from)
        assert self.parallel is not None
        with self.parallel.step_scope():
            return getattr(super(), step)(*((fetching,) if fetching is not None else args), **kwargs)

    @contextlib.contextmanager
    def _stage_step(self) -> Iterator[None]:
        self._in_stage_step = True
        try:
            yield
        finally:
            self._in_stage_step = False

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """As every strategy's (the data-parallel group); a differentiable gather in a pipeline's step -- a loss
        taking the other ranks' rows as negatives -- is warned about once: the step runs per microbatch, so it
        sees one microbatch of every data-parallel rank where one process sees the batch."""
        if sync_grads and self._in_stage_step and not self._warned_step_gather:
            self._warned_step_gather = True
            dp = self.data_parallel_group()
            first = (dp is None or dp.index == 0) and self.topology().coords(self.local_rank).tp == 0
            if first:  # one warning per run: the last stage's first replica, its first tp member
                rows = tensor.shape[0] if tensor.dim() else 1
                warnings.warn(
                    f"lightning_shm: self.all_gather(..., sync_grads=True) in a pipeline's step gathers {rows} rows "
                    f"from each of {dp.size if dp is not None else 1} data-parallel rank(s): the step runs once per "
                    f"microbatch (microbatches={self.parallel_config.microbatches}), so a loss over the gathered "
                    "rows (in-batch negatives: SimCLR, CLIP) sees one microbatch of each rank where one process "
                    "sees the whole batch. Fewer microbatches keep more rows; a strategy without "
                    "pipeline_parallel_size keeps them all.", stacklevel=user_stacklevel())
        return super().all_gather(tensor, group, sync_grads)

    def barrier(self, name: Optional[str] = None) -> None:
        """Inside a pipeline's step over the data-parallel group (the ranks running that code); elsewhere every rank."""
        dp = self.data_parallel_group() if self._in_stage_step else None
        if dp is not None:
            dp.barrier()
        else:
            super().barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Inside a pipeline's step from ``src``'s data-parallel replica on this stage (``src=0``: the first),
        over the data-parallel group: global rank ``src`` may be on another stage, not running the step."""
        dp = self.data_parallel_group() if self._in_stage_step else None
        if dp is None:
            return super().broadcast(obj, src)
        local_dp = self.topology().dp
        member = (src // self.num_processes) * local_dp + self.topology().coords(src % self.num_processes).dp
        return dp.broadcast_object(obj, src_member=member)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._before_forward()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._before_forward()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._before_forward()
        replica = self._groups.replica if self._groups is not None else None
        if replica is not None and replica.index != 0:  # the replica's first rank writes its predictions
            self._muted_writers = mute_writers(self.lightning_module.trainer.callbacks)

    def on_predict_end(self) -> None:
        unmute_writers(self._muted_writers)
        self._muted_writers = []
        super().on_predict_end()

    def metric_sync(self) -> MetricSync:
        """Under a pipeline a metric's states come from the last stage (:class:`.collectives.MetricSync`)."""
        stages = self._groups.pp if self._groups is not None and self.topology().pp > 1 else None
        return MetricSync(self.metric_group(), stages, self.topology().pp - 1, lambda: self._in_stage_step)

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the schedule ran backward inside training_step: hand its gradients over now, between
        # Lightning's zero_grad and optimizer step, keeping Lightning's hooks around it
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.pipeline.hand_over_grads()
        return self.precision_plugin.post_backward(closure_loss, module)

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.parallel is not None and self.parallel.reducer is not None and self.pipeline is None:
            self.parallel.reducer.post_backward()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradient accumulation: no data-parallel reduction until the last micro-step."""
        if self.pipeline is not None:
            self.pipeline.sync_grads = False
            try:
                yield None
            finally:
                self.pipeline.sync_grads = True
        elif self.parallel is not None and self.parallel.reducer is not None:
            with self.parallel.reducer.no_sync():
                yield None
        else:
            yield None

    # ------------------------------------------------------------------ checkpoints: plain, any layout
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.parallel is None:  # the main process (after fit it holds the full weights)
            return super().lightning_module_state_dict()
        with self._save_noted():
            return self.parallel.state.full_state_dict()  # collective

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.parallel is not None
        self.parallel.state.load_full_state_dict(checkpoint["state_dict"], strict=strict)

    def plain_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Copies of the module's state kept elsewhere in the checkpoint (a callback's EMA of
        ``pl_module.state_dict()``) made plain, as the module's own entries are (collective)."""
        with self._save_noted():
            return self._plain_copies(checkpoint, self._plain_already(), "the checkpoint")

    def _save_noted(self) -> ContextManager[None]:
        """The save note (:data:`~.collective_calls.SAVE`) on a save made during a Trainer call -- the program's
        own. Not on the end-of-fit checkpoint the launcher gathers once the call has ended: a rank that meets
        another's steps there ended its fit alone, and :mod:`.loop_position` says why (the note told it to save
        on every rank)."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None or trainer.state.status != TrainerStatus.RUNNING:
            return contextlib.nullcontext()
        return noted(SAVE, self.global_rank, type(self).__name__)

    def plain_attributes(self, attributes: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
        """The same for what the module and callbacks keep in attributes (a callback's EMA dict)."""
        named = {f"{kind}[{i}]": attrs for i, (kind, attrs) in enumerate(attributes)}  # paths name the holder
        plain = self._plain_copies(named, (), "the attributes the main process gets back")
        return [(kind, attrs) for (kind, _), attrs in zip(attributes, plain.values())]

    def _plain_copies(self, tree: Any, skip: Sequence[tuple[Any, ...]], where: str) -> Any:
        if self.parallel is None or self._group is None:
            return tree
        plain, partial = consolidate_copies(tree, self.parallel.state, self._group, skip)
        if partial:
            rank_zero_warn(f"lightning_shm: {['/'.join(map(str, p)) for p in partial]} in {where} look like copies "
                           "of the module's state on some ranks only; kept as rank 0 holds them (its pieces), which "
                           "will not resume under another layout or load in one process")
        return plain

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        if self.parallel is None:
            return checkpoint
        return localize_copies(checkpoint, self.parallel.state, self._plain_already())

    def _plain_already(self) -> list[tuple[Any, ...]]:
        """Checkpoint entries plain by other means: the module's, the optimizers', the averaging callbacks'
        (``WeightAveraging`` also moves the module's own entries to ``current_model_state``)."""
        trainer = self.lightning_module._trainer
        averaging = [] if trainer is None else [cb for cb in trainer.callbacks
                                                if isinstance(cb, (StochasticWeightAveraging, WeightAveraging))]
        moved = [("current_model_state",), ("averaging_state",)] if any(
            isinstance(cb, WeightAveraging) for cb in averaging) else []
        return [("state_dict",), ("optimizer_states",), *moved, *(("callbacks", cb.state_key) for cb in averaging)]

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self.parallel is None:  # the main process: a plain optimizer over the plain module
            return opt.state_dict()
        state = self.parallel.state.full_optimizer_state(opt)  # collective: every rank takes part
        return state if self.local_rank == 0 else {}  # global rank 0 writes; each node's local rank 0 reports

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.parallel is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            self.parallel.state.load_full_optimizer_state(opt, state)

    # ------------------------------------------------------------------ lifecycle
    def teardown(self) -> None:
        if self.parallel is not None:
            self.parallel.close()
        if self._exit is not None:
            self._exit.close()
            self._exit = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        from lightning_shm.strategies import register_all

        register_all(strategy_registry)


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

