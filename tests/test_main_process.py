"""The main process's Trainer after the workers ran: the trained one, as in one process.

Every strategy runs its steps in worker processes; the Trainer the user holds in the main process
must still end up with the real global step, loop progress, optimizer / scheduler / callback
states (consolidated for sharded strategies), so that ``trainer.save_checkpoint`` there writes what
a single process writes, and ``test(ckpt_path="best")`` finds the best checkpoint.
"""

from __future__ import annotations

import collections
import csv
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
)
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader

from lightning_shm import SHMDDPStrategy, SHMPipeline, SHMTensorParallel
from lightning_shm.models import MNISTClassifier
from lightning_shm.runtime import SharedMemoryFullError
from tests.helpers import (
    GLOBAL_BATCH,
    LAYOUTS,
    SEED,
    SchedClassifier,
    fit_seeded,
    loader,
    mnist_like,
    reference_loader,
    trainer,
)


def _fit_then_save(strategy: Any, devices: int, batch: int, ckpt_dir, path, ref: bool = False):
    pl.seed_everything(SEED)
    model = SchedClassifier(optimizer="sgd", lr=0.1)
    ds = mnist_like(GLOBAL_BATCH * 3, seed=1)
    dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
    cb = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2)
    t = trainer(strategy=strategy, devices=devices, max_epochs=2, enable_checkpointing=True, callbacks=[cb])
    t.fit(model, dl, DataLoader(ds, batch_size=batch))  # per replica, as for training: same batch counts
    t.save_checkpoint(path)
    return t, torch.load(path, weights_only=False)


def _assert_same(got: Any, want: Any, where: str = "checkpoint") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(map(str, set(got) ^ set(want)))} differ"
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=where)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-5), where
    else:
        assert got == want, where


STRATEGIES = [
    ("shm_ddp_fork", 2, GLOBAL_BATCH // 2),
    ("shm_fsdp_fork", 2, GLOBAL_BATCH // 2),  # optimizer state consolidated from shards
    (SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, GLOBAL_BATCH),
    (SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4), 2, GLOBAL_BATCH),
]


@pytest.mark.parametrize("strategy, devices, batch", STRATEGIES, ids=["ddp", "fsdp", "tp", "pipeline"])
def test_main_process_trainer_is_the_trained_one(tmp_path, strategy, devices, batch):
    one, want = _fit_then_save("auto", 1, GLOBAL_BATCH, tmp_path / "one", tmp_path / "one.ckpt", ref=True)
    ours, got = _fit_then_save(strategy, devices, batch, tmp_path / "ours", tmp_path / "ours.ckpt")
    assert ours.global_step == one.global_step == 6 and ours.current_epoch == one.current_epoch == 2
    assert got["optimizer_states"][0]["state"], "no optimizer state in the main process's checkpoint"
    # the checkpoint callbacks wrote into their own folders: compare their states up to that
    for ckpt in (got, want):
        for state in ckpt["callbacks"].values():
            if "dirpath" in state:
                state["dirpath"] = "<dir>"
            for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
                if isinstance(state.get(key), str):
                    state[key] = state[key].rsplit("/", 1)[-1]
            if "best_k_models" in state:
                state["best_k_models"] = {k.rsplit("/", 1)[-1]: v for k, v in state["best_k_models"].items()}
    _assert_same(got, want)
    # and the main process's Trainer uses them as one process would
    best, one_best = ours.checkpoint_callback.best_model_path, one.checkpoint_callback.best_model_path
    assert best.startswith(str(tmp_path / "ours")) and best.rsplit("/", 1)[-1] == one_best.rsplit("/", 1)[-1]
    res = ours.test(ckpt_path="best", dataloaders=DataLoader(mnist_like(48, seed=3), batch_size=12), verbose=False)
    ref = one.test(ckpt_path="best", dataloaders=DataLoader(mnist_like(48, seed=3), batch_size=12), verbose=False)
    assert res[0]["test_loss"] == pytest.approx(ref[0]["test_loss"], abs=1e-5)


def _fit_twice(strategy: Any, devices: int, batch: int, ckpt_dir, ref: bool = False):
    """One epoch, then ``max_epochs`` raised and ``fit`` again on the same Trainer (a notebook's "train more")."""
    pl.seed_everything(SEED)
    model = SchedClassifier(optimizer="adam", lr=0.01)
    ds = mnist_like(GLOBAL_BATCH * 3, seed=1)
    dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
    cb = ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2)
    t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true", enable_checkpointing=True,
                callbacks=[cb])
    t.fit(model, dl, DataLoader(ds, batch_size=batch))
    t.fit_loop.max_epochs = 3
    t.fit(model, dl, DataLoader(ds, batch_size=batch))
    return t, torch.cat([p.detach().flatten() for p in model.parameters()]), sorted(
        Path(p).name for p in cb.best_k_models)


@pytest.mark.parametrize("strategy, devices, batch", [
    ("shm_ddp", 2, GLOBAL_BATCH // 2), ("shm_fsdp_fork", 2, GLOBAL_BATCH // 2),
    (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2, GLOBAL_BATCH),
    (lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=4), 2, GLOBAL_BATCH),
], ids=["ddp-forkserver", "fsdp", "tp", "pipeline"])
def test_a_second_fit_on_the_same_trainer_goes_on_as_in_one_process(tmp_path, strategy, devices, batch):
    """The second fit starts where the main process's Trainer stands after the first -- the workers' loops,
    weights and callback states, handed back -- and trains the epochs left, with a fresh optimizer from
    configure_optimizers, as one process does. Until 2026-12-07 it was refused ("the main process does not hold
    the loop state"), as Lightning's ddp_spawn refuses it."""
    one, want, want_best = _fit_twice("auto", 1, GLOBAL_BATCH, tmp_path / "one", ref=True)
    ours, got, got_best = _fit_twice(strategy if isinstance(strategy, str) else strategy(), devices, batch,
                                     tmp_path / "ours")
    assert ours.global_step == one.global_step == 9 and ours.current_epoch == one.current_epoch == 3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert got_best == want_best == ["epoch=1-step=6.ckpt", "epoch=2-step=9.ckpt"]


def test_too_small_dev_shm_fails_before_any_worker_starts(monkeypatch):
    """The whole run's need is estimated in the main process and named, with its parts."""
    import lightning_shm.runtime.segment as segment

    monkeypatch.setattr(segment, "shm_free_bytes", lambda: 1 << 20)
    started = []
    monkeypatch.setattr("lightning_shm.runtime.launcher.Launcher.run", lambda *a, **k: started.append(1))
    model = SchedClassifier(hidden_sizes=[1024, 1024])  # ~1.9M parameters: ~15 MiB of gradient buckets at W=2
    with pytest.raises(SharedMemoryFullError, match=r"this run \(SHMDDPStrategy, 2 processes\) needs (\d+\.\d) MiB "
                                                    r".* 1\.0 MiB free \(.*gradient buckets 14\.\d MiB") as info:
        trainer(strategy="shm_ddp", devices=2, max_epochs=1).fit(model, loader(mnist_like(8), 4))
    assert started == []
    assert "--shm-size" in str(info.value)


class _OneCycleClassifier(SchedClassifier):
    """Sizes its schedule from the data, as Lightning's docs show: ``configure_optimizers`` reads
    ``trainer.estimated_stepping_batches``, which loads the training dataloader."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        steps = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _SetUpDataModule(pl.LightningDataModule):
    """Builds its dataset in ``setup``, as most datamodules do: its loaders exist only after it."""

    def __init__(self) -> None:
        super().__init__()
        self.train_set = None

    def setup(self, stage: str) -> None:
        self.train_set = mnist_like(GLOBAL_BATCH * 3, seed=1)

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            raise RuntimeError("call setup() before requesting dataloaders")
        return loader(self.train_set, GLOBAL_BATCH // 2)


@pytest.mark.parametrize("data", ["dataloaders", "datamodule"])
def test_main_process_rebuilds_a_schedule_sized_from_the_data(data, caplog):
    """``fit`` ran in the workers only, so the main process had no data attached and could not run such a
    ``configure_optimizers`` (it warned and kept no optimizer): it gets fit's data as the workers did."""
    pl.seed_everything(SEED)
    model = _OneCycleClassifier(optimizer="sgd")
    t = trainer(strategy="shm_ddp_fork", devices=2, max_epochs=2)
    with caplog.at_level("WARNING"):
        if data == "dataloaders":
            t.fit(model, loader(mnist_like(GLOBAL_BATCH * 3, seed=1), GLOBAL_BATCH // 2))
        else:
            t.fit(model, datamodule=_SetUpDataModule())
    assert "could not rebuild" not in caplog.text
    assert len(t.optimizers) == 1 and len(t.lr_scheduler_configs) == 1
    sched = t.lr_scheduler_configs[0].scheduler
    assert sched.total_steps == 6 and sched.last_epoch == t.global_step == 6  # 3 steps per epoch per rank, 2 epochs
    assert t.optimizers[0].state, "the rebuilt optimizer holds no state"


class _FindsItsRate(MNISTClassifier):
    """Its training data as a hook (the Tuner needs ``train_dataloader``), per data-parallel rank or, ``ref``, one
    process's order of the same global batches."""

    def __init__(self, batch: int, ref: bool = False, **kw):
        super().__init__(**kw)
        self.batch, self.ref = batch, ref

    def train_dataloader(self):
        ds = mnist_like(GLOBAL_BATCH * 24, seed=1)
        return reference_loader(ds, self.batch, SEED) if self.ref else loader(ds, self.batch)


def _lr_find(strategy: Any, devices: int, batch: int, ref: bool = False):
    pl.seed_everything(SEED)
    model = _FindsItsRate(batch, ref, optimizer="adam", lr=0.01)
    t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true")
    finder = Tuner(t).lr_find(model, num_training=20)
    return finder, model, t


@pytest.mark.parametrize("layout", ["ddp", "tp2", "pp2-1f1b"])
def test_tuner_lr_find_reports_and_sets_the_rate_it_found(layout):
    """It ran in the workers and came back empty (None, the module's rate unchanged); now as in one process. With
    tp / pp every rank sees the global batch: one process's loss curve; with dp > 1 rank 0's, as Lightning's ddp."""
    one, one_model, _ = _lr_find("auto", 1, GLOBAL_BATCH, ref=True)
    strategy, devices, dp = LAYOUTS[layout]
    finder, model, t = _lr_find(strategy(), devices, GLOBAL_BATCH // dp)
    assert finder is not None and len(finder.results["loss"]) == 20
    assert model.hparams.lr == finder.suggestion() != 0.01  # the module's rate is the one found
    assert t.global_step == 0 and t.state.finished  # the weights and loops as before, as the finder restores them
    if dp == 1:
        torch.testing.assert_close(torch.tensor(finder.results["loss"]), torch.tensor(one.results["loss"]),
                                   rtol=0, atol=1e-12)
        assert finder.suggestion() == one.suggestion() == one_model.hparams.lr


def test_learning_rate_finder_callback_result_comes_back():
    """The callback finds the rate and training goes on with it: the main process's callback holds the result and
    its module the rate, as in one process."""
    strategy, devices, dp = LAYOUTS["ddp"]
    pl.seed_everything(SEED)
    model = _FindsItsRate(GLOBAL_BATCH // dp, optimizer="adam", lr=0.01)
    finder = LearningRateFinder(num_training_steps=20)
    trainer(strategy=strategy(), devices=devices, max_epochs=1, callbacks=[finder]).fit(model)
    assert finder.optimal_lr is not None and model.hparams.lr == finder.optimal_lr.suggestion() != 0.01


def test_the_main_process_logger_points_where_rank_0_wrote(tmp_path):
    """The main process's CSVLogger named its version only after the workers ran: ``log_dir`` said version_1 while
    rank 0 had written version_0 (and version_2 for the next run's version_1)."""
    strategy, devices, dp = LAYOUTS["ddp"]
    dirs = []
    for _ in range(2):
        t = pl.Trainer(logger=CSVLogger(tmp_path, name="exp"), strategy=strategy(), devices=devices,
                       accelerator="cpu", max_epochs=1, log_every_n_steps=1, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False)
        t.fit(MNISTClassifier(optimizer="adam"), loader(mnist_like(GLOBAL_BATCH * 2, seed=1), GLOBAL_BATCH // dp))
        dirs.append(t.logger.log_dir)
    assert dirs == [str(tmp_path / "exp" / f"version_{i}") for i in range(2)]
    for d in dirs:
        assert "train_loss" in (Path(d) / "metrics.csv").read_text()


def _csv_rows_of_runs(strategy: Any, devices: int, batch: int, save_dir: Path) -> list[tuple[str, str, list[str]]]:
    """fit, test, fit again on one Trainer, then a row logged by the main process: each row's epoch, step and the
    metrics it holds."""
    pl.seed_everything(SEED)
    t = pl.Trainer(logger=CSVLogger(save_dir, name="exp"), strategy=strategy, devices=devices, accelerator="cpu",
                   max_epochs=1, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False)
    model, ds = MNISTClassifier(optimizer="adam"), mnist_like(GLOBAL_BATCH * 2, seed=1)
    t.fit(model, loader(ds, batch))
    t.test(model, loader(ds, batch, shuffle=False), verbose=False)
    t.fit_loop.max_epochs = 2
    t.fit(model, loader(ds, batch))
    t.logger.log_metrics({"after": 1.0}, step=99)  # the main process's first use of the logger's writer
    t.logger.save()
    with open(Path(t.logger.log_dir) / "metrics.csv", newline="") as f:
        return [(r["epoch"], r["step"], sorted(k for k, v in r.items() if v)) for r in csv.DictReader(f)]


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_csv_log_keeps_every_run_of_the_trainer_as_in_one_process(tmp_path, start):
    """One process's CSV logger makes its writer once and appends each run's rows to one metrics.csv. Until
    2026-12-07 each run's rank 0 made a writer anew, which deletes the file first: a test after fit (the CLI's
    test_after_fit) left only the test's row, a second fit only its own, and so did the main process's first
    use of the logger after the run."""
    one = _csv_rows_of_runs("auto", 1, GLOBAL_BATCH, tmp_path / "one")
    ours = _csv_rows_of_runs(SHMDDPStrategy(start_method=start), 2, GLOBAL_BATCH // 2, tmp_path / "ours")
    assert len(ours) == 6 and ours == one  # 2 training steps, the test, 2 more steps, the main process's row


def test_the_main_process_trainer_holds_each_run_s_logged_and_progress_bar_metrics():
    """They were empty after fit (only callback_metrics came back, as from Lightning's ddp_spawn), and a second
    run's callback_metrics kept the first run's keys; one process starts each run's afresh."""
    def runs(strategy, devices, batch, ref=False):
        pl.seed_everything(SEED)
        t = trainer(strategy=strategy, devices=devices, max_epochs=1, precision="64-true")
        ds = mnist_like(GLOBAL_BATCH * 2, seed=1)
        dl = reference_loader(ds, batch, SEED) if ref else loader(ds, batch)
        model = MNISTClassifier(optimizer="adam")
        t.fit(model, dl, dl)
        out = [{a: {k: float(v) for k, v in getattr(t, a).items()} for a in ("callback_metrics", "logged_metrics",
                                                                            "progress_bar_metrics")}]
        t.validate(model, dl, verbose=False)
        return out + [{"callback_metrics": dict(t.callback_metrics), "logged_metrics": dict(t.logged_metrics)}]

    strategy, devices, dp = LAYOUTS["pp2-1f1b"]
    one_fit, one_val = runs("auto", 1, GLOBAL_BATCH, ref=True)
    fit, val = runs(strategy(), devices, GLOBAL_BATCH // dp)
    assert set(one_fit["logged_metrics"]) == {"train_loss", "val_loss", "val_acc"}
    for name in one_fit:
        assert fit[name] == pytest.approx(one_fit[name], rel=1e-12), name
    assert set(val["callback_metrics"]) == set(val["logged_metrics"]) == set(one_val["logged_metrics"]) == {
        "val_loss", "val_acc"}


class _History(Callback):
    """A callback without state_dict gathering what it sees in public attributes."""

    def __init__(self):
        self.val_losses, self.epochs, self.by_epoch = [], 0, {}
        self.per_epoch = collections.defaultdict(lambda: 0)  # cannot be pickled: stays in the workers

    def on_validation_epoch_end(self, trainer, pl_module):
        self.val_losses.append(trainer.callback_metrics["val_loss"].clone())
        self.by_epoch[trainer.current_epoch] = float(trainer.callback_metrics["val_loss"])

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs += 1
        self.per_epoch[trainer.current_epoch] += 1


class _KeepsHistory(SchedClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.val_history, self.best_val = [], None

    def on_validation_epoch_end(self):
        v = float(self.trainer.callback_metrics["val_loss"])
        self.val_history.append(v)
        self.best_val = v if self.best_val is None else min(v, self.best_val)


@pytest.mark.parametrize("layout", ["ddp", "pp2-1f1b"])
def test_what_the_module_and_callbacks_gathered_comes_back_to_the_main_process(layout):
    """It stayed in the workers: after fit the main process's module and callbacks held what they held before the
    run (empty histories) -- as after Lightning's ddp_spawn, unlike one process. LearningRateMonitor's ``lrs`` too."""
    def run(strategy, devices, batch, ref=False):
        history, lrs = _History(), LearningRateMonitor()
        _, model = fit_seeded(lambda: _KeepsHistory(optimizer="adam", lr=0.01), strategy, devices, batch, ref=ref,
                              validate=True, max_epochs=3, callbacks=[history, lrs],
                              logger=CSVLogger(tempfile.mkdtemp()))
        return history, lrs.lrs, model

    one, one_lrs, one_model = run("auto", 1, GLOBAL_BATCH, ref=True)
    strategy, devices, dp = LAYOUTS[layout]
    got, got_lrs, model = run(strategy(), devices, GLOBAL_BATCH // dp)
    assert len(model.val_history) == 3 and model.val_history == pytest.approx(one_model.val_history, rel=1e-12)
    assert model.best_val == pytest.approx(one_model.best_val, rel=1e-12)
    assert got.epochs == one.epochs == 3 and len(got.val_losses) == 3
    assert len(one.per_epoch) == 3 and len(got.per_epoch) == 0  # left as it was, without failing the run
    torch.testing.assert_close(torch.stack(got.val_losses), torch.stack(one.val_losses), rtol=1e-12, atol=0)
    assert got.by_epoch == pytest.approx(one.by_epoch, rel=1e-12)
    assert got_lrs == one_lrs == {"lr-Adam": [0.01, 0.01, 0.005]}  # StepLR(step_size=2, gamma=0.5), per epoch


class _UsersLogger(Logger):
    """What any logger of the user's writes besides its own calls: a name, a version, rank-0-only hyperparameters."""

    name, version = "users", 0

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _fit_and_test(logger: Any, strategy: Any, devices: int, batch: int, ref: bool = False,
                  after_fit: Any = lambda: None) -> Any:
    """fit (2 epochs, validated) and then test on one Trainer logging into ``logger``; returns ``after_fit()``,
    called between the two."""
    t, model = fit_seeded(lambda: MNISTClassifier(optimizer="adam", lr=0.01), strategy, devices, batch, ref=ref,
                          validate=True, max_epochs=2, logger=logger, log_every_n_steps=1)
    seen = after_fit()
    ds = mnist_like(GLOBAL_BATCH, seed=2)
    t.test(model, reference_loader(ds, batch, SEED) if ref else loader(ds, batch), verbose=False)
    return seen


class _InMemoryLogger(_UsersLogger):
    """A logger keeping what it is given in lists (a notebook's, or a test's): only rank 0 logs."""

    def __init__(self):
        super().__init__()
        self.rows, self.hyperparameters, self.statuses = [], [], []

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs):
        self.hyperparameters.append(dict(params))

    @rank_zero_only
    def log_metrics(self, metrics, step=None):
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    @rank_zero_only
    def finalize(self, status):
        self.statuses.append(status)


@pytest.mark.parametrize("layout", ["ddp", "pp2-1f1b"])
def test_an_in_memory_logger_holds_every_run_s_rows_as_in_one_process(layout):
    """Rank 0 logged into its copy of the logger: the main process's held nothing after fit -- no rows, no
    hyperparameters, no final status -- where one process's holds them (Lightning's ddp too: its rank 0 is the
    main process). A test after the fit appends to the same lists."""
    one, got = _InMemoryLogger(), _InMemoryLogger()
    _fit_and_test([CSVLogger(tempfile.mkdtemp()), one], "auto", 1, GLOBAL_BATCH, ref=True)
    strategy, devices, dp = LAYOUTS[layout]
    _fit_and_test([CSVLogger(tempfile.mkdtemp()), got], strategy(), devices, GLOBAL_BATCH // dp)
    kinds = [(step, sorted(k for k in row if k != "epoch")) for step, row in one.rows]
    assert kinds == [(0, ["train_loss"]), (1, ["train_loss"]), (1, ["val_acc", "val_loss"]), (2, ["train_loss"]),
                     (3, ["train_loss"]), (3, ["val_acc", "val_loss"]), (4, ["test_acc", "test_loss"])]
    assert [(step, set(row)) for step, row in got.rows] == [(step, set(row)) for step, row in one.rows]
    for (_, row), (_, want) in zip(got.rows, one.rows):
        assert row == pytest.approx(want, rel=1e-12)
    assert got.hyperparameters == one.hyperparameters and len(one.hyperparameters) == 2  # fit's, test's
    assert got.statuses == one.statuses == ["success", "success"]


class _RunLogger(_UsersLogger):
    """Makes its run on first use, as MLflow's logger does: a file under ``root`` named by a fresh id it keeps in a
    private attribute."""

    def __init__(self, root):
        super().__init__()
        self._root, self._run_id = root, None

    @property
    @rank_zero_experiment
    def experiment(self):
        if self._run_id is None:
            self._run_id = uuid.uuid4().hex
        return os.path.join(self._root, self._run_id)

    @property
    def run_id(self):
        self.experiment
        return self._run_id

    @rank_zero_only
    def log_metrics(self, metrics, step=None):
        with open(self.experiment, "a") as f:
            f.write(f"{step} {sorted(metrics)}\n")


def _one_run_s_lines(root: Path, make_logger: Any, *fit_args: Any, **fit_kw: Any) -> list[str]:
    """fit and test logging into ``make_logger(root)``: every line went into one run (the logger's ``run_id`` after
    the fit and after the test); its lines."""
    root.mkdir()
    logger = make_logger(root)
    after_fit = _fit_and_test(logger, *fit_args, after_fit=lambda: logger.run_id, **fit_kw)
    assert os.listdir(root) == [after_fit] == [logger.run_id]
    return (root / after_fit).read_text().splitlines()


@pytest.mark.parametrize("layout", ["ddp", "pp2-1f1b"])
def test_a_logger_that_makes_its_run_on_first_use_keeps_one_run_as_in_one_process(tmp_path, layout):
    """Rank 0 made the run: the main process's logger made a second one when read after fit (``logger.run_id``,
    to log an artifact there), and the test after the fit logged into a third -- MLflow's logger did the same."""
    one = _one_run_s_lines(tmp_path / "one", _RunLogger, "auto", 1, GLOBAL_BATCH, ref=True)
    strategy, devices, dp = LAYOUTS[layout]
    assert _one_run_s_lines(tmp_path / "got", _RunLogger, strategy(), devices, GLOBAL_BATCH // dp) == one
    assert len(one) == 7 and one[-1] == "4 ['epoch', 'test_acc', 'test_loss']"


class _Run:
    """A run handle that does not come back as plain data and serves only the process that made it (W&B's ``Run``,
    whose connection a forked copy must not share): lines appended to a file named by its id."""

    def __init__(self, root, run_id=None):
        self.id = run_id or uuid.uuid4().hex
        self.path, self.pid = os.path.join(root, self.id), os.getpid()

    def log(self, line):
        assert os.getpid() == self.pid, "a run handle used by a process that did not make it"
        with open(self.path, "a") as f:
            f.write(line + "\n")


class _RunMadeWhenPickled(_UsersLogger):
    """W&B's way across processes: pickled for a spawned worker, it makes its run in the pickling process and hands
    over the id, which the worker's copy attaches to."""

    def __init__(self, root):
        super().__init__()
        self._root, self._run = root, None

    @property
    @rank_zero_experiment
    def experiment(self):
        if self._run is None:
            self._run = _Run(self._root, getattr(self, "_attach_id", None))
        return self._run

    @property
    def run_id(self):
        return self.experiment.id

    def __getstate__(self):
        return dict(self.__dict__, _attach_id=self.experiment.id, _run=None)

    @rank_zero_only
    def log_metrics(self, metrics, step=None):
        self.experiment.log(f"{step} {sorted(metrics)}")


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_logger_that_makes_its_run_when_pickled_keeps_one_run_as_in_one_process(tmp_path, start):
    """Under fork the workers copied the logger without pickling it: rank 0 made a run of its own, the main process
    another when the script read ``logger.experiment`` after fit, the test after the fit a third (W&B's logger did
    the same, as under Lightning's ddp_fork). Now fork-started workers get it as pickling carries it."""
    one = _one_run_s_lines(tmp_path / "one", _RunMadeWhenPickled, "auto", 1, GLOBAL_BATCH, ref=True)
    assert len(one) == 7 and one[-1] == "4 ['epoch', 'test_acc', 'test_loss']"
    got = _one_run_s_lines(tmp_path / "got", _RunMadeWhenPickled, SHMDDPStrategy(start_method=start), 2,
                           GLOBAL_BATCH // 2)
    assert got == one


@pytest.mark.parametrize("layout", ["ddp", "pp2-1f1b"])
def test_the_main_process_trainer_holds_the_loops_batch_counts_and_checkpoint_path_as_in_one_process(tmp_path,
                                                                                                    layout):
    """The main process sets up no loop: after fit it said ``num_training_batches`` inf, ``num_val_batches`` [] and
    ``val_check_batch`` None where one process says 3, [2] and 3; so for test, validate and predict. And
    ``trainer.ckpt_path`` after ``test(ckpt_path="best")`` was None, not the checkpoint tested."""
    def seen(root, strategy, devices, batch, ref=False):
        pl.seed_everything(SEED)
        model = MNISTClassifier(optimizer="adam")
        ds, held_out = mnist_like(GLOBAL_BATCH * 3, seed=1), mnist_like(GLOBAL_BATCH * 2, seed=2)
        t = trainer(strategy=strategy, devices=devices, max_epochs=1, num_sanity_val_steps=1, enable_checkpointing=True,
                    callbacks=[ModelCheckpoint(dirpath=root, monitor="val_loss")])
        t.fit(model, reference_loader(ds, batch, SEED) if ref else loader(ds, batch), loader(held_out, batch, False))
        out = [t.num_training_batches, t.num_val_batches, t.num_sanity_val_batches, t.val_check_batch, t.ckpt_path]
        t.test(model, loader(held_out, batch, False), ckpt_path="best", verbose=False)
        out += [t.num_test_batches, os.path.relpath(t.ckpt_path, root)]
        t.validate(model, loader(held_out, batch, False), verbose=False)
        out += [t.num_val_batches]
        t.predict(model, loader(held_out, batch, False))
        return out + [t.num_predict_batches, t.num_training_batches]

    one = seen(tmp_path / "one", "auto", 1, GLOBAL_BATCH, ref=True)
    assert one == [3, [2], [1], 3, None, [2], "epoch=0-step=3.ckpt", [2], [2], 3]
    strategy, devices, dp = LAYOUTS[layout]
    assert seen(tmp_path / "got", strategy(), devices, GLOBAL_BATCH // dp) == one


class _DerivesInSetup(pl.LightningDataModule):
    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch

    def setup(self, stage: str):
        self.ds = mnist_like(GLOBAL_BATCH * 2, seed=1)
        self.num_samples, self.stages = len(self.ds), getattr(self, "stages", []) + [stage]

    def train_dataloader(self):
        return loader(self.ds, self.batch)


def test_what_the_datamodule_setup_derived_comes_back_to_the_main_process():
    """A count derived in ``setup`` stayed in the workers; the dataset itself still does (no setup here)."""
    strategy, devices, dp = LAYOUTS["ddp"]
    dm = _DerivesInSetup(GLOBAL_BATCH // dp)
    trainer(strategy=strategy(), devices=devices, max_epochs=1).fit(MNISTClassifier(optimizer="adam"), datamodule=dm)
    assert (dm.num_samples, dm.stages) == (GLOBAL_BATCH * 2, ["fit"]) and not hasattr(dm, "ds")


@pytest.mark.parametrize("layout", ["ddp", "pp2-1f1b"])
def test_the_main_process_trainer_says_the_run_was_stopped(layout):
    """EarlyStopping ended the run: one process's ``trainer.should_stop`` stays True (a script asking whether the
    run stopped early reads it); the main process's said False."""
    make, devices, dp = LAYOUTS[layout]

    def fit(strategy, devices, batch, ref=False):
        stop = EarlyStopping("val_loss", patience=0, min_delta=10.0)
        return fit_seeded(MNISTClassifier, strategy, devices, batch, ref=ref, validate=True, max_epochs=5,
                          callbacks=[stop])[0]

    one, ours = fit("auto", 1, GLOBAL_BATCH, ref=True), fit(make(), devices, GLOBAL_BATCH // dp)
    assert one.should_stop and ours.should_stop and ours.current_epoch == one.current_epoch == 2
