from lightning_shm.parallel.pipeline.engine import PipelineEngine, StageIO
from lightning_shm.parallel.pipeline.microbatches import split_batch
from lightning_shm.parallel.pipeline.schedules import (
    Action,
    PipelineSchedule,
    Schedule,
    Timed,
    between_actions,
    bubble_fraction,
    handover_delays,
    measured_costs,
    simulate,
)
from lightning_shm.parallel.pipeline.split import balanced_split, layer_costs_by_time, plan_chunks
from lightning_shm.parallel.pipeline.stage import CapturedInput, PipelineStage

__all__ = [
    "Action", "CapturedInput", "PipelineEngine", "PipelineSchedule", "PipelineStage",
    "Schedule", "StageIO", "Timed", "balanced_split", "between_actions", "bubble_fraction", "handover_delays",
    "layer_costs_by_time", "measured_costs", "plan_chunks", "simulate", "split_batch",
]
