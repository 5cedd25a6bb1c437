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
whole graph (the engine's stuck ranks say where to look), and names each wait on the
cycle by this graph's data edges (``producers``: which action a stuck one waits for);
the whole graph is for users and tools that want to look at the structure, e.g.
``networkx.find_cycle`` or critical paths. Its data edges are the dataflow rule of
``schedules.dataflow``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schedules import dataflow
from schedules.action import RECV_KINDS, RECV_OF, SEND_KINDS, SEND_OF, Action
from schedules.dataflow import SAME_STAGE_INPUT
from schedules.schedule import Schedule

if TYPE_CHECKING:
    import networkx as nx


def producers(action: Action, rank: int, schedule: Schedule, lowered: bool) -> list[tuple[Action, str]]:
    """What ``action`` waits for on account of data, as ``(producer, edge kind)`` pairs.

    Producers that the schedule does not contain (for example the previous stage's
    backward in a schedule missing it) are still returned; callers decide what to do
    with them. Program order is not included.
    """
    stage, kind, microbatch = action
    placement = schedule.placement
    found = [(Action(stage, SAME_STAGE_INPUT[kind], microbatch), "data")] if kind in SAME_STAGE_INPUT else []
    if kind in RECV_OF:
        if lowered and dataflow.receives(placement, stage, kind, rank, schedule.copies):
            found.append((Action(stage, RECV_OF[kind], microbatch), "data"))
        else:
            found += [(producer, "data") for producer in dataflow.neighbour_producers(action, schedule.num_stages,
                                                                                              schedule.copies)]
        return found
    if kind in SEND_KINDS:  # a SEND waits for the compute piece whose output it carries
        return [(Action(stage, producer, microbatch), "data") for producer in _CARRIED_BY[kind]]
    if kind in RECV_KINDS:
        return [(action.matching(), "comm")]
    return found


# the compute kinds whose output each SEND kind carries (SEND_B: B, or I when split)
_CARRIED_BY = {send: tuple(kind for kind, carrier in SEND_OF.items() if carrier == send) for send in SEND_OF.values()}


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
