"""The zero-bubble papers' model of a step, shared by ``benchmarks/bench_zero_bubble.py``
and its tests: every pair of ranks a fixed ``T_comm`` apart on links that never queue,
transfers posted as their producer ends and awaited just before their consumer, and the
papers' measure of a stage's time (a rank's first compute start to its last end).
"""

from __future__ import annotations

import networkx as nx

from pipesim.cluster.topology import Topology, add_link, ideal_topology
from pipesim.model.costs import uniform_costs
from pipesim.sim.engine import simulate
from schedules.lowering import _lower_naively  # the papers' transfer model: post at production, wait at use
from schedules.overlap import keep_pairs_together
from schedules.p2p import BUFFERED, RENDEZVOUS
from schedules.schedule import Schedule


def latency_topology(pp: int, hop: float) -> Topology:
    """Every pair of ranks ``hop`` seconds apart with unlimited bandwidth: a transfer
    takes exactly T_comm = ``hop`` and never queues (the papers' model)."""
    if hop == 0:
        return ideal_topology()
    graph = nx.DiGraph()
    devices = [f"gpu{rank}" for rank in range(pp)]
    for device in devices:
        graph.add_node(device, kind="gpu", memory_bytes=1e15, peak_flops=1e15)
    for first in range(pp):
        for second in range(first + 1, pp):
            add_link(graph, devices[first], devices[second], bandwidth=1e300, latency=hop)
    return Topology("latency", graph, devices)


def run(schedule: Schedule, forward: float, backward_input: float, backward_weight: float, hop: float = 0.0,
        production: bool = False):
    """Simulate with per-rank F, I, W seconds (each of ``v`` chunks costs 1/v of them).

    By default in the papers' model: every transfer posted as its producer ends and
    awaited just before its consumer, sends never waiting (``buffered``), so the time
    measured is the order's own. ``production`` uses what ``pipesim simulate`` predicts
    for NCCL: ``lower``'s P2P groups under rendezvous."""
    costs = uniform_costs(schedule.num_stages, forward, backward_input + backward_weight, backward_weight,
                          virtual_stages=schedule.virtual_stages)
    if production:
        return simulate(schedule, costs, latency_topology(schedule.pp, hop), p2p=RENDEZVOUS)  # lowered for these costs
    lowered = keep_pairs_together(_lower_naively(schedule), schedule)
    return simulate(lowered, costs, latency_topology(schedule.pp, hop), p2p=BUFFERED)


def longest_rank_span(trace) -> float:
    """The paper's "largest execution time of all stages": per rank, first compute start
    to last compute end."""
    spans = []
    for events in trace.by_rank():
        compute = [event for event in events if event.stream == "compute"]
        spans.append(max(event.end for event in compute) - min(event.start for event in compute))
    return max(spans)
