"""One node's share of the multi-node tests (run by scripts/launch_nodes.py; see tests/test_nodes.py).

    python tests/nodes_job.py <strategy>[,<strategy>...] <out dir> <mode>

Each node trains the MNIST module on synthetic data with 2 devices and ``num_nodes=2``, then writes
what the test compares into ``<out dir>``: its final weights, the metrics it logged, the
checkpoints the run wrote. ``mode`` "fail" makes global rank 3 (node 1) raise mid-epoch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchmetrics import SumMetric

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_shm  # noqa: E402
from lightning_shm import SHMFSDPStrategy, SHMPipeline, SHMTensorParallel  # noqa: E402
from lightning_shm.models import MNISTClassifier  # noqa: E402
from tests.helpers import GLOBAL_BATCH, SEED, flat_params, loader, mnist_like  # noqa: E402

STRATEGIES = {
    "ddp": (lambda: "shm_ddp_fork", 4),  # (strategy, data-parallel replicas over both nodes)
    "fsdp": (lambda: SHMFSDPStrategy(start_method="fork"), 4),  # HSDP: shards in a node, replicas across
    "tp": (lambda: SHMTensorParallel(start_method="fork", tensor_parallel_size=2), 2),
    "pipeline": (lambda: SHMPipeline(start_method="fork", pipeline_parallel_size=2, microbatches=2), 2),
}


class Counted(MNISTClassifier):
    """Logs a SumMetric of rank + 1 per step and the data-parallel mean of the rank, and can fail on rank 3."""

    def __init__(self, fail: bool = False, **kw):
        super().__init__(**kw)
        self.fail = fail
        self.counter = SumMetric()

    def training_step(self, batch, batch_idx):
        if self.fail and self.global_rank == 3 and batch_idx == 2:
            raise ValueError("rank 3 on node 1 failed on purpose")
        loss = super().training_step(batch, batch_idx)
        self.counter.update(self.global_rank + 1)
        self.log("rank_sum", self.counter, on_step=False, on_epoch=True)
        self.log("rank_mean", float(self.global_rank), sync_dist=True, on_step=False, on_epoch=True)
        return loss

    def on_before_optimizer_step(self, optimizer):  # over both nodes' pieces: one process's norm
        self.log("grad_norm", lightning_shm.grad_norm(self, 2)["grad_2.0_norm_total"])


def main() -> None:
    """One fit per strategy named (comma-separated), one after the other in this node's process, each writing
    into ``<out dir>/<name>`` (a fresh interpreter per fit would import torch and lightning again)."""
    names, out, mode = sys.argv[1].split(","), Path(sys.argv[2]), sys.argv[3]
    for name in names:
        fit(name, out / name if len(names) > 1 else out, mode)


def fit(name: str, out: Path, mode: str) -> None:
    make, replicas = STRATEGIES[name]
    node = int(os.environ["NODE_RANK"])
    pl.seed_everything(SEED)
    model = Counted(fail=mode == "fail", optimizer="sgd", lr=0.1)
    ckpt = ModelCheckpoint(dirpath=out / "ckpt")
    trainer = pl.Trainer(strategy=make(), accelerator="cpu", devices=2, num_nodes=2, max_epochs=1, logger=False,
                         callbacks=[ckpt], enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true")
    trainer.fit(model, loader(mnist_like(GLOBAL_BATCH * 5, seed=1), GLOBAL_BATCH // replicas))
    torch.save(flat_params(model), out / f"node{node}.pt")
    (out / f"node{node}.json").write_text(json.dumps({
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step, "best": ckpt.best_model_path}))


if __name__ == "__main__":
    main()
