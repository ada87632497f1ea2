"""The module's own hooks, wrapped for one fit where Lightning gives a strategy no hook of its own.

A strategy hook runs before or after the module's at some points of the loops only (``on_train_start``,
``on_validation_end``, ...); after the module's ``on_train_batch_end`` or around its ``lr_scheduler_step`` there
is none. There the strategy sets an instance attribute on the module that runs the module's own hook (the
class's, or one the user set on the instance) inside ``around``, and removes it when the fit ends::

    module.on_train_batch_end(...) -> WrappedHook -> around(hook, ...) -> hook(...)  (the module's)

A copy of the module made meanwhile (``deepcopy``, ``pickle``: an EMA teacher, a module saved whole) gets its
own hook back, bound to the copy, without the wrapping.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator

from torch import nn


class WrappedHook:
    """``around(hook, *args, **kwargs)`` in place of the module's ``hook``."""

    def __init__(self, hook: Callable[..., Any], around: Callable[..., Any]) -> None:
        self.hook, self.around = hook, around
        functools.update_wrapper(self, hook)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.around(self.hook, *args, **kwargs)

    def __reduce__(self) -> Any:
        return functools.partial, (self.hook.__func__, self.hook.__self__)


def wrap(module: nn.Module, name: str, around: Callable[..., Any]) -> None:
    """Wrap ``module``'s hook ``name``, once: a hook found wrapped (a second start of the same fit) is kept as it
    is -- so two concepts cannot share a hook; each wraps its own (the stop votes: the training epoch's and
    batch's hooks; the scheduler metrics: ``lr_scheduler_step``)."""
    if not isinstance(module.__dict__.get(name), WrappedHook):
        setattr(module, name, WrappedHook(getattr(module, name), around))


def unwrap(module: nn.Module, names: Iterable[str]) -> None:
    for name in names:
        if isinstance(module.__dict__.get(name), WrappedHook):
            delattr(module, name)


@contextlib.contextmanager
def instead(module: nn.Module, name: str, value: Any) -> Iterator[None]:
    """``module.<name>`` is ``value`` for a while: an instance attribute over the class's, then what was there
    before -- an enclosing swap's, one the user set, or nothing -- again, so swaps nest."""
    previous = module.__dict__.get(name)
    setattr(module, name, value)
    try:
        yield
    finally:
        if previous is None:
            delattr(module, name)
        else:
            setattr(module, name, previous)
