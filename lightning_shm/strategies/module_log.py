"""``module.log`` routed elsewhere for a while, nestably: one place for the swap both users need.

The pipeline records a microbatch's logs to combine them (:mod:`.pipeline_io`); an optimizer step
checks the names logged in it (:mod:`.grad_norm`), and a pipelined step runs inside that step. Each
swap installs an instance attribute over ``LightningModule.log`` and puts back what was there before
(the enclosing swap's function, or nothing), so leaving the inner one does not undo the outer
(:func:`.module_hooks.instead`).
"""

from __future__ import annotations

from typing import Callable, ContextManager

import lightning.pytorch as pl

from lightning_shm.strategies.module_hooks import instead


def logging_through(module: pl.LightningModule, log: Callable[..., None]) -> ContextManager[None]:
    return instead(module, "log", log)
