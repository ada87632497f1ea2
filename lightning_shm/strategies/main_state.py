"""The main process's Trainer after the workers finished: the trained one, not the copy it started with.

The Trainer in the main process never runs a step -- the workers do. So that ``trainer.global_step``,
``trainer.save_checkpoint(path)``, ``trainer.test(ckpt_path="best")`` or ``fit(ckpt_path="last")``
in the main process behave as in one process, rank 0 hands back the full checkpoint it would write
at the end (model, loops, optimizer and scheduler states -- consolidated by sharded strategies --,
callback, precision and datamodule states) and :func:`restore_trainer` loads it here, the way
Lightning restores a checkpoint, except for the module's own ``on_load_checkpoint`` hook, which a
single process would not call after ``fit`` either -- nor is that checkpoint made through the module's
``on_save_checkpoint`` (:func:`end_checkpoint`).

Optimizers are built here by the module's ``configure_optimizers`` over the plain module and loaded
with the plain (consolidated) state; if that cannot run in the main process the Trainer keeps no
optimizers and says so.

What a ``LearningRateFinder`` found (``Tuner.lr_find`` or the callback) is not in any checkpoint: its
result object and the learning-rate attribute it set come back beside it (:func:`found_learning_rates`,
:func:`apply_found_learning_rates`). Neither is what a callback without ``state_dict`` gathered in
public attributes (a history of validation losses): plain data -- numbers, strings, tensors and lists
or dicts of them -- comes back too, and so does what the LightningModule and the datamodule kept that way (a
list of epoch losses, a best score, a sample count ``setup`` derived), and a logger's plain data, private too (the
MLflow run it logs to, the rows a logger of the user's kept) (:func:`gathered_attributes`),
where Lightning's spawn launcher leaves them as they were before the run. Datasets ``setup`` built stay in
the workers (the main process does not run ``setup``). What else crosses for the loggers -- a CSV logger's writer
among it -- is in :mod:`.loggers`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Mapping, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateFinder, ModelCheckpoint
from lightning.pytorch.trainer import call
from lightning.pytorch.tuner.lr_finder import _determine_lr_attr_name
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_setattr
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_shm.strategies.main_globals import pickled
from lightning_shm.strategies.module_hooks import instead

log = logging.getLogger(__name__)

_LOOPS = ("fit_loop", "validate_loop", "test_loop", "predict_loop")


def fit_data(function: Callable, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The data ``Trainer.fit`` was given, read from the arguments of its entry point ``function``
    (``trainer._fit_impl``, which ran in the workers only): train / val dataloaders and datamodule."""
    try:
        given = inspect.signature(function).bind(*args, **kwargs).arguments
    except TypeError:  # an entry point with other arguments: nothing to attach
        return {}
    data = {k: given.get(k) for k in ("train_dataloaders", "val_dataloaders", "datamodule")}
    if isinstance(data["train_dataloaders"], pl.LightningDataModule):  # fit(model, dm), as fit reads it
        data["datamodule"], data["train_dataloaders"] = data["train_dataloaders"], None
    return data


def end_checkpoint(trainer: "pl.Trainer") -> dict[str, Any]:
    """What rank 0 hands back: the checkpoint it would write now, without the module's ``on_save_checkpoint`` --
    it shapes files the user keeps (drops a frozen backbone's keys, casts to half), not the trained module the main
    process takes over, which one process simply holds (and :func:`restore_trainer` calls no ``on_load_checkpoint``
    either). Lightning's spawn launcher hands back ``state_dict()`` alike."""
    with instead(trainer.lightning_module, "on_save_checkpoint", lambda checkpoint: None):
        return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def restore_trainer(trainer: "pl.Trainer", checkpoint: dict[str, Any], data: Mapping[str, Any]) -> None:
    """Load rank 0's end-of-run ``checkpoint`` into the main process's ``trainer`` and its module.

    ``data``: :func:`fit_data` -- attached here as ``fit`` attached it in the workers, so that what the
    module's hooks read of it here (``configure_optimizers`` reading ``trainer.estimated_stepping_batches``
    for a OneCycleLR, say) is what they read there."""
    module = trainer.lightning_module
    trainer._data_connector.attach_data(module, **data)
    module.trainer = trainer
    trainer.precision_plugin.convert_module(module)  # e.g. "64-true": float64, as the workers' (and one process's)
    if set(checkpoint["state_dict"]) - set(module.state_dict()):  # layers built in configure_model, as the workers did
        call._call_configure_model(trainer)
    module.load_state_dict(checkpoint["state_dict"])
    for name in _LOOPS:
        state = checkpoint.get("loops", {}).get(name)
        if state is not None:
            loop = getattr(trainer, name)
            loop.load_state_dict(state)
            loop.restarting = False  # it ran to here; nothing is being resumed
    trainer._callback_connector._attach_model_callbacks()  # callbacks from configure_callbacks, as in the workers
    states = checkpoint.get("callbacks") or {}
    for cb in trainer.callbacks:
        state = states.get(cb.state_key)
        if isinstance(cb, ModelCheckpoint) and state and cb.dirpath is None:
            cb.dirpath = state.get("dirpath")  # resolved in the workers: without it the state is not loaded
    call._call_callbacks_load_state_dict(trainer, checkpoint)
    for cb in trainer.callbacks:  # what ModelCheckpoint.load_state_dict leaves out (it is resuming, we are not)
        state = states.get(cb.state_key)
        if isinstance(cb, ModelCheckpoint) and state:
            cb.current_score = state.get("current_score")
    plugin = trainer.precision_plugin
    if type(plugin).__qualname__ in checkpoint:
        plugin.load_state_dict(checkpoint[type(plugin).__qualname__])
    dm = trainer.datamodule
    if dm is not None and type(dm).__qualname__ in checkpoint:
        dm.load_state_dict(checkpoint[type(dm).__qualname__])
    if "optimizer_states" in checkpoint:
        _restore_optimizers(trainer, checkpoint)


def _restore_optimizers(trainer: "pl.Trainer", checkpoint: dict[str, Any]) -> None:
    """``configure_optimizers`` may read the training data (``trainer.estimated_stepping_batches`` for a
    OneCycleLR): the dataloaders ``fit`` was given are attached here, and a datamodule that builds them in
    ``setup`` is set up here if the first call fails -- one process's is set up after ``fit``, but doing
    it for every run would cost every run its setup time."""
    strategy = trainer.strategy
    try:
        try:
            strategy.setup_optimizers(trainer)
        except Exception:
            if trainer.datamodule is None:
                raise
            call._call_lightning_datamodule_hook(trainer, "setup", stage="fit")
            strategy.setup_optimizers(trainer)
        for opt, state in zip(strategy.optimizers, checkpoint["optimizer_states"]):
            opt.load_state_dict(state)
        for config, state in zip(trainer.lr_scheduler_configs, checkpoint.get("lr_schedulers", [])):
            config.scheduler.load_state_dict(state)
    except Exception as e:  # e.g. configure_optimizers needs data only the workers built
        strategy.optimizers, strategy.lr_scheduler_configs = [], []
        log.warning("the main process could not rebuild the optimizers after the run (%r): its Trainer holds the "
                    "trained weights, loops and callbacks but no optimizer state; the checkpoints the workers "
                    "wrote hold it.", e)


def run_details(trainer: "pl.Trainer") -> dict[str, Any]:
    """On rank 0 after the run: what its Trainer set up from the data and the arguments, which the main process
    never sets up itself -- the batch counts of the loops (``trainer.num_training_batches``, ``val_check_batch``,
    ``num_val_batches`` -- the fit's and ``validate``'s --, ``num_test_batches``, ``num_predict_batches``) and
    ``trainer.ckpt_path``, the checkpoint the run restored (``"best"`` resolved). Without them the main process said
    ``inf``, ``[]`` and None after a fit where one process says 3, ``[2]`` and the path. Each loop sets its counts
    up again from its data at its next run."""
    return {"fit": trainer.fit_loop.max_batches, "val_check": trainer.val_check_batch,
            "fit_val": list(trainer.fit_loop.epoch_loop.val_loop._max_batches),
            "validate": list(trainer.validate_loop._max_batches), "test": list(trainer.test_loop._max_batches),
            "predict": list(trainer.predict_loop.max_batches), "ckpt_path": trainer.ckpt_path}


def apply_run_details(trainer: "pl.Trainer", details: Mapping[str, Any]) -> None:
    trainer.fit_loop.max_batches, trainer.val_check_batch = details["fit"], details["val_check"]
    trainer.fit_loop.epoch_loop.val_loop._max_batches = details["fit_val"]
    trainer.validate_loop._max_batches, trainer.test_loop._max_batches = details["validate"], details["test"]
    trainer.predict_loop.max_batches = details["predict"]
    trainer._checkpoint_connector._ckpt_path = details["ckpt_path"]  # not the setter: that marks it the user's


def found_learning_rates(trainer: "pl.Trainer") -> list[tuple[int, Any, str, Any]]:
    """In a worker after the run: ``(callback index, its optimal_lr, lr attribute, the attribute's value)`` for
    every ``LearningRateFinder`` that ran (the same on every rank: Lightning broadcasts rank 0's results)."""
    found = []
    for i, cb in enumerate(trainer.callbacks):
        if isinstance(cb, LearningRateFinder) and cb.optimal_lr is not None:
            attr = _determine_lr_attr_name(trainer.lightning_module, cb._attr_name) if cb._update_attr else ""
            found.append((i, cb.optimal_lr, attr, lightning_getattr(trainer.lightning_module, attr) if attr else None))
    return found


def apply_found_learning_rates(trainer: "pl.Trainer", found: list[tuple[int, Any, str, Any]]) -> None:
    """In the main process: the finders' results on its own callbacks (same order as the workers' copies), and
    the learning rate they set on its module, as one process's ``Tuner.lr_find`` leaves them."""
    for i, optimal_lr, attr, value in found:
        trainer.callbacks[i].optimal_lr = optimal_lr
        if attr:
            lightning_setattr(trainer.lightning_module, attr, value)


def gathered_attributes(trainer: "pl.Trainer") -> list[tuple[str, dict[str, Any]]]:
    """On rank 0 after the run: the type and the public plain-data attributes of the LightningModule, of the
    datamodule (what its ``setup`` derived: a sample count, a mean), of each logger and of each callback.

    A logger's private plain data comes back too: only rank 0 logs, so what a logger learns while logging is its
    copy's -- the run it made (MLflow's ``_run_id``, ``_experiment_id``), the rows a logger of the user's kept in
    lists. Without it the main process's logger made a run of its own when read after ``fit``
    (``logger.run_id``), and a ``test`` after the fit logged into a third."""
    return [(type(obj).__qualname__, plain_attributes(obj, private) if obj is not None else {})
            for obj, private in _holders(trainer)]


def apply_gathered_attributes(trainer: "pl.Trainer", attributes: list[tuple[str, dict[str, Any]]]) -> None:
    """In the main process: rank 0's attributes on the module, the datamodule, the logger and the callback at the
    same position (each of the same type)."""
    for (obj, _), (kind, attrs) in zip(_holders(trainer), attributes):
        if obj is not None and type(obj).__qualname__ == kind:
            for name, value in attrs.items():
                setattr(obj, name, value)


def _holders(trainer: "pl.Trainer") -> list[tuple[Any, bool]]:
    """``(object, whether its private plain data comes back too)``, in the same order on every side."""
    loggers = [(logger, True) for logger in trainer.loggers]
    return [(trainer.lightning_module, False), (trainer.datamodule, False), *loggers,
            *((cb, False) for cb in trainer.callbacks)]


def plain_attributes(obj: Any, private: bool = False) -> dict[str, Any]:
    """``obj``'s public (``private``: and private) attributes holding plain data (tensors detached), each one that
    pickles."""
    attrs = {}
    for name, value in vars(obj).items():
        if (name.startswith("_") and not private) or not _plain(value):
            continue
        value = apply_to_collection(value, torch.Tensor, lambda t: t.detach().cpu())
        if pickled(value) is None:  # e.g. a defaultdict whose factory is a lambda
            continue
        attrs[name] = value
    return attrs


def _plain(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if depth < 4 and isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False

