"""The plain state of a parallelized module: one save and one load for every layout.

Checkpoints never hold pieces. Model state uses the plain module's keys and shapes; optimizer state
looks like a single-process optimizer's over the plain parameters (ids = positions in the plain
``named_parameters()`` order). So a checkpoint written under any layout -- FSDP shards, TP slices,
pipeline stages, all three combined -- loads in one process, and under any other layout.

Every parallelism only says where the pieces of each entry live (:mod:`.placement`); this module
does the rest:

    save   piece --placement.gather--> full entries of this rank's stage --(pp group)--> all entries
    load   all entries --(keep this stage's)--> placement.cut --> piece

A pipeline boundary inside a Linear (``split_linear``) gives two stages rows of the same entry
(``stage_rows``: first row, rows, full rows): the stages' rows are joined by row offset when the
stages' entries are merged, and cut again before the placement's cut on load.

Optimizer state tensors shaped like their parameter's piece (momentum, Adam's moments) follow the
parameter's placement; other state (Adam's scalar ``step``) is the same on every rank and copied.
Parameters are numbered as one process's optimizer numbers them: group by group, and within a
group in the module's order (pipeline stages each hold part of every group: the numbering is
agreed over the pipeline group). All methods are collective over every rank of the run, called in
the same order everywhere.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from lightning_shm.parallel.optim_state import load_plain_optimizer_state
from lightning_shm.parallel.placement import WHOLE, Placement
from lightning_shm.runtime import Group
from lightning_shm.runtime.ops import barrier_reason

# what the stages gather (a rank on another path meets a gather of another reason: a mismatch, not its bytes)
_GROUP_NAMES = barrier_reason("the stages' optimizer parameter groups, by plain parameter name")
_STAGE_STATES = barrier_reason("the stages' state entries, merged into the full state dict")
_STAGE_OPTIMIZERS = barrier_reason("the stages' optimizer states, merged into one plain optimizer state")


class ModelState:
    """Consolidates and cuts the state of ``module`` (already parallelized).

    Args:
        module: the parallelized module (its state-dict keys are the plain keys it still holds).
        plain_keys, plain_params: ``state_dict()`` keys and ``named_parameters()`` names of the plain
            module, in order, taken before parallelizing.
        placements: per state key, how this rank's piece is cut from the full entry (absent: whole).
        stages: the pipeline group when the module is one stage of a pipeline, else None.
        before_load, after_load: called (on every rank) before and after new values are written into
            the pieces, e.g. FSDP's barriers: nobody still reads the old values / nobody reads the new
            ones before all are written.
        stage_rows: per state key, ``(first row, rows, full rows)`` when this stage holds only those rows
            of the entry (a Linear cut by rows between two stages).
        aliases: per ``named_parameters(remove_duplicate=False)`` name of the plain module, the name
            ``named_parameters()`` gives that parameter (its first holder's): a stage may hold a tied parameter
            under another holder's name only (GPT-2's embedding on the first stage, tied to the last layer).
    """

    def __init__(self, module: nn.Module, plain_keys: Sequence[str], plain_params: Sequence[str],
                 placements: Mapping[str, Placement], stages: Optional[Group] = None,
                 before_load: Optional[Callable[[], None]] = None,
                 after_load: Optional[Callable[[], None]] = None,
                 stage_rows: Optional[Mapping[str, tuple[int, int, int]]] = None,
                 aliases: Optional[Mapping[str, str]] = None) -> None:
        self.module = module
        self.aliases = dict(aliases or {})
        self.stage_rows = dict(stage_rows or {})
        if self.stage_rows and (stages is None or stages.size == 1):
            raise ValueError(f"{sorted(self.stage_rows)} hold only some rows, but there is no pipeline stage to "
                             "hold the rest")
        self.plain_keys, self.plain_params = list(plain_keys), list(plain_params)
        self.placements = dict(placements)
        self.stages = stages if stages is not None and stages.size > 1 else None
        self.before_load = before_load or (lambda: None)
        self.after_load = after_load or (lambda: None)
        self._copies = {id(p): self.placement(n).copies for n, p in module.named_parameters()}

    def plain_name(self, name: str) -> str:
        """The plain module's ``named_parameters()`` name of the parameter this rank names ``name``."""
        return self.aliases.get(name, name)

    def placement(self, key: str) -> Placement:
        return self.placements.get(key, WHOLE)

    def copies(self, param: torch.Tensor) -> int:
        """Ranks holding the same piece as ``param`` (for a global gradient norm)."""
        return self._copies.get(id(param), 1)

    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.module.named_parameters()}

    def _plain_ids(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """The id each of the optimizer's parameters (by this rank's name) has in one process's optimizer
        (collective over the pipeline group): groups in order, each group's parameters in the plain module's
        order."""
        names = self._names()
        plain = {n: self.plain_name(n) for n in names.values()}
        local = [[plain[names[id(p)]] for p in g["params"]] for g in optimizer.param_groups]
        unknown = [id(p) for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} tensor(s) that are not parameters of the module")
        groups = local
        if self.stages is not None:  # a Linear cut by rows is named on two stages: count it once
            # a group may exist on some stages only (one added later for a stage's layers, e.g. an unfrozen backbone)
            groups = [list(dict.fromkeys(sum(g, []))) for g in
                      itertools.zip_longest(*self.stages.all_gather_object(local, _GROUP_NAMES), fillvalue=[])]
        order = {n: i for i, n in enumerate(self.plain_params)}
        ids, offset = {}, 0
        for g in groups:
            for pos, n in enumerate(sorted(g, key=order.__getitem__)):
                ids[n] = offset + pos
            offset += len(g)
        return {n: ids[p] for n, p in plain.items() if p in ids}  # by this rank's names

    # ------------------------------------------------------------------ any state dict of this layout
    def _tensor_names(self) -> dict[str, str]:
        """Each ``state_dict()`` key -> the name of the parameter or buffer it holds, where they differ: a module's
        state-dict hooks may save a tensor under another key (``weight`` as ``w``, a checkpoint kept loadable by
        older code), and placements follow the tensors' names. Found by identity (``keep_vars``)."""
        named: dict[int, list[str]] = {}  # a tied tensor has several names, each its own key
        for n, t in [*self.module.named_parameters(remove_duplicate=False),
                     *self.module.named_buffers(remove_duplicate=False)]:
            named.setdefault(id(t), []).append(n)
        return {k: named[id(v)][0] for k, v in self.module.state_dict(keep_vars=True).items()
                if torch.is_tensor(v) and k not in named.get(id(v), [k])}

    def consolidate(self, local: Mapping[str, Any]) -> dict[str, Any]:
        """Full entries from this rank's pieces ``local`` (keys as in ``module.state_dict()``), all stages
        merged, in plain key order."""
        name = self._tensor_names()
        full = {k: (self._rows(name.get(k, k), self.placement(name.get(k, k)).gather(v)) if torch.is_tensor(v) else v)
                for k, v in local.items()}
        if self.stages is not None:
            full = _merge_stages(self.stages.all_gather_object(full, _STAGE_STATES))
        out = OrderedDict((k, full[k]) for k in self.plain_keys if k in full)
        out.update((k, v) for k, v in full.items() if k not in out)
        return out

    def localize(self, full: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
        """This rank's pieces of the ``keys`` it holds, cut from full entries."""
        name = self._tensor_names()
        return {k: (self.placement(name.get(k, k)).cut(self._my_rows(name.get(k, k), full[k]))
                    if torch.is_tensor(full[k]) else full[k]) for k in keys if k in full}

    def _rows(self, key: str, entry: torch.Tensor) -> Any:
        """``entry`` (this stage's part of ``key``), tagged with its row offset if it holds only some rows."""
        rows = self.stage_rows.get(key)
        return entry if rows is None else _Rows(rows[0], rows[2], entry)

    def _my_rows(self, key: str, full: torch.Tensor) -> torch.Tensor:
        rows = self.stage_rows.get(key)
        if rows is None:
            return full
        if full.dim() == 0 or full.shape[0] != rows[2]:
            raise ValueError(f"{key}: expected {rows[2]} rows, got shape {tuple(full.shape)}")
        return full.narrow(0, rows[0], rows[1])

    def full_shape(self, name: str, piece: torch.Tensor) -> torch.Size:
        shape = self.placement(name).full_shape(piece.shape)
        rows = self.stage_rows.get(name)
        return shape if rows is None else torch.Size((rows[2], *shape[1:]))

    def piece(self, t: torch.Tensor) -> Optional["Piece"]:
        """Where ``t`` is a parameter of the module (or views exactly its elements: ``p.data``) that this rank
        holds less than the whole of: its name, the whole shape and how to cut this rank's piece from a whole
        tensor. Else None. Local (not collective)."""
        for name, p in self.module.named_parameters():
            if p is t or same_elements(p, t):
                full = self.full_shape(name, p)
                if full == p.shape:
                    return None
                return Piece(name, full, lambda whole, name=name: self.localize({name: whole}, [name])[name])
        return None

    # ------------------------------------------------------------------ the module
    def full_state_dict(self) -> dict[str, Any]:
        return self.consolidate(self.module.state_dict())

    def load_full_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        local_keys = list(self.module.state_dict())
        missing = [k for k in local_keys if k not in state_dict]
        if strict and missing:
            raise KeyError(f"the checkpoint lacks {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        unexpected = [k for k in state_dict if k not in self.plain_keys and k not in local_keys]
        if strict and unexpected:
            raise KeyError(f"unexpected keys in the checkpoint: {unexpected[:10]}")
        self.before_load()
        with torch.no_grad():
            self.module.load_state_dict(self.localize(state_dict, local_keys), strict=False)
        self.after_load()

    # ------------------------------------------------------------------ optimizer state
    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        names = self._names()
        index = self._plain_ids(optimizer)
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        for group in optimizer.param_groups:
            ids = []
            for p in group["params"]:
                name = names[id(p)]
                ids.append(index[name])
                st = optimizer.state.get(p, {})
                if st:
                    place = self.placement(name)
                    state[index[name]] = {k: (self._rows(name, place.gather(v)) if _follows(v, p) else
                                              v.clone() if torch.is_tensor(v) else v) for k, v in sorted(st.items())}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        if self.stages is not None:  # each stage's optimizer has its own parameters: merge them
            merged_groups: list[dict[str, Any]] = []
            gathered = self.stages.all_gather_object((state, groups), _STAGE_OPTIMIZERS)
            for _, grps in gathered:
                for gi, g in enumerate(grps):
                    if gi == len(merged_groups):
                        merged_groups.append({**g, "params": []})
                    merged_groups[gi]["params"] = sorted(set(merged_groups[gi]["params"] + g["params"]))
            ids = sorted({i for st, _ in gathered for i in st})
            state = {i: _merge_stages([st[i] for st, _ in gathered if i in st]) for i in ids}
            groups = merged_groups
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> None:
        """``full``: a plain optimizer state, as one process's optimizer of the same groups saves it."""
        shapes = {n: self.full_shape(n, p) for n, p in self.module.named_parameters()}

        def convert(name: str, key: str, v: Any) -> Any:
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == shapes[name]:
                return self.placement(name).cut(self._my_rows(name, v))
            return v.clone() if torch.is_tensor(v) else v

        load_plain_optimizer_state(optimizer, full, self.module, self._plain_ids(optimizer), convert)


def same_elements(p: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` views exactly ``p``'s elements (``p.data``, ``p.detach()``)."""
    if t.device != p.device or t.is_meta or p.is_meta:
        return False
    return (t.shape == p.shape and t.stride() == p.stride() and t.storage_offset() == p.storage_offset()
            and t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr())


@dataclass(frozen=True)
class Piece:
    """A parameter this rank holds part of (:meth:`ModelState.piece`): ``cut(whole)`` gives this rank's part."""

    name: str
    full_shape: torch.Size
    cut: Callable[[torch.Tensor], torch.Tensor]


def _follows(value: Any, param: torch.Tensor) -> bool:
    """Optimizer state shaped like its parameter's piece is cut like it."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape


@dataclass
class _Rows:
    """Rows ``[offset, offset + len(tensor))`` of an entry with ``total`` rows, as one stage holds them."""

    offset: int
    total: int
    tensor: torch.Tensor


def _merge_stages(pieces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The stages' entries in one dict; rows that several stages hold of one entry joined in row order."""
    merged: dict[str, Any] = {}
    rows: dict[str, list[_Rows]] = {}
    for piece in pieces:
        for k, v in piece.items():
            if isinstance(v, _Rows):
                rows.setdefault(k, []).append(v)
            else:
                merged[k] = v
    for k, parts in rows.items():
        parts.sort(key=lambda r: r.offset)
        covered = [r.offset for r in parts] + [parts[-1].offset + parts[-1].tensor.shape[0]]
        expected = [0] + [r.offset + r.tensor.shape[0] for r in parts]
        if covered != expected or covered[-1] != parts[0].total:
            raise RuntimeError(f"{k}: the stages' rows {[(r.offset, r.tensor.shape[0]) for r in parts]} do not "
                               f"cover its {parts[0].total} rows exactly once")
        merged[k] = torch.cat([r.tensor for r in parts])
    return merged
