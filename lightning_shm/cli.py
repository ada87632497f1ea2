"""``python -m lightning_shm`` / ``lightning-shm``: LightningCLI over the MNIST module and data.

Importing :mod:`lightning_shm` registers the strategy names. A strategy is chosen by

* its registered name: ``--trainer.strategy shm_ddp`` (or ``shm_fsdp``, ``shm_tp``, ``shm_pipeline``,
  ``shm_model_parallel``, each also ``_fork``);
* its class, with arguments: ``--trainer.strategy.class_path lightning_shm.SHMPipeline
  --trainer.strategy.init_args.pipeline_parallel_size 2``, or in a config file (``class_path`` /
  ``init_args`` under ``trainer.strategy``, as in ``scripts/configs/``). A bare class path *followed by*
  an argument also works (``--trainer.strategy lightning_shm.SHMDDPStrategy
  --trainer.strategy.start_method fork``); a bare class path alone does not: the argument is then
  read as a strategy name, and Lightning has no strategy of that name.

Examples::

    python -m lightning_shm fit --config scripts/configs/shm_ddp.yaml
    python -m lightning_shm fit --trainer.strategy shm_ddp --trainer.devices 2 --test_after_fit true
    python -m lightning_shm test --config scripts/configs/shm_ddp.yaml --ckpt_path path/to.ckpt
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_shm  # noqa: F401  (the strategy names: registered as Lightning is imported)
from datamodules import MNISTDataModule
from lightning_shm.models import MNISTClassifier

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "max_epochs": 10,
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "."}},
}


class SHMCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--test_after_fit", type=bool, default=False,
                            help="after `fit`, evaluate the trained model on the test split and print its accuracy")

    def after_fit(self) -> None:
        if not self.config[self.subcommand].get("test_after_fit"):
            return
        results = self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
        if results and self.trainer.is_global_zero:
            acc = results[0].get("test_acc")
            limit = self.trainer.limit_test_batches
            part = "" if limit == 1.0 else f" (limit_test_batches={limit}: part of it)"
            print(f"test accuracy: {acc:.4f} on {self.datamodule.describe_test_split()}{part}")


def main(args: Optional[list[str]] = None) -> None:
    SHMCLI(MNISTClassifier, MNISTDataModule, trainer_defaults=TRAINER_DEFAULTS,
           save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
