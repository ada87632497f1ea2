"""Which modules become FSDP units (each unit's parameters are flattened and sharded together).

Default: every child of the model's top-level ``nn.Sequential`` that owns parameters (for the
reference MLP: the three Linear and two LayerNorm layers); parameters outside the Sequential go to
a unit per module whose forward reads them (the owner; for a parameter container, which has no forward,
the nearest enclosing module that is not one; for the children of an ``nn.MultiheadAttention`` or
``nn.TransformerEncoderLayer``, which read them in their own forward, that module). ``min_unit_params``
merges consecutive small Sequential children into one unit (fewer collectives); a callable
``policy(name, module) -> bool`` marks unit roots explicitly, like torch FSDP's ``auto_wrap_policy``.

A unit is a list of consecutive modules executed one after the other; its parameters are those of
the modules' subtrees not claimed by a nested unit.

Shared parameters (a layer placed twice, weights tied between two layers): a unit gathers its
parameters around its own modules' forward only, so every module holding a parameter must run inside
the unit that holds it. A layer placed several times needs nothing: its unit's hooks run at every
placement. Units of different layers that share a parameter are joined into one unit (with the layers
between them, as torch FSDP asks its users to wrap the common parent); a unit policy that separates
them is refused, naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from torch import nn

from lightning_shm.parallel.sequential import find_sequential, layers_of, parameter_holders, shared_spans

PolicyFn = Callable[[str, nn.Module], bool]


@dataclass
class UnitSpec:
    name: str
    modules: list[tuple[str, nn.Module]]
    params: list[tuple[str, nn.Module, str, nn.Parameter]] = field(default_factory=list)  # (full, owner, attr, p)

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
    def parse(cls, policy: Union[None, int, PolicyFn, "UnitPolicy"]) -> "UnitPolicy":
        if policy is None:
            return cls()
        if isinstance(policy, UnitPolicy):
            return policy
        if isinstance(policy, int) and not isinstance(policy, bool):
            return cls(min_unit_params=policy)
        if callable(policy):
            return cls(fn=policy)
        raise ValueError(f"unit policy must be None, an int (min_unit_params) or a callable, got {policy!r}")


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
    to cut) and :func:`tied_outside` ones (``tied``: found on the whole model, before a pipeline cut hid
    one of the holders from this stage): no one unit runs around both holders. Mostly small: 1/W of them
    would save little (a tied embedding is the exception; it costs its size on every rank)."""
    read_directly, todo = [], [module]
    while todo:  # the module and the containers reachable from it through containers only
        m = todo.pop()
        read_directly.append(m)
        todo.extend(c for c in m.children() if isinstance(c, CONTAINERS))
    whole = {id(p) for m in read_directly for p in m.parameters(recurse=False)}
    whole |= tied_outside(module) if tied is None else tied
    return {n: p for n, p in module.named_parameters() if id(p) in whole or p.dim() == 0}


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
            group: list[tuple[str, nn.Module]] = []
            size = 0
            for qname, child in layers:
                n = sum(p.numel() for p in child.parameters())
                if n == 0 and not group:
                    continue  # Flatten, ReLU before any parameters: run outside units
                group.append((qname, child))
                size += n
                if size >= max(policy.min_unit_params, 1):
                    roots.append(group)
                    group, size = [], 0
            if group and size:
                roots.append(group)
            elif group and roots:  # trailing parameter-free modules belong to the last unit
                roots[-1].extend(group)
            roots = _join_shared(roots, layers)
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
            caller = owner_name
            while caller and isinstance(modules[caller], CONTAINERS):
                caller = caller.rpartition(".")[0]
            path = caller.split(".")
            caller = next((n for n in (".".join(path[:k]) for k in range(1, len(path) + 1))
                           if isinstance(modules.get(n), READ_BY_PARENT)), caller)
            u = outside.setdefault(caller, UnitSpec(name=caller or "<root>", modules=[(caller, modules[caller])]))
            claimed.add(id(p))
            u.params.append((f"{owner_name}.{a}" if owner_name else a, owner, a, p))
    units.extend(outside.values())
    units = [u for u in units if u.params]
    _check_shared(module, units)
    for u in units:  # execution order within a unit = parameter registration order
        order = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
        u.params.sort(key=lambda t: order[id(t[3])])
    return units


def _join_shared(roots: list[list[tuple[str, nn.Module]]],
                 layers: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """Consecutive layer groups -> the same, with the groups from the first to the last holder of each
    shared parameter (and the layers between them) joined into one."""
    position = {name: i for i, (name, _) in enumerate(layers)}
    ranges = [[position[r[0][0]], position[r[-1][0]]] for r in roots]
    for span in shared_spans(layers):
        if len({id(layers[i][1]) for i in span.positions}) == 1:
            continue  # one layer placed several times: its unit's hooks run at every placement
        a = next(k for k, (lo, hi) in enumerate(ranges) if lo <= span.first <= hi)
        b = next(k for k, (lo, hi) in enumerate(ranges) if lo <= span.last <= hi)
        if a != b:
            ranges[a:b + 1] = [[ranges[a][0], ranges[b][1]]]
    return [layers[lo:hi + 1] for lo, hi in ranges]


# torch modules whose forward reads their children's parameters itself, not through the children's
# forward: MultiheadAttention (``out_proj.weight`` in F.multi_head_attention_forward), TransformerEncoderLayer
# (its inference fast path reads every weight)
READ_BY_PARENT = (nn.MultiheadAttention, nn.TransformerEncoderLayer)


def _check_shared(module: nn.Module, units: list[UnitSpec]) -> None:
    """Every module holding -- or, for :data:`READ_BY_PARENT`, reading -- a unit's parameter must run
    inside that unit (deepest unit wins), else ValueError naming the parameter and both units."""
    inside: dict[int, UnitSpec] = {}
    for unit in sorted(units, key=lambda u: min((n.count(".") if n else -1) for n, _ in u.modules)):
        for _, m in unit.modules:
            for sub in m.modules():
                inside[id(sub)] = unit
    holders = parameter_holders(module)
    readers: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, m in module.named_modules():
        if isinstance(m, READ_BY_PARENT):
            for p in m.parameters():
                readers.setdefault(id(p), []).append((name, m))
    for unit in units:
        for pname, *_, p in unit.params:
            for hname, m in holders[id(p)]:
                other = inside.get(id(m))
                if other is not unit:
                    raise ValueError(
                        f"'{pname}' and '{hname}' are one parameter, but FSDP unit '{unit.name}' holds it and "
                        f"'{hname}' runs in {f'unit {other.name!r}' if other else 'no unit'}: a unit gathers its "
                        "parameters only around its own modules. Choose units that put every module holding it "
                        "in one unit (e.g. a policy that selects their common parent).")
            for rname, reader in readers.get(id(p), []):
                other = inside.get(id(reader))
                if other is not unit:
                    raise ValueError(
                        f"{type(reader).__name__} '{rname}' reads '{pname}' in its own forward (not through the "
                        f"child's forward), but FSDP unit '{unit.name}' holds it and '{rname}' runs in "
                        f"{f'unit {other.name!r}' if other else 'no unit'}, which would find this rank's rows "
                        "only. Leave the children of such a module in its unit (a policy that does not select "
                        "them).")
