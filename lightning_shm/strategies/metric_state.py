"""The torchmetrics internals the pipeline copies from the last stage to the others, in one place.

A metric logged in a step on the last stage must be logged by every rank (progress bar, monitors,
``callback_metrics``), so its accumulated state travels to the other stages. torchmetrics has no
public "export/import state" API: the state lives in the attributes named by ``_defaults``, plus
``_update_count`` and ``_forward_cache``, and ``_computed`` caches ``compute()``. Those names are
checked against the installed version once, so an incompatible torchmetrics fails with a clear
message instead of silently logging stale values.
"""

from __future__ import annotations

from typing import Any

import torchmetrics
from packaging.version import Version

_TESTED = (Version("1.4"), Version("2.0"))  # [lowest, first untested major)
_FIELDS = ("_defaults", "_update_count", "_forward_cache", "_computed")


def _check(metric: Any) -> None:
    missing = [f for f in _FIELDS if not hasattr(metric, f)]
    if missing:
        raise RuntimeError(
            f"torchmetrics {torchmetrics.__version__}: {type(metric).__name__} lacks {missing}, which shm_pipeline "
            f"uses to copy a logged metric's state between stages (tested with {_TESTED[0]} <= torchmetrics < "
            f"{_TESTED[1]})"
        )


def export_state(metric: Any) -> dict[str, Any]:
    """What ``metric.compute()`` and its logging depend on (tensors and lists of tensors)."""
    _check(metric)
    return {"states": {k: getattr(metric, k) for k in metric._defaults},
            "update_count": metric._update_count, "forward_cache": metric._forward_cache}


def import_state(metric: Any, state: dict[str, Any]) -> None:
    _check(metric)
    for k, v in state["states"].items():
        setattr(metric, k, v)
    metric._update_count = state["update_count"]
    metric._forward_cache = state["forward_cache"]
    metric._computed = None  # compute() again from the new state
