"""Each rule of the model listed in docs/simulator.md has one home: a second copy fails here.

The product code (``schedules``, ``pipesim``, ``executor``, ``viz``) is read as syntax
trees and searched for the shapes each rule takes when it is written inline:

- the transfer key: a stage and direction packed as ``stage * 2 + direction`` and scaled
  by the microbatch count, or unpacked again (``// 2``, ``% 2``, ``divmod(..., 2)``)
  next to the microbatch count;
- the dataflow offsets: a neighbouring stage (``stage + 1``, ``stage - 1``) named as an
  action's stage, as the index of the placement, beside a kind in a table's index, or
  picked per kind (``np.where`` / ``np.select`` over ±1);
- the unloaded hop: a wire priced by hand (``occupancy + latency`` summed, the two
  ends' ``2 * comm_overhead`` added) instead of asking the hop's one function;
- the compute kinds: ``COMPUTE_KINDS`` defined anywhere but ``schedules.action``.

Each pattern is also planted in a small source here, so that the search is known to find it.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("schedules", "pipesim", "executor", "viz")
HOMES = {
    "transfer key": {"schedules/dataflow.py"},
    "dataflow offsets": {"schedules/dataflow.py", "schedules/action.py"},
    # a route's own unloaded time (``Route.seconds``, ``Route.wire``'s two parts, priced before
    # any wire exists), and the engine's wires priced the same way below pipesim
    "unloaded hop": {"schedules/hop.py", "pipesim/cluster/topology.py"},
    "compute kinds": {"schedules/action.py"},
}
_STAGE = re.compile(r"(^|_)stage$")


def _is_stage(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return bool(_STAGE.search(name))


def _is_one(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == 1  # a stage step, not a sign


def _neighbour(node: ast.AST) -> bool:
    """``stage + 1`` or ``stage - 1`` (any name ending in ``stage``)."""
    return (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and _is_stage(node.left)
            and _is_one(node.right))


def _names(node: ast.AST) -> set[str]:
    return {sub.id if isinstance(sub, ast.Name) else sub.attr
            for sub in ast.walk(node) if isinstance(sub, (ast.Name, ast.Attribute))}


_PACKED = re.compile(r"stage|key|sent|direction|backward|wire|sender|microbatch")


def _is_two(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 2


def _by_two(node: ast.AST) -> bool:
    """``x * 2``, ``2 * x``, ``x // 2``, ``x % 2`` or ``divmod(x, 2)`` of a stage, a key or
    a microbatch count: packing or unpacking a direction."""
    if isinstance(node, ast.BinOp):
        sides = (node.left, node.right)
        if isinstance(node.op, ast.Mult) and any(map(_is_two, sides)):
            other = node.right if _is_two(node.left) else node.left
        elif isinstance(node.op, (ast.FloorDiv, ast.Mod)) and _is_two(node.right):
            other = node.left
        else:
            return False
    elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "divmod"
          and len(node.args) == 2 and _is_two(node.args[1])):
        other = node.args[0]
    else:
        return False
    return any(_PACKED.search(name) for name in _names(other))


def _expressions(tree: ast.AST):
    """Every outermost arithmetic expression (a run of ``BinOp`` nodes) and every
    ``divmod`` call: the units a packed number is written in."""
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            inner.update(id(side) for side in (node.left, node.right) if isinstance(side, ast.BinOp))
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and id(node) not in inner:
            yield node
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "divmod":
            yield node


def _in_expression(expression: ast.AST):
    """The nodes of an arithmetic expression, not looking into calls or subscripts."""
    if isinstance(expression, ast.Call):
        yield expression
        for argument in expression.args:
            yield from _in_expression(argument)
    elif isinstance(expression, ast.BinOp):
        yield expression
        yield from _in_expression(expression.left)
        yield from _in_expression(expression.right)
    else:
        yield expression


def transfer_key_copies(tree: ast.AST) -> list[int]:
    """Lines of expressions that pack or unpack a transfer key by hand: a stage and a
    direction by two, with the microbatch count in the same expression."""
    lines = []
    for expression in _expressions(tree):
        nodes = list(_in_expression(expression))
        if any(map(_by_two, nodes)) and any("microbatch" in name for node in nodes for name in _names(node)):
            lines.append(expression.lineno)
    return lines


def _picks_by_kind(node: ast.Call) -> bool:
    """``np.where(..., stage - 1, ...)`` or ``np.select(..., [-1, 1], ...)``: an offset per kind."""
    callee = node.func.attr if isinstance(node.func, ast.Attribute) else ""
    if callee == "where":
        return any(map(_neighbour, node.args)) or (len(node.args) == 3 and all(map(_is_one, node.args[1:])))
    if callee == "select" and len(node.args) > 1 and isinstance(node.args[1], (ast.List, ast.Tuple)):
        return bool(node.args[1].elts) and all(map(_is_one, node.args[1].elts))
    return False


def dataflow_offset_copies(tree: ast.AST) -> list[int]:
    """Lines that name a neighbouring stage as the dataflow rule's producer or consumer."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if (callee == "Action" and node.args and _neighbour(node.args[0])) or _picks_by_kind(node):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript):
            index = node.slice
            holder = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
            if (holder == "placement" and _neighbour(index)) or (
                    isinstance(index, ast.Tuple) and any(map(_neighbour, index.elts))):
                lines.append(node.lineno)
    return lines


def unloaded_hop_copies(tree: ast.AST) -> list[int]:
    """Lines that price a hop by hand: a wire's ``occupancy + latency`` summed, or the
    posting overhead of a transfer's two ends added (``2 * comm_overhead``)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.BinOp):
            continue
        sides = (node.left, node.right)
        if isinstance(node.op, ast.Add) and {"occupancy", "latency"} <= {getattr(side, "id", None) for side in sides}:
            lines.append(node.lineno)
            continue
        doubled = isinstance(node.op, ast.Mult) and any(isinstance(side, ast.Constant) and side.value == 2
                                                        for side in sides)
        if doubled and any("comm_overhead" in _names(side) for side in sides):
            lines.append(node.lineno)
    return lines


def compute_kinds_copies(tree: ast.AST) -> list[int]:
    """Lines that define the compute kinds again (``COMPUTE_KINDS = ...``)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if getattr(target, "id", None) == "COMPUTE_KINDS"]


FINDERS = {"transfer key": transfer_key_copies, "dataflow offsets": dataflow_offset_copies,
           "unloaded hop": unloaded_hop_copies, "compute kinds": compute_kinds_copies}


@functools.cache
def product_trees() -> tuple[tuple[str, ast.AST], ...]:
    """Every product file's repository path and syntax tree, parsed once per test run."""
    return tuple((path.relative_to(ROOT).as_posix(), ast.parse(path.read_text()))
                 for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py")))


@pytest.mark.parametrize("rule", sorted(FINDERS))
def test_each_rule_is_written_only_in_its_home(rule):
    copies = []
    for name, tree in product_trees():
        if name not in HOMES[rule]:
            copies += [f"{name}:{line}" for line in FINDERS[rule](tree)]
    assert copies == [], f"{rule} written outside {sorted(HOMES[rule])}"


# the functions each home offers its readers
HOME_FUNCTIONS = {
    "transfer key": ("schedules/dataflow.py", {"transfer_key", "end_transfer_key", "transfer_parts", "wire_of"}),
    "dataflow offsets": ("schedules/dataflow.py", {"input_stage", "output_stage", "input_stages", "output_stages",
                                                   "receives", "sends", "neighbour_producers"}),
    "unloaded hop": ("schedules/hop.py", {"flights", "wire_flight", "planning_hop"}),
    "compute kinds": ("schedules/action.py", set()),
}


@pytest.mark.parametrize("rule", sorted(FINDERS))
def test_each_home_offers_its_rule(rule):
    """A home that lost its functions (renamed, emptied) would leave the search vacuous."""
    home, functions = HOME_FUNCTIONS[rule]
    tree = ast.parse((ROOT / home).read_text())
    if not functions:  # a definition, not functions: the home writes it exactly once
        assert len(FINDERS[rule](tree)) == 1
        return
    assert functions <= {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize(("rule", "source"), [
    ("transfer key", "key = (stage * 2 + direction) * microbatches + microbatch"),
    ("transfer key", "return (sender * self.microbatches + action.microbatch) * 2 + int(backward)"),
    ("transfer key", "stage, direction = np.divmod(sent // arrays.microbatches, 2)"),
    ("transfer key", "sender = placement[np.arange(transfers) // (2 * arrays.microbatches)]"),
    ("transfer key", "direction = (self.key // self.step.program.arrays.microbatches) % 2"),
    ("dataflow offsets", "producer = Action(stage - 1, F, microbatch)"),
    ("dataflow offsets", "if placement[stage + 1] != rank:\n    pass"),
    ("dataflow offsets", "end = self.end[_F, stage - 1, microbatch]"),
    ("dataflow offsets", "source = np.where(is_forward, stage - 1, np.where(is_backward, stage + 1, -1))"),
    ("dataflow offsets", "peer = stage + np.select([upward, downward], [1, -1], 0)"),
    ("unloaded hop", "comm = hop_seconds(costs, topology, devices, placement) + 2 * costs.comm_overhead"),
    ("unloaded hop", "comm = max(occupancy + latency for _links, occupancy, latency in routes)"),
    ("compute kinds", 'COMPUTE_KINDS = ("F", "B", "I", "W")  # the columns of ``StepTiming.seconds``'),
])
def test_a_planted_copy_is_found(rule, source):
    lines = FINDERS[rule](ast.parse(source))
    assert lines and set(lines) == {1}


@pytest.mark.parametrize("source", [
    "extra[stage] >= extra[stage - 1]",  # a list scheduler's neighbouring stages, not the dataflow
    "following = clock[stage + 1] + costs[F][stage + 1]",
    "count = 2 * pp - 1",
    "held = stage * microbatches + microbatch",
    "source = dataflow.input_stage(stage, kind)",
    "sign = np.where(forward, 1.0, -1.0)",
])
def test_code_that_reads_the_homes_is_not_a_copy(source):
    tree = ast.parse(source)
    assert [finder(tree) for finder in FINDERS.values()] == [[]] * len(FINDERS)
