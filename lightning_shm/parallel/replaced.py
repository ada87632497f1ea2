"""What the model attached to the objects a parallelism replaces (hooks, attributes), and what it kept of them
(parameter lists its optimizer is built from).

FSDP holds each parameter as a new tensor (its row block), tensor parallelism a layer as a new module
over new parameters (its slice), a pipeline's ``split_linear`` a Linear as two row pieces. What the
model set on the originals in ``__init__`` -- ``p.register_hook(lambda g: g * mask)``, a post-accumulate
hook, a forward or backward hook on a layer, ``p.no_weight_decay = True`` read by its
``configure_optimizers`` -- would stay on objects nothing uses any more, and training would go on
without it, silently. It moves to the replacement instead::

    original p --(hooks dict shared, attributes copied)--> p's block / slice / row piece:
                 a gradient hook sees the piece's gradient
    original m --(hooks dicts shared, attributes copied)--> m's tensor-parallel module: a forward hook sees
                 whole tensors (:mod:`lightning_shm.parallel.tp.hooks` gathers the split ones for it)

The dicts are shared, not copied, so a handle the user kept still removes the hook. An elementwise gradient
or backward hook (scale, clamp, zero) gives what it gives in one process wherever the piece holds the whole
gradient of its elements; one that needs the whole gradient (a norm) sees a piece.
A list of the original parameters the model kept (``self.head_params = list(...)`` in ``__init__``) reaches
the optimizer after the replacement: :func:`rebind` swaps in what the rank holds now.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                 "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


_STATE_DICT_HOOKS = ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")


def has_module_hooks(m: nn.Module) -> bool:
    """Whether the model registered hooks on ``m`` -- forward, backward or state-dict ones -- which a layer cut
    into pieces (a Linear's rows on two pipeline stages) could not run as they were written."""
    return any(getattr(m, attr) for attr in (*_MODULE_HOOKS, *_STATE_DICT_HOOKS))


@contextlib.contextmanager
def parameter_hooks_suspended(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """No gradient hook of ``params`` runs inside (``register_hook``, post-accumulate); restored after. The
    dicts are emptied, not detached: autograd holds them (assigning None does not unregister a post-accumulate
    hook)."""
    emptied = [(hooks, dict(hooks)) for p in params
               for hooks in (p._backward_hooks, p._post_accumulate_grad_hooks) if hooks]
    for hooks, _ in emptied:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in emptied:
            hooks.update(saved)


@contextlib.contextmanager
def gradient_hooks_suspended(module: nn.Module) -> Iterator[None]:
    """No gradient hook of ``module``'s parameters or layers runs inside: a backward the strategy runs on its
    own (timing layers) is none of the model's business. Forward hooks still run (the older weight_norm and
    spectral_norm compute the weight in one)."""
    layers = [(m, m._backward_pre_hooks, m._backward_hooks) for m in module.modules()]
    for m, _, _ in layers:
        m._backward_pre_hooks, m._backward_hooks = OrderedDict(), OrderedDict()
    try:
        with parameter_hooks_suspended(module.parameters()):
            yield
    finally:
        for m, pre_hooks, hooks in layers:
            m._backward_pre_hooks, m._backward_hooks = pre_hooks, hooks


def carry_over(old: torch.Tensor, new: torch.Tensor) -> None:
    """``old``'s gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``) run on ``new``, and
    ``new`` has ``old``'s Python attributes (``p.no_weight_decay``: parameter groups built from them)."""
    new.__dict__.update(old.__dict__)
    if old._backward_hooks:  # assigning the dict registers it with autograd, as torch's own unpickling does
        new._backward_hooks = old._backward_hooks
    if old._post_accumulate_grad_hooks:
        new._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks


def accumulate_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``p.grad`` as autograd does for a leaf -- ``p``'s ``register_hook`` hooks on ``grad``,
    the sum, its post-accumulate hooks -- for a gradient that reaches ``p`` outside autograd (a pipeline step's
    sum over its microbatches, FSDP's reduce-scatter of it)."""
    for hook in list((p._backward_hooks or {}).values()):
        out = hook(grad)
        grad = grad if out is None else out
    p.grad = grad if p.grad is None else p.grad.add_(grad)
    for hook in list((p._post_accumulate_grad_hooks or {}).values()):
        hook(p)


def carry_over_module(old: nn.Module, new: nn.Module) -> None:
    """``old``'s forward (pre-)hooks, backward (pre-)hooks and state-dict hooks (one saving ``weight`` under an
    older key) run on ``new``, before any of ``new``'s own; and ``new`` has the attributes the model set on ``old``
    (``layer.lr_mult = 0.1``) that it does not set itself."""
    for key, value in old.__dict__.items():
        if not key.startswith("_") and key not in new.__dict__:
            new.__dict__[key] = value
    for attr in (*_MODULE_HOOKS, *_STATE_DICT_HOOKS):
        hooks = getattr(old, attr)
        if hooks and hooks is not getattr(new, attr):
            hooks.update(getattr(new, attr))
            setattr(new, attr, hooks)
    if old._backward_hooks:
        new._is_full_backward_hook = old._is_full_backward_hook


Originals = dict[int, tuple["weakref.ref[torch.Tensor]", str]]


def remember(module: nn.Module) -> Originals:
    """``module``'s own parameters by identity and name, before a parallelism replaces any (see :func:`rebind`)."""
    return {id(p): (weakref.ref(p), n) for n, p in module.named_parameters(remove_duplicate=False)}


def rebind(optimizers: Iterable[torch.optim.Optimizer], originals: Originals, module: nn.Module) -> None:
    """Parameters an optimizer holds from before the replacement (a list the model kept from ``__init__``)
    become what this rank holds under the same name now; where it holds none (another pipeline stage's
    layer) they leave the optimizer. Over the replaced tensors it would train tensors the model no longer uses
    (and the run failed at its end, saving that optimizer's state). Refused where a parameter would then appear
    twice (the model also gave its new form). Identity is checked through a weak reference: the id of a
    collected original may be reused by a new tensor."""
    current = dict(module.named_parameters(remove_duplicate=False))
    live = {id(p) for p in current.values()}
    for opt in optimizers:
        rebound: list[str] = []
        for group in opt.param_groups:
            params = []
            for p in group["params"]:
                entry = originals.get(id(p)) if id(p) not in live else None
                if entry is not None and entry[0]() is p:
                    rebound.append(entry[1])
                    p = current.get(entry[1])
                    if p is None:
                        continue
                params.append(p)
            group["params"] = params
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        if rebound and len(ids) != len(set(ids)):
            twice = sorted({n for n, p in current.items() if ids.count(id(p)) > 1})
            raise ValueError(f"{type(opt).__name__} holds {twice} twice: once as kept from before the strategy "
                             f"replaced them (parameters {sorted(set(rebound))} were taken before setup, e.g. a list "
                             "made in __init__) and once as this rank holds them now. Build the parameter groups "
                             "inside configure_optimizers from self.named_parameters().")


def refuse_averaged_copies(module: nn.Module, tp_plan: Iterable[str], pipelined: Optional[str]) -> None:
    """ValueError for a torch ``AveragedModel`` the model keeps of a part that tensor parallelism slices
    or a pipeline splits into stages (``self.ema = AveragedModel(self.net)`` in ``__init__``): the average
    stays a whole copy while each rank holds slices or one stage of the part, so ``update_parameters``
    pairs them wrongly -- "The size of tensor a (256) must match the size of tensor b (128)" after the
    first step. FSDP keeps working: it shards the copy as it shards the part, block for block.
    ``tp_plan``: the module paths tensor parallelism splits; ``pipelined``: the path of the pipelined
    Sequential (None without a pipeline)."""
    from torch.optim.swa_utils import AveragedModel

    planned = list(tp_plan)
    for name, average in module.named_modules():
        if not isinstance(average, AveragedModel):
            continue
        copy = [(k, v.shape) for k, v in average.module.state_dict().items()]
        for src_name, src in module.named_modules():
            if (type(src) is not type(average.module) or src is average.module or src_name.startswith(name + ".")
                    or [(k, v.shape) for k, v in src.state_dict().items()] != copy):
                continue
            inside = [k for k in planned if k == src_name or k.startswith(src_name + ".")]
            staged = pipelined is not None and (pipelined == src_name or pipelined.startswith(src_name + "."))
            if inside or staged:
                how = (f"tensor parallelism splits {inside[:3]}" if inside else
                       f"the pipeline gives each stage some layers of '{pipelined}'")
                raise ValueError(f"'{name}' is a torch AveragedModel of '{src_name}', and {how}: the average stays "
                                 f"a whole copy while each rank holds pieces of '{src_name}', so update_parameters "
                                 "would pair them wrongly. Use Lightning's EMAWeightAveraging (or WeightAveraging) "
                                 "callback, which averages in the trained layout under every strategy, or "
                                 "shm_fsdp / shm_ddp.")
