"""The one mistake a script that calls ``pipesim.run`` can make before any rank starts:
calling it at the script's top level.

``pipesim.run`` starts its ranks with multiprocessing's *spawn*, which imports the main
script afresh in every rank. A script whose call is not under ``if __name__ ==
"__main__":`` makes each rank run the script again and fail while it is still starting,
which the launcher can only report as a rank that exited before its first action. So
``pipesim.run`` reads its caller's script first and names the missing guard instead.
Notebooks, ``python -c`` and code run under the guard are left alone.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


class MissingMainGuardError(RuntimeError):
    """A script calls ``pipesim.run`` where every spawned rank would call it again."""


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either side of the comparison)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    return any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides) and any(
        isinstance(side, ast.Constant) and side.value == "__main__" for side in sides)


def _run_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names the script calls ``pipesim.run`` by: module aliases (``import pipesim as
    ps``: ``ps``) and function names (``from pipesim import run as launch``: ``launch``)."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name for alias in node.names if alias.name == "pipesim"}
        elif isinstance(node, ast.ImportFrom) and node.module == "pipesim":
            functions |= {alias.asname or alias.name for alias in node.names if alias.name == "run"}
    return modules, functions


def _unguarded_run_calls(tree: ast.Module) -> list[int]:
    """Lines of ``pipesim.run(...)`` calls that execute on import: in module-level
    statements outside the main guard, function and class bodies."""
    modules, functions = _run_names(tree)
    lines = []
    pending = [node for node in tree.body if not _is_main_guard(node)]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "run" and isinstance(func.value, ast.Name)
                    and func.value.id in modules) or (isinstance(func, ast.Name) and func.id in functions):
                lines.append(node.lineno)
        pending.extend(ast.iter_child_nodes(node))
    return sorted(lines)


def require_main_guard() -> None:
    """Raise ``MissingMainGuardError`` naming the script and line when the running main
    script calls ``pipesim.run`` outside ``if __name__ == "__main__":``."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:  # a notebook or python -c: nothing is imported again
        return
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = _unguarded_run_calls(tree)
    if lines:
        raise MissingMainGuardError(
            f"{path}, line {lines[0]}: pipesim.run starts its ranks with multiprocessing's spawn, which imports this "
            f"script again in every rank; put the call under `if __name__ == \"__main__\":` so the ranks do not run "
            f"it again")
