"""Parallelism mechanics on the shared-memory runtime; nothing here knows about the Trainer.

One folder per parallelism: ``ddp`` (gradient reducer), ``fsdp`` (sharded units), ``tp`` (parallel
layers and plans), ``pipeline`` (stages, channels, schedules).
"""
