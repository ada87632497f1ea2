"""``shm_fsdp``: fully sharded data parallel (ZeRO-3) over shared memory.

Each rank persistently holds its rows of every parameter (in shared memory), of their gradients
and of the optimizer state. By default the W ranks' rows of a unit form one shared tensor that is
the unit's full parameters (``gather="view"``); ``gather="copy"`` gathers them into private memory
only around the unit's forward and backward, as FSDP does across GPUs.
See :mod:`lightning_shm.parallel.fsdp.unit` for the per-unit rhythm.

The module keeps its own parameters -- same names, one tensor each, holding this rank's rows --
so ``configure_optimizers`` (which Lightning calls after sharding, as its own FSDPStrategy does)
builds parameter groups by name or position exactly as in one process. A preset of
:class:`~lightning_shm.strategies.model_parallel.SHMModelParallel` (dp shard).
"""

from __future__ import annotations

from typing import AbstractSet, Any, Callable, Union

from torch import nn

from lightning_shm.strategies.model_parallel import SHMModelParallel


class SHMFSDPStrategy(SHMModelParallel):
    """ZeRO-3 on W CPU processes through shared memory.

    Args:
        unit_policy: None (each parameter-owning child of the model's ``nn.Sequential``), an int
            (merge consecutive Sequential children until a unit has at least this many parameters),
            a set of module classes whose instances are units (``{Block}``: what Lightning's
            ``FSDPStrategy(auto_wrap_policy={Block})`` takes) or a callable ``(name, module) -> bool``
            marking unit roots (defined at a module's top level: the default fork server pickles it).
        gather: "view" (default): a unit's full parameters are one tensor in shared memory that
            every rank maps, each rank's rows a slice of it -- no copy, no private full parameters.
            "copy": FSDP's textbook gather of the blocks into private memory around each unit's
            forward and backward (the two options below shape it).
        reshard_after_forward: ("copy") free a unit's full parameters after its forward and gather
            them again for backward (ZeRO-3); False keeps them until the unit's backward (ZeRO-2-like).
        prefetch: ("copy") gather the next unit on a helper thread while the current one computes.
            Costs one more unit's full parameters; faster only when cores are left over (e.g.
            devices < cores with OMP_NUM_THREADS=1) -- see README "shm_fsdp" for the measurement.
        **kwargs: see :class:`~lightning_shm.strategies.base.SHMStrategyBase`.
    """

    def __init__(self, *args: Any,
                 unit_policy: Union[None, int, Callable[[str, nn.Module], bool], AbstractSet[type]] = None,
                 gather: str = "view", reshard_after_forward: bool = True, prefetch: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, data_parallel="shard", unit_policy=unit_policy, gather=gather,
                         reshard_after_forward=reshard_after_forward, prefetch=prefetch, **kwargs)
        self.unit_policy = self.parallel_config.policy
        self.gather = gather
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
