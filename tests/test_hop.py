"""The unloaded hop (``schedules.hop``): one rule, and every list scheduler's caller plans with it.

Expected values are hand sums of a route's two parts (``Route.seconds``: bytes over the
slowest link's bandwidth, plus latency) and of the wires handed in.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipesim.cluster.mapping import map_ranks
from pipesim.cluster.presets import ib
from pipesim.model.costs import uniform_costs
from pipesim.sim import cost_aware
from schedules import engine
from schedules.generators import adaptive, generate
from schedules.hop import flights, planning_hop, wire_flight


def test_a_wire_takes_its_slowest_route():
    routes = [((0,), 2.0, 0.5), ((1, 2), 1.0, 3.0)]
    assert flights(routes) == [2.5, 4.0]
    assert wire_flight(routes) == 4.0
    assert wire_flight([]) == 0.0 and wire_flight(None) == 0.0


def test_the_planning_hop_is_the_slowest_wire_without_posting_overhead():
    timing = engine.StepTiming(np.ones((3, 4)), wires=engine.hop_wires(3, [0.2, 0.3]), comm_overhead=0.1)
    assert planning_hop(timing) == 0.3
    assert planning_hop(dataclasses.replace(timing, wires=())) == 0.0


@pytest.mark.parametrize("name", ["zb-auto", "zbv-auto"])
def test_cost_aware_schedules_plan_with_the_slowest_boundary_route(monkeypatch, name):
    """Two nodes of eight: the pipeline's boundary between the nodes crosses InfiniBand;
    its route's bytes / bandwidth + latency is the hop, the overhead is not added."""
    topology, act_bytes = ib(2), 64e6
    pp = 16
    stages = pp if name == "zb-auto" else 2 * pp
    costs = dataclasses.replace(uniform_costs(stages, 1e-3, 2e-3, 1e-3, act_bytes=act_bytes), comm_overhead=1e-4)
    devices = map_ranks(topology, 1, pp, 1).pipeline()
    placement = cost_aware.cost_shell(name, pp, 4).placement
    expected = max(topology.route(devices[placement[stage]], devices[placement[stage + 1]]).seconds(act_bytes)
                   for stage in range(stages - 1))
    seen = {}

    def record(*args, comm, **kwargs):
        seen["comm"] = comm
        return "built"

    monkeypatch.setattr(cost_aware, name.replace("-", "_"), record)
    assert cost_aware.build_cost_aware(name, pp, 4, costs, topology) == "built"
    assert seen["comm"] == pytest.approx(expected, rel=1e-12)
    # the slowest boundary is the one between the nodes, slower than NVLink's
    assert expected > 2 * topology.route(devices[0], devices[1]).seconds(act_bytes)


def test_adapt_plans_with_the_same_hop(monkeypatch):
    hops = [0.05, 0.4, 0.1]
    timing = engine.StepTiming(engine.StepTiming.uniform(4, 1.0, 2.0, 1.0).seconds,
                               wires=engine.hop_wires(4, hops), comm_overhead=0.2)
    seen = []

    def record(pp, microbatches, forward, backward_input, backward_weight, comm, *args, **kwargs):
        seen.append((comm, kwargs["cutoff_comm"]))

    monkeypatch.setattr(adaptive, "heuristic_orders", record)
    adaptive.adapt(generate("zb-h1", 4, 6), timing)
    assert seen and set(seen) == {(0.4, 0.05)}  # the slowest hop plans, the quickest bounds the cutoff
