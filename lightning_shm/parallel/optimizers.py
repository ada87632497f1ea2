"""Which optimizers a layout runs as one process would.

An elementwise optimizer (SGD, Adam, AdamW, RMSprop, ...) updates each element from its own gradient
and state, so a rank holding a piece of a tensor, or only some tensors, updates it exactly as one
process does. Two torch optimizers read more than that:

* ``LBFGS`` -- dot products over the whole flat gradient and a line search over all parameters: wrong
  wherever a rank holds less than every parameter whole (FSDP shards, tensor-parallel slices, a
  pipeline stage's layers);
* ``Adafactor`` -- row and column statistics of each whole tensor: wrong wherever a tensor is cut
  (FSDP rows, tensor-parallel slices, a Linear cut between pipeline stages).

Measured against one process on the reference MLP (local script, 5 steps): LBFGS off by 0.047 (fsdp),
0.081 (tp=2), 0.087 (pp=2) in a weight; Adafactor by 0.0023 (fsdp) and 0.025 (tp=2), exact under a
pipeline; both exact under data parallelism. Such an optimizer under such a layout is refused.
User-written optimizers are not inspected: one that reads across elements (LAMB, LARS, Shampoo) sees
only the rank's pieces.
"""

from __future__ import annotations

from typing import Sequence

import torch

WHOLE_MODEL: tuple[type, ...] = (torch.optim.LBFGS,)
WHOLE_TENSORS: tuple[type, ...] = tuple(t for t in (getattr(torch.optim, "Adafactor", None),) if t is not None)


def check_optimizers(optimizers: Sequence[torch.optim.Optimizer], cut: Sequence[str], stages: int) -> None:
    """ValueError for an optimizer this layout cannot run exactly. ``cut``: parameters held in pieces;
    ``stages``: pipeline stages (each holds only its layers' parameters)."""
    for opt in optimizers:
        name = type(opt).__name__
        if isinstance(opt, WHOLE_MODEL) and (cut or stages > 1):
            held = (f"{len(cut)} parameters in pieces (e.g. '{cut[0]}')" if cut else
                    f"the layers of 1 of {stages} stages")
            raise ValueError(f"{name} computes each update from every parameter at once (dot products over the "
                             f"flat gradient, a line search), but each rank holds {held}: its steps would differ "
                             "from one process's. Use an elementwise optimizer (SGD, Adam, AdamW, ...) or shm_ddp.")
        if isinstance(opt, WHOLE_TENSORS) and cut:
            raise ValueError(f"{name} computes each update from statistics of the whole tensor, but each rank holds "
                             f"pieces of {len(cut)} parameters (e.g. '{cut[0]}'): its steps would differ from one "
                             "process's. Use an elementwise optimizer (SGD, Adam, AdamW, ...), or a layout that "
                             "keeps tensors whole (shm_ddp, a pipeline without split_linear).")
