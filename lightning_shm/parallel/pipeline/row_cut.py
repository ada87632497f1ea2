"""A stage boundary inside a Linear layer: its output rows divided between two pipeline stages.

Why: a Sequential dominated by one layer cannot be balanced at layer boundaries. In the wide MLP,
``Linear(4096, 4096)`` holds 84% of the parameters, so the best layer cut leaves one of two stages
with that Linear and ~86% of the measured work, and the pipeline runs at that stage's pace. The
rows of a Linear's output are independent, so a boundary can fall between them
(``split_linear=True``)::

    head, rows [0, r)   on stage s:    x [B, in]  ->  z = cat(x, x @ W[:r]^T + b[:r])             [B, in + r]
    tail, rows [r, n)   on stage s+1:  z          ->  cat(z[:, in:], z[:, :in] @ W[r:]^T + b[r:])  [B, n]

The activation crossing the boundary carries the layer's input next to the head's rows (``in + r``
columns instead of ``n``: the wide MLP cut by parameter count, r = 1,661, sends 5,757 floats per
sample instead of 4,096). Backward needs nothing new: the tail returns dL/dz, whose first ``in``
columns are its share of dL/dx, and autograd adds the head's share to it. Both pieces keep the
plain parameter names (``net.4.weight`` holds rows [0, r) on one stage and [r, n) on the other);
:class:`~lightning_shm.parallel.state.ModelState` joins the rows for checkpoints (``stage_rows``)
and cuts them again on load.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shm.parallel.pipeline.split import (
    NO_CUT_RULES,
    balanced_split,
    empty_rank,
    layer_costs_by_params,
    layer_costs_by_time,
    layers_to_spread,
    plan_chunks,
)
from lightning_shm.parallel.replaced import carry_over, has_module_hooks
from lightning_shm.parallel.sequential import shared_spans

MIN_GAIN = 0.02  # a row cut must lower the slowest chunk's cost by this fraction to be worth a new layer kind


class LinearRows(nn.Linear):
    """Output rows ``[lo, hi)`` of ``linear``: the head (``lo == 0``) or the tail of a cut (see module doc). An
    ``nn.Linear`` still, for code that classifies modules by type; ``out_features`` stays the whole layer's."""

    def __init__(self, linear: nn.Linear, lo: int, hi: int) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate the whole weight
        if not 0 <= lo < hi <= linear.out_features or (lo == 0) == (hi == linear.out_features):
            raise ValueError(f"rows [{lo}, {hi}) are not the head or tail of a Linear with "
                             f"{linear.out_features} outputs")
        self.in_features, self.out_features, self.lo, self.hi = linear.in_features, linear.out_features, lo, hi
        w = linear.weight.detach()
        self.weight = nn.Parameter(w[lo:hi].clone(), requires_grad=linear.weight.requires_grad)
        carry_over(linear.weight, self.weight)
        if linear.bias is not None:
            self.bias: Optional[nn.Parameter] = nn.Parameter(linear.bias.detach()[lo:hi].clone(),
                                                             requires_grad=linear.bias.requires_grad)
            carry_over(linear.bias, self.bias)
        else:
            self.register_parameter("bias", None)

    @property
    def is_head(self) -> bool:
        return self.lo == 0

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The rows' product (a method, so the zero-bubble engine can defer its weight gradient)."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_head:
            return torch.cat([x, self.linear(x)], dim=-1)
        n_in = self.in_features
        return torch.cat([x[..., n_in:], self.linear(x[..., :n_in])], dim=-1)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, rows=[{self.lo}, {self.hi}) of {self.out_features}, "
                f"bias={self.bias is not None}")


def plan_row_cuts(layers: Sequence[nn.Module], costs: Sequence[float], parts: int,
                  stages: Optional[int] = None) -> Optional[list[tuple[int, int]]]:
    """Chunk starts ``(layer, row)`` with boundaries allowed inside ``nn.Linear`` layers, or None when no
    such cut lowers the slowest chunk's cost by at least ``MIN_GAIN`` over the best layer-boundary cut.

    The ideal boundaries lie at ``k * total / parts``; a Linear that contains one is offered to the
    layer-boundary partition (:func:`balanced_split`) as two pieces, rows proportional to the cost on
    each side, its cost shared by rows. At most one cut per Linear; ``row == 0``: at the layer's start.
    """
    if parts < 2:
        return None
    has_params = layers_to_spread(layers, parts)
    required = has_params if sum(has_params) >= parts else None
    total = float(sum(costs))
    targets = [total * k / parts for k in range(1, parts)]
    pieces: list[tuple[int, int, float, bool]] = []  # (layer, first row, cost, has params)
    prefix = 0.0
    shared = {i for span in shared_spans([(str(i), m) for i, m in enumerate(layers)]) for i in span.positions}
    for i, (m, c) in enumerate(zip(layers, costs)):
        # a Linear with the user's forward / backward hooks stays whole: they expect its whole input and output;
        # so does one sharing a parameter with another layer (its rows would be new parameters, the tie lost)
        n = m.out_features if type(m) is nn.Linear and not has_module_hooks(m) and i not in shared else 0
        inside = [t for t in targets if prefix < t < prefix + c]
        r = min(max(round((inside[0] - prefix) / c * n), 1), n - 1) if n >= 2 and inside else 0
        if r:
            pieces += [(i, 0, c * r / n, has_params[i]), (i, r, c * (n - r) / n, has_params[i])]
        else:
            pieces.append((i, 0, c, has_params[i]))
        prefix += c
    if len(pieces) == len(layers):
        return None
    piece_required = [p[3] for p in pieces] if required is not None else None
    try:
        starts = balanced_split([p[2] for p in pieces], parts, piece_required)
    except ValueError:
        return None
    if stages and empty_rank(starts, [p[3] for p in pieces], parts, stages) is not None:
        return None
    layer_starts = balanced_split(costs, parts, required)
    if _slowest(starts, [p[2] for p in pieces]) > (1 - MIN_GAIN) * _slowest(layer_starts, costs):
        return None
    return [(pieces[s][0], pieces[s][1]) for s in starts]


def _slowest(starts: Sequence[int], costs: Sequence[float]) -> float:
    bounds = list(starts) + [len(costs)]
    return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


def apply_row_cuts(named: Sequence[tuple[str, nn.Module]],
                   starts: Sequence[tuple[int, int]]) -> tuple[list[tuple[str, nn.Module]], list[int]]:
    """The layers with each cut Linear replaced by its head and tail (both under the Linear's name), and
    the chunk starts as indices into them. Who holds which piece follows from the chunk starts."""
    cut_at = {layer: row for layer, row in starts if row > 0}
    out: list[tuple[str, nn.Module]] = []
    position: dict[tuple[int, int], int] = {}
    for i, (name, m) in enumerate(named):
        position[(i, 0)] = len(out)
        if i in cut_at:
            if type(m) is not nn.Linear:
                raise ValueError(f"layer {i} ({name}: {type(m).__name__}) is not an nn.Linear; only Linear "
                                 "layers can be cut by rows")
            r = cut_at[i]
            out.append((name, LinearRows(m, 0, r)))
            position[(i, r)] = len(out)
            out.append((name, LinearRows(m, r, m.out_features)))
        else:
            out.append((name, m))
    return out, [position[s] for s in starts]


def stage_rows(module: nn.Module) -> dict[str, tuple[int, int, int]]:
    """``{state key: (first row, rows, full rows)}`` for every entry ``module`` holds only some rows of."""
    out = {}
    for path, m in module.named_modules():
        if isinstance(m, LinearRows):
            for name, p in m.named_parameters(recurse=False):
                out[f"{path}.{name}" if path else name] = (m.lo, m.hi - m.lo, m.out_features)
    return out


def plan_cuts(seq: nn.Sequential, parts: int, split_points: Optional[Sequence[int]] = None,
              sample: Optional[torch.Tensor] = None, stages: Optional[int] = None,
              forbidden: Mapping[int, str] = NO_CUT_RULES, split_linear: bool = False
              ) -> tuple[list[tuple[int, int]], str]:
    """Chunk starts as ``(layer, row)`` and how they were chosen: :func:`~.split.plan_chunks` at layer
    boundaries, or with ``split_linear`` a boundary inside a Linear where that balances the chunks better
    (without it, ``how`` says when it would)."""
    if split_points is not None or parts > len(seq):
        starts, how = plan_chunks(seq, parts, split_points, sample, stages, forbidden)
        return [(s, 0) for s in starts], how
    costs = layer_costs_by_time(seq, sample) if sample is not None else layer_costs_by_params(seq)
    rows = plan_row_cuts(list(seq), costs, parts, stages) if not forbidden else None
    cut = [c for c in rows if c[1]] if rows is not None else []
    if split_linear and rows is not None:
        how = "measured time" if sample is not None else "parameter count"
        return rows, f"{how}, a Linear cut by rows at {cut} (layer, row)"
    starts, how = plan_chunks(seq, parts, None, sample, stages, forbidden, costs)
    if rows is not None:
        how += (f"; split_linear=True would cut inside layer {cut[0][0]} and balance the layers' compute better "
                "(it does not count the wider activation or per-microbatch costs: compare throughput)")
    return [(s, 0) for s in starts], how
