"""Automatic zero-bubble scheduling (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024, Section 3): the order chosen for the stage costs at hand and a memory limit.

The handcrafted orders assume F = I = W and free links. Real stages differ (the last
one computes the loss, W is often shorter than I) and transfers take time, so the paper
builds the order from the profiled ``F``, ``I``, ``W`` and communication time ``T``
under a memory limit, by greedy heuristics that it then refines. We do the same:
several variants of the greedy list scheduler (``greedy_zero_bubble``: eager or patient
``W`` placement, warm-up depths up to the limit) and the handcrafted orders that fit the
limit (``zb-h1`` holds ``p`` stashes, ``zb-h2`` ``2p - 1``) are timed under the given
costs (the engine's ``free`` timing, ``schedules.engine``), and the fastest step wins (ties go to the order
whose longest rank span is shortest, the paper's bubble). Because zb-h1 is among the
candidates whenever the limit allows 1F1B's memory, zb-auto is never slower than it
under the costs it was built for, in that timing (each transfer ``T`` after its producer,
as the paper models it); ``lower``'s P2P groups for NCCL add their own cost to both.

``memory_limit`` counts stashes of one microbatch per rank (default ``p``, 1F1B's peak);
no rank ever holds more, which the simulated memory shows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from schedules import engine
from schedules.action import ActionKind
from schedules.generators.common import ScheduleUnavailableError, require_positive
from schedules.generators.greedy_zero_bubble import greedy_orders
from schedules.generators.zb_h1 import zb_h1
from schedules.generators.zb_h2 import zb_h2
from schedules.schedule import Schedule, looped_placement


def zb_auto(
    pp: int,
    microbatches: int,
    forward: float | Sequence[float],
    backward_input: float | Sequence[float],
    backward_weight: float | Sequence[float],
    comm: float = 0.0,
    memory_limit: int | None = None,
) -> Schedule:
    """The fastest order found for these per-stage seconds (one number for every stage
    or one per stage), ``comm`` seconds per hop, at most ``memory_limit`` stashes a rank."""
    require_positive("zb-auto", pp, microbatches, 1)
    limit = pp if memory_limit is None else memory_limit
    if not isinstance(limit, int) or limit < 1:
        raise ScheduleUnavailableError(
            f"zb-auto: --memory-limit must be a whole number of microbatch stashes >= 1, got {memory_limit!r}"
        )
    costs = {kind: _per_stage(name, value, pp) for kind, name, value in (
        (ActionKind.F, "forward", forward), (ActionKind.I, "input-gradient", backward_input),
        (ActionKind.W, "weight-gradient", backward_weight))}
    if comm < 0:
        raise ScheduleUnavailableError(f"zb-auto: communication time must be >= 0, got {comm!r}")
    return _fastest_order(pp, microbatches, tuple(costs["F"]), tuple(costs["I"]), tuple(costs["W"]), float(comm),
                          limit)


@functools.lru_cache(maxsize=256)
def _fastest_order(pp: int, microbatches: int, forward: tuple[float, ...], backward_input: tuple[float, ...],
                   backward_weight: tuple[float, ...], comm: float, limit: int) -> Schedule:
    """The search itself, kept per distinct input: it is a pure function of them and a
    schedule never changes, so a planner whose layouts differ only in what the order does
    not depend on (optimizer sharding, say) searches once and shares the schedule, with
    its lowering and compiled programs (``Schedule.derived``)."""
    placement = looped_placement(pp, 1)
    # per stage: F, B (= I + W, unused: the orders split every backward), I, W
    timing = engine.StepTiming(
        np.array([[f, i + w, i, w] for f, i, w in zip(forward, backward_input, backward_weight, strict=True)]),
        wires=engine.hop_wires(pp, comm))

    def step_and_rank_span(programs) -> tuple[float, float]:
        step = engine.run(Schedule(pp, microbatches, placement, programs), timing, engine.FREE)
        return step.makespan, float(step.rank_spans().max())

    candidates = []
    for patient in (False, True):
        for cap in sorted({None, *(c for c in (pp, 2 * pp - 1, limit // 2) if 1 <= c < limit)}, key=str):
            orders = greedy_orders(pp, microbatches, forward, backward_input, backward_weight, comm, limit,
                                   patient_weights=patient, warmup_cap=cap)
            candidates.append(orders)
    if limit >= pp:
        candidates.append(zb_h1(pp, microbatches).programs)
    if limit >= 2 * pp - 1:
        candidates.append(zb_h2(pp, microbatches).programs)
    # fastest step first; among equals, the one whose ranks work in the tightest span
    # (the paper's bubble: what the next step's warm-up cannot fill)
    best = min(candidates, key=step_and_rank_span)
    return Schedule(pp, microbatches, placement, best, name="zb-auto", meta={"memory_microbatches": limit})


def _per_stage(name: str, value: float | Sequence[float], pp: int) -> list[float]:
    values = [float(value)] * pp if isinstance(value, (int, float)) else [float(item) for item in value]
    if len(values) != pp:
        raise ScheduleUnavailableError(f"zb-auto: {len(values)} {name} costs given for pp={pp} stages")
    if min(values) < 0:
        raise ScheduleUnavailableError(f"zb-auto: {name} costs must be >= 0, got {values}")
    return values
