"""The layout evaluator: everything the search asks of one layout of a plan's job, as
one object owning one cache.

Each layout is a ``Job`` (``layout_job``): the plan's base job with the layout's
schedule, pp, tp, dp, microbatches and options filled in, simulated by the very functions
``pipesim simulate`` calls, so a plan's rows are what ``simulate`` prints for them. Before
simulating, the evaluator says whether a layout provably does not fit
(``reject_cause``: ``pipesim.plan.memory_floors``) and what step it cannot beat
(``lower_bound``, ``order_bound``: ``pipesim.plan.layout_bounds``). What these derive is
kept in the evaluator's ``cache``, so an evaluator built for another job starts empty. A
worker process builds its evaluator once, when it starts (``pipesim.plan.workers``).
"""

from __future__ import annotations

import math

from pipesim.job import Job, costs_of, parallel_of, schedule_of, throughput_figures
from pipesim.plan.cache import LayoutCache, kept
from pipesim.plan.layout_bounds import LayoutBounds
from pipesim.plan.layout_costs import LayoutCosts
from pipesim.plan.layouts import Layout, layout_fields
from pipesim.plan.memory_floors import MEMORY_LIMIT_TOO_SMALL, MemoryFloors
from schedules.collector import without_collector


class LayoutEvaluator:
    """Screens, simulates, bounds and rejects the layouts of the plan whose every layout
    starts from ``base`` (its model, cluster and settings; a layout fills in the rest);
    ``torchtitan_fsdp``: the data parallelism priced as torchtitan's FSDP runs it
    (``pipesim.plan.torchtitan_fsdp``)."""

    def __init__(self, base: Job, torchtitan_fsdp: bool = False) -> None:
        self.cache = LayoutCache()
        self.tables = self.cache.tables
        self.costs = LayoutCosts(base, self.cache, torchtitan_fsdp)
        self.bounds = LayoutBounds(self.costs)
        self.floors = MemoryFloors(self.costs)

    def __reduce__(self):
        """Sent to a worker that does not fork: rebuilt there from its job, its cache empty."""
        return type(self), (self.base, self.costs.torchtitan_fsdp)

    @property
    def base(self) -> Job:
        """The job every layout starts from."""
        return self.costs.base

    @property
    def topology(self):
        """The base job's cluster, loaded once (its routes computed once)."""
        return self.costs.topology

    def layout_job(self, layout: Layout) -> Job:
        """The plan's job with ``layout`` filled in: what ``pipesim simulate`` would be given."""
        return self.costs.layout_job(layout)

    def lower_bound(self, layout: Layout) -> float:
        """A step no schedule of ``layout`` can beat (``pipesim.plan.layout_bounds``)."""
        return self.bounds.lower_bound(layout)

    def order_bound(self, layout: Layout, schedule) -> float:
        """A step no lowering of ``schedule``, the layout's order, can beat."""
        return self.bounds.order_bound(layout, schedule)

    def reject_cause(self, layout: Layout) -> str | None:
        """Why ``layout`` provably does not fit, before anything is built; None if it may."""
        return self.floors.reject_cause(layout)

    def memory_floors(self, layout: Layout) -> list[tuple[float, float]] | None:
        """Per rank, the layout's memory floor and the device's usable memory."""
        return self.floors.memory_floors(layout)

    def describe(self, layout: Layout) -> dict:
        """What the chart shows of a layout never simulated: its largest memory floor and its
        lower bound."""
        floors = self.memory_floors(layout)
        facts = {"lower_bound": self.lower_bound(layout)}
        return {**facts, "peak_memory_bytes": max(floor for floor, _ in floors)} if floors else facts

    @without_collector  # paused for the whole layout: its Trace is freed before the collector runs again
    def evaluate(self, layout: Layout, cutoff: float = math.inf) -> dict:
        """Simulate one layout exactly as ``pipesim simulate`` would; a row for the table, or
        ``{"error": cause}`` for a layout that cannot be built, or ``{"rejected": cause}``
        where its order provably does not fit, or ``{"pruned": bound}`` where its
        ``order_bound`` is no better than ``cutoff`` (the search's ``top``-th best step so
        far: the layout cannot reach the top)."""
        return self._evaluated(layout, True, cutoff)

    @without_collector
    def screen(self, layout: Layout, cutoff: float = math.inf) -> dict:
        """``evaluate`` with the searches that cost the most and change the least cut short:
        lowering places the transfers by one rule, untimed and unrepaired, zb-auto keeps its
        best heuristic without the solver's pass, and zbv-auto tries only its most often
        winning variants. Each only ever keeps what makes the step shorter, so a screened
        step is the exact one or a little longer; the planner screens every layout this way
        and simulates its finalists exactly."""
        return self._evaluated(layout, False, cutoff)

    def _evaluated(self, layout: Layout, exact: bool, cutoff: float) -> dict:
        from pipesim.sim.engine import lower_for
        from pipesim.sim.stash_budget import is_budget
        from pipesim.sim.step import run_simulation
        from schedules.generators import COST_AWARE, ScheduleUnavailableError
        from schedules.lowering import repair_budget
        from schedules.placement_search import SCREEN_RULE

        topology = self.topology
        try:
            job = self.layout_job(layout)
            _, layout_costs, shell, _ = self.costs.of(layout)
            # orders and lowering read the stages' times and transfers, never the optimizer step:
            # layouts that differ in their ZeRO stage alone share them (built for ZeRO 0), but for
            # a cost-aware order within a memory budget, whose room the sharded state decides
            unsharded = layout if layout.schedule in COST_AWARE and is_budget(job.memory_limit) else \
                layout._replace(zero=0)
            # zb-auto's optimising pass and zbv-auto's full search are what screening leaves out; the
            # adapted orders have neither
            search_seconds = None if exact or layout.schedule not in COST_AWARE else 0.0
            schedule = self.order_of(unsharded, search_seconds)
            # costs depend on the stages and their placement only (``LayoutCosts.of``)
            costs = layout_costs if schedule.placement == shell.placement else costs_of(job, schedule, topology)
            cause = self.floors.order_cause(schedule, costs, parallel_of(job), layout)
            if cause is not None:
                return {"rejected": cause}
            if cutoff < math.inf:  # an order whose best case cannot reach the top is not lowered or simulated
                bound = self.order_bound(layout, schedule)
                if bound >= cutoff:
                    return {"pruned": bound}
            # screening places the transfers by one rule, untimed (``SCREEN_RULE``); the exact
            # lowering times every rule and repairs the best (where the budget has runs)
            repair_runs = None if exact and repair_budget(sum(map(len, schedule.programs))) else 0
            rule = None if exact else SCREEN_RULE
            if costs is layout_costs:
                schedule = self.lowered_for(unsharded, search_seconds, repair_runs, rule)
            else:
                devices = self.costs.pipeline_devices(layout.dp, layout.pp, layout.tp, job.rank_order, layout.cp)
                schedule = lower_for(schedule, costs, topology, devices, repair_runs, rule)
            # Generated here and lowered for this layout's costs and links as simulate lowers it, so
            # valid by construction (tests/test_p2p.py proves it for every generator); the engine's
            # run is the deadlock check that remains.
            result = run_simulation(schedule, costs, topology, parallel=parallel_of(job), p2p=job.p2p, validate=False)
        except ScheduleUnavailableError as error:
            if str(error).startswith("--memory-limit"):  # a budget without room for one microbatch on some rank
                return {"rejected": MEMORY_LIMIT_TOO_SMALL}
            return {"error": f"{layout.schedule} does not exist for that microbatch count and pp"}
        except ValueError as error:
            return {"error": f"{type(error).__name__}: {str(error).split(';')[0]}"}
        return self._row(layout, job, result)

    @staticmethod
    def _row(layout: Layout, job: Job, result) -> dict:
        """The table's row of a simulated layout: what ``simulate`` prints for it."""
        metrics = result.metrics
        figures = throughput_figures(job, result)
        peak = max((memory.peak_bytes for memory in result.memory), default=0.0)
        capacity = min((memory.capacity_bytes for memory in result.memory), default=float("inf"))
        usable = min((memory.usable_bytes for memory in result.memory), default=float("inf"))
        return {
            **layout_fields(layout),
            "step_time": metrics.makespan,
            "tokens_per_second": figures["tokens_per_second"] or 0.0,
            "mfu": figures["mfu"],
            "model_tflops_per_gpu": figures["model_tflops_per_gpu"],
            "bubble_fraction": metrics.bubble_fraction,
            "idle_fraction": metrics.idle_fraction,
            "exposed_comm": sum(rank.exposed_comm for rank in metrics.ranks) / len(metrics.ranks),
            "peak_memory_bytes": peak,
            "capacity_bytes": capacity if capacity != float("inf") else None,
            # the limit the out-of-memory verdict was judged against, for the chart's line
            "usable_bytes": usable if usable != float("inf") else None,
            "memory_headroom": job.memory_headroom,
            "oom": result.oom,
        }

    def order_of(self, layout: Layout, search_seconds: float | None):
        """The layout's order as ``simulate`` builds it: generated, or for a cost-aware or
        adapted one (zb-auto, zbv-auto, zb-h1, zb-h2) built from the layout's costs
        (``search_seconds`` 0 when screening: their quick searches), kept either way."""
        from schedules.generators import COST_AWARE
        from schedules.generators.adaptive import ADAPTABLE

        if layout.schedule in COST_AWARE or layout.schedule in ADAPTABLE:
            return self.ordered_by_costs(layout, search_seconds)
        return self.generated(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages,
                              self.base.max_actions, layout.microbatch_group, layout.ep_overlap)

    @kept(limit=256)
    def generated(self, name: str, pp: int, microbatches: int, virtual_stages: int, max_actions: int,
                  microbatch_group: int | None = None, combined: bool = False):
        """The schedule's order (``combined``: run as combined 1F1B, as ``simulate
        --ep-overlap`` builds it), shared by every layout with the same one: tp, dp,
        microbatch size, recompute and sharding leave it alone (its transfers are placed for
        each layout's costs when it is simulated, as ``simulate`` places them)."""
        from schedules.generators import generate, require_within_limit
        from schedules.generators.combined import combined_1f1b

        if combined:  # the layouts enumerated are those combined 1F1B runs (``layouts._combines``)
            require_within_limit(name, pp, microbatches, virtual_stages, max_actions)
            return combined_1f1b(name, pp, microbatches, virtual_stages, microbatch_group)
        return generate(name, pp, microbatches, virtual_stages, max_actions=max_actions,
                        microbatch_group=microbatch_group)

    @kept(limit=256)
    def ordered_by_costs(self, layout: Layout, search_seconds: float | None):
        """``order_of`` a cost-aware or adapted order, kept per layout and budget."""
        return schedule_of(self.layout_job(layout), self.topology, search_seconds=search_seconds, notes=False)

    @kept(limit=256)
    def lowered_for(self, layout: Layout, search_seconds: float | None, repair_runs: int | None, rule: int | None):
        """The layout's order lowered for its costs on its pipeline's devices, as ``simulate``
        lowers it (``pipesim.sim.engine.lower_for``; one untimed ``rule`` when screening),
        kept: layouts that differ only in what lowering does not read share it."""
        from pipesim.sim.engine import lower_for

        _, costs, _, _ = self.costs.of(layout)
        devices = self.costs.pipeline_devices(layout.dp, layout.pp, layout.tp, self.base.rank_order, layout.cp)
        return lower_for(self.order_of(layout, search_seconds), costs, self.topology, devices, repair_runs, rule)

    def schedule_of(self, layout: Layout):
        """The layout's order exactly as ``simulate`` builds it (what ``--torchtitan`` writes)."""
        return schedule_of(self.layout_job(layout), self.topology, notes=False)

    def planned_order(self, layout: Layout) -> dict | None:
        """The compute order of a layout whose order the plan builds from its costs
        (zb-auto, zbv-auto; zb-h1 and zb-h2 adapted), as ``simulate`` builds it, in the
        JSON form ``pipesim run --plan`` runs (``schedules.order_json``); None for an order
        that a generator gives alike to anyone who names it."""
        from schedules.generators import COST_AWARE
        from schedules.generators.adaptive import ADAPTABLE
        from schedules.order_json import order_to_dict

        if layout.schedule not in COST_AWARE | ADAPTABLE:
            return None
        return order_to_dict(self.schedule_of(layout))

    def best_trace(self, layout: Layout):
        """The layout's simulated step as ``simulate`` runs it: the chart's Gantt."""
        from pipesim.job import simulate_job

        return simulate_job(self.layout_job(layout)).trace
