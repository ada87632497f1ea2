"""Run a function once a module has been imported: now if it has been, else right after its code runs.

Why: ``import lightning_shm`` must make "shm_ddp" a name Lightning's Trainer knows, yet a process that uses
only the runtime or the parallel layer (a runtime worker, ``scripts/bench_collectives.py``) must not pay for
importing Lightning (10-14 s of CPU on a slow day here, against 4 s for torch). So the package registers its
strategies when ``lightning.pytorch`` loads, whoever imports it and whenever.

How: a finder at the head of ``sys.meta_path`` waits for that one import. It lets the other finders locate the
module and hands the import machinery a loader that runs the module's own loader, then leaves the path and
calls ``then``. The module keeps its own loader (``__loader__``, ``__spec__.loader``). An import that fails
leaves the finder waiting: the next attempt that succeeds still calls ``then``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Callable, Optional, Sequence


def after_import(name: str, then: Callable[[], None]) -> None:
    """Call ``then()`` once ``name`` has been imported: at once if it is in ``sys.modules``."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _Watch(name, then))


class _Watch(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name, self.then, self.searching = name, then, False

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
                  ) -> Optional[ModuleSpec]:
        if fullname != self.name or self.searching:  # the search below must not find this finder again
            return None
        self.searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.searching = False
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """Runs the module's own loader; once its code has run without raising, stops watching and calls ``then``.
    An import that raises (a broken dependency, an interrupt) leaves the watch in place for the next try."""

    def __init__(self, loader: Any, watch: _Watch) -> None:
        self.loader, self.watch = loader, watch

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # resources, source, is_package: the real one's
        self.loader.exec_module(module)
        if self.watch in sys.meta_path:
            sys.meta_path.remove(self.watch)
        self.watch.then()
