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
        if not isinstance(seq, nn.Sequential):
            raise ValueError(f"'{name}' is a {type(seq).__name__}, not an nn.Sequential")
        return name, seq
    if isinstance(module, nn.Sequential):
        return "", module
    for n, child in module.named_children():
        if isinstance(child, nn.Sequential):
            return n, child
    raise ValueError(f"{type(module).__name__} has no top-level nn.Sequential to split; pass sequential='<attribute "
                     "name>' or build the model around an nn.Sequential")


def replace_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, new)
