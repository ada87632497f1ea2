"""Finding the model's ``nn.Sequential``: the structure FSDP units, TP plans and pipeline stages come from."""

from __future__ import annotations

from typing import Optional

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
            raise ValueError(f"'{name}' is a {type(seq).__name__}, not an nn.Sequential")
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
    raise ValueError(f"{type(module).__name__} has no top-level nn.Sequential to split; pass sequential='<attribute "
                     "name>' or build the model around an nn.Sequential")


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
