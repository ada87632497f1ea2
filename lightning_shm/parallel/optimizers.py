"""Which optimizers a layout runs as one process would.

An elementwise optimizer (SGD, Adam, AdamW, RMSprop, ...) updates each element from its own gradient
and state, so a rank holding a piece of a tensor, or only some tensors, updates it exactly as one
process does. Two torch optimizers read more than that:

* ``LBFGS`` -- dot products over the whole flat gradient and a line search over all parameters: wrong
  wherever a rank holds less than every parameter whole (FSDP shards, tensor-parallel slices, a
  pipeline stage's layers);
* ``Adafactor`` -- row and column statistics of each whole tensor: wrong wherever a tensor is cut
  (FSDP rows, tensor-parallel slices, a Linear cut between pipeline stages).

* ``Muon`` -- orthogonalizes each whole 2-D update (Newton-Schulz iterations on the matrix): wrong
  wherever a matrix is cut, as for Adafactor.

Measured against one process on the reference MLP (local script, 5 steps): LBFGS off by 0.047 (fsdp),
0.081 (tp=2), 0.087 (pp=2) in a weight; Adafactor by 0.0023 (fsdp) and 0.025 (tp=2), exact under a
pipeline; Muon (on the weights, AdamW on the rest) by 0.020 (fsdp) and 0.012 (tp=2), exact under
data parallelism. Such an optimizer under such a layout is refused.
User-written optimizers are not inspected: one that reads across elements (LAMB, LARS, Shampoo) sees
only the rank's pieces.

LBFGS also decides from the *loss* its closure returns: a line search (``line_search_fn="strong_wolfe"``)
accepts a step size by comparing losses, and the iterations stop when the loss changes less than
``tolerance_change``. Under data parallelism the gradient it reads is the replicas' mean (the reducer's), but
each rank's closure returned its own batch's loss, so each replica chose its own step size and the replicas
drifted apart -- 2.50 off one process in a weight after 5 steps (10 iterations each) of the reference MLP
under shm_ddp with the strong-Wolfe search (`/tmp/ph/lbfgs.py`, a local script; Lightning's ``ddp`` does the
same). So the closure such an optimizer calls returns the replicas' mean loss, the function whose gradient it
reads (:func:`replicas_loss`)::

    LBFGS.step(closure) -> closure(): forward, backward (gradient all-reduced), loss_r -> all_reduce(mean)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from lightning_shm.runtime import Group

WHOLE_MODEL: tuple[type, ...] = (torch.optim.LBFGS,)
READS_LOSS: tuple[type, ...] = (torch.optim.LBFGS,)  # decide from the loss their closure returns
WHOLE_TENSORS: tuple[type, ...] = tuple(t for t in (getattr(torch.optim, "Adafactor", None),
                                                   getattr(torch.optim, "Muon", None)) if t is not None)


def check_optimizers(optimizers: Sequence[torch.optim.Optimizer], pieces: Mapping[int, str], stages: int) -> None:
    """ValueError for an optimizer this layout cannot run exactly. ``pieces``: ``id(parameter) -> name``
    of the parameters held in pieces; ``stages``: pipeline stages (each holds only its layers' parameters)."""
    for opt in optimizers:
        name = type(opt).__name__
        cut = [pieces[id(p)] for group in opt.param_groups for p in group["params"] if id(p) in pieces]
        if isinstance(opt, WHOLE_MODEL) and (cut or stages > 1):
            held = (f"{_count(cut)} in pieces (e.g. '{cut[0]}')" if cut else
                    f"the layers of 1 of {stages} stages")
            raise ValueError(f"{name} computes each update from every parameter at once (dot products over the "
                             f"flat gradient, a line search), but each rank holds {held}: its steps would differ "
                             "from one process's. Use an elementwise optimizer (SGD, Adam, AdamW, ...) or shm_ddp.")
        if isinstance(opt, torch.optim.SparseAdam) and cut:
            raise ValueError(f"SparseAdam takes sparse gradients only, but each rank holds pieces of {_count(cut)} "
                             f"(e.g. '{cut[0]}'), whose gradients are reduced into dense pieces. Use shm_ddp, "
                             "which keeps nn.Embedding(sparse=True) gradients sparse, or a dense optimizer.")
        if isinstance(opt, WHOLE_TENSORS) and cut:
            raise ValueError(f"{name} computes each update from statistics of the whole tensor, but each rank holds "
                             f"pieces of {_count(cut)} (e.g. '{cut[0]}'): its steps would differ from one "
                             "process's. Use an elementwise optimizer (SGD, Adam, AdamW, ...), or a layout that "
                             "keeps tensors whole (shm_ddp, a pipeline without split_linear).")


def replicas_loss(optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                  replicas: Optional[Group]) -> Callable[[], Any]:
    """``closure`` for ``optimizer.step``, returning the mean of the ``replicas``' losses (one scalar all-reduce a
    call) where the optimizer decides from that loss (:data:`READS_LOSS`); ``closure`` itself otherwise."""
    if not isinstance(optimizer, READS_LOSS) or replicas is None or replicas.size == 1:
        return closure

    def mean_loss() -> Any:
        loss = closure()
        if not isinstance(loss, torch.Tensor):  # a step that returned None: nothing to decide from
            return loss
        return replicas.all_reduce(loss.detach().clone(), "mean")

    return mean_loss


def _count(names: Sequence[str]) -> str:
    return f"{len(names)} parameter{'s' if len(names) != 1 else ''}"
