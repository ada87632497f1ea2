"""``grad_norm``: each parameter's gradient norm as one process would log it, under every layout.

Lightning's :func:`lightning.pytorch.utilities.grad_norm` -- the usual ``self.log_dict(grad_norm(self, 2))``
in ``on_before_optimizer_step`` -- takes ``p.grad.norm()`` of the tensors a rank holds. Under shm_fsdp,
shm_tp and pipelines those are pieces (an FSDP rank's rows, a tp rank's columns, a stage's layers): its
values are the pieces' norms, and rank 0, whose values the loggers write, sees the first stage's only.

:func:`grad_norm` takes its place: the same keys and one process's values on every rank (each rank's
powered sums over the elements it owns, all-reduced over the world, :func:`~lightning_shm.parallel.clip.
grad_norms`). Where Lightning's is logged anyway, :class:`GradNormLogs` warns once: the numbers do not
pass silently.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterator, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_shm.parallel.clip import grad_norms
from lightning_shm.parallel.state import ModelState
from lightning_shm.runtime import Group
from lightning_shm.strategies.module_log import logging_through

_LIGHTNING_KEY = re.compile(r"grad_(inf|[0-9.e+-]+)_norm")


def grad_norm(module: nn.Module, norm_type: Union[float, int, str],
              group_separator: str = "/") -> dict[str, Tensor]:
    """Lightning's ``grad_norm(module, norm_type, group_separator)``, with one process's values when ``module``
    is a LightningModule trained by an shm strategy that splits gradients (collective: call it on every rank,
    as ``on_before_optimizer_step`` is). For a submodule: ``self.trainer.strategy.grad_norm(self.encoder, 2)``."""
    return _strategys(module, "grad_norm", lightning_grad_norm)(module, norm_type, group_separator)


def param_norm(module: nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> dict[str, Tensor]:
    """Each parameter's own norm, keyed as :func:`grad_norm`'s with ``param`` for ``grad``
    (``param_2.0_norm/net.1.weight``, ``param_2.0_norm_total``), with one process's values under every layout --
    a norm the step takes of what a rank holds is of its row block, slice or stage (collective where a rank holds
    pieces: call it on every rank). For a submodule: ``self.trainer.strategy.param_norm(self.encoder, 2)``."""
    return _strategys(module, "param_norm", whole_param_norm)(module, norm_type, group_separator)


def _strategys(module: nn.Module, name: str, otherwise: Callable[..., dict[str, Tensor]]) -> Callable[..., Any]:
    """The method ``name`` of the strategy training ``module`` (a LightningModule attached to a Trainer whose
    strategy has one), else ``otherwise``."""
    if isinstance(module, pl.LightningModule):
        with contextlib.suppress(RuntimeError):  # not attached to a Trainer
            return getattr(module.trainer.strategy, name, otherwise)
    return otherwise


def whole_param_norm(module: nn.Module, norm_type: Union[float, int, str],
                     group_separator: str = "/") -> dict[str, Tensor]:
    """:func:`param_norm` where the rank holds every parameter whole (one process, shm_ddp)."""
    norm_type = _checked(norm_type)
    norms = {f"param_{norm_type}_norm{group_separator}{name}": p.detach().norm(norm_type)
             for name, p in module.named_parameters()}
    if norms:
        norms[f"param_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms


def _checked(norm_type: Union[float, int, str]) -> float:
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    return norm_type


def split_norm(module: nn.Module, root: nn.Module, state: ModelState, group: Group,
               norm_type: Union[float, int, str], group_separator: str = "/",
               of_params: bool = False) -> dict[str, Tensor]:
    """Lightning's dict for ``module`` (``root`` or one of its submodules on this rank), its values over every
    rank's pieces of ``state.plain_params``; the total is the norm of those norms, as Lightning's. ``of_params``:
    the parameters' own norms (:func:`param_norm`), not their gradients'."""
    norm_type = _checked(norm_type)
    prefix = next((name for name, m in root.named_modules() if m is module), None)
    if prefix is None:
        what = "param_norm" if of_params else "grad_norm"
        raise ValueError(f"{what}: this {type(module).__name__} is not part of the trained {type(root).__name__} "
                         f"on rank {group.global_rank}; every rank must pass a module it holds (a pipeline stage "
                         "holds only its layers: pass the LightningModule)")
    head = f"{prefix}." if prefix else ""
    names = [n for n in state.plain_params if n.startswith(head)]  # the root's names: one checksum per module
    # by the plain module's name: a stage may hold a tied parameter under another holder's name only
    key = "param" if of_params else "grad"
    norms = grad_norms(((state.plain_name(head + n), p) for n, p in module.named_parameters()), names, norm_type,
                       group, state.copies, (lambda p: p.detach()) if of_params else (lambda p: p.grad))
    out = {f"{key}_{norm_type}_norm{group_separator}{name[len(head):]}": v for name, v in norms.items()}
    if norms:
        out[f"{key}_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return out


class GradNormLogs:
    """Warns once per run when Lightning's ``grad_norm`` keys are logged where a rank holds pieces."""

    def __init__(self, layout: Callable[[], str]) -> None:
        self.layout = layout
        self.ours: set[str] = set()  # the keys :func:`split_norm` returned: their values are right
        self.warned = False

    def record(self, norms: dict[str, Tensor]) -> dict[str, Tensor]:
        self.ours.update(norms)
        return norms

    @contextlib.contextmanager
    def watching(self, module: pl.LightningModule) -> Iterator[None]:
        """Inside (an optimizer step: ``on_before_optimizer_step`` runs in it), ``module.log`` checks the names."""
        if self.warned:
            yield
            return
        log = module.log

        def checked(name: str, *args: Any, **kwargs: Any) -> None:
            if not self.warned and name not in self.ours and _LIGHTNING_KEY.match(name):
                self.warned = True
                rank_zero_warn(f"{name!r} logged from Lightning's grad_norm: under {self.layout()} each rank holds "
                               "pieces of the gradients, so it is the norm of this rank's pieces, not one process's. "
                               "lightning_shm.grad_norm(self, norm_type) gives one process's values.")
            log(name, *args, **kwargs)

        with logging_through(module, checked):
            yield
