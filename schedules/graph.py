"""The dependency graph of a schedule, as a networkx ``DiGraph``.

Nodes are the schedule's ``Action``s themselves: an action names its stage, and a stage
lives on exactly one rank, so an action is unique in a valid schedule (``validate``
rejects duplicates). Each node carries ``rank`` and ``position`` (its 0-based index in
that rank's program). Edges point from what must happen first to what waits for it and
carry ``kind``:

- ``"data"``: the target needs the source's result (``F(s-1,m) -> F(s,m)``,
  ``F(s,m) -> B|I(s,m)``, ``B|I(s+1,m) -> B|I(s,m)``, ``I(s,m) -> W(s,m)``; in a lowered
  schedule a cross-rank dependency runs ``producer -> SEND`` and ``RECV -> consumer``).
- ``"comm"``: ``SEND -> RECV`` of one transfer.
- ``"program"``: consecutive actions of one rank's program. Where the next action also
  depends on the previous one, the edge keeps the dependency's kind.

A cycle in this graph is a deadlock. ``validate`` finds deadlocks without building the
graph (it is far cheaper to walk the programs); the graph is for users and tools that
want to look at the structure, e.g. ``networkx.find_cycle`` or critical paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schedules.action import Action, ActionKind
from schedules.schedule import Schedule

if TYPE_CHECKING:
    import networkx as nx

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B


def producers(action: Action, rank: int, schedule: Schedule, lowered: bool) -> list[tuple[Action, str]]:
    """What ``action`` waits for on account of data, as ``(producer, edge kind)`` pairs.

    Producers that the schedule does not contain (for example the previous stage's
    backward in a schedule missing it) are still returned; callers decide what to do
    with them. Program order is not included.
    """
    stage, kind, microbatch = action
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    if kind == _F:
        if stage == 0 or not schedule.same_copy(stage, stage - 1):
            return []
        if lowered and placement[stage - 1] != rank:
            return [(Action(stage, _RECV_F, microbatch), "data")]
        return [(Action(stage - 1, _F, microbatch), "data")]
    if kind == _B or kind == _I:
        found = [(Action(stage, _F, microbatch), "data")]
        if stage < last_stage and schedule.same_copy(stage, stage + 1):
            if lowered and placement[stage + 1] != rank:
                found.append((Action(stage, _RECV_B, microbatch), "data"))
            else:
                found.append((Action(stage + 1, _B, microbatch), "data"))
                found.append((Action(stage + 1, _I, microbatch), "data"))
        return found
    if kind == _W:
        return [(Action(stage, _I, microbatch), "data")]
    if kind == _SEND_F:
        return [(Action(stage, _F, microbatch), "data")]
    if kind == _SEND_B:
        return [(Action(stage, _B, microbatch), "data"), (Action(stage, _I, microbatch), "data")]
    if kind == _RECV_F or kind == _RECV_B:
        return [(action.matching(), "comm")]
    return []


def dependency_graph(schedule: Schedule) -> nx.DiGraph:
    """The schedule's actions joined by data, communication and program-order edges.

    Works on compute-only schedules (cross-rank dependencies are direct ``data`` edges)
    and lowered ones (they go through the SEND/RECV pair). Edges only join actions the
    schedule contains: a producer that is missing simply has no edge (``validate``
    reports it).
    """
    import networkx as nx

    graph = nx.DiGraph()
    lowered = schedule.is_lowered
    for rank, program in enumerate(schedule.programs):
        for position, action in enumerate(program):
            graph.add_node(action, rank=rank, position=position)
    for rank, program in enumerate(schedule.programs):
        previous = None
        for action in program:
            if previous is not None:
                graph.add_edge(previous, action, kind="program")
            previous = action
            for producer, edge_kind in producers(action, rank, schedule, lowered):
                if producer in graph:
                    graph.add_edge(producer, action, kind=edge_kind)
    return graph
