"""The CLI: python -m lightning_shm, configs under scripts/configs, strategy names and class paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from datamodules import MNISTDataModule
from lightning_shm import SHMDDPStrategy, SHMFSDPStrategy, SHMPipeline, SHMTensorParallel
from lightning_shm.cli import SHMCLI, TRAINER_DEFAULTS, main
from lightning_shm.models import MNISTClassifier

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "scripts" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_parses(config, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(config), "--print_config"])
    assert info.value.code == 0
    assert "strategy" in capsys.readouterr().out


MODELS = sorted((ROOT / "scripts" / "configs" / "models").glob("*.yaml"))


@pytest.mark.parametrize("model", MODELS, ids=[m.stem for m in MODELS])
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_model_trains_under_every_strategy_config(config, model, tmp_path, mnist_dir):
    """Each strategy config combined with each model config (plans, stage cuts, microbatches all checked by
    a real fit). Forked workers instead of the configs' spawn: the combination, not start-up, is under test."""
    strategy = yaml.safe_load(config.read_text())["trainer"].get("strategy")
    fork = ([] if strategy is None else ["--trainer.strategy", f"{strategy}_fork"] if isinstance(strategy, str)
            else ["--trainer.strategy.init_args.start_method", "fork"])
    main(["fit", "--config", str(config), "--config", str(model), *fork, "--trainer.max_epochs", "1",
          "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
          "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
          "--trainer.enable_model_summary", "false", "--test_after_fit", "false", "--data.data_dir", str(mnist_dir),
          "--trainer.default_root_dir", str(tmp_path)])


@pytest.mark.parametrize("args, cls, check", [
    (["--trainer.strategy", "shm_fsdp", "--trainer.devices", "4"], SHMFSDPStrategy, lambda s: s.num_processes == 4),
    (["--trainer.strategy.class_path", "lightning_shm.SHMPipeline", "--trainer.strategy.init_args.microbatches", "2",
      "--trainer.devices", "2"], SHMPipeline, lambda s: s.microbatches == 2),
    (["--trainer.strategy", "lightning_shm.SHMDDPStrategy", "--trainer.strategy.start_method", "fork",
      "--trainer.devices", "2"], SHMDDPStrategy, lambda s: s._start_method == "fork"),
    (["--config", str(ROOT / "scripts" / "configs" / "shm_tp.yaml")], SHMTensorParallel,
     lambda s: s.tensor_parallel_size == 2),
], ids=["name", "class_path+init_args", "class+argument", "config"])
def test_the_strategy_forms_the_docs_show(args, cls, check):
    cli = SHMCLI(MNISTClassifier, MNISTDataModule, trainer_defaults=TRAINER_DEFAULTS, run=False, args=args)
    assert isinstance(cli.trainer.strategy, cls) and check(cli.trainer.strategy)


def test_fit_with_strategy_class_path_and_test_after_fit(tmp_path, mnist_dir):
    args = ["fit", "--trainer.strategy", "lightning_shm.SHMDDPStrategy", "--trainer.strategy.start_method", "fork",
            "--trainer.devices", "2", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "10",
            "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--data.data_dir", str(mnist_dir), "--test_after_fit", "true", "--trainer.limit_test_batches", "5"]
    out = subprocess.run([sys.executable, "-m", "lightning_shm", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "test accuracy:" in out.stdout and "official MNIST test split" in out.stdout
    assert "(limit_test_batches=5: part of it)" in out.stdout  # not the whole split its name describes
    metrics = list(tmp_path.rglob("metrics.csv"))
    assert metrics, "the CSV logger wrote no metrics"
    png = tmp_path / "curves.png"
    plot = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(metrics[0]), "-o", str(png)], cwd=ROOT,
                          capture_output=True, text=True)
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert png.stat().st_size > 1000
