"""Imports point down only (DESIGN.md's layering), and no package imports itself round a cycle.

Every import statement of the product packages is read from the source (``ast``, so the
imports inside functions count too), each module is placed in its room, and each room
may import only the rooms listed below it. The order, top to bottom: the command line
and the Python API (which may load anything, lazily), the planner, a ``Job``, the
simulation, the cluster and the model side by side, the GPUs' datasheets, then
``schedules``; the executor reads ``schedules`` and the model's description only, the
charts read ``schedules`` and ``pipesim`` but never torch or simpy.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("schedules", "pipesim", "executor", "viz")

_BOTTOM = {"pipesim.hardware"}
_SIDE_BY_SIDE = _BOTTOM | {"schedules"}
_SIMULATION = _SIDE_BY_SIDE | {"pipesim.cluster", "pipesim.model", "pipesim.sim"}
# room -> the rooms (and third-party packages of concern) it may import, besides its own
ALLOWED: dict[str, set[str]] = {
    "schedules": {"schedules.generators"},
    "schedules.generators": {"schedules"},
    "pipesim.hardware": set(),
    "pipesim.cluster": _SIDE_BY_SIDE,
    "pipesim.model": _SIDE_BY_SIDE,
    "pipesim.sim": (_SIMULATION - {"pipesim.sim"}) | {"simpy"},
    "pipesim.job": _SIMULATION,
    "pipesim.plan": _SIMULATION | {"pipesim.job"},
    "executor": {"schedules", "pipesim.model", "pipesim.hardware", "torch"},
    "viz": _SIMULATION | {"pipesim.job", "pipesim.plan", "plotly"},
}
TOP = {"pipesim.cli", "pipesim.api", "pipesim"}  # may import every room, lazily
WATCHED = {"torch", "simpy", "plotly", *ALLOWED, *TOP}
# the one module of schedules that imports simpy: the engine's specification
SIMPY_IN_SCHEDULES = "schedules.engine_reference"


def room_of(module: str) -> str:
    """The room a dotted module name belongs to: a package of ``pipesim`` (its root modules
    ``api`` and ``job`` are rooms of their own), ``schedules.generators``, or the top-level
    package; third-party names come back as their top-level package."""
    parts = module.split(".")
    if parts[0] == "pipesim" and len(parts) > 1 and parts[1] not in ("__init__", "__main__"):
        return f"pipesim.{parts[1]}"
    if parts[:2] == ["schedules", "generators"]:
        return "schedules.generators"
    return parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every module ``source`` imports, absolute, wherever the statement stands."""
    names = []
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            else:
                names.append(node.module)
    return names


@functools.cache
def product_imports() -> list[tuple[str, str]]:
    """(importing module, imported module) for every import of the product packages (read
    once per test run)."""
    edges = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = module_name(path)
            edges += [(module, name) for name in imports_of(path.read_text(), module, path.name == "__init__.py")]
    return edges


def upward(edges: list[tuple[str, str]]) -> list[str]:
    """The imports that break the order, each as ``importer -> imported``."""
    wrong = []
    for importer, imported in edges:
        source, target = room_of(importer), room_of(imported)
        if source == target or target not in WATCHED or source in TOP:
            continue
        if target == "simpy" and importer == SIMPY_IN_SCHEDULES:
            continue
        if target == "schedules.generators" and not source.startswith("schedules"):
            target = "schedules"  # outside schedules, its generators are schedules
        if target not in ALLOWED.get(source, set()):
            wrong.append(f"{importer} -> {imported}")
    return wrong


def room_graph(edges: list[tuple[str, str]]) -> nx.DiGraph:
    """Rooms and who imports whom, a package's ``__init__`` re-exporting its own
    subpackages left out (the face of a package, not a dependency of its parts)."""
    graph = nx.DiGraph()
    for importer, imported in edges:
        source, target = room_of(importer), room_of(imported)
        if source == target or target not in WATCHED:
            continue
        if importer == source.split(".")[0] and target.startswith(importer + "."):
            continue
        graph.add_edge(source, target)
    return graph


def test_no_product_module_imports_upward():
    assert upward(product_imports()) == []


def test_no_package_cycle():
    cycles = list(nx.simple_cycles(room_graph(product_imports())))
    assert cycles == []


def test_schedules_imports_simpy_only_in_its_specification():
    importers = {importer for importer, imported in product_imports()
                 if room_of(imported) == "simpy" and room_of(importer).startswith("schedules")}
    assert importers == {SIMPY_IN_SCHEDULES}


def test_benchmarks_import_nothing_from_tests():
    edges = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        edges += [(path.name, name) for name in imports_of(path.read_text(), "benchmarks." + path.stem)]
    assert [edge for edge in edges if edge[1].split(".")[0] == "tests"] == []


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("schedules.engine", "def run():\n    from pipesim.sim.reference import run_reference\n",
     ["schedules.engine -> pipesim.sim.reference"]),
    ("pipesim.model.compute_model", "from pipesim.cluster.gpus import GPUS\n",
     ["pipesim.model.compute_model -> pipesim.cluster.gpus"]),
    ("pipesim.sim.step", "from ..plan import search\n", ["pipesim.sim.step -> pipesim.plan"]),
    ("executor.runtime", "import simpy\n", ["executor.runtime -> simpy"]),
    ("viz.gantt", "import torch\n", ["viz.gantt -> torch"]),
    ("schedules.lowering", "import simpy\n", ["schedules.lowering -> simpy"]),
    ("pipesim.sim.step", "from pipesim.cluster import topology\nfrom schedules import engine\n", []),
    ("pipesim.cli.run", "import torch\nfrom executor import launch\n", []),
])
def test_an_upward_import_is_named(module, source, expected):
    """The check itself: a planted import up the order is reported, one down is not."""
    assert upward([(module, name) for name in imports_of(source, module)]) == expected


def test_a_cycle_between_rooms_is_found():
    edges = [("pipesim.sim.step", "pipesim.cluster.topology"), ("pipesim.cluster.mapping", "pipesim.sim.step")]
    assert list(nx.simple_cycles(room_graph(edges))) in (
        [["pipesim.sim", "pipesim.cluster"]], [["pipesim.cluster", "pipesim.sim"]])
