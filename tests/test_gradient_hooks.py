"""A hook that rewrites gradients -- ``p.grad = f(p.grad)``, ``p.grad.data = f(p.grad.data)`` or in place -- after
they are averaged (``on_after_backward``, ``on_before_optimizer_step``) trains as one process in every layout.

Under shm_ddp ``p.grad`` is a view of the shared gradient bucket; until 2026-12-04 it was the reducer's own view
object, and ``p.grad.data = ...`` gave that object private storage: the parameter's gradient left the bucket for
the rest of the run, each rank stepped with its own gradient, and nothing failed (0.034 off one process after 3
Adam steps)."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_shm.models import MNISTClassifier
from tests.helpers import GLOBAL_BATCH, LAYOUTS, fit_seeded, flat_params


class RewritesGradients(MNISTClassifier):
    """Halves every gradient and adds 0.001 (affine: which rank's or which sum's gradient it saw shows) in ``hook``,
    through ``idiom``; ``zeroed``: the optimizer zeroes gradients in place (``set_to_none=False``), so the tensor
    objects of the first step stay ``p.grad`` for the whole run."""

    def __init__(self, hook: str, idiom: str, zeroed: bool = False):
        super().__init__(optimizer="adam", lr=0.01)
        self.hook, self.idiom, self.zeroed = hook, idiom, zeroed

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=not self.zeroed)

    def _rewrite(self) -> None:
        for p in self.parameters():
            if p.grad is None:
                continue
            if self.idiom == "assign":
                p.grad = p.grad * 0.5 + 0.001
            elif self.idiom == "data":
                p.grad.data = p.grad.data * 0.5 + 0.001
            else:
                p.grad.mul_(0.5).add_(0.001)

    def on_after_backward(self):
        if self.hook == "on_after_backward":
            self._rewrite()

    def on_before_optimizer_step(self, optimizer):
        if self.hook == "on_before_optimizer_step":
            self._rewrite()


def _fit(layout: str, hook: str, idiom: str, accumulate: int, zeroed: bool) -> torch.Tensor:
    kw = dict(samples=GLOBAL_BATCH * 3 * accumulate, accumulate_grad_batches=accumulate)
    model = lambda: RewritesGradients(hook, idiom, zeroed)  # noqa: E731
    if layout == "one process":
        return flat_params(fit_seeded(model, "auto", 1, GLOBAL_BATCH, ref=True, **kw)[1])
    make, devices, dp = LAYOUTS[layout]
    return flat_params(fit_seeded(model, make(), devices, GLOBAL_BATCH // dp, **kw)[1])


@functools.cache
def _one_process(hook: str, idiom: str, accumulate: int, zeroed: bool) -> torch.Tensor:
    return _fit("one process", hook, idiom, accumulate, zeroed)


CASES = [("ddp", hook, idiom, accumulate, False) for idiom in ("assign", "data", "inplace")
         for hook, accumulate in (("on_after_backward", 2), ("on_before_optimizer_step", 1))]
CASES += [("ddp", "on_before_optimizer_step", "data", 1, True)]
CASES += [(layout, "on_after_backward", "data", 2, False) for layout in ("fsdp", "tp2", "pp2-1f1b")]


@pytest.mark.parametrize("layout, hook, idiom, accumulate, zeroed", CASES)
def test_a_hook_rewriting_gradients_trains_as_one_process(layout, hook, idiom, accumulate, zeroed):
    key = (hook, idiom, accumulate, zeroed)
    torch.testing.assert_close(_fit(layout, *key), _one_process(*key), rtol=0, atol=1e-9)
