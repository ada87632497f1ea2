"""Arguments of Lightning's own ``DDPStrategy`` / ``FSDPStrategy`` (and torch FSDP's, which ``FSDPStrategy`` passes on)
that the shm strategies do not take, each refused with what does its job here.

Why: code moving from ``FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP")`` to
``SHMFSDPStrategy`` got Python's bare "unexpected keyword argument"; now it learns the equivalent when the strategy
is made, before any worker starts. ``timeout`` (a ``timedelta`` too) and ``find_unused_parameters``,
``bucket_cap_mb``, ``broadcast_buffers`` are taken as Lightning takes them.
"""

from __future__ import annotations

import traceback
from typing import Any, Mapping, Optional

from torch import nn

_COMM_HOOKS = ("gradients are averaged in shared-memory buckets in their own dtype; no communication hook or "
               "periodic model averaging runs (a compressed all-reduce would change the numbers)")

_PREFETCH = ("prefetch=True (with gather='copy') gathers the next unit while one computes; the default gather='view' "
             "gathers nothing: the full parameters are the ranks' rows in shared memory")

INSTEAD: dict[str, str] = {
    "auto_wrap_policy": "unit_policy selects shm_fsdp's units: a set of module classes ({Block}, as auto_wrap_policy "
                        "takes), a callable (name, module) -> bool, or an int (merge small layers)",
    "activation_checkpointing_policy": "activation_checkpointing takes the same set of module classes ({Block}: "
                                       "each instance recomputed in backward)",
    "sharding_strategy": "FULL_SHARD is shm_fsdp itself; SHARD_GRAD_OP is gather='copy', reshard_after_forward=False "
                         "(the default gather='view' never gathers); NO_SHARD is shm_ddp; on several nodes shm_fsdp "
                         "shards inside each node and replicates across them (HYBRID_SHARD)",
    "cpu_offload": "parameters, gradients and optimizer state are in CPU memory already",
    "mixed_precision": "Trainer(precision='bf16-mixed')",
    "state_dict_type": "checkpoints always hold the full state dict, which one process loads",
    "device_mesh": "SHMModelParallel(data_parallel_size=..., tensor_parallel_size=..., pipeline_parallel_size=...)",
    "process_group_backend": "ranks on a machine communicate through shared memory, machines through gloo rails",
    "ddp_comm_hook": _COMM_HOOKS,
    "ddp_comm_state": _COMM_HOOKS,
    "ddp_comm_wrapper": _COMM_HOOKS,
    "model_averaging_period": _COMM_HOOKS,
    "gradient_as_bucket_view": "shm_ddp's gradients are views of its shared buckets already",
    # torch FSDP's own, which Lightning's FSDPStrategy passes on from its **kwargs
    "use_orig_params": "the optimizer sees the module's own parameters already, by name (each one's rows under "
                       "shm_fsdp)",
    "sync_module_states": "every rank starts from rank 0's weights and buffers already",
    "forward_prefetch": _PREFETCH,
    "backward_prefetch": _PREFETCH,
    "limit_all_gathers": "gather='copy' frees each unit's copy after its forward and its backward "
                         "(reshard_after_forward=True), and the default gather='view' makes none",
    "static_graph": "shm_ddp needs no hint of a static graph (parameters some steps leave unused: "
                    "find_unused_parameters=True)",
}


def refuse_lightning_only(strategy: str, kwargs: Mapping[str, Any]) -> None:
    """A TypeError naming each of Lightning's arguments in ``kwargs`` with what to use instead; others are left to
    the base class (Python's own error names them)."""
    known = [name for name in kwargs if name in INSTEAD]
    if known:
        said = "; ".join(f"{name}={kwargs[name]!r}: {INSTEAD[name]}" for name in known)
        raise TypeError(f"{strategy} does not take Lightning's {', '.join(known)} -- {said}")


def note_device_mesh(module: Optional[nn.Module], exc: BaseException) -> None:
    """A module written for Lightning's ``ModelParallelStrategy`` parallelizes itself in ``configure_model`` with
    ``self.device_mesh``, which is None here: Python says only "'NoneType' object is not subscriptable". When
    ``exc`` came from a line of ``configure_model`` reading it, a note says what takes its place."""
    if module is None or getattr(module, "device_mesh", None) is not None or not isinstance(
            exc, (TypeError, AttributeError)):
        return
    if any(f.name == "configure_model" and "device_mesh" in (f.line or "") for f in traceback.extract_tb(
            exc.__traceback__)):
        exc.add_note("configure_model reads self.device_mesh, which Lightning's ModelParallelStrategy gives a module "
                     "to call torch's parallelize_module with. The shm strategies have none (it is None): they apply "
                     "a tensor-parallel plan themselves. Give it as SHMTensorParallel(plan=...) or as the module's "
                     "tp_plan attribute -- torch's ColwiseParallel() / RowwiseParallel() are taken as they are -- "
                     "and leave configure_model to build layers.")
