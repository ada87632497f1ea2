"""A spawned worker that dies before it reaches our code must surface in seconds, with its own error.

Lightning's ``ddp_spawn`` exits with the worker's message in 6-11 s here; a main process blocked on
a pipe to a dead child never would (this once hung for good). A hang is caught by the subprocess's
timeout; a slow detection by the time from the dead worker's ``fit()`` to the exit.
"""

from __future__ import annotations

import logging
import pickle
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

_NO_GUARD = textwrap.dedent(
    """
    import sys
    import time
    import lightning.pytorch as pl
    import lightning_shm
    from lightning.pytorch.demos.boring_classes import BoringModel

    sys.stdout.write(f"fit at {time.time()}\\n")  # one write: the processes' lines never interleave
    sys.stdout.flush()
    pl.Trainer(strategy="STRATEGY", accelerator="cpu", devices=2, max_epochs=1, logger=False).fit(BoringModel())
    """
)


def test_script_without_main_guard_is_refused_before_any_worker_starts(tmp_path):
    """Unguarded, each worker ran the script again and died in its fit() -- after importing torch and lightning,
    with Lightning's advice to use strategy="ddp". The main process now reads its own call's line in the script
    and refuses it, naming the line and the two ways out."""
    script = tmp_path / "no_guard.py"
    script.write_text(_NO_GUARD.replace("STRATEGY", "shm_ddp_spawn"))
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert len(re.findall(r"^fit at ", out.stdout, re.MULTILINE)) == 1, out.stdout  # no worker ran the script
    said = out.stderr.strip().splitlines()[-1]
    assert said.startswith(f"RuntimeError: start_method='spawn' starts each worker by running the main script "
                           f"again ({script}), and its line 10 -- `pl.Trainer(strategy=\"shm_ddp_spawn\", "), said
    assert "is not under `if __name__ == \"__main__\":`" in said and "strategy='shm_ddp_fork'" in said, said
    assert "WorkerDiedError" not in out.stderr


def test_a_guard_the_workers_pass_fails_fast_with_their_message(tmp_path):
    """A test of ``__name__`` that is no guard (the workers run the script as ``__mp_main__``) is left to them:
    they die in fit() with Lightning's message, which the main process quotes within seconds."""
    script = tmp_path / "no_guard.py"
    code = _NO_GUARD.replace("STRATEGY", "shm_ddp").replace(
        "pl.Trainer(", 'if __name__ in ("__main__", "__mp_main__"):\n    pl.Trainer(')
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    ended = time.time()
    assert out.returncode != 0
    # the main process's fit(), then each worker's (it runs the unguarded script again and dies in fit())
    fits = [float(t) for t in re.findall(r"^fit at ([0-9.]+)$", out.stdout, re.MULTILINE)]
    assert len(fits) >= 2, out.stdout
    # From the last worker's fit() to the main process's exit: the worker's error, its detection, the
    # others stopped, the main process's shutdown (1.2-2.4 s here). Before it, the workers' start imports
    # torch and lightning (7.5 s here). Both are interpreter work that a loaded machine slows alike (CI
    # once took 15.5 s over the window), so the bound is the same run's start, and at least 10 s.
    started, window = fits[-1] - fits[0], ended - fits[-1]
    assert window < max(10.0, started), f"{window:.1f} s from the last fit() to the exit ({started:.1f} s to start)"
    assert "WorkerDiedError" in out.stderr, out.stderr[-3000:]
    # Lightning's own message, from the worker, quoted in the exception (not only forwarded to the terminal)
    assert "wrote to stderr:" in out.stderr, out.stderr[-3000:]
    assert "guards the main" in out.stderr.split("wrote to stderr:", 1)[1], out.stderr[-3000:]


_MAIN = """
import sys
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_shm import SHMDDPStrategy
from tests.helpers import trainer

def main():
    trainer(strategy=SHMDDPStrategy(start_method="forkserver"), devices=2, max_epochs=1).fit(BoringModel())
"""


@pytest.mark.parametrize("ending, refused_line", [
    ("main()", 9),
    ("if True:\n    main()", 10),
    ("import fits_on_import", 9),  # a module whose import fits: the script's line that imported it
    ('if __name__ == "__main__":\n    main()', None),
    ('if __name__ != "__main__":\n    sys.exit()\nmain()', None),
    ('if "__main__" == __name__ and len(sys.argv) > 0:\n    main()', None),
])
def test_the_line_that_called_fit_is_read_in_the_main_script(monkeypatch, no_worker_starts, tmp_path, ending,
                                                             refused_line):
    """The script runs here as ``__main__`` (the check reads the caller's top-level frame and the file's
    syntax): refused where the line that called fit() is unguarded; else the launch goes on to start workers."""
    import types

    path = tmp_path / "train.py"
    path.write_text(_MAIN + ending + "\n")
    (tmp_path / "fits_on_import.py").write_text("import train\n\ntrain.main()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fits_on_import", raising=False)
    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = str(path), None
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setitem(sys.modules, "train", main)
    code = compile(path.read_text(), str(path), "exec")
    if refused_line is None:
        with pytest.raises(AssertionError, match="a worker was about to start"):
            exec(code, vars(main))
        return
    said = re.escape(path.read_text().splitlines()[refused_line - 1].strip())
    with pytest.raises(RuntimeError, match=rf"\({re.escape(str(path))}\), and its line {refused_line} -- `{said}`, "
                                           r"which led here -- is not under"):
        exec(code, vars(main))


def test_script_from_stdin_is_refused_before_any_worker_starts():
    """The default start method (a fork server); spawn's refusal: the in-process test below."""
    guarded = 'if __name__ == "__main__":\n    pl.Trainer('
    code = _NO_GUARD.replace("STRATEGY", "shm_ddp").replace("pl.Trainer(", guarded)
    out = subprocess.run([sys.executable, "-"], input=code, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "has no file ('<stdin>'" in out.stderr and "start_method='fork'" in out.stderr, out.stderr[-3000:]
    assert "WorkerDiedError" not in out.stderr


_NOTEBOOK_CELL = textwrap.dedent(
    """
    import lightning.pytorch as pl
    import lightning_shm
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Cell(BoringModel):  # defined in __main__, as in a notebook
        pass

    t = pl.Trainer(strategy="STRATEGY", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                   enable_progress_bar=False, enable_checkpointing=False, limit_train_batches=2, limit_val_batches=0)
    t.fit(Cell())
    print("trained", t.global_step)
    """
)


@pytest.mark.parametrize("strategy", ["shm_ddp", "shm_ddp_fork"])
def test_a_module_defined_without_a_main_script_is_refused_unless_forked(strategy):
    """``python -c`` or a notebook has no main script: a new interpreter cannot find the session's classes (the
    workers failed with "Can't get attribute 'Cell' on <module '__main__'>"); a forked worker has them. Spawn's
    refusal: the in-process test below."""
    out = subprocess.run([sys.executable, "-c", _NOTEBOOK_CELL.replace("STRATEGY", strategy)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    if strategy == "shm_ddp_fork":
        assert out.returncode == 0 and "trained 2" in out.stdout, out.stderr[-3000:]
        return
    assert out.returncode != 0
    assert "cannot see what this session defined in __main__ (Cell)" in out.stderr, out.stderr[-3000:]
    assert "WorkerTraceback" not in out.stderr and "Can't get attribute" not in out.stderr


@pytest.mark.parametrize("main_file, refusal", [
    ("<stdin>", r"start_method='spawn' starts each worker by importing the main script again, but it has no file "
                r"\('<stdin>'"),
    (None, r"start_method='spawn' starts each worker in a new interpreter, which cannot see what this session "
           r"defined in __main__ \(Cell\)")])
def test_spawned_workers_need_a_main_script_to_import(monkeypatch, no_worker_starts, main_file, refusal):
    """The two tests above under spawn, in this process (a fresh interpreter costs the suite 15 s a case):
    ``__main__`` as a script read from stdin leaves it, or as ``python -c`` / a notebook leaves it, holding
    the module's class."""
    import types

    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_shm import SHMDDPStrategy
    from tests.helpers import trainer

    cell = type("Cell", (BoringModel,), {"__module__": "__main__"})
    main = types.ModuleType("__main__")
    main.__spec__ = None
    if main_file is not None:
        main.__file__ = main_file
    main.Cell = cell
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(RuntimeError, match=refusal):
        trainer(strategy=SHMDDPStrategy(start_method="spawn"), devices=2, max_epochs=1).fit(cell())


_GUARDED = """
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_shm import SHMFSDPStrategy
from tests.helpers import trainer

def fit(model):
    trainer(strategy=SHMFSDPStrategy(start_method="spawn"), devices=2, max_epochs=1).fit(model)
"""


@pytest.mark.parametrize("body, refused", [
    ('if __name__ == "__main__":\n    class Cell(BoringModel):\n        pass\n    fit(Cell())', "Cell"),
    ('class Cell(BoringModel):\n    pass\nif __name__ == "__main__":\n    fit(Cell())', None),
    # imported above, redefined under the guard: the workers have the imported one (no refusal where unsure)
    ('from lightning.pytorch.demos.boring_classes import BoringModel as Cell\nif __name__ == "__main__":\n'
     '    class Cell(BoringModel):\n        pass\n    fit(Cell())', None),
    # the guard's else: what the workers run
    ('if __name__ == "__main__":\n    class Cell(BoringModel):\n        pass\n    fit(Cell())\nelse:\n'
     '    Cell = BoringModel', None),
    # a class inside a function never pickles: left to the launch, whose pickling names it with its own note
    ('if __name__ == "__main__":\n    def main():\n        class Cell(BoringModel):\n            pass\n'
     '        fit(Cell())\n    main()', None),
])
def test_classes_defined_under_the_guard_are_refused_before_any_worker_starts(monkeypatch, no_worker_starts,
                                                                              tmp_path, body, refused):
    """A worker runs the script as ``__mp_main__`` and skips the guard's body: a class defined only there
    failed in every worker ("Can't get attribute 'Cell' on <module '__mp_main__'>", ~10 s into the run)."""
    import types

    path = tmp_path / "train.py"
    path.write_text(_GUARDED + body + "\n")
    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = str(path), None
    monkeypatch.setitem(sys.modules, "__main__", main)
    code = compile(path.read_text(), str(path), "exec")
    if refused is None:
        with pytest.raises(AssertionError, match="a worker was about to start"):
            exec(code, vars(main))
    else:
        with pytest.raises(RuntimeError, match=rf"as __mp_main__, which skips the body of `if __name__ == "
                                               rf"\"__main__\":`; what the workers receive refers to {refused}, "
                                               r"defined only there, so they could not unpickle it\. Define it "
                                               r"above the guard \(or in a module\), or pass start_method='fork' "
                                               r"\(strategy='shm_fsdp_fork', or SHMFSDPStrategy\(\.\.\., "
                                               r"start_method='fork'\)\)\.$"):
            exec(code, vars(main))


def test_the_advice_names_the_strategys_own_fork_twin():
    from lightning_shm import SHMPipeline, SHMTensorParallel
    from lightning_shm.strategies.main_script import fork_twin

    assert fork_twin(SHMTensorParallel) == ("start_method='fork' (strategy='shm_tp_fork', or "
                                            "SHMTensorParallel(..., start_method='fork'))")
    mine = type("MyPipeline", (SHMPipeline,), {})
    assert fork_twin(mine) == "MyPipeline(..., start_method='fork')"


def test_fork_server_output_holds_what_a_dead_worker_wrote_last():
    """A worker's last lines reach the fork server's pipe before it exits, but the thread forwarding
    them may not have read them when the main process sees the exit: reading the tail drains the pipe
    first (this once cut a worker's message off in CI)."""
    import os

    from lightning_shm.runtime.forkserver import _ServerOutput

    out = _ServerOutput()
    for i in range(200):  # the forwarding thread gets no chance to run between write and read
        mark = out.mark()
        line = f"worker line {i}\n".encode()
        os.write(out.write_fd, line)
        assert out.since(mark) == line.decode(), i
    os.close(out.write_fd)  # end of file: the forwarding thread stops


def test_fork_server_note_keeps_the_dead_workers_message_after_a_killed_workers_partial_copy():
    """Every worker of a script without a main guard prints the same traceback to the fork server's
    stderr; the others are killed once the first dies, possibly half-way through theirs. The note must
    still hold the first one's last line (25 lines once held only a cut-off copy: CI failed)."""
    from lightning_shm.runtime.forkserver import NOTE_LINES, last_lines

    frames = [f'  File "lib{i}.py", line {i}, in f{i}\n    call_{i}()' for i in range(14)]
    dead = "\n".join(["Traceback (most recent call last):", *frames,
                      "RuntimeError: ... a script that guards the main ...", "Alternatively, ..."])
    killed = "\n".join(["Traceback (most recent call last):", *frames[:12]])  # stopped mid-way
    assert "guards the main" in last_lines(f"{dead}\n{killed}", NOTE_LINES)


@pytest.mark.parametrize("what", ["lambda", "scripted layer"])
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_what_cannot_be_pickled_for_the_workers_is_named_before_they_start(start_method, what):
    """A lambda collate_fn, as Lightning's ddp_spawn fails on it, and a layer scripted with torch.jit (torch raises
    a RuntimeError for it, which came without the note): with the reason and the two ways out."""
    import torch
    from torch.utils.data import DataLoader, default_collate

    from lightning_shm import SHMDDPStrategy
    from lightning_shm.models import MNISTClassifier
    from tests.helpers import mnist_like, trainer

    model = MNISTClassifier()
    if what == "lambda":
        data = DataLoader(mnist_like(16), batch_size=8, collate_fn=lambda b: default_collate(b))
    else:
        data = DataLoader(mnist_like(16), batch_size=8)
        model.net[1] = torch.jit.script(model.net[1])
    with pytest.raises((pickle.PicklingError, AttributeError, RuntimeError)) as raised:
        trainer(strategy=SHMDDPStrategy(start_method=start_method), devices=2, max_epochs=1).fit(model, data)
    note = "".join(getattr(raised.value, "__notes__", []))
    assert f"start_method='{start_method}' sends the job to every worker by pickling it" in note
    assert "start_method='fork'" in note and "a TorchScript module (torch.jit.script)" in note


class _MadeWithoutDtype(torch.utils.data.Dataset):
    """Samples created in ``__getitem__`` without a dtype: the worker's default dtype."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return torch.randn(8, generator=torch.Generator().manual_seed(i)), i % 2


def _legacy_precision() -> float:
    """``torch.get_float32_matmul_precision()`` as a number; -1 where torch refuses to read it (set mixed)."""
    try:
        return {"highest": 0.0, "high": 1.0, "medium": 2.0}[torch.get_float32_matmul_precision()]
    except RuntimeError:
        return -1.0


class _LogsDefaultDtype(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("default_float64", float(torch.get_default_dtype() == torch.float64), sync_dist=True)
        self.log("matmul_bf16", float(torch.backends.mkldnn.matmul.fp32_precision == "bf16"), sync_dist=True)
        self.log("legacy_precision", _legacy_precision(), sync_dist=True)
        return F.cross_entropy(self.net(x) * (1 + torch.tensor(0.1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("start_method,precision_api", [("forkserver", "legacy"), ("spawn", "per-backend")])
def test_the_main_processs_default_dtype_and_float32_precision_reach_the_workers(start_method, precision_api):
    """``torch.set_default_dtype(torch.float64)`` in the main process: a spawned or fork-server worker started from
    float32, and the float32 samples its dataset created met float64 weights ("mat1 and mat2 must have the same
    dtype"); Lightning's spawn launcher carries the deterministic flags and random states, not the dtype. Nor the
    float32 matmul precision -- ``torch.set_float32_matmul_precision("medium")`` or the per-backend setting it
    makes: on a CPU with bfloat16 units oneDNN multiplies in bfloat16 in one process, in float32 in those
    workers. Now they train as a forked worker, which inherits them. (Anomaly detection is the Trainer's own:
    its ``detect_anomaly`` flag decides inside every fit, in one process too.)"""
    from lightning_shm import SHMDDPStrategy
    from tests.helpers import flat_params, trainer

    torch.set_default_dtype(torch.float64)
    if precision_api == "legacy":
        torch.set_float32_matmul_precision("medium")
    else:  # set alone, it makes torch refuse to read the legacy setting: the workers are left as mixed
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    legacy = _legacy_precision()
    try:
        weights = []
        for method in (start_method, "fork"):
            pl.seed_everything(3)
            model = _LogsDefaultDtype()
            t = trainer(strategy=SHMDDPStrategy(start_method=method), devices=2, max_epochs=1)
            t.fit(model, torch.utils.data.DataLoader(_MadeWithoutDtype(), batch_size=8))
            said = {k: float(t.callback_metrics[k]) for k in ("default_float64", "matmul_bf16", "legacy_precision")}
            assert said == {"default_float64": 1.0, "matmul_bf16": 1.0, "legacy_precision": legacy}, said
            weights.append(flat_params(model))
    finally:
        torch.set_default_dtype(torch.float32)
        torch.backends.mkldnn.matmul.fp32_precision = "none"
        torch.set_float32_matmul_precision("highest")
    assert weights[0].dtype == torch.float64
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-15)


class _WarnsAndLogs(_LogsDefaultDtype):
    def training_step(self, batch, batch_idx):
        warnings.warn("a warning the main process silenced")
        logging.getLogger("tests.carried").info("rank %d step %d", self.global_rank, batch_idx)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_the_main_processs_warning_filters_and_logging_reach_the_workers(start_method, tmp_path, capfd):
    """What a script's main block set up before ``fit``: a spawned or fork-server worker printed the warning the main
    process silenced (once per rank), and Lightning's model summary and its "`Trainer.fit` stopped" under
    ``lightning.pytorch`` set to ERROR, and its INFO records never reached the file handler the main process added
    (the logger's level and handler were the fresh interpreter's). A forked worker inherits them; so do these now.
    The handler's file is opened with "w": the main process's record after the fit landed over the workers' lines
    (its own file offset); it appends now, as it does after forked workers (their offset is its)."""
    from lightning_shm import SHMDDPStrategy
    from tests.helpers import trainer

    path = tmp_path / "carried.log"
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    carried, lightning_log = logging.getLogger("tests.carried"), logging.getLogger("lightning.pytorch")
    levels = carried.level, lightning_log.level
    carried.addHandler(handler)
    carried.setLevel(logging.INFO)
    lightning_log.setLevel(logging.ERROR)
    try:
        carried.info("main before the fit")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="a warning the main process silenced")
            capfd.readouterr()
            t = trainer(strategy=SHMDDPStrategy(start_method=start_method), devices=2, max_epochs=1,
                        enable_model_summary=True)
            t.fit(_WarnsAndLogs(), torch.utils.data.DataLoader(_MadeWithoutDtype(), batch_size=8))
        carried.info("main after the fit")
    finally:
        carried.removeHandler(handler)
        handler.close()
        carried.setLevel(levels[0])
        lightning_log.setLevel(levels[1])
    printed = "".join(capfd.readouterr())
    assert "a warning the main process silenced" not in printed, printed
    assert "Trainable params" not in printed and "`Trainer.fit` stopped" not in printed, printed
    said = path.read_text().splitlines()
    steps = sorted(f"INFO tests.carried: rank {r} step {i}" for r in (0, 1) for i in (0, 1))
    assert said[0] == "INFO tests.carried: main before the fit" and said[-1] == "INFO tests.carried: main after the fit"
    assert sorted(said[1:-1]) == steps, said


_DEFINED_IN_THE_MAIN_BLOCK = textwrap.dedent(
    """
    import dataclasses
    import logging
    import sys
    import warnings
    import lightning.pytorch as pl
    import torch
    import lightning_shm
    from lightning.pytorch.demos.boring_classes import BoringModel

    @dataclasses.dataclass
    class Config:
        lr: float = 0.1

    class Warns(BoringModel):
        def __init__(self, config: Config = Config()):
            super().__init__()
            self.save_hyperparameters()

        def training_step(self, batch, batch_idx):
            warnings.warn("a filter that loads in the workers")
            logging.getLogger("script").warning("logged through the handler kept behind")
            return super().training_step(batch, batch_idx)

    def trainer(**kw):
        return pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=sys.argv[1], **kw)

    if __name__ == "__main__":
        class OnlyHere(UserWarning):
            pass

        class OwnFormat(logging.Formatter):
            pass

        warnings.filterwarnings("ignore", category=OnlyHere)
        warnings.filterwarnings("ignore", message="a filter that loads in the workers")
        logging.getLogger("script").disabled = True
        first = trainer(max_steps=1)  # one process: a checkpoint whose hyperparameters hold a __main__.Config
        first.fit(Warns())
        logging.getLogger("script").disabled = False
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(OwnFormat("main block's format: %(message)s"))
        logging.getLogger("script").addHandler(handler)
        torch.serialization.add_safe_globals([Config])
        last = first.checkpoint_callback.best_model_path
        trainer(strategy="shm_ddp", devices=2, max_steps=3).fit(Warns(), ckpt_path=last)
        print("trained")
    """
)


def test_what_only_the_main_block_defines_stays_behind_and_the_rest_reaches_the_workers(tmp_path):
    """A warning category and a formatter class the main block defines are pickled by reference to ``__main__``,
    which a fork-server or spawned worker runs without that block: carried with the job, they failed its
    unpickling and no worker would start. Each filter and each logger's handlers load on their own: those two
    stay behind (the logger keeps the worker's own handler: its record prints bare), the other filter reaches
    the workers. So does the script's class the main block made a safe global for ``torch.load``, by the name the
    checkpoint gives it (``__main__.Config``; the worker's copy is ``__mp_main__.Config``): before, the workers'
    resume failed with torch's "Weights only load failed", where one process and forked workers resumed."""
    script = tmp_path / "main_block.py"
    script.write_text(_DEFINED_IN_THE_MAIN_BLOCK)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "trained" in out.stdout, out.stderr[-3000:]
    assert "a filter that loads in the workers" not in out.stderr, out.stderr[-3000:]
    assert "logged through the handler kept behind" in out.stderr, out.stderr[-3000:]
    assert "main block's format" not in out.stderr, out.stderr[-3000:]


def test_carried_warning_filters_keep_their_order_and_what_each_matches():
    """The first filter that matches decides: the worker's list is the main process's, in its order. The
    interpreter's own filters name a module by a plain string, which matches only that module."""
    from lightning_shm.strategies.main_globals import capture_warning_filters, restore_warning_filters

    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filters.append(("default", None, DeprecationWarning, "__main__", 0))  # as the interpreter has it
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("error", message="Stop here", category=UserWarning, module="pkg\\.mod", lineno=3)
        main = list(warnings.filters)
        carried = capture_warning_filters()
        warnings.resetwarnings()
        restore_warning_filters(carried)
        worker = list(warnings.filters)
    assert [(a, c, n) for a, _, c, _, n in worker] == [(a, c, n) for a, _, c, _, n in main]
    assert worker[0][1].match("stop HERE, said the worker") and worker[0][3].match("pkg.mod")
    assert not worker[0][3].match("pkgXmod")
    plain = worker[2][3]
    assert plain.match("__main__") and not plain.match("__main__2") and not plain.match("_x_main__")
