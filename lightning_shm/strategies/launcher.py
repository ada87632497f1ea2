"""Lightning's launcher interface on top of the runtime launcher.

The main process calls ``trainer.fit`` -> :meth:`SHMLauncher.launch`, which runs the Trainer's own
``_fit_impl`` / ``_test_impl`` / ``_predict_impl`` in W workers through
:class:`lightning_shm.runtime.Launcher` (segments, fault handling, clean-up), then copies back to
the main process what a user expects there: the trained weights, ``trainer.state``,
``callback_metrics``, ``best_model_path`` and -- unlike Lightning's spawn launcher -- the
predictions of *all* ranks, in dataset order.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch
from lightning.fabric.strategies.launchers.multiprocessing import _check_missing_main_guard
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _GlobalStateSnapshot
from lightning.pytorch.trainer.states import TrainerFn, TrainerState
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_shm.runtime import LaunchConfig, Launcher, World

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_shm.strategies.base import SHMStrategyBase


class WorkerOutput(NamedTuple):
    best_model_path: Optional[str]
    weights_path: Optional[str]
    trainer_state: TrainerState
    trainer_results: Any
    callback_metrics_bytes: bytes


class SHMLauncher(_Launcher):
    """Runs a Trainer entry point on the strategy's W worker processes."""

    def __init__(self, strategy: "SHMStrategyBase", start_method: str = "spawn") -> None:
        self._strategy = strategy
        self._start_method = start_method
        self._runtime: Optional[Launcher] = None
        self._already_fit = False

    @property
    def is_interactive_compatible(self) -> bool:
        return self._start_method == "fork"

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        if self._start_method == "spawn":
            _check_missing_main_guard()
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise NotImplementedError(
                "Calling `trainer.fit()` twice on the same Trainer with a process-launching strategy is not "
                "supported (the main process does not hold the loop state). Create a new Trainer and pass "
                "`fit(ckpt_path=...)` to continue training."
            )
        if trainer is not None and trainer.lightning_module is not None:  # bad input fails before any worker starts
            self._strategy.validate_model(trainer.lightning_module, trainer, (args, kwargs))
        snapshot = _GlobalStateSnapshot.capture() if self._start_method == "spawn" else None
        config = LaunchConfig(world_size=self._strategy.num_processes, start_method=self._start_method,
                              runtime=self._strategy.runtime_config)
        self._runtime = Launcher(config)
        outputs = self._runtime.run(_run_in_worker, self, trainer, function, args, kwargs, snapshot)
        output = outputs[0]
        if trainer is None:
            return output
        self._already_fit |= trainer.state.fn == TrainerFn.FITTING
        self._recover_in_main_process(output, trainer)
        return output.trainer_results

    def kill(self, signum: Any) -> None:
        if self._runtime is not None:
            self._runtime.kill(int(signum))

    # ------------------------------------------------------------------ worker side
    def _collect_results(self, trainer: "pl.Trainer", results: Any) -> Optional[WorkerOutput]:
        """Collective on all ranks; rank 0 returns what the main process needs."""
        strategy = self._strategy
        if trainer.state.fn == TrainerFn.PREDICTING and trainer.predict_loop.return_predictions:
            results = strategy.gather_predictions(trainer, results)
        state_dict = strategy.full_state_dict() if trainer.state.fn == TrainerFn.FITTING else None
        if strategy.global_rank != 0:
            return None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(prefix="lightning_shm_"), "weights.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        ckpt = trainer.checkpoint_callback
        best = getattr(ckpt, "best_model_path", None) if ckpt is not None else None
        metrics = apply_to_collection(trainer.callback_metrics, torch.Tensor, lambda t: t.detach().cpu())
        buffer = io.BytesIO()
        torch.save(metrics, buffer)
        return WorkerOutput(best, weights_path, trainer.state, results, buffer.getvalue())

    # ------------------------------------------------------------------ main side
    def _recover_in_main_process(self, output: WorkerOutput, trainer: "pl.Trainer") -> None:
        if trainer.checkpoint_callback is not None and hasattr(trainer.checkpoint_callback, "best_model_path"):
            trainer.checkpoint_callback.best_model_path = str(output.best_model_path or "")
        if output.weights_path is not None:
            state = self._strategy.checkpoint_io.load_checkpoint(output.weights_path)
            trainer.lightning_module.load_state_dict(state, strict=False)
            self._strategy.checkpoint_io.remove_checkpoint(os.path.dirname(output.weights_path))
        trainer.state = output.trainer_state
        metrics = torch.load(io.BytesIO(output.callback_metrics_bytes), weights_only=True)
        trainer.callback_metrics.update(metrics)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_runtime"] = None  # holds processes; the workers never need it
        return state


def _run_in_worker(world: World, launcher: SHMLauncher, trainer: Optional["pl.Trainer"], function: Callable,
                   args: Any, kwargs: Any, snapshot: Optional[_GlobalStateSnapshot]) -> Optional[WorkerOutput]:
    if snapshot is not None:
        snapshot.restore()
    os.environ["LOCAL_RANK"] = str(world.rank)
    launcher._strategy.attach_world(world)
    results = function(*args, **kwargs)
    if trainer is None:
        return results if world.rank == 0 else None
    return launcher._collect_results(trainer, results)
