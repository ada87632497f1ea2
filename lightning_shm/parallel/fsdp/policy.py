"""Which modules become FSDP units (each unit's parameters are flattened and sharded together).

Default: every child of the model's top-level ``nn.Sequential`` that owns parameters (for the
reference MLP: the three Linear and two LayerNorm layers); parameters outside the Sequential go to
a unit per module whose forward reads them (the owner; for a parameter container, which has no forward,
the nearest enclosing module that is not one; for the children of an ``nn.MultiheadAttention`` or
``nn.TransformerEncoderLayer``, which read them in their own forward, that module). ``min_unit_params``
merges consecutive small Sequential children into one unit (fewer collectives); a callable
``policy(name, module) -> bool`` marks unit roots explicitly, like torch FSDP's ``auto_wrap_policy``; a set of
module classes (``{Block}``, as Lightning's ``FSDPStrategy(auto_wrap_policy={Block})`` takes) marks their
instances.

A unit is a list of consecutive modules executed one after the other; its parameters are those of
the modules' subtrees not claimed by a nested unit.

Shared parameters (a layer placed twice, weights tied between two modules -- GPT-2's head and input
embedding): one unit holds the parameter -- the first to claim it -- and every other module holding it
becomes a *placement* of that unit: the unit's gather/free hooks run around it too, so each holder
computes with the full parameter, and each application's gradient is reduce-scattered into the one
shard (autograd sums them, as in one process). No unit has to span the layers between the holders (as
torch FSDP asks of its users: wrap the common parent), and a tied embedding is sharded like any other
parameter. A layer placed several times needs nothing: its unit's hooks run at every placement. A
layer of the Sequential the model also reaches by another name (``self.classifier = self.net[-1]``, a
layer placed twice) may run alone, so it is a unit of its own even where ``min_unit_params`` merges
layers: a merged run's hooks open at its first layer and close at its last.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Optional, Union

import torch
from torch import nn

from lightning_shm.parallel.checkpointing import module_classes
from lightning_shm.parallel.sequential import find_sequential, layers_of, parameter_holders

PolicyFn = Callable[[str, nn.Module], bool]


@dataclass(frozen=True)
class InstancesOf:
    """The unit policy of a set of module classes: every instance is a unit root. Unlike a lambda doing the same,
    it pickles, so it reaches workers the fork server or spawn starts."""

    classes: tuple[type, ...]

    def __call__(self, name: str, module: nn.Module) -> bool:
        return isinstance(module, self.classes)


@dataclass
class UnitSpec:
    name: str
    modules: list[tuple[str, nn.Module]]
    params: list[tuple[str, nn.Module, str, nn.Parameter]] = field(default_factory=list)  # (full, owner, attr, p)
    # other modules whose forward reads some of ``params`` (a tied weight's other holders): gathered there too
    placements: list[tuple[str, nn.Module]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for *_, p in self.params)


@dataclass(frozen=True)
class UnitPolicy:
    """``min_unit_params`` (int >= 0) or ``fn`` (callable); at most one of them."""

    min_unit_params: int = 0
    fn: Optional[PolicyFn] = None

    def __post_init__(self) -> None:
        if self.min_unit_params < 0:
            raise ValueError(f"min_unit_params must be >= 0, got {self.min_unit_params}")
        if self.fn is not None and self.min_unit_params:
            raise ValueError("give either a policy callable or min_unit_params, not both")

    @classmethod
    def parse(cls, policy: Union[None, int, PolicyFn, "UnitPolicy", AbstractSet[type]]) -> "UnitPolicy":
        if policy is None:
            return cls()
        if isinstance(policy, UnitPolicy):
            return policy
        if isinstance(policy, int) and not isinstance(policy, bool):
            return cls(min_unit_params=policy)
        classes = module_classes(policy)
        if classes:
            return cls(fn=InstancesOf(classes))
        if callable(policy) and not isinstance(policy, type):
            return cls(fn=policy)
        raise ValueError(f"unit policy must be None, an int (min_unit_params), a set of nn.Module classes (their "
                         f"instances are units) or a callable (name, module) -> bool, got {policy!r}")


# modules without a forward of their own: what they hold is read directly, never inside a call of theirs
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def tied_outside(module: nn.Module, sequential: Optional[str] = None) -> set[int]:
    """Ids of the parameters a module outside the Sequential (``sequential``: its path; default the first
    top-level one) shares with another module -- GPT-2's input embedding, applied in the step, tied to the
    Sequential's output layer. Without a Sequential, every parameter shared between modules."""
    try:
        inside = {id(m) for m in find_sequential(module, sequential)[1].modules()}
    except ValueError:
        inside = set()
    return {pid for pid, holders in parameter_holders(module).items()
            if len(mods := {id(m) for _, m in holders}) > 1 and not mods <= inside}


def kept_whole(module: nn.Module, tied: Optional[set[int]] = None) -> dict[str, nn.Parameter]:
    """Parameters no unit can gather, which FSDP keeps whole on every rank (their gradients averaged, as
    DDP does): the module's own -- a LightningModule's learned temperature, read in its step, where no
    submodule's forward hook sees the read --, those of the parameter containers it holds (an
    ``nn.ParameterDict`` of per-task prompts, an ``nn.ParameterList`` of layer-mixing weights, also inside
    a ``ModuleDict`` / ``ModuleList``: they have no forward, so every read is direct), 0-d ones (no rows
    to cut), ``tied`` ones (ids: a pipeline stage's parameters tied to a module another stage runs --
    GPT-2's embedding and head -- whose gradients the stages sum whole) and those of TorchScript modules
    (``torch.jit.script(block)``): a scripted forward runs no hooks and reads its own parameter slots, so no
    unit could gather around it ("register_forward_pre_hook is not supported on ScriptModules", refused until
    2026-12-06). Mostly small: 1/W of them would save little."""
    read_directly, todo = [], [module]
    while todo:  # the module and the containers reachable from it through containers only
        m = todo.pop()
        read_directly.append(m)
        todo.extend(c for c in m.children() if isinstance(c, CONTAINERS))
    whole = {id(p) for m in read_directly for p in m.parameters(recurse=False)} | (tied or set())
    whole |= {id(p) for _, m in scripted(module) for p in m.parameters()}
    return {n: p for n, p in module.named_parameters() if id(p) in whole or p.dim() == 0}


def scripted(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost TorchScript modules inside ``module`` that hold parameters (see :func:`kept_whole`)."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if isinstance(m, torch.jit.ScriptModule) and next(m.parameters(), None) is not None \
                and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, m))
    return found


def split_off_other_dtypes(units: list[UnitSpec]) -> dict[str, nn.Parameter]:
    """A unit is one flat tensor, so of one dtype. Where a unit's modules hold several -- a Fourier layer's
    complex mode weights beside its real bias, a float64 head kept in a float32 block -- the parameters of every
    dtype but the one holding most of its elements leave the unit (``units`` is changed in place) and are
    returned, to be kept whole as :func:`kept_whole`'s are: mostly small, where refusing the unit stopped the
    model."""
    apart: dict[str, nn.Parameter] = {}
    for u in units:
        numel: Counter = Counter()
        for *_, p in u.params:
            numel[p.dtype] += p.numel()
        if len(numel) > 1:
            main = max(numel, key=lambda dt: (numel[dt], str(dt)))  # the same choice on every rank
            apart.update({n: p for n, _, _, p in u.params if p.dtype != main})
            u.params = [t for t in u.params if t[3].dtype == main]
    return apart


def selects_nothing(module: nn.Module, policy: UnitPolicy) -> bool:
    """A unit policy that selects no module holding parameters: a mistake, not "shard everything per module".
    Checked on the whole model -- a pipeline stage may well hold none of the selected modules."""
    return policy.fn is not None and not any(
        p.numel() for n, m in module.named_modules() if n and policy.fn(n, m) for p in m.parameters())


def find_units(module: nn.Module, policy: UnitPolicy, layers: Optional[list[tuple[str, nn.Module]]] = None,
               tied: Optional[set[int]] = None) -> list[UnitSpec]:
    """Units in execution order of ``layers`` (qualified name, module) -- by default the children of the
    model's Sequential -- and registration order for everything else. :func:`kept_whole` parameters
    belong to no unit."""
    exclude = frozenset(id(p) for p in kept_whole(module, tied).values())
    roots: list[list[tuple[str, nn.Module]]] = []
    if policy.fn is not None:  # the rest of the parameters: units of their own, as below
        roots = [[(n, m)] for n, m in module.named_modules() if n and policy.fn(n, m)]
    else:
        if layers is None:
            try:
                prefix, seq = find_sequential(module)
                layers = [(f"{prefix}.{n}" if prefix else n, c) for n, c in layers_of(seq)]
            except ValueError:
                layers = []
        if layers:
            # a layer reachable under another name too (kept as ``self.classifier``, placed twice) may run alone:
            # it gets a unit of its own, whose hooks open and close around each call
            names = Counter(id(m) for _, m in module.named_modules(remove_duplicate=False))
            roots = _runs(layers, policy.min_unit_params, {id(c) for _, c in layers if names[id(c)] > 1})
    claimed: set[int] = set(exclude)
    units: list[UnitSpec] = []
    for mods in roots:  # nested roots first would claim their own params: process deepest names first
        units.append(UnitSpec(name="+".join(n for n, _ in mods) or "<root>", modules=mods))
    for unit in sorted(units, key=lambda u: -min(n.count(".") for n, _ in u.modules)):
        for mname, mod in unit.modules:
            for sub, owner in mod.named_modules(prefix=mname):
                for attr, p in owner.named_parameters(recurse=False):
                    if id(p) not in claimed:
                        claimed.add(id(p))
                        unit.params.append((f"{sub}.{attr}" if sub else attr, owner, attr, p))
    # parameters outside every unit: one unit per module whose forward reads them -- the owner; for a
    # container's parameters (a head's nn.ParameterList) the nearest enclosing module that is not a container;
    # under a READ_BY_PARENT module (an attention-pooling head, an encoder layer) the outermost such module
    modules = dict(module.named_modules())
    outside: dict[str, UnitSpec] = {}
    for owner_name, owner in modules.items():
        for a, p in owner.named_parameters(recurse=False):
            if id(p) in claimed:
                continue
            caller = _caller(modules, owner_name)
            u = outside.setdefault(caller, UnitSpec(name=caller or "<root>", modules=[(caller, modules[caller])]))
            claimed.add(id(p))
            u.params.append((f"{owner_name}.{a}" if owner_name else a, owner, a, p))
    units.extend(outside.values())
    units = [u for u in units if u.params]
    _place_shared(module, units)
    for u in units:  # execution order within a unit = parameter registration order
        order = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
        u.params.sort(key=lambda t: order[id(t[3])])
    return units


def _runs(layers: list[tuple[str, nn.Module]], min_params: int, alone: set[int]) -> list[list[tuple[str, nn.Module]]]:
    """Consecutive layers grouped until a run holds ``min_params`` parameters (at least one); parameter-free layers
    before any parameters run outside units, trailing ones join the last run; a layer in ``alone`` (ids) holding
    parameters is a run of its own."""
    roots: list[list[tuple[str, nn.Module]]] = []
    group: list[tuple[str, nn.Module]] = []
    size = 0

    def close() -> None:
        nonlocal group, size
        if size:
            roots.append(group)
        elif group and roots:
            roots[-1].extend(group)
        group, size = [], 0

    for qname, child in layers:
        n = sum(p.numel() for p in child.parameters())
        if n and id(child) in alone:
            close()
            roots.append([(qname, child)])
        elif n or group:  # Flatten, ReLU before any parameters: run outside units
            group.append((qname, child))
            size += n
            if size >= max(min_params, 1):
                close()
    close()
    return roots


def _caller(modules: dict[str, nn.Module], owner: str) -> str:
    """The module whose forward reads the parameters ``owner`` holds: itself; for a container (a head's
    ``nn.ParameterList``) the nearest enclosing module that is not one; under a READ_BY_PARENT module (an
    attention-pooling head, an encoder layer) the outermost such module."""
    caller = owner
    while caller and isinstance(modules[caller], CONTAINERS):
        caller = caller.rpartition(".")[0]
    path = caller.split(".")
    return next((n for n in (".".join(path[:k]) for k in range(1, len(path) + 1))
                 if isinstance(modules.get(n), READ_BY_PARENT)), caller)


def _place_shared(module: nn.Module, units: list[UnitSpec]) -> None:
    """Every module that reads one of a unit's parameters under a name outside the unit's modules becomes a
    placement of that unit: the other holder of a tied weight (in another unit or in none), a layer inside one
    of the unit's layers that the model also keeps under a second name (``self.head = self.net[4][0]``), which
    the step may call alone, and a :data:`READ_BY_PARENT` module around a unit's layer (an attention reading its
    ``out_proj`` unit's weight itself). Called inside the unit, such a module finds it gathered (the hooks count
    how deep the unit's forwards are open)."""
    holders = parameter_holders(module)
    modules = dict(module.named_modules(remove_duplicate=False))  # a layer placed twice: under both names
    for unit in units:
        runs = [n for n, _ in unit.modules]
        hooked = {id(m) for n, m in unit.modules if len(unit.modules) == 1}  # gathers alone already
        for *_, p in unit.params:
            for hname, _ in holders[id(p)]:
                name = _caller(modules, hname.rpartition(".")[0])
                if not any(name == r or name.startswith(f"{r}.") for r in runs) and id(modules[name]) not in hooked:
                    unit.placements.append((name, modules[name]))
                    runs.append(name)
                    hooked.add(id(modules[name]))


# torch modules whose forward reads their children's parameters itself, not through the children's
# forward: MultiheadAttention (``out_proj.weight`` in F.multi_head_attention_forward), TransformerEncoderLayer
# (its inference fast path reads every weight)
READ_BY_PARENT = (nn.MultiheadAttention, nn.TransformerEncoderLayer)
