"""Steps that fetch their own batches: Lightning's ``training_step(self, dataloader_iter)`` flavor.

In that flavor Lightning calls the step with an iterator of ``(batch, batch_idx, dataloader_idx)`` and moves
no batch itself -- ``batch_to_device`` never runs. What the strategy does to each batch there would be
skipped with it: the ranks of a model replica (tp members, pipeline stages) computing on member 0's batch
(``tp_batch`` "auto" for a loader it cannot split, "broadcast"), or checking that they loaded the same
("check"). Under tp with per-rank augmentations the members computed the halves of each layer on
different inputs, silently (0.046 off one process after 5 SGD steps). So the step gets
:class:`PreparedBatches`, whose ``next()`` hands out each batch as ``batch_to_device`` would::

    Lightning's iterator --next()--> (batch, i, d) --prepare(batch)--> (member 0's batch, i, d) --> the step

A pipeline cuts the batch into microbatches and calls the step once per microbatch (to capture the
Sequential's input on the first stage, for the loss on the last): the strategy fetches the batch, and
each call gets a :class:`OneMicrobatch` holding its microbatch. A step that fetches several batches per
call cannot be cut that way; its second ``next()`` raises, naming why (a ``StopIteration`` would end the
epoch silently).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

Fetched = tuple[Any, int, int]  # (batch, batch_idx, dataloader_idx), what Lightning's iterator yields


def takes_loader_iter(module: pl.LightningModule, step: str) -> bool:
    """Whether ``module``'s ``step`` (``"training_step"``, ...) takes ``dataloader_iter`` (Lightning's test)."""
    fn = getattr(module, step, None)
    return fn is not None and is_param_in_hook_signature(fn, "dataloader_iter", explicit=True)


class PreparedBatches(Iterator[Fetched]):
    """Lightning's ``dataloader_iter`` with ``prepare`` applied to each batch it yields. Keeps what this
    step fetched, so that the step can be rerun on the same batches (:meth:`replay`)."""

    def __init__(self, inner: Iterator[Fetched], prepare: Callable[[Any], Any]) -> None:
        self.inner, self.prepare = inner, prepare
        self.fetched_now: list[Fetched] = []

    def __next__(self) -> Fetched:
        batch, batch_idx, dataloader_idx = next(self.inner)
        item = (self.prepare(batch), batch_idx, dataloader_idx)
        self.fetched_now.append(item)
        return item

    def replay(self) -> Iterator[Fetched]:
        """The batches this iterator handed out, again (then Lightning's next ones)."""
        yield from list(self.fetched_now)
        yield from self.inner

    def __getattr__(self, name: str) -> Any:  # what Lightning's iterator also offers a step: done, fetched, length
        if name == "inner":  # not set yet (copy and pickle build the object first): an AttributeError, as they expect
            raise AttributeError(name)
        return getattr(self.inner, name)


class OneMicrobatch(Iterator[Fetched]):
    """What a pipeline's call of a ``dataloader_iter`` step gets: ``(microbatch, batch_idx, dataloader_idx)``, once."""

    def __init__(self, batch: Any, batch_idx: int, dataloader_idx: int, step: str, microbatches: int) -> None:
        self.item: Optional[Fetched] = (batch, batch_idx, dataloader_idx)
        self.step, self.microbatches = step, microbatches

    def __next__(self) -> Fetched:
        if self.item is None:
            raise RuntimeError(
                f"{self.step}(dataloader_iter) asked for a second batch in one call. Under a pipeline the strategy "
                f"fetches the step's batch, cuts it into {self.microbatches} microbatch(es) and calls the step once "
                "per microbatch with an iterator holding only that microbatch, so a step that consumes several "
                "batches per call cannot be pipelined: fetch one batch per call (or take `batch, batch_idx`), or "
                "use a strategy without pipeline_parallel_size.")
        item, self.item = self.item, None
        return item

    @property
    def done(self) -> bool:
        return self.item is None
