"""Finding the model's ``nn.Sequential``: the structure FSDP units, TP plans and pipeline stages come from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import nn


def find_sequential(module: nn.Module, name: Optional[str] = None) -> tuple[str, nn.Sequential]:
    """``(attribute path, Sequential)``: the one named ``name``, else the module itself if it is one, else
    its first top-level Sequential child. Raises ValueError naming the model when there is none."""
    if name is not None:
        try:
            seq = module.get_submodule(name) if name else module
        except AttributeError:
            raise ValueError(f"{type(module).__name__} has no submodule '{name}'") from None
        if _compiled(seq):
            raise ValueError(_compiled_message(f"'{name}'"))
        if not isinstance(seq, nn.Sequential):
            raise ValueError(f"'{name}' is a {type(seq).__name__}, not an nn.Sequential"
                             + (_as_sequential(name, seq) if isinstance(seq, nn.ModuleList) else ""))
        return name, seq
    if isinstance(module, nn.Sequential):
        return "", module
    if _compiled(module):  # its one child, `_orig_mod`, would pass for the Sequential below
        raise ValueError(_compiled_message("the model"))
    for n, child in module.named_children():
        if isinstance(child, nn.Sequential):
            return n, child
    compiled = [n for n, child in module.named_children() if _compiled(child)]
    if compiled:
        raise ValueError(_compiled_message(f"'{compiled[0]}'"))
    lists = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    raise ValueError(f"{type(module).__name__} has no top-level nn.Sequential to split; pass sequential='<attribute "
                     "name>' or build the model around an nn.Sequential"
                     + (f". Its blocks are in the ModuleList '{lists[0][0]}'" + _as_sequential(*lists[0]) if lists
                        else ""))


def _as_sequential(name: str, blocks: nn.ModuleList) -> str:
    """How a ModuleList the forward runs block after block becomes the Sequential the layouts split."""
    return (f" ({len(blocks)} modules): the strategies split an nn.Sequential the step calls once. If the forward "
            f"runs them one after another (for block in self.{name}: x = block(x)), build them as nn.Sequential("
            f"*blocks) -- the same parameter names, so checkpoints still load -- call it once, x = self.{name}(x), "
            f"and pass sequential='{name}'")


def copies_of(module: nn.Module, seq_name: str) -> list[tuple[str, nn.Sequential]]:
    """The top-level children of ``module`` that copy the architecture of its Sequential ``seq_name``
    (``copy.deepcopy(self.net)``): Sequentials with the same module types in the same places and the same
    parameter names and shapes. A BYOL / DINO / mean-teacher EMA target is one, updated by
    ``zip(teacher.parameters(), net.parameters())``: paired by position with the Sequential's parameters,
    it must be split as the Sequential is (tensor parallelism does so), or the pairs mismatch -- a shape
    error, or silently other layers where shapes agree (a pipeline stage holds only its layers)."""
    seq = module.get_submodule(seq_name) if seq_name else module
    kinds = [(n, type(m)) for n, m in seq.named_modules()]
    shapes = [(n, p.shape) for n, p in seq.named_parameters()]
    return [(n, c) for n, c in module.named_children()
            if n != seq_name and c is not seq and isinstance(c, nn.Sequential)
            and [(k, type(m)) for k, m in c.named_modules()] == kinds
            and [(k, p.shape) for k, p in c.named_parameters()] == shapes]


def compiled_original(m: nn.Module) -> Optional[nn.Module]:
    """The module ``torch.compile`` wrapped, if ``m`` is such a wrapper (torch's ``OptimizedModule`` keeps
    it as ``_orig_mod``), else None."""
    inner = getattr(m, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def _compiled(m: nn.Module) -> bool:
    return isinstance(compiled_original(m), nn.Sequential)


def _compiled_message(what: str) -> str:
    return (f"{what} is a torch.compile'd nn.Sequential: the Sequential is what this strategy splits (into "
            "pipeline stages, tensor-parallel layers), and a compiled module cannot be cut. Pass the model "
            "uncompiled.")


def replace_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, new)


def layers_of(seq: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` in the order the Sequential's forward runs them. A module placed at two positions
    (one layer applied twice, ALBERT-style sharing) appears at both: ``named_children()`` lists it once,
    which drops the second application and shifts every later index."""
    return list(seq._modules.items())


def parameter_holders(module: nn.Module, prefix: str = "") -> dict[int, list[tuple[str, nn.Module]]]:
    """Per parameter (by id): every ``(qualified name, module holding it)`` -- several for weights tied
    between modules or a module reachable under two names."""
    out: dict[int, list[tuple[str, nn.Module]]] = {}
    for mname, m in module.named_modules(prefix=prefix, remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((f"{mname}.{attr}" if mname else attr, m))
    return out


def held_outside(module: nn.Module, part: nn.Module) -> dict[int, str]:
    """Per parameter (id) that ``module`` holds under some name outside ``part``, its first such name, in
    ``named_modules`` order: with ``part``'s own, those tied to a module outside it (GPT-2's input embedding,
    applied in the step, tied to the Sequential's output layer) and those of its layers the module also keeps
    under another name (``self.classifier = self.net[-1]``, ``self.features = self.net[:4]``). The names and
    their order do not depend on what ``part`` holds -- the same on every pipeline stage."""
    paths = [n for n, m in module.named_modules(remove_duplicate=False) if m is part]
    out: dict[int, str] = {}
    for n, m in module.named_modules(remove_duplicate=False):
        if not any(n == q or n.startswith(f"{q}.") for q in paths):
            for a, p in m.named_parameters(recurse=False):
                out.setdefault(id(p), f"{n}.{a}" if n else a)
    return out


@dataclass(frozen=True)
class SharedSpan:
    """Layers of a Sequential (``positions``, at least two) that hold the same parameter (``names``: its
    qualified names, one per holder): a module placed twice, or weights tied between two modules (``tied``: no
    holder module sits at two positions, so the holders share nothing else -- no buffers, no hooks' state)."""

    positions: tuple[int, ...]
    names: tuple[str, ...]
    tied: bool = False

    @property
    def first(self) -> int:
        return self.positions[0]

    @property
    def last(self) -> int:
        return self.positions[-1]

    def __str__(self) -> str:
        return f"layers {self.first} and {self.last} share one parameter ({' = '.join(self.names)})"


def shared_spans(layers: Sequence[tuple[str, nn.Module]]) -> list[SharedSpan]:
    """Every parameter held at more than one position of ``layers`` (``(qualified name, layer)``), as the
    span from its first to its last holder. Parallelisms that give layers to different owners (pipeline
    stages, FSDP units, tensor-parallel pieces) must keep each span with one owner: two copies of a
    parameter would each get only their own layers' gradient and drift apart."""
    where: dict[int, list[tuple[int, str, nn.Module]]] = {}
    for i, (lname, layer) in enumerate(layers):
        for pid, held in parameter_holders(layer, lname).items():
            where.setdefault(pid, []).extend((i, name, m) for name, m in held)
    spans = []
    for holders in where.values():
        positions = tuple(sorted({i for i, _, _ in holders}))
        if len(positions) > 1:
            at: dict[int, set[int]] = {}  # holder module -> the positions it sits at
            for i, _, m in holders:
                at.setdefault(id(m), set()).add(i)
            spans.append(SharedSpan(positions, tuple(dict.fromkeys(n for _, n, _ in holders)),
                                    tied=all(len(where_m) == 1 for where_m in at.values())))
    return sorted(spans, key=lambda s: (s.first, s.last))
