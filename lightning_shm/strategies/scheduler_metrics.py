"""A learning-rate scheduler stepping on a metric the ranks did not sync: one value for every replica.

A scheduler with a ``monitor`` (``ReduceLROnPlateau``) steps on ``trainer.callback_metrics[monitor]``. A metric
logged without ``sync_dist=True`` holds each data-parallel rank's own batches, so each rank's scheduler decided
on its own value, the replicas' learning rates parted and their weights drifted apart, silently::

    rank 0: val_loss 0.61 (its half of the data) -> plateau -> lr 0.25 -> weights A
    rank 1: val_loss 0.58                        -> better  -> lr 0.5  -> weights B   (rank 0's A is saved)

(measured before this module: the replicas 1.12 apart in a weight after 6 epochs under shm_ddp, `lr` 0.25 on rank
0 and 0.5 on rank 1, `/tmp/ph/plateau.py`, a local script. Lightning's ``ddp`` does the same and warns when such a
metric is logged, a warning that needs ``torch.distributed``, which these workers never start.) So the module's
``lr_scheduler_step`` is wrapped for the fit (:mod:`.module_hooks`): the data-parallel ranks gather the value
(one scalar all-gather a step of a monitored scheduler) and, where they differ, every rank steps on their
combination by the metric's ``reduce_fx`` -- what ``sync_dist=True`` gives, one process's value for a mean over
equal shards --, with a warning once per metric.

Under manual optimization Lightning never calls that hook: the module steps its schedulers itself, as Lightning's
docs show for ``ReduceLROnPlateau``::

    def on_train_epoch_end(self):
        self.lr_schedulers().step(self.trainer.callback_metrics["loss"])   # each rank's own "loss"

(before: the replicas 0.18 apart after 6 epochs, ``lr`` 0.03125 on rank 0 and 0.25 on rank 1,
`/tmp/ph/plateau_manual.py`, a local script). There each ``ReduceLROnPlateau`` of the fit gets a ``step`` that agrees on
the value first -- its class swapped for a subclass for the fit (an attribute on the scheduler would be saved
in its ``state_dict``) and put back at the fit's end; a copy made meanwhile is a plain scheduler. The metric's
name (for ``reduce_fx`` and the warning) is the ``callback_metrics`` entry holding the value passed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from lightning_shm.runtime import Group
from lightning_shm.strategies import module_hooks

_HOOK = "lr_scheduler_step"
_REDUCE = {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}


def install(trainer: "pl.Trainer", group: Optional[Group]) -> None:
    """Where ``group`` (the data-parallel ranks) has several members: wrap the module's ``lr_scheduler_step`` for
    this fit if a scheduler monitors a metric, or, under manual optimization, each ``ReduceLROnPlateau``'s
    ``step``."""
    if group is None or group.size == 1:
        return
    warned: set[Optional[str]] = set()
    if not trainer.lightning_module.automatic_optimization:
        for config in trainer.lr_scheduler_configs:
            if isinstance(config.scheduler, ReduceLROnPlateau):
                _agree_on_step(config.scheduler, lambda s, metric: _agreed(trainer, group, s, metric, warned))
        return
    if not any(c.monitor for c in trainer.lr_scheduler_configs):
        return

    def around(hook: Callable[..., Any], scheduler: Any, metric: Any = None) -> Any:
        if metric is not None:
            metric = _agreed(trainer, group, scheduler, metric, warned)
        return hook(scheduler, metric)

    module_hooks.wrap(trainer.lightning_module, _HOOK, around)


def uninstall(trainer: "pl.Trainer") -> None:
    module_hooks.unwrap(trainer.lightning_module, (_HOOK,))
    for config in trainer.lr_scheduler_configs:
        plain = getattr(type(config.scheduler), "_plain_class", None)
        if plain is not None:
            config.scheduler.__class__ = plain


def _agree_on_step(scheduler: ReduceLROnPlateau, agreed: Callable[[Any, Any], Any]) -> None:
    """Swap ``scheduler``'s class for a subclass whose ``step(metrics, ...)`` steps on ``agreed(scheduler,
    metrics)``; ``_plain_class`` names the class to put back, which a copy or pickle of it also gets."""
    plain = type(scheduler)
    if hasattr(plain, "_plain_class"):
        return  # a second start of the same fit

    def step(self: Any, metrics: Any, *args: Any, **kwargs: Any) -> Any:
        return plain.step(self, agreed(self, metrics), *args, **kwargs)

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        fn, args, *rest = object.__reduce_ex__(self, protocol)
        return (fn, (plain, *args[1:]), *rest)

    scheduler.__class__ = type(plain.__name__, (plain,), {
        "step": step, "__reduce_ex__": __reduce_ex__, "_plain_class": plain, "__module__": plain.__module__,
        "__qualname__": plain.__qualname__})


def _agreed(trainer: "pl.Trainer", group: Group, scheduler: Any, metric: Any, warned: set[Optional[str]]) -> Any:
    """``metric`` if every member of ``group`` holds the same value, else their combination (a tensor)."""
    value = torch.as_tensor(metric, dtype=torch.float64).detach().reshape(())
    values = group.all_gather(value.clone())
    if bool((values == values[0]).all()):
        return metric
    key = next((c.monitor for c in trainer.lr_scheduler_configs if c.scheduler is scheduler), None)
    key = key or _logged_as(trainer, metric)
    how = _reduce_fx(trainer, key) if key else "mean"
    combined = _REDUCE[how](values)
    if key not in warned:
        warned.add(key)
        each = ", ".join(f"{float(v):.6g} on rank {r}" for r, v in enumerate(values))
        name = repr(key) if key else "the value passed to its step()"
        rank_zero_warn(
            f"lightning_shm: the learning-rate scheduler monitors {name}, whose value differs between the "
            f"data-parallel ranks ({each}): it was logged without sync_dist=True, so each holds its own batches'. "
            f"Every rank's scheduler steps on their {how} ({float(combined):.6g}), what sync_dist=True gives -- "
            "each on its own would give each replica its own learning rate. Log it with sync_dist=True to say so.")
    return combined.to(metric.dtype) if isinstance(metric, torch.Tensor) else float(combined)


def _logged_as(trainer: "pl.Trainer", metric: Any) -> Optional[str]:
    """The ``callback_metrics`` key holding ``metric`` (that object, else an equal value); None where none does."""
    found = [k for k, v in trainer.callback_metrics.items() if v is metric]
    if not found:
        found = [k for k, v in trainer.callback_metrics.items() if v.numel() == 1 and float(v) == float(metric)]
    return found[0] if len(found) == 1 else None


def _reduce_fx(trainer: "pl.Trainer", key: str) -> str:
    """The ``reduce_fx`` ``key`` was logged with (Lightning's result collections; "mean" where not found)."""
    loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.fit_loop.epoch_loop)
    for loop in loops:
        for result in getattr(loop, "_results", {}).values():
            meta = getattr(result, "meta", None)
            if meta is not None and key in (meta.name, getattr(meta, "forked_name", None)):
                fx = meta.reduce_fx
                name = fx if isinstance(fx, str) else getattr(fx, "__name__", "")
                if name in _REDUCE:
                    return name
    return "mean"
