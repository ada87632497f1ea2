"""Data (replicated or sharded) x tensor x pipeline parallelism, composed outside the model.

The order, as torchtitan's ``parallelize`` applies it::

    plain module (rank 0's weights on every rank)
      -> SyncBatchNorm over the dp group                 (if asked)
      -> pipeline split: the rank keeps its stage's layers (a PipelineStage stands in for the Sequential)
      -> tensor-parallel plan on what the rank holds      (slices over the tp group)
      -> data parallelism over the dp group: "replicate" = the shm_ddp gradient reducer,
                                             "shard"     = FSDP units (ZeRO-3 on top of the tp/pp split)
      -> ModelState: one consolidation path for checkpoints, over all of it

Rank layout: ``rank = (pp * dp_size + dp) * tp_size + tp`` (:class:`~lightning_shm.runtime.Topology`):
tp groups are neighbours, stages are the slowest index. Under a pipeline, gathering an FSDP unit once
per microbatch would repeat the same copy M times: a stage's units are gathered once per step, stay
gathered over its microbatches, and their summed gradient is reduce-scattered once (ZeRO-3 between
steps, the stage's full parameters within one).

Nothing here knows the Trainer; :func:`validate` holds every check of the configuration against a
model, called by the main process before any worker starts. A model whose layers ``configure_model``
builds in the workers meets the same rules there, in :func:`parallelize` and the pieces it calls.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, ContextManager, Mapping, Optional, Union

import torch
from torch import nn

from lightning_shm.parallel.checkpointing import checkpoint_instances, module_classes
from lightning_shm.parallel.ddp import GradReducer, refuse_lazy, sparse_grad_parameters
from lightning_shm.parallel.ddp.sync_batchnorm import convert_sync_batchnorm
from lightning_shm.parallel.fsdp import FSDPState, UnitPolicy
from lightning_shm.parallel.fsdp.policy import PolicyFn, scripted, selects_nothing, tied_outside
from lightning_shm.parallel.fsdp.unit import check_gather
from lightning_shm.parallel.optimizers import check_optimizers
from lightning_shm.parallel.pipeline import PipelineEngine, PipelineSchedule, PipelineStage, Schedule
from lightning_shm.parallel.pipeline.copies import SequentialCopies
from lightning_shm.parallel.pipeline.outside import Holders, OutsideParameters, held_apart
from lightning_shm.parallel.pipeline.row_cut import apply_row_cuts, plan_cuts, stage_rows
from lightning_shm.parallel.pipeline.split import attributes_kept, plan_chunks, validate_split_points
from lightning_shm.parallel.placement import Placement
from lightning_shm.parallel.replaced import Originals, carry_over_module, rebind, refuse_averaged_copies, remember
from lightning_shm.parallel.sequential import (
    compiled_original,
    find_sequential,
    layers_of,
    replace_submodule,
    shared_spans,
)
from lightning_shm.parallel.state import ModelState
from lightning_shm.parallel.tp import LayerPlan, TensorParallelState, check_plan, plan_for
from lightning_shm.parallel.tp.kinds import computed_weight
from lightning_shm.parallel.tp.rng import share_stream
from lightning_shm.runtime import ParallelGroups, ReduceOp, Topology, World
from lightning_shm.runtime.ops import barrier_reason

_CUTS = barrier_reason("the pipeline's cut of the model, planned on rank 0")

DATA_PARALLEL = ("replicate", "shard")


@dataclass
class ParallelConfig:
    """Everything that decides how a model is split; validated here, before any process starts."""

    data_parallel_size: Union[int, str] = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel: str = "replicate"
    plan: Optional[Mapping[str, Any]] = None
    sequential: Optional[str] = None
    microbatches: int = 4
    schedule: str = "1f1b"
    virtual_stages: Optional[int] = None
    split_points: Optional[list[int]] = None
    balance: str = "time"
    activation_checkpointing: Union[bool, AbstractSet[type]] = False
    unit_policy: Union[None, int, PolicyFn, UnitPolicy, AbstractSet[type]] = None
    reshard_after_forward: bool = True
    prefetch: bool = False
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    sync_batchnorm: bool = False
    split_linear: bool = False
    gather: str = "view"
    pipeline: PipelineSchedule = field(init=False)
    policy: UnitPolicy = field(init=False)
    checkpointed: tuple[type, ...] = field(init=False)  # module classes whose instances recompute in backward

    def __post_init__(self) -> None:
        sizes = {"data_parallel_size": self.data_parallel_size, "tensor_parallel_size": self.tensor_parallel_size,
                 "pipeline_parallel_size": self.pipeline_parallel_size}
        for name, v in sizes.items():
            if not (v == "auto" and name == "data_parallel_size") and (
                    not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int (or 'auto' for data_parallel_size), got {v!r} "
                                 f"(sizes: {sizes})")
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {self.data_parallel!r}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {self.microbatches!r}")
        if self.balance not in ("time", "params"):
            raise ValueError(f"balance must be 'time' or 'params', got {self.balance!r}")
        self.checkpointed = module_classes(self.activation_checkpointing)
        if not isinstance(self.activation_checkpointing, bool) and not self.checkpointed:
            raise ValueError(f"activation_checkpointing must be True (a pipeline's chunks), False or a set of "
                             f"nn.Module classes (their instances), got {self.activation_checkpointing!r}")
        if self.activation_checkpointing is True and self.pipeline_parallel_size == 1:
            raise ValueError("activation_checkpointing=True recomputes a pipeline's chunks in backward: it needs "
                             "pipeline_parallel_size > 1, got 1; without a pipeline name the blocks to recompute, "
                             "activation_checkpointing={Block}")
        if self.split_linear and self.split_points is not None:
            raise ValueError(f"split_linear=True chooses the pipeline cut itself; it cannot be combined with "
                             f"split_points={self.split_points}")
        if self.split_linear and self.tensor_parallel_size > 1:
            raise ValueError(f"split_linear=True cuts a Linear between pipeline stages; with tensor_parallel_size="
                             f"{self.tensor_parallel_size} the Linear layers are already tensor-parallel: use one")
        # prefetch / reshard_after_forward only matter to FSDP (data_parallel="shard")
        check_gather(self.gather, *((self.reshard_after_forward, self.prefetch) if self.shard else ()))
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        kind = Schedule.parse(self.schedule)
        v = self.virtual_stages if self.virtual_stages is not None else (2 if kind == Schedule.INTERLEAVED_1F1B else 1)
        self.pipeline = PipelineSchedule(kind, self.pipeline_parallel_size, self.microbatches, v)  # validates
        self.policy = UnitPolicy.parse(self.unit_policy)

    @property
    def shard(self) -> bool:
        return self.data_parallel == "shard"

    def topology(self, world_size: int) -> Topology:
        """The dp x tp x pp grid for ``world_size`` processes; a ValueError naming every size if it does not fit."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.data_parallel_size == "auto":
            return Topology.infer(world_size, tp=tp, pp=pp)
        dp = self.data_parallel_size
        if dp * tp * pp != world_size:
            raise ValueError(f"devices={world_size} must equal data_parallel_size x tensor_parallel_size x "
                             f"pipeline_parallel_size = {dp} x {tp} x {pp} = {dp * tp * pp}")
        return Topology(world_size, dp=dp, tp=tp, pp=pp)


def idle_arguments(config: ParallelConfig) -> Optional[str]:
    """What to tell a user who set arguments (away from their defaults) that do nothing in ``config``'s layout:
    each of them and what it belongs to; None if there are none.

    Why: one who writes ``SHMDDPStrategy(microbatches=8)`` expecting gradient accumulation, or
    ``SHMFSDPStrategy(find_unused_parameters=True)`` carried over from a DDP config, would otherwise train as if
    they had not, silently. A warning, not an error: a sweep over layouts keeps one set of arguments (the
    pipeline's microbatches at pipeline_parallel_size=1 too). Only what the sizes given decide is checked
    (``data_parallel_size="auto"`` may still come to 1)."""
    defaults = ParallelConfig.__dataclass_fields__
    idle: list[str] = []

    def say(names: tuple[str, ...], why: str) -> None:
        set_ = [f"{n}={getattr(config, n)!r}" for n in names if getattr(config, n) != defaults[n].default]
        if set_:
            idle.append(f"{', '.join(set_)} {'does' if len(set_) == 1 else 'do'} nothing {why}")

    if config.pipeline_parallel_size == 1:
        say(("microbatches",), "without a pipeline: it splits each batch for a pipeline's schedule; to accumulate "
                               f"gradients over batches use Trainer(accumulate_grad_batches={config.microbatches})")
        say(("schedule", "virtual_stages", "split_points", "balance", "split_linear"),
            "without a pipeline (pipeline_parallel_size > 1)")
    if config.tensor_parallel_size == 1:
        say(("plan",), "without tensor parallelism (tensor_parallel_size > 1)")
    if config.shard:
        say(("bucket_cap_mb", "find_unused_parameters"), "when sharded (shm_ddp's gradient reducer takes them); "
            "sharded, each unit's gradients are reduce-scattered as its backward ends, and a parameter no rank used "
            "keeps no gradient")
    else:
        say(("unit_policy", "reshard_after_forward", "prefetch", "gather"),
            "without sharding (data_parallel='shard', shm_fsdp)")
    if not idle:
        return None
    return (f"{'; '.join(idle)}. Layout: pipeline_parallel_size={config.pipeline_parallel_size}, "
            f"tensor_parallel_size={config.tensor_parallel_size}, data_parallel={config.data_parallel!r}")


# ---------------------------------------------------------------------- validation (main process and workers)
def validate(module: nn.Module, config: ParallelConfig, world_size: int, batch_size: Optional[int] = None,
             automatic_optimization: bool = True) -> None:
    """Every check of ``config`` against ``module`` that needs no process group: raises ValueError
    naming the values. A module whose layers are built later (``configure_model``) is checked then."""
    topo = config.topology(world_size)
    if topo.pp > 1 and not automatic_optimization:
        raise ValueError("a pipeline runs forward and backward inside its schedule; manual optimization "
                         "(automatic_optimization = False) is not supported with pipeline_parallel_size > 1")
    refuse_lazy(module)
    if config.checkpointed and not any(isinstance(m, config.checkpointed) for m in module.modules()):
        names = sorted(c.__name__ for c in config.checkpointed)
        raise ValueError(f"activation_checkpointing={{{', '.join(names)}}}: {type(module).__name__} holds no instance "
                         f"of {names} to recompute")
    if next(module.parameters(), None) is None:
        return
    plan = _tp_plan(module, config, topo.tp) if topo.tp > 1 else {}
    if plan:
        check_plan(module, plan, topo.tp)
    elif topo.tp > 1:
        raise ValueError(_nothing_to_split(module, config, topo.tp))
    pipelined, seq = find_sequential(module, config.sequential) if topo.pp > 1 else (None, None)
    refuse_averaged_copies(module, plan, pipelined)
    if seq is not None:
        V = config.pipeline.chunks
        if V > len(seq):
            raise ValueError(f"{len(seq)} layers in the nn.Sequential cannot form {V} pipeline chunks "
                             f"(stages={config.pipeline.stages} x virtual_stages={config.pipeline.virtual}); use "
                             "fewer stages")
        no_cut = _cut_rules(module, config, plan)
        if config.split_points is not None:
            validate_split_points(config.split_points, len(seq), V, no_cut)
        elif no_cut:  # some cut must remain (the workers' planner measures costs; feasibility needs none)
            plan_chunks(seq, V, stages=config.pipeline.stages, forbidden=no_cut)
        if batch_size is not None and batch_size % config.microbatches:
            raise ValueError(f"batch size {batch_size} is not divisible by microbatches={config.microbatches}")
    if config.shard and topo.dp > 1:  # on the whole model: a policy's mistake shows before any stage cut
        if selects_nothing(module, config.policy):
            raise ValueError(f"the FSDP unit policy selected no module with parameters in {type(module).__name__}: "
                             "nothing to shard")


def _nothing_to_split(module: nn.Module, config: ParallelConfig, tp: int) -> str:
    """tp ranks that split nothing would all compute the whole model on the same batch: refused."""
    if config.plan is not None or isinstance(getattr(module, "tp_plan", None), Mapping):
        given = "plan=" if config.plan is not None else f"{type(module).__name__}.tp_plan"
        return (f"tensor_parallel_size={tp} but the plan given ({given}) splits no layer: every tp rank would "
                "compute the whole model. Name the layers to split, or use tensor_parallel_size=1.")
    prefix, seq = find_sequential(module, config.sequential)
    named = [(f"{prefix}.{n}" if prefix else n, c) for n, c in layers_of(seq)]
    compiled = [n for n, c in named if compiled_original(c) is not None]
    computed = [n for n, c in named if isinstance(c, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
                                                     nn.ConvTranspose2d, nn.ConvTranspose3d)) and computed_weight(c)]
    hint = f" ({compiled} are torch.compile'd: compiling hides a layer from the plan)" if compiled else ""
    hint += (f" ({computed} compute their weights, e.g. weight_norm / spectral_norm: such a layer stays whole)"
             if computed else "")
    return (f"tensor_parallel_size={tp} but the plan splits no layer of {type(module).__name__}: the plan derived "
            f"for its nn.Sequential pairs nn.Linear / nn.Conv1d-3d / nn.ConvTranspose1d-3d children (and torch's "
            f"nn.TransformerEncoderLayer / nn.TransformerDecoderLayer blocks anywhere in the model get their "
            f"feed-forward layers and attention heads split) and found none to split{hint}. Pass plan={{...}}, give "
            "the model a tp_plan, or use tensor_parallel_size=1.")


def _tp_plan(module: nn.Module, config: ParallelConfig, tp: int) -> dict[str, LayerPlan]:
    return plan_for(module, config.plan, tp, config.sequential)


def _cut_rules(module: nn.Module, config: ParallelConfig, plan: Mapping[str, LayerPlan]) -> dict[int, str]:
    """Where no stage may start (:func:`_no_cut`). Weights tied between two layers stay on one stage where
    some cut allows it (one copy, no gradients summed between stages). Where none does -- GPT-2's embedding
    and head tied at the Sequential's two ends -- or where ``split_points`` fall between them, each holding
    stage keeps a copy and the stages sum its gradient (Megatron's embedding group;
    :class:`~lightning_shm.parallel.pipeline.outside.OutsideParameters`)."""
    strict = _no_cut(module, config, plan)
    apart = _no_cut(module, config, plan, cut_ties=True)
    if strict == apart or config.split_points is not None:
        return apart
    _, seq = find_sequential(module, config.sequential)
    try:
        plan_chunks(seq, config.pipeline.chunks, stages=config.pipeline.stages, forbidden=strict)
    except ValueError:
        return apart
    return strict


def _no_cut(module: nn.Module, config: ParallelConfig, plan: Mapping[str, LayerPlan],
            cut_ties: bool = False) -> dict[int, str]:
    """Indices of the pipelined Sequential at which no stage may start, each with why: inside a
    tensor-parallel column -> row pair (its split activation must not cross stages), or between two
    positions of a module placed twice (each stage would train its own copy, with its own buffers) --
    and, unless ``cut_ties``, between two layers whose weights are tied."""
    prefix, seq = find_sequential(module, config.sequential)
    layers = layers_of(seq)
    out: dict[int, str] = {}
    for span in shared_spans([(f"{prefix}.{n}" if prefix else n, c) for n, c in layers]):
        if cut_ties and span.tied:
            continue
        for i in range(span.first + 1, span.last + 1):
            out.setdefault(i, f"{span}: both must sit on one pipeline stage (each stage would train its own "
                              "copy)")
    inside = False
    for i, (name, _) in enumerate(layers):
        style = plan.get(f"{prefix}.{name}" if prefix else name)
        if inside:
            out.setdefault(i, "it falls between a tensor-parallel column layer and its row layer")
        if style is not None and style.style == "column":
            inside = True
        elif style is not None and style.style == "row":
            inside = False
    return out


def _layers(module: nn.Module, config: ParallelConfig) -> Optional[list[tuple[str, nn.Module]]]:
    """The sequence FSDP groups into units: the pipelined Sequential's children (or the stage's)."""
    try:
        prefix, seq = find_sequential(module, config.sequential)
    except ValueError:
        return None
    return [(f"{prefix}.{n}" if prefix else n, c) for n, c in layers_of(seq)]


# ---------------------------------------------------------------------- composition (each worker)
@dataclass
class ParallelState:
    """What one rank holds after :func:`parallelize`, and the per-step calls its parallelisms need."""

    module: nn.Module
    groups: ParallelGroups
    state: ModelState
    stage: Optional[PipelineStage] = None
    engine: Optional[PipelineEngine] = None
    chunk_starts: Optional[list[int]] = None
    tp: Optional[TensorParallelState] = None
    fsdp: Optional[FSDPState] = None
    reducer: Optional[GradReducer] = None
    outside: Optional[OutsideParameters] = None  # a pipeline's parameters outside its Sequential
    originals: Originals = field(default_factory=dict)  # the model's parameters before any was replaced
    copies: Optional[SequentialCopies] = None  # copies of a pipeline's Sequential kept outside it (EMA teachers)
    uncheckpoint: Optional[Callable[[], None]] = None  # takes activation checkpointing by class off again

    def begin_batch(self) -> None:
        """Before a training batch's hooks and step: FSDP's barrier before shards are written (they may write the
        rank's rows in place; every rank has stopped reading them by then -- see :mod:`.fsdp.sharded`)."""
        if self.fsdp is not None:
            self.fsdp.before_shards_written()

    def begin_step(self) -> None:
        """Before a training step: drop what a forward without backward left gathered; average the
        gradients of the parameters that require them now (a callback may have (un)frozen some)."""
        if self.fsdp is not None:
            self.fsdp.begin_step()
        if self.reducer is not None:
            self.reducer.follow_requires_grad()
        if self.copies is not None:
            self.copies.check()

    def share_streams(self) -> None:
        """The tp group's members on member 0's random stream (:func:`.tp.rng.share_stream`): before a step, and
        after each batch a step fetches itself (each member may have drawn its own rows' augmentations)."""
        if self.tp is not None and self.stage is None:
            share_stream(self.tp.group)

    def step_scope(self) -> ContextManager[None]:
        """Around a step (not a pipeline's, whose stages seed their streams per microbatch): the tp group's
        members draw from member 0's stream (:meth:`share_streams`); FSDP shows its full parameters
        (:meth:`FSDPState.step_scope`)."""
        self.share_streams()
        if self.fsdp is None or self.stage is not None:
            return contextlib.nullcontext()
        return self.fsdp.step_scope()

    def watch(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The optimizers of the run: refused if they cannot update this layout's pieces as one process
        would (:mod:`.optimizers`); FSDP: every step ends with the barrier before shards are read again."""
        rebind(optimizers, self.originals, self.module)
        pieces = {id(p): n for n, p in self.module.named_parameters()
                  if self.state.placement(n).splits or n in self.state.stage_rows}
        check_optimizers(optimizers, pieces, self.groups.topology.pp)
        if self.fsdp is not None:
            self.fsdp.watch(optimizers)
        if self.copies is not None:
            self.copies.skip_optimized({id(p) for o in optimizers for g in o.param_groups for p in g["params"]})

    def close(self) -> None:
        if self.uncheckpoint is not None:  # first: it put back the forward the others' patches had left
            self.uncheckpoint()
            self.uncheckpoint = None
        if self.reducer is not None:
            self.reducer.close()
        if self.fsdp is not None:
            self.fsdp.close()
        if self.engine is not None:
            self.engine.close()


def parallelize(module: nn.Module, config: ParallelConfig, world: World, groups: ParallelGroups, *,
                training: bool, sample_input: Optional[torch.Tensor] = None,
                log: Callable[[str], None] = lambda msg: None) -> ParallelState:
    """Apply the configured parallelisms to ``module`` (in place) on this rank. Every rank calls it with
    the same arguments; ``module`` holds rank 0's weights everywhere already."""
    topo = groups.topology
    originals = remember(module)
    plain_keys = list(module.state_dict())
    plain_params = [n for n, _ in module.named_parameters()]
    # every name of a parameter -> the one named_parameters() gives it: a pipeline stage may know a tied or
    # second-named parameter only under another holder's name (the optimizer state, norms, averages use this)
    first: dict[int, str] = {}
    aliases = {n: first.setdefault(id(p), n) for n, p in module.named_parameters(remove_duplicate=False)}
    plan = _tp_plan(module, config, topo.tp) if topo.tp > 1 else {}
    splits = check_plan(module, plan, topo.tp) if plan else {}  # on the whole model, before any stage cut
    # after the plan, checked on the user's BatchNorm types (sliced per channel by tp, each slice synced over dp);
    # torch's own SyncBatchNorm, converted by the user, asks for it too: it would sync over torch.distributed,
    # which the workers do not start, and normalised each rank's samples alone
    torch_sync = any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())
    if (config.sync_batchnorm or torch_sync) and groups.dp_size > 1:
        kinds = (nn.modules.batchnorm._BatchNorm,) if config.sync_batchnorm else (nn.SyncBatchNorm,)
        convert_sync_batchnorm(module, groups.dp, kinds)
    stage = engine = starts = copies = None
    # FSDP keeps whole what a module outside the Sequential shares with another: under a pipeline the stages
    # sum its gradients (found on the whole model: a stage may hold one of the holders); else a unit gathers it
    tied = tied_outside(module, config.sequential) if topo.pp > 1 else set()
    outside = None
    apart: list[tuple[nn.Parameter, Holders]] = []
    if topo.pp > 1:
        copies = SequentialCopies(module, find_sequential(module, config.sequential)[0])  # before the cut
        if copies.frozen and world.rank == 0:
            warnings.warn(copies.note(), stacklevel=2)
        ties = _tied_in_sequential(module, config)  # before the cut, which may leave their holders on two stages
        stage, starts = _split_pipeline(module, config, world, groups, plan, sample_input, log)
        apart = held_apart(ties, stage, groups.pp)  # a copy on each holding stage: FSDP keeps them whole
        tied |= {id(p) for p, _ in apart}
        if apart:
            log(f"pipeline: tied weights {[first[id(p)] for p, _ in apart]} sit on several stages: each keeps a "
                "copy, and the stages sum their gradients every step")
    tp = TensorParallelState(module, groups.tp, splits) if splits else None
    if tp is not None:  # a tie split with its layers: the stages hold, and FSDP keeps whole, the rank's piece
        apart = [(tp.piece_of(p), holders) for p, holders in apart]
        tied = {id(tp.pieces[i]) if i in tp.pieces else i for i in tied}
    if stage is not None:
        stage.refresh_chunks()  # the chunks run the tensor-parallel layers that replaced the plain ones
    # the sequence FSDP groups into units, as it is now (tp layers in place): the stage's layers or the Sequential's
    layers = ([(f"{_stage_path(module, stage)}.{n}", c) for n, c in layers_of(stage)] if stage is not None
              else _layers(module, config))
    placements: dict[str, Placement] = tp.placements() if tp is not None else {}
    fsdp = reducer = None
    if topo.dp > 1 and config.shard:  # FSDP inside the node; several nodes: replicas of it (HSDP)
        unsharded = sum(p.numel() for p in module.parameters())
        fsdp = FSDPState(module, groups.node_dp, config.policy, config.reshard_after_forward, config.prefetch,
                         layers=layers, across=_node_mean(groups), gather=config.gather, tied=tied,
                         sliced=frozenset(n for n, pl in placements.items() if pl.splits))
        placements = {**placements, **fsdp.placements(placements)}
        if scripts := scripted(module):
            held = sum(p.numel() for _, m in scripts for p in m.parameters())
            log(f"shm_fsdp: {[n for n, _ in scripts]} are TorchScript modules, whose forward runs no hooks: their "
                f"{held:,} parameters (of {unsharded:,}) stay whole on every rank")
        if groups.nodes > 1:
            placements = {n: p.replicated(groups.nodes) for n, p in placements.items()}
    elif groups.dp_size > 1:
        # every parameter, and the tp-split buffers (a sliced BatchNorm's running statistics) with their split
        names = dict.fromkeys([*(n for n, _ in module.named_parameters()), *placements])
        placements = {n: placements.get(n, Placement()).replicated(groups.dp_size) for n in names}
        # a pipeline stage of frozen layers only (a fine-tuned model's backbone) has nothing to reduce
        if training and (topo.pp == 1 or any(p.requires_grad for p in module.parameters())):
            reducer = GradReducer(list(module.named_parameters()), groups.dp, config.bucket_cap_mb,
                                  config.find_unused_parameters, tag=f"ddp-tp{groups.coords.tp}-pp{groups.coords.pp}",
                                  hooks=topo.pp == 1, sparse=sparse_grad_parameters(module))
            if topo.pp == 1:  # a pipeline engine takes its Linear layers' weight gradients itself
                reducer.route_linears(module.modules())
    if stage is not None:  # a copy on every stage (or each holding one), the gradients summed over the stages
        # a tie held by some stages is summed over those alone (Megatron's embedding group): only they create it
        pp_ranks = groups.pp.ranks
        tie_groups = {h: world.group([pp_ranks[i] for i in h], name="tie") for h in {h for _, h in apart}
                      if groups.pp.index in h and len(h) < groups.pp.size}
        outside = OutsideParameters(module, stage, groups.pp, apart, tie_groups)
        placements = {**placements, **{n: placements.get(n, Placement()).replicated(outside.stages_holding[n])
                                       for n in outside.names}}
        # last: it patches the Linear layers it runs (zero-bubble) and knows their storages
        engine = PipelineEngine(stage.chunks, config.pipeline, groups.coords.pp, list(groups.pp.ranks), world,
                                tag=f"pp-dp{groups.coords.dp}-tp{groups.coords.tp}",
                                activation_checkpointing=config.activation_checkpointing is True,
                                track_activation_memory=False)  # no step reads it; it costs every forward
        engine.held = fsdp
    # last: the forward it replays is the one that runs now (tp layers, the reducer's and the engine's patches)
    recompute = checkpoint_instances(module, config.checkpointed) if config.checkpointed and training else None
    state = ModelState(module, plain_keys, plain_params, placements, stages=groups.pp if topo.pp > 1 else None,
                       before_load=fsdp.before_shards_written if fsdp is not None else None,
                       after_load=fsdp.after_shards_written if fsdp is not None else None,
                       stage_rows=stage_rows(module) if stage is not None else None, aliases=aliases)
    return ParallelState(module, groups, state, stage, engine, starts, tp, fsdp, reducer, outside, originals,
                         copies if copies is not None and copies.names else None, recompute)


def _tied_in_sequential(module: nn.Module, config: ParallelConfig) -> list[nn.Parameter]:
    """The parameters tied between layers of the pipelined Sequential (holders that are different modules), in
    the module's order -- the same list on every rank, taken before the stages are cut."""
    prefix, seq = find_sequential(module, config.sequential)
    named = [(f"{prefix}.{n}" if prefix else n, c) for n, c in layers_of(seq)]
    by_name = dict(module.named_parameters(remove_duplicate=False))
    ids = {id(by_name[span.names[0]]) for span in shared_spans(named) if span.tied}
    return [p for _, p in module.named_parameters() if id(p) in ids]


def _node_mean(groups: ParallelGroups) -> Optional[Callable[[torch.Tensor], None]]:
    """HSDP: a gradient shard, averaged with the same shard on every other node over the rank's rail."""
    rail = groups.rail
    if rail is None or rail.size == 1:
        return None

    def mean_over_nodes(part: torch.Tensor) -> None:
        rail.all_reduce(part, ReduceOp.SUM)
        part.div_(rail.size)

    return mean_over_nodes


def _stage_path(module: nn.Module, stage: nn.Module) -> str:
    return next(n for n, m in module.named_modules() if m is stage)


def _split_pipeline(module: nn.Module, config: ParallelConfig, world: World, groups: ParallelGroups,
                    plan: Mapping[str, LayerPlan], sample: Optional[torch.Tensor],
                    log: Callable[[str], None]) -> tuple[PipelineStage, list[int]]:
    path, seq = find_sequential(module, config.sequential)
    sched = config.pipeline
    forbidden = _cut_rules(module, config, plan)
    if groups.world.index == 0:  # measure once (global rank 0), everyone uses the same cut
        sample = sample if config.balance == "time" else None
        with attributes_kept(module):  # the sample runs the user's forward hooks too
            chosen: Any = plan_cuts(seq, sched.chunks, config.split_points, sample, stages=sched.stages,
                                    forbidden=forbidden, split_linear=config.split_linear)
    else:
        chosen = None
    cuts, how = groups.world.broadcast_object(chosen, src_member=0, why=_CUTS)
    layers, starts = apply_row_cuts(layers_of(seq), cuts)
    log(f"pipeline: {sched.chunks} chunks of {len(seq)} layers start at {[c[0] for c in cuts]} (split by {how}), "
        f"schedule {sched.kind.value}, {sched.microbatches} microbatches")
    pp_index = groups.coords.pp
    stage = PipelineStage(layers, starts, sched.chunks_of(pp_index))
    # the step calls the stage where it called the Sequential: on the first stage its input is the Sequential's,
    # on the last its output is -- so the model's hooks on the Sequential do there what they did
    carry_over_module(seq, stage)
    replace_submodule(module, path, stage)
    return stage, starts
