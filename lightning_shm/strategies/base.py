"""The Lightning contract of the shared-memory strategies: ranks, launcher, collectives, stopping.

A thin adapter: ranks and world size come from the runtime :class:`World` the launcher hands to
each worker; ``reduce`` / ``barrier`` / ``broadcast`` / ``all_gather`` / metric syncing run on its
groups. What a strategy parallelizes lives in :class:`~lightning_shm.strategies.model_parallel.SHMModelParallel`.

Lightning checks (read ``lightning/pytorch/strategies/ddp.py``, ``parallel.py``) that matter here:

* ``is_distributed = True``, else Lightning silently skips the DistributedSampler and ``sync_dist``;
* ``set_world_ranks`` must set ``rank_zero_only.rank`` so only rank 0 logs and prints;
* the inherited ``all_gather`` silently returns its input without ``torch.distributed``.
"""

from __future__ import annotations

import logging
import signal
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

from lightning_shm.runtime import (
    Group,
    NodeLayout,
    NodeSpanningGroup,
    Rail,
    RuntimeConfig,
    Topology,
    World,
    connect_rail,
)
from lightning_shm.runtime.launcher import START_METHODS
from lightning_shm.runtime.ops import barrier_reason
from lightning_shm.runtime.segment import check_free_space
from lightning_shm.runtime.world import control_bytes
from lightning_shm.strategies import collectives, scheduler_metrics, stop_votes, throughput
from lightning_shm.strategies.collective_calls import BARRIER, BROADCAST, GATHER, REDUCE, noted
from lightning_shm.strategies.epoch_lengths import check_equal_epochs, check_reloaded_epochs, eval_stop_points
from lightning_shm.strategies.launcher import SHMLauncher
from lightning_shm.strategies.predictions import merge_predictions
from lightning_shm.strategies.torch_distributed import hint_unsynced_epoch_metrics, warn_on_user_checks

# the logger rank_zero_info writes to (Lightning shows it), for lines one rank of every node writes
_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")

_STOP_REQUEST_VOTE = barrier_reason("a vote on a pending SIGINT / SIGTERM at the start of a step")
_PREDICTIONS = barrier_reason("the ranks' predictions, for the main process in dataset order")


class SHMStrategyBase(ParallelStrategy):
    """CPU processes on one machine, one shared-memory process group.

    Args:
        start_method: "forkserver" (default: workers forked from a server that imported torch and
            lightning once -- the first fit starts like "spawn", later fits in the same process in a
            fraction of a second), "spawn" (a fresh interpreter per worker, every fit) or "fork"
            (fastest start; Linux; forked workers run torch single-threaded).
        timeout: how long any wait may block before raising with the ranks that did not arrive: seconds, or a
            ``datetime.timedelta`` as Lightning's ``DDPStrategy`` takes it. 30 minutes, as
            Lightning's ``DDPStrategy`` (torch.distributed's default): work one rank does while the others wait
            at a barrier -- a download in ``setup`` gated on rank 0, a large checkpoint written to slow storage
            -- may take that long there. A failed or killed rank stops the others at once whatever the timeout.
        runtime: full runtime configuration (overrides ``timeout``).
        stop_grace_s: after SIGINT / SIGTERM, how long the workers may take to reach their next step
            (where they stop together and run ``on_exception`` callbacks) before they are stopped at once. A
            signal before every rank reached its first step (a long ``setup``, a rendezvous) stops them at once.
        stop_check_every: ranks agree on pending stop requests every this many steps (a barrier each
            time: every sync point makes the faster rank wait out the other's jitter).
    """

    def __init__(self, accelerator: Optional["pl.accelerators.Accelerator"] = None,
                 parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision_plugin: Optional[Precision] = None,
                 start_method: str = "forkserver", timeout: Union[float, timedelta] = 1800.0,
                 runtime: Optional[RuntimeConfig] = None,
                 stop_grace_s: float = 60.0, stop_check_every: int = 4) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        if stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must be >= 0, got {stop_grace_s}")
        if not isinstance(stop_check_every, int) or stop_check_every < 1:
            raise ValueError(f"stop_check_every must be a positive int, got {stop_check_every!r}")
        self.stop_check_every = stop_check_every
        self._start_method = start_method
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"timeout must be seconds > 0 or a datetime.timedelta, got {timeout!r}")
        self.runtime_config = runtime or RuntimeConfig(timeout_s=seconds)
        self.stop_grace_s = stop_grace_s
        self.stop_agreed = 0  # in a worker: the signal all ranks agreed to stop on
        self.eval_stop_points = True  # in a worker: the running validation or test loop has stop points
        self.workers_handled_failure = False  # in the main process: the run failed or stopped in the workers
        self.train_loop = "not started"  # in a worker: "running" from on_train_start, "ended" at on_train_end
        self._num_nodes = 1
        self._node = 0  # this node's rank (NODE_RANK / SLURM_NODEID ... through the cluster environment)
        self._world: Optional[World] = None
        self._group: Optional[Group] = None
        self._rail: Optional[Rail] = None
        self._restore_dist: Optional[Callable[[], None]] = None  # worker: torch.distributed's answers back
        self._metric_state: list = []
        self._metric_sync: Optional[collectives.MetricSync] = None

    # ------------------------------------------------------------------ topology
    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    def topology(self) -> Topology:
        """The dp x tp x pp grid (pure data parallel unless a subclass says otherwise)."""
        return Topology(world_size=max(self.num_processes, 1), dp=max(self.num_processes, 1))

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        """Several machines: one main process per node starts its ``devices`` workers; shared memory inside
        each node, a gloo rail per local rank between nodes (see :mod:`lightning_shm.runtime.rail`)."""
        if not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
        self._num_nodes = num_nodes

    @property
    def node_rank(self) -> int:
        if self._world is None and self.cluster_environment is not None and self._num_nodes > 1:
            return self.cluster_environment.node_rank()
        return self._node

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        topo = self.topology()  # one node's grid: data-parallel replicas repeat on every node
        return {"num_replicas": topo.dp * self._num_nodes,
                "rank": self.node_rank * topo.dp + topo.coords(self.local_rank).dp}

    @property
    def group(self) -> Group:
        if self._group is None:
            raise RuntimeError(f"{type(self).__name__} has no process group outside its worker processes")
        return self._group

    # ------------------------------------------------------------------ launch & environment
    def _configure_launcher(self) -> None:
        if self.accelerator is not None and not isinstance(self.accelerator, CPUAccelerator):
            raise ValueError(
                f"{type(self).__name__} trains on CPU processes; got accelerator "
                f"{type(self.accelerator).__name__}. Pass Trainer(accelerator='cpu', ...)."
            )
        if self.num_processes < 1:
            raise ValueError(f"{type(self).__name__} needs devices >= 1, got {self.num_processes}")
        self.topology()  # validate the grid in the main process, before any worker starts
        self._launcher = SHMLauncher(self, self._start_method)

    def validate_model(self, module: "pl.LightningModule", trainer: Optional["pl.Trainer"] = None,
                       launch_args: Any = ()) -> None:
        """Check the model (and the Trainer entry point's arguments) against the strategy's configuration
        in the main process, before any worker starts."""

    def attach_world(self, world: World) -> None:
        """Called by the launcher in each worker before the Trainer's entry point runs. On several nodes
        this connects the rank's rail (gloo) to the same local rank of every other node."""
        self._world = world
        self._group = world.world_group
        self.train_loop = "not started"
        restores = [warn_on_user_checks(lambda msg: rank_zero_warn(msg))]
        if self.topology().dp > 1 or self._num_nodes > 1:  # ranks holding different data
            restores.append(hint_unsynced_epoch_metrics())

        def restore_all() -> None:
            for restore in restores:
                restore()
        self._restore_dist = restore_all
        if self._num_nodes > 1:
            env = self.cluster_environment
            assert env is not None
            self._node = env.node_rank()
            layout = NodeLayout(self._num_nodes, self._node, self.num_processes, world.rank)
            say = _log.info if world.rank == 0 else (lambda _: None)  # one line per node
            self._rail = connect_rail(layout, env.main_address, env.main_port, self.runtime_config.timeout_s, say)
            self._group = NodeSpanningGroup(world.world_group, self._rail)

    def detach_world(self) -> None:
        """Called by the launcher in each worker once its results are sent."""
        self._rail = None
        if self._restore_dist is not None:
            self._restore_dist()
            self._restore_dist = None

    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        reset_seed()

    def set_world_ranks(self) -> None:
        rank = self.global_rank
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(rank)
            self.cluster_environment.set_world_size(self.world_size)
        rank_zero_only.rank = utils_rank_zero_only.rank = rank

    @property
    def global_rank(self) -> int:
        """``node_rank x devices + local_rank``."""
        return self.node_rank * max(self.num_processes, 1) + self.local_rank

    @property
    def local_rank(self) -> int:
        return self._world.rank if self._world is not None else 0

    @property
    def world_size(self) -> int:
        return max(self.num_processes, 1) * self._num_nodes

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ stopping on SIGINT / SIGTERM
    def stop_point(self, batch_idx: int) -> None:
        """Where every rank agrees whether to stop on a pending SIGINT / SIGTERM (one barrier).

        Called at the start of training, validation and test steps -- points every rank passes
        equally often --, every ``stop_check_every`` batches; never in predict (ranks may predict
        different numbers of batches), nor in an evaluation whose replicas run different numbers
        (:func:`~.epoch_lengths.eval_stop_points`). A stop raises what one process would raise at this point:
        ``KeyboardInterrupt`` for SIGINT, Lightning's ``SIGTERMException`` for SIGTERM (after the
        previous batch completed, as Lightning does).
        """
        if self._world is None or batch_idx % self.stop_check_every:
            return
        signum = self._world.world_group.vote_max(self._world.stop_requested(), _STOP_REQUEST_VOTE)
        if signum:
            self.stop_agreed = signum
            raise KeyboardInterrupt() if signum == signal.SIGINT else SIGTERMException()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.stop_point(batch_idx)

    def on_train_start(self) -> None:
        self.train_loop = "running"
        self._loop_start()
        if self._world is not None and self.lightning_module is not None:
            trainer, world = self.lightning_module.trainer, self._world.world_group
            replicas, replica = self.data_parallel_group(), self.replica_group()
            check_equal_epochs(trainer, replicas, replica)
            stop_votes.install(trainer, world, epoch_start=lambda: check_reloaded_epochs(trainer, replicas, replica))
            stop_votes.vote_on_stop(trainer, world, "train start")  # after the callbacks' and module's hooks
            scheduler_metrics.install(trainer, replicas)

    def on_train_end(self) -> None:
        self.train_loop = "ended"
        if self.lightning_module is not None:
            stop_votes.uninstall(self.lightning_module)
            scheduler_metrics.uninstall(self.lightning_module.trainer)

    def on_validation_start(self) -> None:
        self._loop_start()
        self._eval_start()

    def on_validation_end(self) -> None:
        module = self.lightning_module
        if self._world is not None and module is not None and module.trainer.state.fn == TrainerFn.FITTING:
            stop_votes.vote_on_stop(module.trainer, self._world.world_group, "validation end")

    def on_test_start(self) -> None:
        self._loop_start()
        self._eval_start()

    def on_predict_start(self) -> None:
        self._loop_start()

    def _eval_start(self) -> None:
        if self._world is not None and self.lightning_module is not None:
            self.eval_stop_points = eval_stop_points(self.lightning_module.trainer, self._world.world_group,
                                                     self.replica_group())

    def _loop_start(self) -> None:
        self.attach_metrics()
        if self._world is not None and self.lightning_module is not None:
            throughput.count_replicas(self.lightning_module.trainer, self.distributed_sampler_kwargs["num_replicas"])

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """In the main process while Lightning handles a failure or stop that happened in the workers, nothing
        is written: it holds the state from before the run. The workers ran ``on_exception`` themselves where
        every rank stopped at the same point -- a stop, or an error of every rank at the same step
        (:mod:`.on_exception`) -- and what they wrote must not be overwritten; after an error of some ranks only
        there is no state every rank stands at, and nothing is written."""
        if self._world is None and self.workers_handled_failure:
            rank_zero_info(f"lightning_shm: not writing {filepath} from the main process, which holds the state from "
                           "before the run: the workers ran the callbacks' on_exception where every rank stopped at "
                           "the same step (a stop, or the same error on every rank), and none after an error of "
                           "some ranks only")
            return
        super().save_checkpoint(self.plain_checkpoint(checkpoint), filepath, storage_options=storage_options)

    def plain_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint as it is written: nothing to make plain where every rank holds the whole model."""
        return checkpoint

    def plain_attributes(self, attributes: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
        """Rank 0's attributes of the module and callbacks as the main process gets them (collective)."""
        return attributes

    # ------------------------------------------------------------------ shared memory
    def shm_components(self, module: "pl.LightningModule") -> dict[str, int]:
        """Bytes the parallelisms put in /dev/shm for ``module``, by component."""
        return {}

    def check_shared_memory(self, module: "pl.LightningModule") -> None:
        """Fail before any worker starts when /dev/shm cannot hold the run (the total and its parts named)."""
        W = max(self.num_processes, 1)  # this node's processes
        parts = {"control, stacks": control_bytes(W) + W * (64 << 10),
                 "collective scratch": self._group_bytes(), **self.shm_components(module)}
        if self._start_method != "fork":
            parts["job (pickled module)"] = sum(p.numel() * p.element_size() for p in module.parameters())
        total = sum(parts.values())
        detail = " (" + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items() if v) + ")"
        check_free_space(total, f"this run ({type(self).__name__}, {W} processes)", detail)

    def _group_bytes(self) -> int:
        topo = self.topology()
        members = {tuple(ranks) for r in range(topo.world_size)
                   for ranks in (range(topo.world_size), topo.dp_ranks(r), topo.tp_ranks(r), topo.pp_ranks(r),
                                 topo.replica_ranks(r))}
        cfg = self.runtime_config.group
        return sum(cfg.segment_bytes(len(m)) for m in members if len(m) > 1)

    # ------------------------------------------------------------------ collectives for Lightning
    def replica_group(self) -> Optional[Group]:
        """The ranks computing one model replica together (tensor-parallel members, pipeline stages); None where
        each rank is a whole replica."""
        return None

    def data_parallel_group(self) -> Optional[Group]:
        """Ranks holding *different* data and equal model pieces: where logged values, metric states
        and predictions are combined (the world for pure data parallelism)."""
        return self._group

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean") -> Any:
        g = group if isinstance(group, Group) else self.data_parallel_group()
        if g is None:
            return tensor
        with noted(REDUCE, self.global_rank, type(self).__name__):
            return collectives.reduce(g, tensor, reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank of the run votes. Lightning's counts ``reduce(..., SUM)`` against ``world_size``, but
        :meth:`reduce` sums over the data-parallel group, which under tp / pp has fewer ranks: "all agree" was
        never true there, so ModelCheckpoint's top-k kept its first checkpoints as the best, silently."""
        if self._group is None:
            return decision
        votes = int(self._group.all_reduce(torch.tensor([int(decision)]), "sum").item())
        return votes == self._group.size if all else votes > 0

    def barrier(self, name: Optional[str] = None) -> None:
        """Lightning's "pre_setup" barrier follows ``prepare_data``, which runs on rank 0 (of each node) alone and
        may download or tokenise for hours: Lightning waits for it without a deadline (its infinite barrier,
        over torch.distributed, which the workers do not start), so this barrier does too -- a rank that fails
        still aborts it. Every other wait keeps the strategy's ``timeout``."""
        if self._group is not None:
            with noted(BARRIER, self.global_rank, type(self).__name__):
                self._group.barrier(untimed=name == "pre_setup")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src`` is a global rank (Lightning's meaning); in the world group it is also the member index."""
        if self._group is None:
            return obj
        with noted(BROADCAST, self.global_rank, type(self).__name__):
            return self._group.broadcast_object(obj, src_member=src)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """``[dp, *tensor.shape]`` over the data-parallel group -- the ranks holding different samples, those
        ``sync_dist`` and metrics combine over -- so a gathered batch holds each sample once, as one process's
        does: tp members and pipeline stages hold the same samples (a loss taking the other ranks' embeddings
        as negatives met each positive again as a negative under tp). Every rank: ``group=strategy.group``."""
        g = group if isinstance(group, Group) else self.data_parallel_group()
        if g is None:
            return tensor.unsqueeze(0) if isinstance(tensor, Tensor) else tensor
        with noted(GATHER, self.global_rank, type(self).__name__):
            return collectives.all_gather(g, tensor, sync_grads=sync_grads)

    def attach_metrics(self) -> None:
        """Make every torchmetrics Metric of the module sync over the data-parallel group -- at setup, and again
        when a loop starts (after the module's own ``on_*_start`` hooks, which may create metrics)."""
        assert self.lightning_module is not None
        if self._metric_sync is None:
            self._metric_sync = self.metric_sync()
        self._metric_state += collectives.attach_metric_sync(self.lightning_module, self._metric_sync)

    def metric_sync(self) -> collectives.MetricSync:
        return collectives.MetricSync(self.metric_group())

    def metric_group(self) -> Group:
        g = self.data_parallel_group()
        assert g is not None
        return g

    # ------------------------------------------------------------------ results for the main process
    def gather_predictions(self, trainer: "pl.Trainer", results: Any) -> Any:
        """All ranks' predictions on rank 0, in dataset order (collective)."""
        loop = trainer.predict_loop
        combined = loop._combined_loader
        loaders = combined.flattened if combined is not None else []
        outputs = results if loop.num_dataloaders > 1 else [results]
        indices = []
        sizes = []
        for dl in loaders:
            bs = getattr(dl, "batch_sampler", None)
            indices.append(list(getattr(bs, "seen_batch_indices", None) or []) or None)
            sizes.append(int(getattr(dl, "batch_size", None) or getattr(bs, "batch_size", 1) or 1))
        gathered = self.prediction_group().all_gather_object((outputs, indices, sizes), _PREDICTIONS)
        if self.local_rank != 0:  # each node's main process gets them from its local rank 0
            return None
        merged = merge_predictions(gathered)
        return merged if loop.num_dataloaders > 1 else merged[0]

    def prediction_group(self) -> Group:
        return self.metric_group()

    # ------------------------------------------------------------------ lifecycle
    def teardown(self) -> None:
        self.workers_handled_failure = False  # main process: Lightning's failure handling ends with teardown
        collectives.detach_metric_sync(self._metric_state)
        self._metric_state, self._metric_sync = [], None
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        if self.accelerator is None:  # never connected to a Trainer: nothing else was set up
            return
        super(ParallelStrategy, self).teardown()
