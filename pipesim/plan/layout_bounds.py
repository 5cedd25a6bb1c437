"""The lower bounds of a layout's step, priced as the simulation prices them: the
layout's bound before its order exists (``lower_bound``, from
``pipesim.plan.bounds.step_lower_bound``'s terms) and its order's bound once it is built
(``order_bound``). Each term is derived once per what it depends on and kept in the
evaluator's one cache: thousands of layouts share a placement, a mapping or a ZeRO stage.
"""

from __future__ import annotations

from itertools import repeat
from operator import add
from typing import TYPE_CHECKING

from pipesim.plan.bounds import Reductions, bound_of, busy_terms, reductions_of, with_tail
from pipesim.plan.cache import kept
from pipesim.plan.layout_costs import CostsKey, LayoutCosts
from pipesim.sim.zero import exposed_gather_seconds, gathers_after_optimizer, gathers_per_layer, reduces_every_backward
from schedules.generators import V_SHAPED, splits_backward

if TYPE_CHECKING:
    from pipesim.plan.layouts import Layout


class LayoutBounds:
    """Step times no schedule of a layout (``lower_bound``) or no lowering of its order
    (``order_bound``) can beat, on the costs and devices of ``costs``."""

    def __init__(self, costs: LayoutCosts) -> None:
        self.costs = costs
        self.tables = costs.tables

    def lower_bound(self, layout: Layout) -> float:
        """``pipesim.plan.bounds.step_lower_bound`` of the layout, with its tp collectives,
        ZeRO gathers and hops priced as the simulation prices them."""
        try:
            _, costs, _, key = self.costs.of(layout)
        except ValueError:
            return float("inf")  # the evaluation reports why
        if (layout.schedule in V_SHAPED or layout.ep_overlap) and self.overlaps_pairs(key):
            # overlapped pairs of a given cost may undercut F + B: only the tail is certain
            # (a pair priced by ``pipesim.sim.overlap``'s rule costs its halves' compute at least)
            return costs.step_overhead + costs.grad_norm_overhead
        return self.bound(key, layout.zero, layout.microbatches, splits_backward(layout.schedule))

    def order_bound(self, layout: Layout, schedule) -> float:
        """A step no lowering of ``schedule`` (the layout's compute order, as built for it)
        can beat: the order timed by the engine with free-flowing transfers, each taking its
        unloaded time (no contention, no rendezvous: every action starts at the earliest its
        rank and its input allow) and each action holding its rank as in ``lower_bound``;
        then each rank's tail (the optimizer step and the gathers after it). The simulation
        only ever waits more. ``lower_bound`` where the order is not the one its costs were
        derived for, or its overlapped pairs run at a cost of their own."""
        _, _, shell, key = self.costs.of(layout)
        if schedule.placement != shell.placement or any(schedule.fused) or (
                layout.schedule in V_SHAPED and self.overlaps_pairs(key)):
            return self.lower_bound(layout)
        from schedules import engine  # only here: an import runs slowly per call

        parallel = self.costs.parallel(layout.dp, layout.tp, layout.zero, layout.ep, layout.cp, layout.etp)
        timing = self.order_timing(key._replace(zero=0), parallel.rank_order, parallel.algorithm,
                                   gathers_per_layer(parallel.zero))
        run = engine.run(schedule, timing, engine.FREE)
        if run.stuck:
            return self.lower_bound(layout)  # the simulation says why
        tails = self.terms_of(key, parallel).tail
        return max(self.lower_bound(layout), *map(add, run.rank_done.tolist(), tails))

    @kept(limit=1024)
    def order_timing(self, key: CostsKey, rank_order: str, algorithm: str, per_layer: bool):
        """``order_bound``'s engine timing of the costs named by ``key``: each (stage,
        kind)'s seconds as the simulation has them, the bounds' holds, and each boundary a
        wire of its unloaded hop on a link of its own (so that transfers never queue)."""
        import numpy as np

        from schedules import engine

        costs = self.costs.placed(key)
        durations = costs.durations()
        holds = self.holds(key, rank_order, algorithm, per_layer)
        stages = range(costs.num_stages)
        seconds = np.array([[durations[stage, kind] for kind in engine.COMPUTE_KINDS] for stage in stages])
        hold = np.array([[holds.get((stage, kind), 0.0) for kind in engine.COMPUTE_KINDS] for stage in stages])
        hop = self.costs.hop(key, rank_order)
        hops = [hop(stage, stage + 1) for stage in range(costs.num_stages - 1)]
        return engine.StepTiming(seconds, hold, wires=engine.hop_wires(costs.num_stages, hops),
                                 comm_overhead=costs.comm_overhead)

    @kept(limit=8192)
    def overlaps_pairs(self, key: CostsKey) -> bool:
        """Whether a stage of the costs named by ``key`` gives its overlapped pair's cost
        (``overlap_fb``), kept: every V-shaped layout of them asks."""
        return any(stage.overlap_fb for stage in self.costs.placed(key).stages)

    @kept(limit=16384)
    def bound(self, key: CostsKey, zero: int, microbatches: int, split_backward: bool) -> float:
        """``lower_bound`` of what it depends on, kept: the schedules of a placement that alike
        split the backward or not share it (the microbatch count follows from the key's dp
        and microbatch size)."""
        parallel = self.costs.parallel(key.dp, key.tp, zero, key.ep, key.cp, key.etp)
        terms = self.terms_of(key, parallel)
        reductions = self.reductions(key, parallel.rank_order, parallel.algorithm, parallel.bucket_bytes,
                                     parallel.zero, parallel.overlap_dp)
        return bound_of(terms, microbatches, split_backward, reductions)

    def terms_of(self, key: CostsKey, parallel):
        """``bound_terms`` of the costs named by ``key`` under ``parallel``'s settings.
        ZeRO enters them only through two flags, so stages 1 and 2 share them."""
        flags = (gathers_per_layer(parallel.zero), gathers_after_optimizer(parallel.zero))
        return self.bound_terms(key, parallel.rank_order, parallel.algorithm, parallel.bucket_bytes, flags)

    @kept(limit=8192)
    def reductions(self, key: CostsKey, rank_order: str, algorithm: str, bucket_bytes: float, zero: int,
                   overlap_dp: bool) -> Reductions | None:
        """``pipesim.plan.bounds.Reductions`` of the layouts whose costs ``key`` names under
        ZeRO ``zero`` (None where the dp stream cannot raise the bound), kept: every schedule
        of a placement and every microbatch count share them."""
        every_backward = reduces_every_backward(zero)
        after_compute = not overlap_dp and not every_backward
        if not (every_backward or after_compute):
            return None
        costs = self.costs.placed(key)
        # what the reductions read of the costs: each stage's parameters and layers (ZeRO-3 reduces
        # per layer); the layouts of every microbatch size, recompute mode and sequence parallelism share them
        kept_as = (key.placement, key.dp, key.pp, key.tp, key.cp, key.ep, key.etp, rank_order, bucket_bytes,
                   algorithm, zero, after_compute, self.costs.parameter_figures(key),
                   tuple(stage.layers for stage in costs.stages))
        table = self.tables["reductions by parameters"]
        reductions = table.get(kept_as, table)
        if reductions is table:
            from pipesim.sim.parallel import gradient_reduction_seconds  # only here: an import runs slowly per call

            seconds = gradient_reduction_seconds(self.costs.placement_shell(key.placement), costs,
                                                 self.costs.topology, self.costs.mapping(key, rank_order),
                                                 bucket_bytes, algorithm, zero)
            reductions = table[kept_as] = reductions_of(key.placement, seconds, every_backward, after_compute)
        return reductions

    @kept(limit=4096)
    def bound_terms(self, key: CostsKey, rank_order: str, algorithm: str, bucket_bytes: float,
                    zero: tuple[bool, bool]):
        """The terms of ``pipesim.plan.bounds.step_lower_bound`` (``busy_terms`` and their
        tail, ``with_tail``) of what they depend on, kept: every schedule of a placement
        and every microbatch count share them (1F1B and GPipe; every split-backward
        order)."""
        per_layer, after_optimizer = zero
        # the key's ZeRO stage changes only the optimizer step, which the busy terms do not read
        busy = self.busy_terms(key._replace(zero=0), rank_order, algorithm, per_layer)
        gather_seconds = self.parameter_gathers(key, rank_order, bucket_bytes) if after_optimizer else {}
        return with_tail(busy, self.costs.placed(key), key.placement, gather_seconds)

    def parameter_gathers(self, key: CostsKey, rank_order: str, bucket_bytes: float) -> dict[int, float]:
        """``pipesim.sim.parallel.parameter_gather_seconds`` of the costs named by ``key`` on
        its mapping, kept under what it reads of them (``parameter_figures``): the layouts
        of every microbatch size and recompute mode share them."""
        kept_as = (key.placement, key.dp, key.pp, key.tp, key.cp, key.ep, key.etp, rank_order, bucket_bytes,
                   self.costs.parameter_figures(key))
        table = self.tables["parameter gathers by parameters"]
        gathers = table.get(kept_as)
        if gathers is None:
            from pipesim.sim.parallel import parameter_gather_seconds  # only here: an import runs slowly per call

            gathers = table[kept_as] = parameter_gather_seconds(
                self.costs.placement_shell(key.placement), self.costs.placed(key), self.costs.topology,
                self.costs.mapping(key, rank_order), bucket_bytes)
        return gathers

    @kept(limit=4096)
    def busy_terms(self, key: CostsKey, rank_order: str, algorithm: str, per_layer: bool):
        """``pipesim.plan.bounds.busy_terms`` of the costs named by ``key`` (ZeRO stage 0:
        the others' stages alike), kept: ZeRO 0, 1 and 2 share them (none gathers per
        layer), their tails differ."""
        return busy_terms(self.costs.placed(key), key.placement, self.holds(key, rank_order, algorithm, per_layer),
                          self.costs.hop(key, rank_order))

    @kept(limit=4096)
    def holds(self, key: CostsKey, rank_order: str, algorithm: str, per_layer: bool) -> dict[tuple[int, str], float]:
        """What holds a rank after each (stage, compute kind) in the bounds: the tp
        collectives and, under ZeRO-3, the layers' unhidden parameter gathers (ep and cp
        exchanges left out: the bounds only need less than the simulation holds), kept."""
        holds = self.tp_holds(key, rank_order, algorithm)
        if per_layer:  # the layers' gathers hold a rank at least by their closed form on a free channel
            from pipesim.sim.parallel import layer_gathers  # only here: an import runs slowly per call

            costs = self.costs.placed(key)
            durations = {(stage, kind): getattr(cost, field) for stage, cost in enumerate(costs.stages)
                         for kind, field in (("F", "fwd"), ("B", "bwd"), ("I", "input_grad"), ("W", "wgrad"))}
            held = {(stage, kind): exposed_gather_seconds(len(layers), layers[0], durations[stage, kind] / len(layers))
                    for (stage, kind), layers in layer_gathers(self.costs.placement_shell(key.placement), costs,
                                                               self.costs.topology,
                                                               self.costs.mapping(key, rank_order)).items()}
            keys = list(holds.keys() | held.keys())  # each key's two holds added by builtins, not per key
            sums = map(add, map(holds.get, keys, repeat(0.0)), map(held.get, keys, repeat(0.0)))
            holds = dict(zip(keys, sums, strict=True))
        return holds

    @kept(limit=4096)
    def tp_holds(self, key: CostsKey, rank_order: str, algorithm: str) -> dict[tuple[int, str], float]:
        """``pipesim.sim.parallel.tp_collective_seconds`` of the costs named by ``key`` on
        its mapping, kept: the busy terms with and without ZeRO-3's per-layer gathers share
        them."""
        from pipesim.sim.parallel import tp_collective_seconds

        return tp_collective_seconds(self.costs.placement_shell(key.placement), self.costs.placed(key),
                                     self.costs.topology, self.costs.mapping(key, rank_order), algorithm)
