"""Lightning's ``ThroughputMonitor`` counted in data-parallel replicas, not ranks.

Its run-wide rates (``samples_per_sec``, ``batches_per_sec``, ``items_per_sec``, ``flops_per_sec``) are one
rank's rates times ``world_size``: right when every rank trains its own samples, as under shm_ddp / shm_fsdp.
The ranks of one tensor- or pipeline-parallel replica train the *same* samples, so that counted each sample
tp x pp times (`/tmp/pb/thru.py`, 12 steps of the reference MLP: tp2 logged 15,688 samples/s where its
one replica trained 7,844; pp2 5,983 for 2,991; dp2 x pp2 2,179 for 1,090). The meters get the number of
replicas (``distributed_sampler_kwargs["num_replicas"]``, nodes included) as their world size instead; with
one replica the run-wide rates are the per-device ones, which Lightning then leaves out, as in one process.
The per-device FLOPs stay the module's ``flops_per_batch`` over the rank's step time, i.e. the replica's.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ThroughputMonitor


def count_replicas(trainer: "pl.Trainer", replicas: int) -> None:
    """Set every ThroughputMonitor meter's world size to ``replicas``. The meters exist from the callback's
    ``setup`` on (before the strategy's setup and the loops' starts, where this runs)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, ThroughputMonitor):
            for meter in getattr(callback, "_throughputs", {}).values():
                meter.world_size = replicas
