"""A whole state dict loaded after the model was cut: torch's failure, said why.

Lightning runs the module's ``setup`` and ``configure_model`` before the strategy's setup cuts the model,
and ``on_fit_start`` (and a callback's ``on_train_start``) after it. Loading pretrained weights with
``self.load_state_dict(full)`` in the later hooks hands a rank that holds pieces the whole tensors: torch
refuses with "size mismatch for net.1.weight: copying a param with shape torch.Size([256, 784]) from
checkpoint, the shape in current model is torch.Size([128, 784])" (shm_fsdp, tp2) or "Unexpected key(s) in
state_dict: net.1.weight" (a pipeline stage) -- true, and no hint that the same line in ``setup`` works
under every layout. While a worker trains such a layout, a failing ``load_state_dict`` of the module or of
one of its submodules gets a note saying so. A load that succeeds (Lightning's and the strategies' own,
of pieces) is untouched.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

from torch import nn

WHY = ("lightning_shm: this rank holds only its part of the model ({layout}): the strategy cut it after the "
       "module's setup() and configure_model() ran, so a whole state dict no longer fits it here. Load whole "
       "weights in setup() or configure_model() (every rank; the strategy then cuts them), or resume with "
       "ckpt_path.")


@contextlib.contextmanager
def whole_loads_explained(module: nn.Module, layout: str) -> Iterator[None]:
    """Inside, ``load_state_dict`` failing on ``module`` or a submodule of it carries :data:`WHY`."""
    original = nn.Module.load_state_dict

    def load_state_dict(self: nn.Module, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        try:
            return original(self, state_dict, strict=strict, assign=assign)
        except RuntimeError as e:
            if any(m is self for m in module.modules()):
                e.add_note(WHY.format(layout=layout))
            raise

    nn.Module.load_state_dict = load_state_dict  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.load_state_dict = original  # type: ignore[method-assign]
