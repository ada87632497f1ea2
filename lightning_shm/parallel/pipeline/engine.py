"""Runs one rank's part of a pipeline schedule: its chunks, its channels, its actions.

Data movement per action (chunk c of V, microbatch m)::

    F  x = microbatch input (c == 0) or recv(act[c-1]);  out = chunk_c(x)  (a tensor or a tuple of them)
       c == V-1: out = the microbatch loss (computed by ``io.last_forward``), else send(act[c], out)
    B  g = recv(grad[c]) (c < V-1);  backward(out, g);  c > 0: send(grad[c-1], x.grad)
       -- both only if out required a gradient: x is received requiring one as out did (as in one process,
       where a layer after a frozen backbone computes no input gradient, and a reentrant checkpoint whose
       input needs none gives its layers none)
       a large Linear's weight gradient goes to the engine (SinkLinear), which stashes (input,
       grad_output): zero-bubble for the W action; other schedules gather several microbatches'
       rows and take weight.grad.addmm_(G^T, X) once over all of them (at the step's end, or
       sooner when the rows would outgrow ``stash_fraction`` of the weight)
    W  zero-bubble: weight.grad += grad_output^T @ input for the stashed Linear calls of (m, c);
       other schedules: recorded for the step-end products

``act[c]`` / ``grad[c]`` are point-to-point channels between the ranks of chunks c and c+1: no
barrier, no other rank involved. Every compute action is timed into :attr:`timeline`. With
``track_activation_memory`` the bytes of storages autograd saves for backward are recorded per (m, c) to
report peak activation memory; a storage shared by several microbatches (the batch they were cut from)
counts once.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shm.parallel import replay_buffers as buffers
from lightning_shm.parallel.linear_grads import PaddedWeights, SinkLinear, restore_linears, route_linears
from lightning_shm.parallel.pipeline import activation as act
from lightning_shm.parallel.pipeline.row_cut import LinearRows
from lightning_shm.parallel.pipeline.schedules import Action, PipelineSchedule, Schedule, Timed
from lightning_shm.parallel.streams import Drawn, ReplayStreams
from lightning_shm.runtime import Channel, ChannelConfig, World

_Replay = tuple[torch.Tensor, buffers.ForwardBuffers, Drawn]  # torch's random state, the buffers, the other streams


class StageIO(Protocol):
    """What the engine needs from the model around it (Lightning step functions or plain code)."""

    def forward_context(self) -> ContextManager[Any]:
        """Opened around every chunk forward, recomputations included (e.g. autocast); backward runs outside."""

    def first_input(self, mb: int) -> torch.Tensor:
        """Input of chunk 0 for microbatch ``mb``."""

    def last_forward(self, mb: int, x: torch.Tensor, chunk: nn.Module) -> Optional[torch.Tensor]:
        """Run the last chunk on ``x``; training: return the microbatch loss already weighted so that
        the sum over microbatches is the batch loss (eval: may return None). Called once per microbatch and
        step, never again to recompute (the step around the chunk may have effects of its own)."""


class HeldParameters(Protocol):
    """Parameters the engine's Linear layers compute with that are not leaves, but whose gradients someone
    takes (FSDP's units held gathered over a pipeline step)."""

    def holds(self, tensor: torch.Tensor) -> bool: ...

    def grad_sink(self, tensor: torch.Tensor, grad: torch.Tensor) -> bool: ...


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _stage_linear_forward(module: nn.Linear | LinearRows, engine: "PipelineEngine", x: torch.Tensor) -> torch.Tensor:
    w = module.weight
    # autograd's path for a weight with live hooks (they must see its gradient; a strategy's training step
    # suspends them and runs them once on the step's sum, see PipelineSteps), for one computed from other
    # parameters (a parametrization such as weight_norm: the gradient must flow back through it), and --
    # unless zero-bubble defers it -- for one that is not a leaf (FSDP's held parameter) or too small to
    # gain from the in-place sum; and for a complex weight, whose products take conjugates
    if torch.is_grad_enabled() and w.requires_grad and not w.is_complex() \
            and (w.is_leaf and (engine.zero_bubble or w.numel() >= engine.in_place_min_numel)
                 or engine.zero_bubble and engine.held is not None and engine.held.holds(w)) \
            and not w._backward_hooks and not w._post_accumulate_grad_hooks:
        return SinkLinear.apply(x, w, module.bias, engine, w)
    return F.linear(x, w, module.bias)


class PipelineEngine:
    """One pipeline rank. ``chunks`` maps global chunk index -> module for the chunks this rank owns.

    ``in_place_min_numel``: the smallest weight whose gradient the engine takes outside zero-bubble.
    Below it the custom autograd node's Python costs about what the engine's products save
    (``scripts/bench_stage_grads.py``: Linear(784, 256) as fast as autograd gathered, slower with one
    product per microbatch; Linear(1024, 1024) and larger faster either way).

    ``track_activation_memory`` (``tracks_memory``, may change between steps): record what autograd saves, for
    :attr:`peak_activation_bytes`. It costs a Python call per saved tensor in forward and another in backward
    (``scripts/bench_stage_grads.py --record``: 2-7% of a step of the 512-wide MLP, up to 5% of the
    transformer's), so the strategies, whose steps read no such figure, leave it off; the runtime-only driver
    (the schedules table) keeps it on.

    ``stash_fraction``: outside zero-bubble, a taken weight's (input, grad_output) rows are kept
    across microbatches -- up to this fraction of the weight's element count -- and its gradient is
    taken as one product over all of them. Why: per microbatch, ``G^T @ X`` is a thin product whose
    cost is the weight-sized output it writes, not its few rows; M of them cost nearly M times one
    product over all the rows (the wide MLP's [4096, 4096] layer, 4 x 32 rows: see
    ``scripts/bench_stage_grads.py``). The rows are activation-sized, so the bound keeps the extra
    memory under that fraction of the weights'. 0: one product per microbatch.
    """

    in_place_min_numel = 1 << 20
    stash_fraction = 0.5

    def __init__(self, chunks: dict[int, nn.Module], schedule: PipelineSchedule, pp_index: int, pp_ranks: list[int],
                 world: World, tag: str = "pp", activation_checkpointing: bool = False,
                 channel: Optional[ChannelConfig] = None, track_activation_memory: bool = True) -> None:
        self.chunks, self.schedule, self.pp_index = chunks, schedule, pp_index
        self.checkpointing = activation_checkpointing
        self.tracks_memory = track_activation_memory
        V = schedule.chunks
        me = pp_ranks[pp_index]
        rank_of = [pp_ranks[schedule.rank_of(c)] for c in range(V)]
        cfg = channel or self.channel_config(schedule)
        self.act_in: dict[int, Channel] = {}
        self.act_out: dict[int, Channel] = {}
        self.grad_in: dict[int, Channel] = {}
        self.grad_out: dict[int, Channel] = {}
        for c in chunks:
            if c > 0:
                self.act_in[c] = world.channel(rank_of[c - 1], me, f"{tag}-act{c - 1}", cfg)
                self.grad_out[c] = world.channel(me, rank_of[c - 1], f"{tag}-grad{c - 1}", cfg)
            if c < V - 1:
                self.act_out[c] = world.channel(me, rank_of[c + 1], f"{tag}-act{c}", cfg)
                self.grad_in[c] = world.channel(rank_of[c + 1], me, f"{tag}-grad{c}", cfg)
        self.zero_bubble = schedule.kind == Schedule.ZERO_BUBBLE
        for chunk in chunks.values():  # the engine takes the Linear layers' weight gradients (SinkLinear)
            route_linears(chunk.modules(), _stage_linear_forward, self)
            route_linears(chunk.modules(), _stage_linear_forward, self, "linear", LinearRows)  # a row cut's product
        self._param_ptrs = {p.untyped_storage().data_ptr() for ch in chunks.values() for p in ch.parameters()}
        # who takes a deferred weight gradient whose weight is not a leaf (FSDP's gathered parameters)
        self.held: Optional[HeldParameters] = None
        self._marks: list[tuple[str, int, int, float, float]] = []  # this step's actions: kind, mb, chunk, start, end
        self._peak = 0
        # (m, c) -> x, out, and under checkpointing what the recomputation replays: forward's random states
        # (torch's; Python's, numpy's and its modules' generators if it draws from them) and the chunk's buffers
        # as forward found them
        self._store: dict[tuple[int, int], tuple[Any, Any, Optional[_Replay]]] = {}
        self._updating: dict[int, set[int]] = {}  # chunk -> ids of the buffers its forwards were seen to update
        self._streams: dict[int, ReplayStreams] = {}  # chunk -> the streams besides torch's its replays keep
        self._saved: dict[tuple[int, int], dict[int, int]] = {}  # (m, c) -> {storage ptr: bytes}
        self._alive: list[tuple[tuple[dict[int, int], ...], Optional[dict[int, int]]]] = []  # see _update_peak
        self._stash: dict[tuple[int, int], list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = {}
        self.padded = PaddedWeights()  # SinkLinear's input gradients: one re-strided weight per step, every microbatch
        self._rows: dict[nn.Parameter, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # outside zero-bubble
        # the storages the stash and the rows hold: bytes, and how many held tensors use each
        self._held_bytes: dict[int, int] = {}
        self._held_uses: dict[int, int] = {}
        self._current: Optional[tuple[int, int]] = None
        self._trainable: dict[int, bool] = {}  # checkpointing, per chunk this step: a parameter requiring a gradient?
        self._last_b: tuple[int, int] = (0, 0)

    def __deepcopy__(self, memo: dict) -> "PipelineEngine":
        return self  # a process resource: the Linear layers it patched hold it, and they may be deep-copied (SWA)

    @staticmethod
    def channel_config(schedule: PipelineSchedule) -> ChannelConfig:
        """Generous slots: a sender never waits on a receiver that is itself waiting on it."""
        return ChannelConfig(slots=2 * (schedule.chunks + 1), slot_bytes=256 << 10)

    # ------------------------------------------------------------------ public
    def train_step(self, io: StageIO, schedule: Optional[PipelineSchedule] = None) -> None:
        """Forward and backward of all microbatches in this rank's schedule order.

        ``schedule`` overrides the engine's for one step (same stages and chunks), e.g. a batch with
        fewer samples than microbatches."""
        self._reset()
        if self.checkpointing:  # whether a checkpointed chunk's output will need a gradient (see _forward)
            self._trainable = {c: any(p.requires_grad for p in ch.parameters()) for c, ch in self.chunks.items()}
        run = {"F": self._forward, "B": self._backward, "W": self._weight}
        schedule = schedule or self.schedule
        for a in schedule.actions(self.pp_index):
            run[a.kind](a, io, True)
        if self._stash and schedule.kind != Schedule.ZERO_BUBBLE:  # a zero-bubble engine's step run as GPipe
            for mb, chunk in list(self._stash):  # (fewer microbatches than stages): each W after the last B
                self._weight(Action("W", mb, chunk), io, True)
        if self._rows:  # the products over every microbatch's rows still held
            t0 = time.perf_counter()
            for param in list(self._rows):
                self._take_rows(param)
            self._record("W", *self._last_b, t0)
        self.padded.clear()
        self._sum_peak()
        if self._store or self._stash:
            raise RuntimeError(f"pipeline rank {self.pp_index}: schedule left work undone {list(self._store)}")

    @torch.no_grad()
    def eval_step(self, io: StageIO, microbatches: int) -> None:
        """Forward only (validate / test / predict): every microbatch through every local chunk."""
        self._reset()
        for c in sorted(self.chunks):
            for m in range(microbatches):
                self._forward(Action("F", m, c), io, False)
        self._store.clear()

    def weight_grad(self, param: nn.Parameter, x: torch.Tensor, g: torch.Tensor) -> None:
        """A Linear's weight gradient ``g^T @ x`` for the microbatch being back-propagated: stashed for
        the W action (zero-bubble), else gathered with other microbatches' rows (``stash_fraction``).
        Always taken here: autograd gets no weight gradient from :class:`SinkLinear` (None)."""
        if self.zero_bubble:
            assert self._current is not None, "deferred weight gradient outside a B action"
            self._stash.setdefault(self._current, []).append((param, x, g))
            self._hold(x, g)
            return
        if g.dtype != param.dtype:  # autocast: one rounded product per microbatch, as autograd's
            self._add_weight_grad(param, x, g)
            return
        rows = self._rows.setdefault(param, [])
        rows.append((x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])))
        self._hold(*rows[-1])
        if sum(a.numel() + b.numel() for a, b in rows) > self.stash_fraction * param.numel():
            self._take_rows(param)

    def _take_rows(self, param: nn.Parameter) -> None:
        """``param``'s gradient over every held microbatch's rows: one product ``cat(G)^T @ cat(X)``."""
        rows = self._rows.pop(param)
        for pair in rows:
            self._release(*pair)
        if len(rows) == 1:
            self._add_weight_grad(param, *rows[0])
        else:
            self._add_weight_grad(param, torch.cat([x for x, _ in rows]), torch.cat([g for _, g in rows]))

    def _add_weight_grad(self, param: nn.Parameter, x: torch.Tensor, g: torch.Tensor) -> None:
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if param.is_leaf and param.grad is not None and param.grad.dtype == g2.dtype == x2.dtype:
            param.grad.addmm_(g2.t(), x2)  # in place: .grad read and written once
            return
        gw = g2.t().matmul(x2)
        if self.held is not None and self.held.grad_sink(param, gw):
            return
        if param.grad is None:
            param.grad = gw.to(param.dtype)
        else:
            param.grad.add_(gw)

    # ------------------------------------------------------------------ actions
    def _forward(self, a: Action, io: StageIO, training: bool) -> None:
        m, c = a.mb, a.chunk
        last = c == self.schedule.chunks - 1
        if c == 0:  # the step up to the Sequential, in the step's precision context as on the last stage: under
            with io.forward_context():  # 64-true it draws float64 numbers there (a mask drawn in the step: the same)
                x = io.first_input(m)
        else:
            x = self.act_in[c].recv_obj()
        chunk = self.chunks[c]
        if self.tracks_memory:
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in self._param_ptrs:
                    saved[storage.data_ptr()] = storage.nbytes()
                return t

            tracked: ContextManager[Any] = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        else:
            tracked = contextlib.nullcontext()
        t0 = time.perf_counter()
        checkpointed = training and self.checkpointing and not last  # recomputed in backward; not the last chunk:
        # the step runs around it, whose effects (a metric's update, a list append) must happen once
        keep_graph = training and not checkpointed
        # the recomputation must draw what this forward draws (dropout's masks): it starts from this state; and
        # it must start from the buffers as this forward found them, and leave them as it finds them
        rng = torch.get_rng_state() if checkpointed else None
        around = buffers.ForwardBuffers(chunk, self._updating.get(c)) if checkpointed else None
        if checkpointed and c not in self._streams:
            self._streams[c] = ReplayStreams(chunk)
        streams = self._streams[c] if checkpointed else None
        host = streams.before_forward() if streams is not None else []  # Python's, numpy's, generators
        grad_ctx = torch.enable_grad() if keep_graph else torch.no_grad()
        with grad_ctx, io.forward_context(), tracked:
            if keep_graph and c > 0:
                inp = act.entries(x)  # its first layer may change it in place (ReLU(inplace=True)): not the leaf
            elif checkpointed:
                inp = act.copied(x)  # backward recomputes from x: this forward must leave it as it was
            else:
                inp = x
            out = io.last_forward(m, inp, chunk) if last else chunk(inp)
        self._record("F", m, c, t0)
        if not last:  # first: the next stage may be waiting for it, the bookkeeping below is not
            if checkpointed:  # computed without a graph; it will need a gradient if its recomputation does
                out = act.leaves(out, act.requires_grad(x) or self._trainable[c])
            self.act_out[c].send_obj(act.checked(out))  # received requiring a gradient as out does
        if training:
            replay = None
            if around is not None:
                self._updating.setdefault(c, set()).update(id(b) for b, _ in around.changed().in_place)
                replay = (rng, around, ReplayStreams.drawn(host))  # the streams it drew from
            self._store[(m, c)] = (x, out, replay)
            if self.tracks_memory:
                if checkpointed:  # only the chunk input is kept
                    saved = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in act.parts(x)}
                self._saved[(m, c)] = saved
                self._update_peak()

    def _backward(self, a: Action, io: StageIO, training: bool) -> None:
        m, c = a.mb, a.chunk
        last = c == self.schedule.chunks - 1
        x, out, replay = self._store.pop((m, c))
        gets_grad = last or act.requires_grad(out)  # the next stage sends one only if out, as sent, required one
        grad = self.grad_in[c].recv_obj() if gets_grad and not last else None
        t0 = time.perf_counter()
        if replay is not None:  # checkpointed: the chunk's forward again, keeping the graph this time -- from x
            # itself (on the first stage it may carry the step's graph: a parameter applied before the Sequential)
            # and forward's random state and buffers; the stream and the buffers end as if nothing were rerun
            rng, around, drawn = replay
            with (torch.random.fork_rng(devices=[]), self._streams[c].replaying(drawn), buffers.replaying(around),
                  torch.enable_grad(), io.forward_context()):
                torch.set_rng_state(rng)
                out = self.chunks[c](act.entries(x))
        self._current = (m, c)
        if gets_grad and out is not None and act.requires_grad(out):
            act.backward(out, grad)
        self._current = None
        self._last_b = (m, c)
        self._saved.pop((m, c), None)
        self._record("B", m, c, t0)
        if c > 0 and act.requires_grad(x):
            self.grad_out[c].send_obj(act.input_grads(x))
        if self.tracks_memory and (self._stash or self._rows):
            self._update_peak()

    def _weight(self, a: Action, io: StageIO, training: bool) -> None:
        t0 = time.perf_counter()
        for param, x, g in self._stash.pop((a.mb, a.chunk), []):
            self._add_weight_grad(param, x, g)
            self._release(x, g)
        self._record("W", a.mb, a.chunk, t0)

    # ------------------------------------------------------------------ bookkeeping
    @property
    def timeline(self) -> list[Timed]:
        """This step's actions as timed (a new list each time it is read)."""
        return [Timed(self.pp_index, Action(k, m, c), start, end) for k, m, c, start, end in self._marks]

    @property
    def peak_activation_bytes(self) -> int:
        """The most activation memory this rank held at once in the last step: the storages autograd saved for
        backward, and the weight-gradient rows held for later products (each storage counted once)."""
        if not self.tracks_memory:
            raise RuntimeError("peak_activation_bytes is recorded only by an engine built with "
                               "track_activation_memory=True")
        return self._peak

    def _record(self, kind: str, mb: int, chunk: int, t0: float) -> None:
        self._marks.append((kind, mb, chunk, t0, time.perf_counter()))  # a plain tuple: this runs between actions

    def _update_peak(self) -> None:
        """Note what is alive now; :meth:`_sum_peak` adds it up once the step is over. Why not here: this runs
        between two actions, where every microsecond delays the next one (and, on the slowest stage, the
        step: 7-14 us per action on the 2-core VM). A ``_saved`` dict never changes once its forward is over;
        the rows held for weight gradients are counted as they come and go (:meth:`_hold`)."""
        self._alive.append((tuple(self._saved.values()), self._held_bytes.copy() if self._held_bytes else None))

    def _hold(self, *tensors: torch.Tensor) -> None:
        if not self.tracks_memory:
            return
        for t in tensors:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            uses = self._held_uses.get(ptr, 0)
            if not uses:
                self._held_bytes[ptr] = storage.nbytes()
            self._held_uses[ptr] = uses + 1

    def _release(self, *tensors: torch.Tensor) -> None:
        if not self.tracks_memory:
            return
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            uses = self._held_uses.pop(ptr) - 1
            if uses:
                self._held_uses[ptr] = uses
            else:
                del self._held_bytes[ptr]

    def _sum_peak(self) -> None:
        """:attr:`peak_activation_bytes`: the largest sum of the storages alive at once (each counted once)."""
        for saved, held in self._alive:
            alive: dict[int, int] = dict(held) if held else {}
            for storages in saved:
                alive.update(storages)
            self._peak = max(self._peak, sum(alive.values()))
        self._alive.clear()

    def _reset(self) -> None:
        self.padded.clear()
        self._marks = []
        self._peak = 0
        self._alive.clear()
        self._store.clear()
        self._saved.clear()
        self._stash.clear()
        self._rows.clear()
        self._held_bytes.clear()
        self._held_uses.clear()

    def close(self) -> None:
        """Restore the Linear modules the engine patched (their weight gradients were its to take)."""
        self.padded.clear()
        for chunk in self.chunks.values():
            restore_linears(chunk.modules())
            restore_linears(chunk.modules(), "linear", LinearRows)
