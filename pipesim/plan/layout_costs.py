"""A layout's job, per-stage costs and devices, as the planner's floors, bounds and
simulations read them: each derived once per what it depends on and kept in the
evaluator's one cache (``pipesim.plan.cache``).

A layout is the job ``pipesim simulate`` would be given (``layout_job``); its costs are
``simulate``'s costs of that job, shared by every layout with the same stages on the same
ranks (the schedule and the microbatch count do not change them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from pipesim.job import Job, costs_of, parallel_of, topology_of
from pipesim.model.costs import parameter_figures
from pipesim.plan.cache import LayoutCache, kept
from pipesim.plan.torchtitan_fsdp import reduces_after_backward

if TYPE_CHECKING:
    from pipesim.plan.layouts import Layout


class CostsKey(NamedTuple):
    """What a layout's per-stage costs depend on (``placed_costs``'s key): the name the
    floors and bounds keep them under (a Costs of a hundred stages is slow to hash for
    every lookup)."""

    placement: tuple[int, ...]
    pp: int
    tp: int
    dp: int
    microbatch_size: int
    recompute: str
    zero: int
    sequence_parallel: bool
    ep: int
    cp: int
    etp: int = 0  # the experts' tensor parallelism: 0 split over tp, 1 folded
    recompute_moe_act: bool = False  # the routed experts' activation recomputed


class LayoutCosts:
    """The plan's base job (every layout starts from it) on its cluster, loaded once so
    that its routes are computed once, and what layouts derive from it."""

    def __init__(self, base: Job, cache: LayoutCache, torchtitan_fsdp: bool = False) -> None:
        self.base = base
        self.topology = topology_of(base)
        self.cache = cache
        self.tables = cache.tables
        self.torchtitan_fsdp = torchtitan_fsdp  # pipesim.plan.torchtitan_fsdp: its zero1 reduces after the backward

    def no_dp_overlap(self, zero: int, dp: int, cp: int) -> bool:
        """The job's ``no_dp_overlap`` for a layout: the base's, or torchtitan's FSDP under
        pipelining (``reduces_after_backward``)."""
        return self.base.no_dp_overlap or (self.torchtitan_fsdp and reduces_after_backward(zero, dp * cp))

    def layout_job(self, layout: Layout) -> Job:
        """The plan's job with ``layout`` filled in: what ``pipesim simulate`` would be given."""
        return replace(self.base, schedule=layout.schedule, pp=layout.pp, tp=layout.tp, dp=layout.dp,
                       microbatches=layout.microbatches, microbatch_size=layout.microbatch_size,
                       virtual_stages=layout.virtual_stages, recompute=layout.recompute, zero=layout.zero,
                       sequence_parallel=layout.sequence_parallel, ep=layout.ep, cp=layout.cp,
                       microbatch_group=layout.microbatch_group, ep_overlap=layout.ep_overlap,
                       etp=layout.etp or None, recompute_moe_act=layout.recompute_moe_act,
                       no_dp_overlap=self.no_dp_overlap(layout.zero, layout.dp, layout.cp))

    @kept()
    def of(self, layout: Layout):
        """The layout's parallel settings, per-stage costs, a shell schedule with its
        placement (no programs: costs depend only on the stages) and its ``CostsKey``,
        without generating its order: the memory floor and the lower bound both read them."""
        shell = self.shell(layout.schedule, layout.pp, layout.virtual_stages, layout.microbatches)
        # the costs see ZeRO only through the optimizer step's bytes, alike for stages 1 to 3
        # (``pipesim.sim.zero.optimizer_bytes_per_param``): those layouts share them
        key = CostsKey(shell.placement, layout.pp, layout.tp, layout.dp, layout.microbatch_size, layout.recompute,
                       min(layout.zero, 1), layout.sequence_parallel, layout.ep, layout.cp, layout.etp,
                       layout.recompute_moe_act)
        parallel = self.parallel(layout.dp, layout.tp, layout.zero, layout.ep, layout.cp, layout.etp)
        return parallel, self.placed(key), shell, key

    @kept(limit=4096)
    def shell(self, schedule: str, pp: int, virtual_stages: int, microbatches: int):
        """A schedule with ``schedule``'s placement and no programs: what costs and bounds read."""
        from schedules.generators import placement_of
        from schedules.schedule import Schedule

        placement = tuple(placement_of(schedule, pp, virtual_stages))
        return Schedule(pp, microbatches, placement, [()] * pp, name=schedule)

    @kept(limit=1024)
    def parallel(self, dp: int, tp: int, zero: int, ep: int = 1, cp: int = 1, etp: int = 0):
        """``parallel_of`` the layout's job: only dp, tp, ZeRO, ep, cp and etp differ between layouts."""
        return parallel_of(replace(self.base, dp=dp, tp=tp, zero=zero, ep=ep, cp=cp, etp=etp or None,
                                   no_dp_overlap=self.no_dp_overlap(zero, dp, cp)))

    @kept(limit=8192)
    def placed(self, key: CostsKey):
        """The per-stage costs of every layout with these stages on these ranks: the
        schedule and the microbatch count do not change them (1F1B, GPipe and the
        zero-bubble orders share them), so they are derived once."""
        job = self.placed_job(*key[1:])
        return costs_of(job, self.placement_shell(key.placement), self.topology)

    @kept(limit=4096)
    def placed_job(self, pp: int, tp: int, dp: int, microbatch_size: int, recompute: str, zero: int,
                   sequence_parallel: bool, ep: int, cp: int, etp: int = 0, recompute_moe_act: bool = False) -> Job:
        """The plan's job with ``placed``'s settings, kept: the placements of one pp (looped,
        V, every chunk count) share it, and a job is slow to copy."""
        return replace(self.base, pp=pp, tp=tp, dp=dp, microbatch_size=microbatch_size, recompute=recompute,
                       zero=zero, sequence_parallel=sequence_parallel, ep=ep, cp=cp, etp=etp or None,
                       recompute_moe_act=recompute_moe_act)

    @kept(limit=1024)
    def placement_shell(self, placement: tuple[int, ...]):
        """A one-microbatch schedule of ``placement`` and no programs: what the costs and the
        bounds' collectives read of a schedule, built once per placement."""
        from schedules.schedule import Schedule

        pp = max(placement) + 1
        return Schedule(pp, 1, placement, [()] * pp)

    @kept(limit=1024)
    def pipeline_devices(self, dp: int, pp: int, tp: int, rank_order: str, cp: int = 1) -> list[str]:
        """The simulated pipeline's devices of a layout's mapping, kept: floors and bounds of
        many layouts share a mapping."""
        from pipesim.cluster.mapping import map_ranks

        return map_ranks(self.topology, dp, pp, tp, rank_order, cp).pipeline()

    @kept(limit=1024)
    def usable_memory(self, dp: int, pp: int, tp: int, rank_order: str, cp: int, headroom,
                      ep: int = 1, etp: int = 0) -> tuple[float, ...]:
        """Each pipeline device's memory less the headroom, kept per mapping: the headroom of
        a rank in the layout's tp, dp x cp, cp and ep communicators, its pipeline's left out
        (they depend on the placement), so that a floor judged against it stays a floor."""
        from pipesim.sim.headroom import Communicators

        holders = dp * cp * tp // (etp or tp)  # folded: the experts held by every rank of a stage
        communicators = Communicators(tp=tp, dp=dp * cp, cp=cp, ep=ep, expert_dp=holders // ep)
        capacities = [self.topology.device_memory(device)
                      for device in self.pipeline_devices(dp, pp, tp, rank_order, cp)]
        return tuple(headroom.usable(capacity, communicators) for capacity in capacities)

    def mapping(self, key: CostsKey, rank_order: str):
        """The ranks' mapping onto the cluster of the layouts whose costs ``key`` names:
        what the bounds' collectives are priced on."""
        from pipesim.cluster.mapping import map_ranks

        return map_ranks(self.topology, key.dp, key.pp, key.tp, rank_order, key.cp, key.ep, key.etp)

    def hop(self, key: CostsKey, rank_order: str):
        """``hop(source, target)``: a stage boundary's transfer on an empty route (latency +
        bytes / bandwidth), 0 between stages on one rank; what the bounds charge a hop.
        Each route's seconds kept (the bounds of many layouts cross the same boundaries with
        the same activations), looked up here rather than through a kept method: a plan's
        bounds ask tens of thousands of times."""
        stages = self.placed(key).stages
        placement = key.placement
        devices = self.pipeline_devices(key.dp, key.pp, key.tp, rank_order, key.cp)
        routes = self.tables["route seconds"]
        topology = self.topology

        def hop(source: int, target: int) -> float:
            if placement[source] == placement[target]:
                return 0.0
            route = (devices[placement[source]], devices[placement[target]], stages[min(source, target)].act_bytes)
            seconds = routes.get(route)
            if seconds is None:
                seconds = routes[route] = topology.route(route[0], route[1]).seconds(route[2])
            return seconds

        return hop

    @kept(limit=8192)
    def parameter_figures(self, key: CostsKey) -> tuple[tuple[float, int, int], ...]:
        """``pipesim.model.costs.parameter_figures`` of the costs named by ``key``, kept: the
        floors of every ZeRO stage and the gathers after the step read them."""
        return parameter_figures(self.placed(key))
