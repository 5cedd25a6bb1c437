"""Whether a layout provably does not fit, before it is simulated: its memory floor (the
parameters, optimizer state and one microbatch's stash of each rank:
``pipesim.plan.bounds.floor_of``) against each device less the headroom, and once its
schedule is built, the peak its programs' order gives. Floors are kept in the
evaluator's one cache: layouts of several schedules and microbatch counts share them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipesim.plan.bounds import floor_of, stash_floor, static_floor
from pipesim.plan.cache import kept
from pipesim.plan.layout_costs import CostsKey, LayoutCosts

if TYPE_CHECKING:
    from pipesim.plan.layouts import Layout

FLOOR_OUT_OF_MEMORY = "out of memory (parameters, optimizer state and one stash alone, with the headroom)"
ORDER_OUT_OF_MEMORY = "out of memory (its schedule's stashes in program order, parameters and optimizer state)"
# a --memory-limit budget that leaves some rank no room for one microbatch's activations (zb-auto, zbv-auto)
MEMORY_LIMIT_TOO_SMALL = "over --memory-limit (no room for one microbatch's activations on some rank)"


class MemoryFloors:
    """The memory verdicts a layout gets before it is simulated, on ``costs``'s devices."""

    def __init__(self, costs: LayoutCosts) -> None:
        self.costs = costs
        self.tables = costs.tables

    def reject_cause(self, layout: Layout) -> str | None:
        """Why the layout cannot work without simulating it: out of memory even at the least
        any schedule holds; None otherwise (the simulation decides)."""
        key = self.floors_key(layout)
        return None if key is None else self.floor_cause(key, layout.zero)

    @kept(limit=16384)
    def floor_cause(self, key: CostsKey, zero: int) -> str | None:
        """``reject_cause`` of what it depends on, kept: layouts of several schedules and
        microbatch counts share their floors and so the verdict."""
        if any(floor > usable for floor, usable in self.floors(key, zero)):
            return FLOOR_OUT_OF_MEMORY
        return None

    def memory_floors(self, layout: Layout) -> list[tuple[float, float]] | None:
        """Per rank, (``pipesim.plan.bounds.floor_of``, the device's usable memory); None
        where the costs say nothing of memory."""
        key = self.floors_key(layout)
        return None if key is None else self.floors(key, layout.zero)

    def floors_key(self, layout: Layout) -> CostsKey | None:
        """The key of the layout's costs, None where they have no memory floor: they cannot
        be built (the evaluation reports why) or say nothing of memory."""
        try:
            _, costs, _, key = self.costs.of(layout)
        except ValueError:
            return None
        return key if costs.memory_known else None

    @kept(limit=16384)
    def floors(self, key: CostsKey, zero: int) -> list[tuple[float, float]]:
        """``memory_floors`` of what it depends on, kept (layouts of several schedules share
        it)."""
        parallel = self.costs.parallel(key.dp, key.tp, zero, key.ep, key.cp, key.etp)
        # the key's ZeRO stage changes only the optimizer step, which the stash does not read
        floors = floor_of(self.static_floor(key, zero), self.stash_floor(key._replace(zero=0)))
        usable = self.costs.usable_memory(key.dp, key.pp, key.tp, parallel.rank_order, parallel.cp,
                                          parallel.memory_headroom, parallel.ep, parallel.etp)
        return list(zip(floors, usable, strict=True))

    def static_floor(self, key: CostsKey, zero: int) -> list[float]:
        """``pipesim.plan.bounds.static_floor`` of the costs named by ``key`` under ZeRO stage
        ``zero``, kept under what it reads of them (``parameter_figures``), the placement
        and the sharding: the layouts of every microbatch size and recompute mode share it."""
        costs = self.costs.placed(key)
        parallel = self.costs.parallel(key.dp, key.tp, zero, key.ep, key.cp, key.etp)
        holders = key.dp * parallel.cp  # the ranks that hold each parameter, as simulate's memory counts them
        kept_as = (key.placement, holders, parallel.zero, parallel.ep, parallel.etp, parallel.bytes_per_param,
                   self.costs.parameter_figures(key))
        table = self.tables["static floor by parameters"]
        static = table.get(kept_as)
        if static is None:
            from pipesim.sim.memory import static_bytes  # only here: an import runs slowly per call

            distinct = {id(cost): cost for cost in costs.stages}  # a model's alike stages share one object
            static_of = {ident: static_bytes(cost, parallel.bytes_per_param, holders, parallel.zero,
                                             parallel.expert_holders(holders))
                         for ident, cost in distinct.items()}
            static = table[kept_as] = static_floor(key.placement, [static_of[id(cost)] for cost in costs.stages])
        return static

    @kept(limit=4096)
    def stash_floor(self, key: CostsKey) -> list[float]:
        """``pipesim.plan.bounds.stash_floor`` of the costs named by ``key``, kept: every ZeRO
        stage shares it."""
        return stash_floor(self.costs.placed(key), key.placement)

    def order_cause(self, schedule, costs, parallel, layout: Layout) -> str | None:
        """The layout's simulated peak memory, read off its programs' order before
        simulating (``pipesim.sim.memory.program_order_trace``: exact when every forward
        that takes a stash takes time): a cause when some rank does not fit its device less
        the headroom, else None."""
        from pipesim.sim.headroom import pipeline_net_channels
        from pipesim.sim.memory import memory_report, program_order_trace

        if not costs.memory_known or any(stage.stash_bytes > 0 and stage.fwd <= 0 for stage in costs.stages):
            return None  # a stash taken by a forward of no time: the simulation decides
        topology = self.costs.topology
        devices = self.costs.pipeline_devices(layout.dp, layout.pp, layout.tp, parallel.rank_order, layout.cp)
        report = memory_report(program_order_trace(schedule), costs, schedule.placement, devices,
                               [topology.device_memory(device) for device in devices], parallel.bytes_per_param,
                               parallel.dp * parallel.cp, parallel.bucket_bytes, parallel.zero,
                               parallel.expert_holders(parallel.dp * parallel.cp), headroom=parallel.memory_headroom,
                               timelines=False, tp=parallel.tp, cp=parallel.cp, ep=parallel.ep,
                               pp_net_channels=pipeline_net_channels(topology, devices))
        return ORDER_OUT_OF_MEMORY if any(rank.oom for rank in report) else None
