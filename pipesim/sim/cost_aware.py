"""Building the schedules whose order depends on costs (``zb-auto``, ``zbv-auto``,
``interleaved-auto``) from what a command already has: the per-stage costs and the
cluster the pipeline runs on.

The generators themselves (``schedules.generators.zb_auto``, ``zbv_auto``,
``interleaved_auto``) take plain seconds, so they stay below the simulator; this module
reads them off a ``Costs`` and a ``Topology``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipesim.cluster.mapping import map_ranks
from pipesim.cluster.topology import Topology
from pipesim.model.costs import Costs
from pipesim.sim.engine import step_timing
from schedules.generators import (
    COST_AWARE,
    V_SHAPED,
    UnknownScheduleError,
    interleaved_auto,
    placement_of,
    zb_auto,
    zbv_auto,
)
from schedules.generators.adaptive import adapt
from schedules.generators.common import ScheduleUnavailableError
from schedules.generators.zb_auto import order_cost
from schedules.hop import planning_hop
from schedules.schedule import Schedule

INTERLEAVED_AUTO = "interleaved-auto"
DEFAULT_CHUNKS = 2  # interleaved-auto's chunks per rank when none are given, as interleaved-1f1b's


def cost_aware_stages(name: str, virtual_stages: int | None = None) -> int:
    """Stages per rank of a cost-aware schedule: 1 for zb-auto, the V's 2 for zbv-auto
    (``virtual_stages``, when given, must say the same), interleaved-auto's
    ``virtual_stages`` (default 2)."""
    if name == INTERLEAVED_AUTO:
        return virtual_stages or DEFAULT_CHUNKS
    chunks = 2 if name in V_SHAPED else 1
    if virtual_stages not in (None, chunks):
        raise ScheduleUnavailableError(
            f"{name} places exactly {chunks} stage{'s' if chunks > 1 else ''} per rank"
            f"{' in a V' if chunks > 1 else ''}; virtual stages={virtual_stages}")
    return chunks


def cost_shell(name: str, pp: int, microbatches: int, virtual_stages: int | None = None) -> Schedule:
    """A schedule with no programs and the cost-aware schedule's placement: what the
    stages' costs are derived for before its order exists (``virtual_stages``:
    interleaved-auto's chunks per rank)."""
    placement = placement_of(name, pp, cost_aware_stages(name, virtual_stages))
    return Schedule(pp, microbatches, placement, [()] * pp, name=name)


def planned_share(share: float) -> float:
    """The share of a stash kept between I and W that zb-auto and zbv-auto plan with:
    rounded up to a tenth, never below what the memory model counts (a share like 0.94 plans as 1, the
    search's cumulative memory constraint staying in coarse units), and at most 1: the
    search's limit is in whole stashes, and what an ``I`` adds beyond a stash held whole
    (the executor's output gradients, ``StageCost.wgrad_stash_share`` above 1) is counted
    by the memory model but not planned for."""
    return min(1.0, math.ceil(share * 10 - 1e-9) / 10)


def build_cost_aware(
    name: str,
    pp: int,
    microbatches: int,
    costs: Costs,
    topology: Topology,
    memory_limit: float | tuple[int, ...] | None = None,
    devices: Sequence[str] | None = None,
    search_seconds: float | None = None,
    inputs: tuple[tuple[list[float], ...], float] | None = None,
) -> Schedule:
    """The named cost-aware schedule with these costs: zb-auto's one stage per rank, or
    zbv-auto's ``2 pp`` stages in a V (``cost_shell``'s placement). ``devices`` are the
    pipeline ranks' devices (default: the topology's mapping); ``search_seconds`` is
    zb-auto's optimising pass budget (default: its own; 0: heuristics only, as a planner
    screening thousands of layouts asks, and then zbv-auto tries only its most often
    winning variants); ``inputs``, ``planning_inputs`` of the same arguments where the
    caller has them already (one schedule built under several limits)."""
    passes, comm = inputs or planning_inputs(name, pp, microbatches, costs, topology, devices)
    if name == INTERLEAVED_AUTO:
        return _interleaved_auto(pp, microbatches, costs, passes, comm, memory_limit)
    weight_memory = planned_share(max(stage.wgrad_stash_share for stage in costs.stages))
    if name == "zbv-auto":
        return zbv_auto(pp, microbatches, *passes, comm=comm, memory_limit=memory_limit, quick=search_seconds == 0,
                        weight_memory=weight_memory)
    if isinstance(memory_limit, float):  # a whole count given as a number (a fraction is zb-auto's to refuse)
        memory_limit = int(memory_limit) if memory_limit.is_integer() else memory_limit
    return zb_auto(
        pp, microbatches, *passes, comm=comm, memory_limit=memory_limit, weight_memory=weight_memory,
        **({} if search_seconds is None else {"search_seconds": search_seconds}),
    )


def _interleaved_auto(pp: int, microbatches: int, costs: Costs, passes: tuple[list[float], ...], comm: float,
                      memory_limit: float | tuple[float, ...] | None) -> Schedule:
    """interleaved-auto on these stages: its limit, microbatches' activations on a rank
    (one number or one per rank; a budget's counts are fractional, ``stash_budget``), in
    bytes of the stages' stashes where the costs know them (so a chunk holding only the
    embedding counts as the little it holds), else in chunk stashes, ``v`` a microbatch."""
    virtual_stages = costs.num_stages // pp
    sizes = [stage.stash_bytes for stage in costs.stages]
    if not any(sizes):
        sizes = [1.0] * costs.num_stages
    per_microbatch = [sum(sizes[rank::pp]) for rank in range(pp)]  # a microbatch on all of a rank's chunks
    limit = None
    if memory_limit is not None:
        counts = list(memory_limit) if isinstance(memory_limit, (list, tuple)) else [memory_limit] * pp
        if len(counts) != pp:
            raise ScheduleUnavailableError(f"{INTERLEAVED_AUTO}: --memory-limit gives {len(counts)} ranks' "
                                           f"microbatches for pp={pp}")
        for rank, count in enumerate(counts):  # in the user's unit, before it becomes bytes
            if not count >= 1:
                raise ScheduleUnavailableError(
                    f"{INTERLEAVED_AUTO}: --memory-limit {count:g} on rank {rank} is below one microbatch's "
                    f"activations, the least an order with whole backwards holds (a backward reaches the rank's "
                    f"first chunk only after the forward has passed all {virtual_stages})")
        limit = [count * size for count, size in zip(counts, per_microbatch, strict=True)]
    schedule = interleaved_auto(pp, microbatches, virtual_stages, passes[0], passes[1], comm, limit, sizes)
    # the limit each rank's order was built to, back in microbatches (``--json``'s stash_limits)
    held = [most / size if size else None
            for most, size in zip(schedule.meta["memory_stashes"], per_microbatch, strict=True)]
    schedule.meta["memory_microbatches"] = tuple(None if count is None else round(count, 6) for count in held)
    return schedule


def planning_inputs(name: str, pp: int, microbatches: int, costs: Costs, topology: Topology,
                    devices: Sequence[str] | None = None) -> tuple[tuple[list[float], ...], float]:
    """What a cost-aware schedule is built from: each stage's F, I and W seconds (with the
    executor's per-action overhead) and the hop its planning takes on the pipeline's links."""
    if name not in COST_AWARE:
        raise UnknownScheduleError(f"{name!r} is not a cost-aware schedule; those are: {', '.join(sorted(COST_AWARE))}")
    shell = cost_shell(name, pp, microbatches, costs.num_stages // pp if name == INTERLEAVED_AUTO else None)
    placement = shell.placement
    if costs.num_stages != len(placement):
        per_rank = ("two stages per rank, in a V" if name in V_SHAPED else
                    "virtual stages per rank" if name == INTERLEAVED_AUTO else "one stage per rank")
        raise ValueError(f"{name}: costs describe {costs.num_stages} stages but pp={pp} needs {len(placement)} "
                         f"({per_rank})")
    if devices is None:
        devices = map_ranks(topology, 1, pp, 1).pipeline()
    stages = costs.stages
    if name == INTERLEAVED_AUTO:  # whole backwards: B, and no weight passes
        passes = ([stage.fwd + costs.action_overhead for stage in stages],
                  [stage.bwd + costs.action_overhead for stage in stages], [0.0] * len(stages))
    else:
        passes = ([stage.fwd + costs.action_overhead for stage in stages],
                  [stage.input_grad + costs.action_overhead for stage in stages],
                  [stage.wgrad + costs.action_overhead for stage in stages])
    return passes, planning_hop(step_timing(shell, costs, topology, devices))


def order_step(name: str, pp: int, microbatches: int, inputs: tuple[tuple[list[float], ...], float]):
    """``cost(programs)``: (the longest rank span, the step) of an order of the named
    cost-aware schedule, timed as its search times its candidates (free-flowing transfers,
    the planning hop) from its ``planning_inputs``."""
    passes, comm = inputs
    chunks = len(passes[0]) // pp if name == INTERLEAVED_AUTO else None
    return order_cost(cost_shell(name, pp, microbatches, chunks).placement, microbatches, *passes, comm)


def adapt_to_costs(schedule: Schedule, costs: Costs, topology: Topology,
                   devices: Sequence[str] | None = None) -> Schedule:
    """zb-h1 and zb-h2 with the order that runs fastest on these costs and links
    (``schedules.generators.adaptive``: the textbook order, ``W`` placed for the costs,
    or 1F1B's), named in ``meta["order"]``; any other schedule as it is."""
    if devices is None:
        devices = map_ranks(topology, 1, schedule.pp, 1).pipeline()
    return adapt(schedule, step_timing(schedule, costs, topology, devices))
