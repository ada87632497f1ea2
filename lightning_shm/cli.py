"""``python -m lightning_shm`` / ``lightning-shm``: LightningCLI over the MNIST module and data.

Importing :mod:`lightning_shm` registers the strategy names, so ``--trainer.strategy shm_ddp`` and
class paths (``lightning_shm.SHMDDPStrategy``) both work. Examples::

    python -m lightning_shm fit --config scripts/configs/shm_ddp.yaml
    python -m lightning_shm fit --trainer.strategy shm_ddp --trainer.devices 2 --test_after_fit true
    python -m lightning_shm test --config scripts/configs/shm_ddp.yaml --ckpt_path path/to.ckpt
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_shm  # noqa: F401  (registers strategies)
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
            print(f"test accuracy: {acc:.4f} on {self.datamodule.describe_test_split()}")


def main(args: Optional[list[str]] = None) -> None:
    SHMCLI(MNISTClassifier, MNISTDataModule, trainer_defaults=TRAINER_DEFAULTS,
           save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
