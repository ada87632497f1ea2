"""``torch.nn.init`` on a parameter a rank holds a piece of: drawn as on the whole parameter.

A model initialised in ``__init__`` or ``configure_model`` is whole when the layout cuts it, and every
piece is cut from rank 0's weights. One initialised again after that -- in ``on_fit_start``, a callback's
``on_train_start``, ``m.reset_parameters()`` of a head -- hands ``torch.nn.init`` the rank's piece, and
without help it draws for the piece alone (measured, the weights after 2 SGD steps at a 1e-12 learning rate,
against one process: 0.24 off after ``reset_parameters()`` of every Linear, 0.55-0.57 after
``xavier_uniform_``, under shm_fsdp and tp2)::

    FSDP, W=2, weight [64, 784] as rows [32, 784] per rank, the streams alike on every rank (Lightning
    seeds them so):
      torch alone:   each rank draws 32 x 784 numbers -> rank 1's rows = rank 0's rows (neurons i and
                     i + 32 start, and stay, identical); xavier's bound from fan_out 32, not 64
      here:          each rank draws the whole [64, 784] as one process does, keeps its rows

So, while a worker trains a layout that cuts parameters, the public ``torch.nn.init`` functions and the
fan computation they share (``_calculate_fan_in_and_fan_out``, which ``nn.Linear.reset_parameters`` reads
for its bias bound) see the whole parameter: a piece is initialised by drawing the whole shape from the
rank's stream, and keeping the piece (:meth:`ModelState.piece`). Each rank draws what one process draws,
and advances its stream as far.

A pipeline stage holds whole layers, but only its own: a hook initialising ``self.net``'s layers draws for
the stage's layers from where one process drew for the first ones. That cannot be replayed without the
other stages' layers, so the first such call warns (initialise before the cut to match one process).
Functions imported by name before the fit (``from torch.nn.init import normal_``), tensor methods
(``w.data.normal_()``) and initialisers handed a new tensor shaped like the piece (``nn.Conv2d``'s
``reset_parameters`` of a channels-last weight draws into ``empty_like(weight)``) are torch's own: they
see the piece.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from lightning_shm.parallel.state import ModelState, same_elements

# the public in-place initialisers of torch.nn.init; each takes the tensor first
INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def initialised_as_whole(state: ModelState, stage: Optional[nn.Module] = None,
                         warn: Callable[[str], None] = lambda _: None) -> Iterator[None]:
    """Inside, ``torch.nn.init``'s initialisers draw for a piece of a parameter as for the whole parameter
    (``state`` knows the pieces); with ``stage`` (a pipeline's), the first one called on a parameter of the
    stage's layers passes ``warn`` a message saying why one process's values cannot be drawn there."""
    init = nn.init
    originals = {name: getattr(init, name) for name in INITIALISERS if hasattr(init, name)}
    fans = init._calculate_fan_in_and_fan_out
    warned = [stage is None]

    def note(name: str, t: torch.Tensor) -> None:
        if warned[0] or not any(p is t or same_elements(p, t) for p in stage.parameters()):  # type: ignore[union-attr]
            return
        warned[0] = True
        warn(f"torch.nn.init.{name} on a parameter of this pipeline stage after the model was cut: the stage draws "
             "for its own layers from where one process draws for the first layers of the nn.Sequential, so the "
             "values differ from one process's. Initialise in __init__ or configure_model (before the cut), or "
             "seed each layer's initialisation yourself.")

    def whole(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(fn)
        def initialise(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            note(name, tensor)
            piece = state.piece(tensor)
            if piece is None:
                return fn(tensor, *args, **kwargs)
            full = torch.empty(piece.full_shape, dtype=tensor.dtype, device=tensor.device)
            fn(full, *args, **kwargs)
            with torch.no_grad():
                tensor.copy_(piece.cut(full))
            return tensor
        return initialise

    def fan_in_and_fan_out(tensor: torch.Tensor) -> tuple[int, int]:
        piece = state.piece(tensor)
        return fans(tensor if piece is None else torch.empty(piece.full_shape, device="meta"))

    for name, fn in originals.items():
        setattr(init, name, whole(name, fn))
    init._calculate_fan_in_and_fan_out = fan_in_and_fan_out
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(init, name, fn)
        init._calculate_fan_in_and_fan_out = fans

