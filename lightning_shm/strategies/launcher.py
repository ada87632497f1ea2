"""Lightning's launcher interface on top of the runtime launcher.

The main process calls ``trainer.fit`` -> :meth:`SHMLauncher.launch`, which runs the Trainer's own
``_fit_impl`` / ``_test_impl`` / ``_predict_impl`` in W workers through
:class:`lightning_shm.runtime.Launcher` (segments, fault handling, clean-up), then makes the main
process's Trainer the one that ran (:mod:`.main_state`): weights, loops, optimizer, scheduler and
callback states, ``callback_metrics``, ``logged_metrics``, ``progress_bar_metrics``, the loggers' state
(:mod:`.loggers`) and -- unlike Lightning's spawn launcher, which hands back only the first -- the predictions
of *all* ranks, in dataset order. Files the program holds open are flushed before a worker leaves
(:mod:`.open_files`).

Interrupts (SIGINT / SIGTERM to the main process or the process group): the runtime turns the
first one into a stop request; the workers agree on it at the start of their next training,
validation or test step (:meth:`SHMStrategyBase.stop_point`) and unwind through Lightning's own
exception path there -- ``on_exception`` callbacks run on the ranks that hold the state, so an
``OnExceptionCheckpoint`` holds the real step and weights. The main process then loads that state
and raises what one process would have raised (KeyboardInterrupt -> exit status 1; SIGTERM ->
Lightning's ``SIGTERMException``); it never writes a checkpoint of its own copy on that path.
"""

from __future__ import annotations

import io
import os
import signal
import tempfile
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch
from lightning.fabric.strategies.launchers.multiprocessing import _check_missing_main_guard
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn, TrainerState, TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException, _TunerExitException
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_shm.parallel.tp.notes import note_local_width
from lightning_shm.runtime import LaunchConfig, Launcher, World, stacks
from lightning_shm.strategies.lightning_args import note_device_mesh
from lightning_shm.strategies.loggers import (
    apply_logger_writers,
    carried,
    logger_writers,
    resolve_log_versions,
    take_carried,
)
from lightning_shm.strategies.loop_position import note_loop_position
from lightning_shm.strategies.main_globals import MainGlobals
from lightning_shm.strategies.main_script import check_main_script
from lightning_shm.strategies.main_state import (
    apply_found_learning_rates,
    apply_gathered_attributes,
    apply_run_details,
    end_checkpoint,
    fit_data,
    found_learning_rates,
    gathered_attributes,
    restore_trainer,
    run_details,
)
from lightning_shm.strategies.on_exception import on_exception_where_all_failed
from lightning_shm.strategies.open_files import flush_held_files

_METRICS = ("callback_metrics", "logged_metrics", "progress_bar_metrics")
# what the fork server imports once, so that no worker of any later fit imports it again
FORKSERVER_PRELOAD = ("torch", "lightning.pytorch", "lightning_shm")

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_shm.strategies.base import SHMStrategyBase


class WorkerOutput(NamedTuple):
    checkpoint_path: Optional[str]  # rank 0's full end-of-fit checkpoint, for the main process's Trainer
    trainer_state: TrainerState
    trainer_results: Any
    metrics_bytes: bytes  # the Trainer's callback, logged and progress-bar metrics (torch.save of a dict)
    stopped_by: int  # the signal all ranks agreed to stop on (0: ran to the end)
    learning_rates: list  # what LearningRateFinder callbacks found (:func:`.main_state.found_learning_rates`)
    attributes: list  # plain data of module, datamodule, loggers, callbacks (:func:`.main_state.gathered_attributes`)
    should_stop: bool  # a callback or the module stopped the run (EarlyStopping): what one process's trainer says
    logger_writers: list  # rank 0's CSV loggers' writers, pickled (:func:`.loggers.logger_writers`)
    run_details: dict  # rank 0's loop batch counts, ckpt_path (:func:`.main_state.run_details`)


class SHMLauncher(_Launcher):
    """Runs a Trainer entry point on the strategy's W worker processes."""

    def __init__(self, strategy: "SHMStrategyBase", start_method: str = "forkserver") -> None:
        self._strategy = strategy
        self._start_method = start_method
        self._runtime: Optional[Launcher] = None

    @property
    def is_interactive_compatible(self) -> bool:
        return self._start_method == "fork"

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        strategy = self._strategy
        if self._start_method != "fork":  # spawn, forkserver: each worker imports the main script again
            _check_missing_main_guard()  # in a worker running an unguarded script again: Lightning's message
            check_main_script(self._start_method, (trainer, function, args, kwargs), type(strategy))
        if trainer is not None and trainer.lightning_module is not None:  # bad input fails before any worker starts
            strategy.validate_model(trainer.lightning_module, trainer, (args, kwargs))
            strategy.check_shared_memory(trainer.lightning_module)
        if trainer is not None:
            resolve_log_versions(trainer)
        snapshot = MainGlobals.capture() if self._start_method != "fork" else None
        loggers = None
        if trainer is not None and self._start_method == "fork":
            loggers = carried(trainer)
            flush_held_files(trainer)  # a forked worker's copy of a buffer then holds only what it writes itself
        predicting = trainer is not None and trainer.state.fn == TrainerFn.PREDICTING
        config = LaunchConfig(world_size=strategy.num_processes, start_method=self._start_method,
                              runtime=strategy.runtime_config, graceful_stop=not predicting,
                              stop_grace_s=strategy.stop_grace_s, preload=FORKSERVER_PRELOAD)
        self._runtime = Launcher(config)
        strategy.workers_handled_failure = True  # any exception leaving here comes after the workers' own handling
        outputs = self._runtime.run(_run_in_worker, self, trainer, function, args, kwargs, snapshot, loggers)
        output = outputs[0]
        stop = self._runtime.stop_signal
        if trainer is None:
            return output
        self._recover_in_main_process(output, trainer, fit_data(function, args, kwargs))
        if output.stopped_by or stop == signal.SIGINT:  # one process would have raised this
            raise KeyboardInterrupt() if (output.stopped_by or stop) == signal.SIGINT else SIGTERMException()
        strategy.workers_handled_failure = False
        return output.trainer_results

    def kill(self, signum: Any) -> None:
        if self._runtime is not None:
            self._runtime.kill(int(signum))

    # ------------------------------------------------------------------ worker side
    def _collect_results(self, trainer: "pl.Trainer", results: Any, stopped_by: int,
                         tuned: bool = False) -> Optional[WorkerOutput]:
        """Collective on all ranks; rank 0 returns what the main process needs. ``tuned``: ``Tuner.lr_find``
        ended the run; it restored the weights the main process holds, and the strategy is torn down."""
        strategy = self._strategy
        if trainer.state.fn == TrainerFn.PREDICTING and trainer.predict_loop.return_predictions:
            results = strategy.gather_predictions(trainer, results)
        checkpoint = None
        if trainer.state.fn == TrainerFn.FITTING and not tuned:  # what rank 0 would write now (collective if sharded)
            checkpoint = strategy.plain_checkpoint(end_checkpoint(trainer))
        attributes = strategy.plain_attributes(gathered_attributes(trainer))  # collective if sharded
        if strategy.local_rank != 0:  # local rank 0 of each node reports to that node's main process
            return None
        path = None
        if checkpoint is not None:
            path = os.path.join(tempfile.mkdtemp(prefix="lightning_shm_"), "end.ckpt")
            torch.save(checkpoint, path)
        metrics = {name: apply_to_collection(dict(getattr(trainer, name)), torch.Tensor, lambda t: t.detach().cpu())
                   for name in _METRICS}
        buffer = io.BytesIO()
        torch.save(metrics, buffer)
        return WorkerOutput(path, trainer.state, results, buffer.getvalue(), stopped_by, found_learning_rates(trainer),
                            attributes, trainer.should_stop, logger_writers(trainer), run_details(trainer))

    # ------------------------------------------------------------------ main side
    def _recover_in_main_process(self, output: WorkerOutput, trainer: "pl.Trainer", data: dict[str, Any]) -> None:
        trainer.state = output.trainer_state
        trainer.should_stop = output.should_stop
        metrics = torch.load(io.BytesIO(output.metrics_bytes), weights_only=True)
        # the Trainer's own dicts (it holds no results to compute them from here): rank 0's, replacing the
        # previous run's, as each run of one process starts them afresh
        for name in _METRICS:
            held = getattr(trainer, name)
            held.clear()
            held.update(metrics[name])
        apply_found_learning_rates(trainer, output.learning_rates)
        if output.checkpoint_path is not None:
            checkpoint = torch.load(output.checkpoint_path, weights_only=False)
            try:
                restore_trainer(trainer, checkpoint, data)
            finally:
                os.remove(output.checkpoint_path)
                os.rmdir(os.path.dirname(output.checkpoint_path))
        apply_gathered_attributes(trainer, output.attributes)
        apply_logger_writers(trainer, output.logger_writers)
        apply_run_details(trainer, output.run_details)  # after restore_trainer, whose optimizers may set up loops

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_runtime"] = None  # holds processes; the workers never need it
        return state


class _StopRequestConnector(_SignalConnector):
    """Lightning's signal handling in a worker: a SIGTERM the worker receives itself (e.g. the scheduler
    signals every process of the job) becomes a stop request that all ranks agree on, instead of a flag
    each rank would act on at a different step.

    The runtime's stack-dump signal is left out of what Lightning's ``teardown`` puts back: faulthandler
    installed its handler in C, where Python's ``signal.getsignal`` sees the default, so restoring "every
    signal as it was" at the end of each Trainer call installed the default action -- and the main process's
    request for this rank's stack, when another rank failed after this one's fit ended, killed it (seen:
    "worker rank 0 was killed by signal SIGUSR2" beside a collective mismatch, its own report lost)."""

    def __init__(self, trainer: "pl.Trainer", world: World) -> None:
        super().__init__(trainer)
        self._world = world

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False
        self._original_handlers = self._get_current_signal_handlers()
        self._original_handlers.pop(stacks.DUMP_SIGNAL, None)
        self._register_signal(signal.SIGTERM, lambda signum, frame: self._world.request_stop(signum))


def _run_in_worker(world: World, launcher: SHMLauncher, trainer: Optional["pl.Trainer"], function: Callable,
                   args: Any, kwargs: Any, snapshot: Optional[MainGlobals],
                   loggers: Optional[list[Optional[bytes]]]) -> Optional[WorkerOutput]:
    if snapshot is not None:
        snapshot.restore()
    if trainer is not None and loggers is not None:  # fork: the loggers as spawn would carry them
        take_carried(trainer, loggers)
    os.environ["LOCAL_RANK"] = str(world.rank)
    strategy = launcher._strategy
    strategy.attach_world(world)
    if trainer is None:
        results = function(*args, **kwargs)
        return results if world.rank == 0 else None
    trainer._signal_connector = _StopRequestConnector(trainer, world)
    tuned = False
    try:
        try:
            results = function(*args, **kwargs)
        except _TunerExitException:  # Tuner.lr_find found the rate (every rank): finish as Lightning's entry point
            call._call_teardown_hook(trainer)
            trainer._teardown()
            trainer.state.status, trainer.state.stage = TrainerStatus.FINISHED, None
            results, tuned = None, True
        except BaseException as exc:
            if not (isinstance(exc, (KeyboardInterrupt, SIGTERMException)) and strategy.stop_agreed):
                note_loop_position(trainer, exc)
                note_device_mesh(trainer.lightning_module, exc)
                note_local_width(trainer.lightning_module, exc)
                # a failure (a stop no rank agreed on included): handled here only where every rank failed
                if strategy.num_nodes == 1:
                    on_exception_where_all_failed(trainer, world.world_group, exc)
                raise
            # every rank is here at the same step: Lightning's own interrupt handling, as in one process
            call._interrupt(trainer, exc)
            trainer._teardown()
            results = None
        try:
            return launcher._collect_results(trainer, results, strategy.stop_agreed, tuned)
        except BaseException as exc:  # collectives: a rank that ended its fit alone meets the others' steps here
            note_loop_position(trainer, exc)
            raise
    finally:
        flush_held_files(trainer)  # a worker leaves by os._exit, which flushes nothing
        strategy.detach_world()
