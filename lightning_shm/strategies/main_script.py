"""What a spawned or fork-server worker needs of the main script, checked before any worker starts.

Such a worker is a new interpreter (or a child of the fork server, which imported torch and lightning but
not the user's code): Python's multiprocessing makes it import the main script again -- as ``__mp_main__``,
so that what the script defines (the LightningModule's class, a dataset's) unpickles -- and then hands it
what ``fit`` was given::

    main process:  python train.py -> line 9: trainer.fit(model)  -> launcher -> W workers
    each worker:   runs train.py again as __mp_main__            -> unpickles (trainer, model) -> fit

So the main script must exist as a file, and its training code must sit under ``if __name__ ==
"__main__":``: unguarded, each worker's re-run reaches ``fit`` itself and dies in it -- after importing torch
and lightning (4-8 s here) and with Lightning's advice to use ``strategy="ddp"``. Forked workers
(``start_method="fork"``, the ``_fork`` twins) copy the running process and import nothing.
"""

from __future__ import annotations

import ast
import linecache
import os
import pickle
import sys
import tokenize
import types
from typing import Any, Optional


def check_main_script(start_method: str, payload: Any, strategy_cls: type) -> None:
    """RuntimeError, before any worker starts, where the workers could not import the main script, could not
    find what ``payload`` (what they receive) refers to in it, or would run its training call again. The advice
    names ``strategy_cls``'s fork twin."""
    fork = fork_twin(strategy_cls)
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is not None and getattr(main, "__spec__", None) is None and not os.path.isfile(path):
        raise RuntimeError(
            f"start_method={start_method!r} starts each worker by importing the main script again, but it has no file "
            f"({path!r}: a script read from stdin or typed interactively). Save it to a file, or pass {fork}."
        )
    if path is None and getattr(main, "__spec__", None) is None:
        defined = _defined_in_main(payload)
        if defined:
            raise RuntimeError(
                f"start_method={start_method!r} starts each worker in a new interpreter, which cannot see what this "
                f"session defined in __main__ ({', '.join(defined[:5])}): there is no main script to import "
                f"(a notebook, python -c). Pass {fork} (as Lightning's 'ddp_notebook'), or move those definitions "
                "into a module."
            )
    rerun = _script_run_again(main)
    if rerun is None:
        return
    path, tree = rerun
    line = _calling_line(main)
    if line is not None and _statement_is_unguarded(tree, line):
        source = linecache.getline(path, line).strip()
        source = source if len(source) <= 100 else source[:97] + "..."
        raise RuntimeError(
            f"start_method={start_method!r} starts each worker by running the main script again ({path}), and its "
            f"line {line} -- `{source}`, which led here -- is not under `if __name__ == \"__main__\":`: each "
            "worker would run it again and fail there. Put the script's training code under that guard (def "
            f"main(): ...; if __name__ == \"__main__\": main()), or pass {fork}: forked workers run nothing again."
        )
    guarded = _names_bound_only_under_the_guard(tree)
    # (a class defined inside a function never pickles: the launch names it, with its own advice)
    missing = [n for n in (_defined_in_main(payload) if guarded else [])
               if n.split(".")[0] in guarded and "<locals>" not in n]
    if missing:
        them = "it" if len(missing) == 1 else "them"
        raise RuntimeError(
            f"start_method={start_method!r} starts each worker by running the main script again ({path}) as "
            f"__mp_main__, which skips the body of `if __name__ == \"__main__\":`; what the workers receive refers "
            f"to {', '.join(missing[:5])}, defined only there, so they could not unpickle {them}. Define {them} "
            f"above the guard (or in a module), or pass {fork}."
        )


def fork_twin(strategy_cls: type) -> str:
    """How to ask for ``strategy_cls`` with forked workers: its registered name's ``_fork`` twin, or the class."""
    from lightning_shm.strategies import REGISTRY  # (the package imports the launcher, which imports this)

    names = [name for name, cls, _ in REGISTRY if cls is strategy_cls]
    keyword = f"{strategy_cls.__name__}(..., start_method='fork')"
    return f"start_method='fork' (strategy='{names[0]}_fork', or {keyword})" if names else keyword


def _script_run_again(main: Optional[types.ModuleType]) -> Optional[tuple[str, ast.Module]]:
    """The main script's path and syntax where multiprocessing runs it again in each worker; None where it
    does not (no file, a package's ``__main__``: ``python -m pkg``) or the file does not parse."""
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if path is None or spec_name == "__main__" or (spec_name or "").endswith(".__main__"):
        return None
    try:
        with tokenize.open(path) as f:
            return path, ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None


def _calling_line(main: types.ModuleType) -> Optional[int]:
    """The main script's top-level line running now (the statement that led to ``fit``); None where ``fit`` was
    not called from it (a thread, an event loop)."""
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    return frame.f_lineno if frame is not None else None


def _statement_is_unguarded(tree: ast.Module, line: int) -> bool:
    """Whether the top-level statement holding ``line`` runs when the module is imported under another name.

    Says True only when sure: the statement is not, and holds no, ``if`` that tests ``__name__``, and no
    earlier top-level ``if`` tests it (``if __name__ != "__main__": sys.exit()``). Any other test of
    ``__name__`` -- ``in ("__main__", "__mp_main__")`` -- is left to the workers, who fail with Lightning's
    message if it was not a guard."""
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return not any(_tests_name(n) for n in ast.walk(node))
        if _tests_name(node):
            return False
    return False


def _names_bound_only_under_the_guard(tree: ast.Module) -> set[str]:
    """Classes and functions the module defines only in the body of ``if __name__ == "__main__":`` -- a worker
    running it as ``__mp_main__`` has none of them. A name bound anywhere else (an import, another branch,
    another test of ``__name__``) counts as defined: where unsure, nothing is refused. Variables bound under
    the guard (the model, the trainer) are not asked about: only classes and functions pickle by name, and an
    empty answer spares the launch a pass over what the workers receive."""
    inside: set[str] = set()
    outside: set[str] = set()
    for node in tree.body:
        if _is_main_guard(node):
            inside.update(n.name for stmt in node.body for n in ast.walk(stmt)
                          if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
            outside.update(_bound(node.orelse))
        else:
            outside.update(_bound([node]))
    return inside - outside


def _bound(statements: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for n in (n for stmt in statements for n in ast.walk(stmt)):
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
    return names


def _is_main_guard(node: ast.AST) -> bool:
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
        return False
    sides = [node.test.left, node.test.comparators[0]]
    return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def _tests_name(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))


def _defined_in_main(payload: Any) -> list[str]:
    """Classes and functions of ``__main__`` that pickling ``payload`` (what the workers receive) refers to."""
    found: dict[str, None] = {}

    class Finder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
                found[obj.__qualname__] = None
            return NotImplemented

    class Discard:
        def write(self, data: bytes) -> int:
            return len(data)

    try:
        Finder(Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    except Exception:  # something that does not pickle at all: the launch itself reports it
        pass
    return list(found)
