"""``module.log`` routed elsewhere for a while, nestably: one place for the swap both users need.

The pipeline records a microbatch's logs to combine them (:mod:`.pipeline_io`); an optimizer step
checks the names logged in it (:mod:`.grad_norm`), and a pipelined step runs inside that step. Each
swap installs an instance attribute over ``LightningModule.log`` and puts back what was there before
(the enclosing swap's function, or nothing), so leaving the inner one does not undo the outer.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import lightning.pytorch as pl


@contextlib.contextmanager
def logging_through(module: pl.LightningModule, log: Callable[..., None]) -> Iterator[None]:
    previous = module.__dict__.get("log")
    module.log = log  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del module.log
        else:
            module.log = previous  # type: ignore[method-assign]
