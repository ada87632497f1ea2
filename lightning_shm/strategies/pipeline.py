"""``shm_pipeline``: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero-bubble) x data parallelism.

``devices = dp x pp``. In ``setup`` the model's ``nn.Sequential`` is cut into P*v chunks balanced by
measured layer time; each rank keeps only its chunks (a :class:`PipelineStage` takes the
Sequential's place). Each training step runs the schedule over microbatches of the batch (see
:mod:`lightning_shm.strategies.pipeline_steps`). A preset of
:class:`~lightning_shm.strategies.model_parallel.SHMModelParallel` (pp x dp replicate).
"""

from __future__ import annotations

from typing import AbstractSet, Any, Optional, Sequence, Union

from torch import Tensor

from lightning_shm.strategies.model_parallel import SHMModelParallel


class SHMPipeline(SHMModelParallel):
    """Pipeline parallelism over ``pipeline_parallel_size`` stages (times devices / pp data-parallel replicas).

    Args:
        pipeline_parallel_size: number of stages P; must divide ``devices``.
        microbatches: M microbatches per batch (the per-rank batch size must be divisible by M).
        schedule: "gpipe", "1f1b", "interleaved_1f1b" or "zero_bubble" (ZB-H1).
        virtual_stages: chunks per rank for interleaved_1f1b (default 2).
        split_points: explicit chunk start indices (P*v - 1 of them) into the Sequential.
        balance: "time" (measured forward+backward per layer) or "params" (parameter count).
        split_linear: let a stage boundary fall inside an ``nn.Linear`` (its output rows divided between
            two stages, :mod:`lightning_shm.parallel.pipeline.row_cut`) where no layer boundary balances
            the stages -- a model dominated by one large Linear. Checkpoints stay plain.
        activation_checkpointing: True: keep only chunk inputs after forward and recompute in backward --
            every chunk but the last, around which the training step runs (its effects must happen once); a set
            of module classes: their instances instead, as under every strategy (see
            :class:`~lightning_shm.strategies.model_parallel.SHMModelParallel`).
        sequential: attribute path of the nn.Sequential to split (default: the first top-level one).
        sample_input: an input of the Sequential for timing layers (default: ``example_input_array``,
            else inferred from the first Linear's in_features).
        **kwargs: see :class:`~lightning_shm.strategies.base.SHMStrategyBase`; and ``tp_batch`` of
            :class:`~lightning_shm.strategies.model_parallel.SHMModelParallel`: how the stages come to
            compute on one batch (default "auto": each loads part of its rows, then all-gather).
    """

    def __init__(self, *args: Any, pipeline_parallel_size: int = 2, microbatches: int = 4,
                 schedule: str = "1f1b", virtual_stages: Optional[int] = None,
                 split_points: Optional[Sequence[int]] = None, balance: str = "time", split_linear: bool = False,
                 activation_checkpointing: Union[bool, AbstractSet[type]] = False, sequential: Optional[str] = None,
                 sample_input: Optional[Tensor] = None, **kwargs: Any) -> None:
        super().__init__(*args, pipeline_parallel_size=pipeline_parallel_size, microbatches=microbatches,
                         schedule=schedule, virtual_stages=virtual_stages, split_points=split_points,
                         balance=balance, split_linear=split_linear,
                         activation_checkpointing=activation_checkpointing, sequential=sequential,
                         sample_input=sample_input, **kwargs)
        self.pipeline_schedule = self.parallel_config.pipeline
        self.split_points = self.parallel_config.split_points
        self.balance = balance
        self.activation_checkpointing = activation_checkpointing
        self.sequential = sequential
