"""What importing the package costs and does: the runtime and the parallel layer load without Lightning, and the
strategy names reach Lightning's registry whichever is imported first (``lightning_shm._after_import``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_shm._after_import import _Watch, after_import

ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter: everything in the runtime and the parallel layer, then Lightning, as a runtime worker or a
# script that trains through Lightning later would.
_FRESH = textwrap.dedent("""
    import pkgutil, sys
    import lightning_shm.parallel, lightning_shm.runtime
    for package in (lightning_shm.runtime, lightning_shm.parallel):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            __import__(info.name)
    print("loaded:", sorted(m for m in ("lightning", "torchmetrics", "lightning_shm.strategies") if m in sys.modules))
    from lightning.pytorch import Trainer
    trainer = Trainer(strategy="shm_fsdp_fork", accelerator="cpu", devices=2, logger=False)
    print("strategy:", type(trainer.strategy).__name__, trainer.strategy._start_method)
""")


def test_runtime_and_parallel_import_without_lightning_which_registers_the_names_when_it_loads():
    out = subprocess.run([sys.executable, "-c", _FRESH], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout, out.stdout
    assert "strategy: SHMFSDPStrategy fork" in out.stdout, out.stdout


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write modules into a directory on ``sys.path``; whatever they and the test import or watch is undone."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = set(sys.modules)

    def write(**sources: str) -> None:
        for name, source in sources.items():
            path = tmp_path.joinpath(*name.split(".")).with_suffix(".py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()

    yield write
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_then_runs_once_right_after_the_module_and_the_module_keeps_its_loader(modules):
    modules(**{"heavy.__init__": "", "heavy.core": "DONE = True\n"})
    seen = []
    after_import("heavy.core", lambda: seen.append(sys.modules["heavy.core"].DONE))
    import heavy  # the parent alone: not the watched module
    assert seen == []
    import heavy.core
    assert seen == [True]
    assert type(heavy.core.__loader__).__name__ == "SourceFileLoader"
    assert heavy.core.__spec__.loader is heavy.core.__loader__
    assert not [f for f in sys.meta_path if isinstance(f, _Watch)]
    importlib.reload(heavy.core)
    assert seen == [True]
    after_import("heavy.core", lambda: seen.append("at once"))  # already imported
    assert seen == [True, "at once"]


@pytest.mark.parametrize("first", ["heavy", "plugin"])
def test_a_plugin_registers_once_whichever_loads_first(modules, first):
    """lightning_shm's case: the plugin imports the heavy module at its top and registers at its end; the heavy
    module's import, when it comes first, loads the plugin. Loading the plugin first means the hook runs while the
    plugin is half-imported: it must neither fail nor register twice."""
    modules(heavy="REGISTRY = []\n", plugin="import heavy\n\nheavy.REGISTRY.append('mine')\n")
    after_import("heavy", lambda: importlib.import_module("plugin"))
    importlib.import_module(first)
    assert sys.modules["heavy"].REGISTRY == ["mine"]


def test_an_import_that_fails_keeps_the_watch_for_the_next_try(modules):
    """A first ``import lightning.pytorch`` that raises (a broken dependency, fixed later in the session) must not
    cost the registration: the import that succeeds later still runs the hook, once."""
    modules(heavy="raise ImportError('a dependency is missing')\n")
    seen = []
    after_import("heavy", lambda: seen.append("then"))
    with pytest.raises(ImportError, match="a dependency is missing"):
        importlib.import_module("heavy")
    assert seen == [] and "heavy" not in sys.modules
    assert [f for f in sys.meta_path if isinstance(f, _Watch)]
    modules(heavy="DONE = True\n")
    assert importlib.import_module("heavy").DONE
    assert seen == ["then"]
    assert not [f for f in sys.meta_path if isinstance(f, _Watch)]
