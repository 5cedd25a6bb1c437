"""Building the schedules whose order depends on costs (``zb-auto``) from what a
command already has: the per-stage costs and the cluster the pipeline runs on.

The generator itself (``schedules.generators.zb_auto``) takes plain seconds, so it stays
below the simulator; this module reads them off a ``Costs`` and a ``Topology``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipesim.cluster.mapping import map_ranks
from pipesim.cluster.topology import Topology
from pipesim.model.costs import Costs
from pipesim.sim.engine import step_timing
from schedules.generators import COST_AWARE, UnknownScheduleError, zb_auto
from schedules.generators.adaptive import adapt
from schedules.schedule import Schedule


def hop_seconds(costs: Costs, topology: Topology, devices: Sequence[str]) -> float:
    """The slowest unloaded transfer between consecutive pipeline ranks: the ``T_comm``
    the zero-bubble scheduler plans with (one number, as in the paper)."""
    if topology.ideal:
        return 0.0
    worst = 0.0
    for stage in range(len(devices) - 1):
        route = topology.route(devices[stage], devices[stage + 1])
        worst = max(worst, route.seconds(costs.stages[stage].act_bytes))
    return worst


def build_cost_aware(
    name: str,
    pp: int,
    microbatches: int,
    costs: Costs,
    topology: Topology,
    memory_limit: int | None = None,
    devices: Sequence[str] | None = None,
    search_seconds: float | None = None,
) -> Schedule:
    """The named cost-aware schedule for one stage per rank with these costs.
    ``devices`` are the pipeline ranks' devices (default: the topology's mapping);
    ``search_seconds`` is zb-auto's optimising pass budget (default: its own; 0:
    heuristics only, as a planner screening thousands of layouts asks)."""
    if name not in COST_AWARE:
        raise UnknownScheduleError(f"{name!r} is not a cost-aware schedule; those are: {', '.join(sorted(COST_AWARE))}")
    if costs.num_stages != pp:
        raise ValueError(f"{name}: costs describe {costs.num_stages} stages but pp={pp} (one stage per rank)")
    if devices is None:
        devices = map_ranks(topology, 1, pp, 1).pipeline()
    stages = costs.stages
    return zb_auto(
        pp, microbatches,
        [stage.fwd + costs.action_overhead for stage in stages],
        [stage.bwd - stage.wgrad + costs.action_overhead for stage in stages],
        [stage.wgrad + costs.action_overhead for stage in stages],
        comm=hop_seconds(costs, topology, devices) + 2 * costs.comm_overhead,
        memory_limit=memory_limit,
        **({} if search_seconds is None else {"search_seconds": search_seconds}),
    )


def adapt_to_costs(schedule: Schedule, costs: Costs, topology: Topology,
                   devices: Sequence[str] | None = None) -> Schedule:
    """zb-h1 and zb-h2 with the order that runs fastest on these costs and links
    (``schedules.generators.adaptive``: the textbook order, ``W`` placed for the costs,
    or 1F1B's), named in ``meta["order"]``; any other schedule as it is."""
    if devices is None:
        devices = map_ranks(topology, 1, schedule.pp, 1).pipeline()
    return adapt(schedule, step_timing(schedule, costs, topology, devices))
