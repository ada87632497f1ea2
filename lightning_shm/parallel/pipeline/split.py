"""Cut an ``nn.Sequential`` into contiguous chunks (pipeline stages) of balanced cost.

Cost per layer: measured forward+backward time on a sample input (the module's
``example_input_array``, repeated to a microbatch), or the parameter count when no input is known.
The split minimises the most expensive chunk (the pipeline's pace) -- a textbook linear partition,
solved exactly by dynamic programming over the few layers of a Sequential.

With V = P * v chunks (v virtual stages per rank, interleaved schedules) chunk c runs on pipeline
rank c % P.
"""

from __future__ import annotations

import contextlib
import time
from types import MappingProxyType
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from lightning_shm.parallel.pipeline import activation as act
from lightning_shm.parallel.replaced import gradient_hooks_suspended

NO_CUT_RULES: Mapping[int, str] = MappingProxyType({})


def layer_costs_by_params(seq: nn.Sequential) -> list[float]:
    """Parameter count per child (+1 so parameter-free layers still weigh something)."""
    return [float(sum(p.numel() for p in m.parameters()) + 1) for m in seq]


def why_sample_fails(seq: nn.Sequential, sample: torch.Tensor) -> Optional[str]:
    """None if ``sample`` runs through ``seq``; else which layer refused it and why. An input guessed
    for timing (a ``[rows, in_features]`` matrix for a first Linear) fits an MLP but not a sequence
    model whose Linear projects ``[B, T, features]``; the caller then balances without timing."""
    with _leaving_no_trace(seq):
        return _first_failure(seq, act.copied(sample))  # a first in-place layer changes its input


@torch.no_grad()
def _first_failure(seq: nn.Sequential, x: torch.Tensor) -> Optional[str]:
    for i, layer in enumerate(seq):
        try:
            x = layer(x)
        except Exception as e:  # any error of the user's layer on this input
            return f"layer {i} ({type(layer).__name__}) on an input of shape {_shapes(x)}: {type(e).__name__}: {e}"
    return None


def _shapes(a: object) -> str:
    items = a if isinstance(a, (tuple, list)) else (a,)
    return ", ".join(str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__ for t in items)


def layer_costs_by_time(seq: nn.Sequential, sample: torch.Tensor, repeats: int = 5) -> list[float]:
    """Median forward+backward seconds per child on ``sample`` (layers run in sequence).

    The model's own layers run, so they must come out as they went in: a BatchNorm would count the
    sample into its running statistics, a spectral_norm advance its power iteration (both buffers), a
    dropout draw from the random stream, and backward leave gradients and run the model's gradient hooks
    (suspended meanwhile)."""
    costs: list[list[float]] = [[] for _ in seq]
    with _leaving_no_trace(seq):
        why = _first_failure(seq, act.copied(sample))  # also the warm-up run
        if why is not None:
            raise ValueError(f"the sample input for timing the pipeline's layers does not run through the "
                             f"Sequential: {why}. Pass sample_input=<a batch of the Sequential's input>, or "
                             "balance='params'.")
        for _ in range(repeats):
            x = act.copied(sample)
            for i, layer in enumerate(seq):
                inp = act.leaves(x)
                t0 = time.perf_counter()
                out = layer(act.entries(inp))  # a ReLU(inplace=True) changes its input: not a leaf's
                # the last layer's output goes to the step, not to another layer: any structure (a dict of logits)
                outs = act.parts(out) if i < len(seq) - 1 else act.tensors_in(out)
                pairs = [(o, torch.ones_like(o)) for o in outs if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                costs[i].append(time.perf_counter() - t0)
                x = act.detached(out) if i < len(seq) - 1 else None
    return [sorted(c)[len(c) // 2] for c in costs]


@contextlib.contextmanager
def _leaving_no_trace(seq: nn.Sequential) -> Iterator[None]:
    buffers = [(b, b.detach().clone()) for b in seq.buffers()]
    grads = [(p, p.grad) for p in seq.parameters()]
    with torch.random.fork_rng(devices=[]), gradient_hooks_suspended(seq):
        yield
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    for p, g in grads:
        p.grad = g


@contextlib.contextmanager
def attributes_kept(root: nn.Module) -> Iterator[None]:
    """Every module of ``root`` leaves with the attributes it came with. Running the layers on a sample input
    runs the user's forward hooks too, and one that keeps an activation (``self.feat = out``, for a loss on an
    inner layer) left the sample's on every rank: on the stages that never run that layer, a stale tensor
    without gradient the step's loss then used -- silently (0.06 off one process after 5 steps under pp2).
    Gone, such a step fails where it reads it, saying why (:mod:`lightning_shm.strategies.pipeline_io`)."""
    saved = [(m, dict(m.__dict__)) for m in root.modules()]
    try:
        yield
    finally:
        for m, before in saved:
            for key in [k for k in m.__dict__ if k not in before]:
                del m.__dict__[key]
            for key, value in before.items():
                if key not in m.__dict__ or m.__dict__[key] is not value:
                    m.__dict__[key] = value


def balanced_split(costs: Sequence[float], parts: int, required: Optional[Sequence[bool]] = None,
                   forbidden: Mapping[int, str] = NO_CUT_RULES) -> list[int]:
    """Start index of each of ``parts`` contiguous, non-empty chunks minimising the largest chunk cost.

    With ``required``, every chunk must contain at least one layer marked True (e.g. one that owns
    parameters: an optimizer cannot be built over none). No chunk starts at an index in
    ``forbidden`` (index -> why: inside a tensor-parallel column -> row pair, whose split activation
    must not cross a stage boundary; between two layers that share a parameter).
    """
    n = len(costs)
    if parts < 1:
        raise ValueError(f"number of chunks must be >= 1, got {parts}")
    if parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} pipeline chunks (stages x virtual stages): "
                         "use fewer stages or a deeper nn.Sequential")
    prefix, marks = [0.0], [0]
    for i, c in enumerate(costs):
        prefix.append(prefix[-1] + c)
        marks.append(marks[-1] + (1 if required is None or required[i] else 0))
    inf = float("inf")
    # best[k][i]: minimal max-chunk cost of the first i layers in k chunks; cut[k][i]: start of the last chunk
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if marks[i] == marks[j] or best[k - 1][j] == inf or (j in forbidden and j > 0):
                    continue  # chunk [j, i) holds no required layer, or the prefix is infeasible
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    if best[parts][n] == inf:
        raise ValueError(f"{n} layers cannot be cut into {parts} chunks that each hold a parameter"
                         + (f" without starting one at {sorted(forbidden)}, where "
                            + "; ".join(dict.fromkeys(forbidden.values())) if forbidden else ""))
    starts, i = [], n
    for k in range(parts, 0, -1):
        starts.append(cut[k][i])
        i = cut[k][i]
    return starts[::-1]


def validate_split_points(points: Sequence[int], n_layers: int, parts: int,
                          forbidden: Mapping[int, str] = NO_CUT_RULES) -> list[int]:
    """Explicit split points (start indices of chunks 1..parts-1) -> chunk starts."""
    pts = list(points)
    if len(pts) != parts - 1:
        raise ValueError(f"{parts} chunks need {parts - 1} split points, got {len(pts)}: {pts}")
    starts = [0] + pts
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n_layers:
        raise ValueError(f"split points {pts} must be strictly increasing within 1..{n_layers - 1} "
                         f"({n_layers} layers)")
    bad = [p for p in pts if p in forbidden]
    if bad:
        raise ValueError(f"split point {bad[0]} is refused: {forbidden[bad[0]]} (no stage may start at "
                         f"{sorted(forbidden)})")
    return starts


def plan_chunks(seq: nn.Sequential, parts: int, split_points: Optional[Sequence[int]] = None,
                sample: Optional[torch.Tensor] = None, stages: Optional[int] = None,
                forbidden: Mapping[int, str] = NO_CUT_RULES,
                costs: Optional[Sequence[float]] = None) -> tuple[list[int], str]:
    """Chunk start indices and how they were chosen ("explicit" / "measured time" / "parameter count").

    Chunks hold at least one layer with trainable parameters when there are enough of them, else one
    with parameters (:func:`layers_to_spread`); with ``stages``, every pipeline rank (chunks r,
    r + stages, ...) must end up with parameters (explicit points: frozen ones will do). No chunk
    starts at an index in ``forbidden``. ``costs``: the per-layer costs already measured on ``sample``.
    """
    if costs is None and split_points is None and parts <= len(seq):
        costs = layer_costs_by_time(seq, sample) if sample is not None else layer_costs_by_params(seq)
    has_params = [any(True for _ in m.parameters()) for m in seq]
    spread = layers_to_spread(list(seq), parts)
    required = spread if sum(spread) >= parts else None
    if split_points is not None:
        starts, how = validate_split_points(split_points, len(seq), parts, forbidden), "explicit"
    elif parts > len(seq):
        balanced_split([1.0] * len(seq), parts)  # raises the standard error
        raise AssertionError("unreachable")
    else:
        starts = balanced_split(costs, parts, required, forbidden)
        how = "measured time" if sample is not None else "parameter count"
    if stages and how != "explicit" and empty_rank(starts, spread, parts, stages) is not None:
        for holds in (spread, has_params):  # the DP balances chunks; search for a cut that gives every rank some
            best = _search_rank_feasible(costs, holds, parts, stages, forbidden)
            if best is not None:
                return best, how
    r = empty_rank(starts, has_params, parts, stages) if stages else None
    if r is not None:  # explicit points may leave a rank only frozen layers, not none with parameters
        raise ValueError(f"pipeline rank {r} would hold no parameters with chunk starts {starts}; use fewer "
                         "stages or explicit split_points")
    return starts, how


def layers_to_spread(layers: Sequence[nn.Module], parts: int) -> list[bool]:
    """The layers every chunk should hold one of: those with trainable parameters when there are at
    least ``parts`` of them, else those with any parameters. Why trainable: a fine-tuning run commonly
    builds its optimizer over ``requires_grad`` parameters only, which fails on a stage holding none
    (a frozen backbone cut into stages of its own)."""
    trainable = [any(p.requires_grad for p in m.parameters()) for m in layers]
    return trainable if sum(trainable) >= parts else [any(True for _ in m.parameters()) for m in layers]


def empty_rank(starts: Sequence[int], has_params: Sequence[bool], parts: int, stages: int) -> Optional[int]:
    """The first pipeline rank whose chunks (r, r + stages, ...) hold no parameterised layer, or None."""
    bounds = list(starts) + [len(has_params)]
    for r in range(stages):
        if not any(has_params[i] for c in range(r, parts, stages) for i in range(bounds[c], bounds[c + 1])):
            return r
    return None


def _search_rank_feasible(costs: Sequence[float], has_params: Sequence[bool], parts: int,
                          stages: int, forbidden: Mapping[int, str] = NO_CUT_RULES,
                          limit: int = 200_000) -> Optional[list[int]]:
    """Exhaustive search (small Sequentials only) for the most balanced cut giving every rank parameters."""
    import itertools
    import math

    n = len(costs)
    if math.comb(n - 1, parts - 1) > limit:
        return None
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best, best_cost = None, float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        if any(c in forbidden for c in cuts):
            continue
        starts = [0, *cuts]
        if empty_rank(starts, has_params, parts, stages) is not None:
            continue
        bounds = starts + [n]
        cost = max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:]))
        if cost < best_cost:
            best, best_cost = starts, cost
    return best
