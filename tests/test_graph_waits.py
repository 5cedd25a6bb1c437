"""The dependency graph (``schedules.graph``) is the one the validator names deadlocks by:
the action a stuck rank is said to wait for is its data edge's producer in the graph."""

from __future__ import annotations

import networkx as nx
import pytest

from schedules import dependency_graph, validate
from schedules.action import parse_action
from schedules.schedule import Schedule
from schedules.validate import ScheduleValidationError


def crossed_1f1b() -> Schedule:
    """Rank 0 waits at 0B0 for 1B0, which rank 1 runs last; rank 1 waits at 1F1 for 0F1,
    which rank 0 runs only after 0B0: a cycle."""
    programs = [[parse_action(text) for text in "0F0 0B0 0F1 0B1".split()],
                [parse_action(text) for text in "1F1 1B1 1F0 1B0".split()]]
    return Schedule(2, 2, (0, 1), programs, name="crossed")


def test_the_named_cycle_is_a_cycle_of_the_dependency_graph():
    schedule = crossed_1f1b()
    with pytest.raises(ScheduleValidationError) as error:
        validate(schedule)
    graph = dependency_graph(schedule)
    cycle = nx.find_cycle(graph)
    on_cycle = {node for edge in cycle for node in edge[:2]}
    named = set(error.value.cycle)
    assert len(named) == 4 and named <= on_cycle  # the validator's waits lie on the graph's cycle
    for head, needed in zip(error.value.cycle[::2], error.value.cycle[1::2], strict=True):
        assert graph.edges[needed, head]["kind"] == "data"  # each wait is one of the graph's data edges
