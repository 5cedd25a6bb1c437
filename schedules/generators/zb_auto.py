"""Automatic zero-bubble scheduling (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024, Section 3): the order chosen for the stage costs at hand and a memory limit.

The handcrafted orders assume F = I = W and free links. Real stages differ (the last
one computes the loss, W is often shorter than I) and transfers take time, so the paper
builds the order from the profiled ``F``, ``I``, ``W`` and communication time ``T``
under a memory limit, by greedy heuristics that it then refines. We do the same:

1. heuristics: the paper's own list scheduler under its eight switch settings
   (``zb_heuristic``), our greedy list scheduler in eager and patient variants with
   several warm-up depths (``greedy_zero_bubble``), and the handcrafted orders that fit
   the limit (``zb-h1`` holds ``p`` stashes, ``zb-h2`` ``2p - 1``);
2. an optimising pass from the best of them: a CP-SAT model of the same problem
   (``zb_refine``) under a deterministic time budget, kept only if the engine times it
   better.

Every candidate is timed by the engine with free-flowing transfers (``schedules.engine``,
each transfer ``T`` after its producer, as the paper models it) and the best wins: the
shortest longest rank span (the paper's cost, what a step costs once the next step's
warm-up overlaps this one's drain), then the shortest step. Because zb-h1 is among the
candidates whenever the limit allows 1F1B's memory, zb-auto's cost never exceeds it.

``memory_limit`` counts microbatches' activations per rank (default ``p``, 1F1B's peak).
``weight_memory`` says how much of them a microbatch still holds between its ``I`` and
its ``W``: 1 (the default) is pipesim's stash, held whole until ``W``, so the simulated
memory never exceeds the limit; the paper counts what a transformer's ``W`` still needs,
the inputs of its matrix products, ``32h`` of ``34h + 5as`` per token and layer (its
Table 1). On the paper's rows its ZB-2p rates need that accounting: with whole stashes
the best order at ``2p`` (CP-SAT proves it optimal on the first row) keeps a 10 % bubble.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np

from schedules import engine
from schedules.action import ActionKind
from schedules.generators.common import Cutoff, ScheduleUnavailableError, fastest, require_positive
from schedules.generators.greedy_zero_bubble import greedy_orders
from schedules.generators.zb_h1 import zb_h1
from schedules.generators.zb_h2 import zb_h2
from schedules.generators.zb_heuristic import heuristic_orders
from schedules.generators.zb_refine import refine
from schedules.metrics import order_peak_stashes
from schedules.schedule import Schedule, looped_placement

# The optimising pass's budget by default, in CP-SAT's deterministic seconds (2-4 s of
# wall time at p = 8, m = 24-64 on a 2-core machine, model building included).
DEFAULT_SEARCH_SECONDS = 0.2
# Above this many (stage, microbatch) pairs the model takes longer to build than the
# pass is likely to win: heuristics only.
SEARCH_PASSES = 512


def zb_auto(
    pp: int,
    microbatches: int,
    forward: float | Sequence[float],
    backward_input: float | Sequence[float],
    backward_weight: float | Sequence[float],
    comm: float = 0.0,
    memory_limit: int | Sequence[int] | None = None,
    weight_memory: float = 1.0,
    search_seconds: float = DEFAULT_SEARCH_SECONDS,
) -> Schedule:
    """The fastest order found for these per-stage seconds (one number for every stage
    or one per stage), ``comm`` seconds per hop, at most ``memory_limit`` microbatches'
    activations on a rank (one number for every rank, or one each: a memory budget leaves
    the ranks different room, ``pipesim.sim.stash_budget``). ``weight_memory`` is the
    share of a microbatch's activations still held between its ``I`` and its ``W`` (1:
    all of them, pipesim's stash; the paper's transformer keeps the inputs of its matrix
    products, ``32h / (34h + 5as)``); ``search_seconds`` is the optimising pass's budget
    (0: heuristics only)."""
    require_positive("zb-auto", pp, microbatches, 1)
    limit = rank_limits(pp, memory_limit)
    if not 0.0 <= weight_memory <= 1.0:
        raise ScheduleUnavailableError(f"zb-auto: weight memory must be a share in [0, 1], got {weight_memory!r}")
    costs = {kind: per_stage(name, value, pp) for kind, name, value in (
        (ActionKind.F, "forward", forward), (ActionKind.I, "input-gradient", backward_input),
        (ActionKind.W, "weight-gradient", backward_weight))}
    if comm < 0:
        raise ScheduleUnavailableError(f"zb-auto: communication time must be >= 0, got {comm!r}")
    if pp * microbatches > SEARCH_PASSES:
        search_seconds = 0.0  # no optimising pass at this size: the same search as heuristics only
    return _fastest_order(pp, microbatches, tuple(costs["F"]), tuple(costs["I"]), tuple(costs["W"]), float(comm),
                          limit, float(weight_memory), float(search_seconds))


def rank_limits(pp: int, memory_limit: int | Sequence[int] | None) -> int | tuple[int, ...]:
    """``memory_limit`` checked: one whole number of stashes >= 1 (default ``pp``), or
    one per rank (kept as one number where they are all equal, which is the same order)."""
    limit = pp if memory_limit is None else memory_limit
    limits = list(limit) if isinstance(limit, (list, tuple)) else [limit] * pp
    if len(limits) != pp or any(isinstance(value, bool) or not isinstance(value, int) or value < 1
                                for value in limits):
        raise ScheduleUnavailableError(
            f"zb-auto: --memory-limit must be a whole number of microbatch stashes >= 1 (or one per rank of "
            f"pp={pp}), got {memory_limit!r}")
    return limits[0] if len(set(limits)) == 1 else tuple(limits)


def fits(programs: Sequence[Sequence], limit: int | tuple[int, ...], weight_memory: float = 1.0) -> bool:
    """Whether every rank's order holds at most its limit of stashes, each ``I`` keeping
    ``weight_memory`` of its stash until its ``W`` (1: the whole stash)."""
    limits = [limit] * len(programs) if isinstance(limit, int) else limit
    return all(order_peak_stashes(program, weight_memory) <= most + 1e-9
               for program, most in zip(programs, limits, strict=True))


@functools.lru_cache(maxsize=256)
def _fastest_order(pp: int, microbatches: int, forward: tuple[float, ...], backward_input: tuple[float, ...],
                   backward_weight: tuple[float, ...], comm: float, limit: int | tuple[int, ...],
                   weight_memory: float, search_seconds: float) -> Schedule:
    """The search itself, kept per distinct input: it is a pure function of them and a
    schedule never changes, so a planner whose layouts differ only in what the order does
    not depend on (optimizer sharding, say) searches once and shares the schedule, with
    its lowering and compiled programs (``Schedule.derived``)."""
    best = _best_heuristic(pp, microbatches, forward, backward_input, backward_weight, comm, limit, weight_memory)
    if search_seconds > 0:  # ``zb_auto`` passes 0 above ``SEARCH_PASSES``
        refined = refine(pp, microbatches, forward, backward_input, backward_weight, comm, limit, weight_memory,
                         best, search_seconds)
        cost = _cost_of(pp, microbatches, forward, backward_input, backward_weight, comm)
        if refined is not None and cost(refined) < cost(best):
            best = refined
    return Schedule(pp, microbatches, looped_placement(pp, 1), best, name="zb-auto",
                    meta={"memory_microbatches": limit, "weight_memory": weight_memory})


def _cost_of(pp: int, microbatches: int, forward: tuple[float, ...], backward_input: tuple[float, ...],
             backward_weight: tuple[float, ...], comm: float):
    """The candidates' cost: the paper's (the longest rank span) first, then the step, on
    the engine with free-flowing transfers ``comm`` after their producer."""
    return order_cost(looped_placement(pp, 1), microbatches, forward, backward_input, backward_weight, comm)


def order_cost(placement: tuple[int, ...], microbatches: int, forward: Sequence[float],
               backward_input: Sequence[float], backward_weight: Sequence[float], comm: float):
    """``cost(programs)``: (the longest rank span, the step) of an order for stages placed
    by ``placement``, timed by the engine with free-flowing transfers, each ``comm`` after
    its producer where it crosses ranks (none between stages on one rank)."""
    pp = max(placement) + 1
    # per stage: F, B (= I + W, unused: the orders split every backward), I, W
    timing = engine.StepTiming(
        np.array([[f, i + w, i, w] for f, i, w in zip(forward, backward_input, backward_weight, strict=True)]),
        wires=engine.hop_wires(len(placement), comm))

    def cost(programs) -> tuple[float, float]:
        step = engine.run(Schedule(pp, microbatches, placement, programs), timing, engine.FREE)
        return float(step.rank_spans().max()), step.makespan

    return cost


@functools.lru_cache(maxsize=256)
def _best_heuristic(pp: int, microbatches: int, forward: tuple[float, ...], backward_input: tuple[float, ...],
                    backward_weight: tuple[float, ...], comm: float, limit: int | tuple[int, ...],
                    weight_memory: float):
    """The best of the heuristics' orders, kept: a planner screens with it and then asks
    for the optimising pass from it on its finalists. The first of equals wins; a list
    scheduler's run stops once its span must exceed the best so far (it could not win)."""
    cost = _cost_of(pp, microbatches, forward, backward_input, backward_weight, comm)

    def candidates(cutoff):
        """The candidates in turn, each run stopped at ``cutoff()`` (read as it starts)."""
        most = limit if isinstance(limit, int) else max(limit)
        for patient in (False, True):
            for cap in sorted({None, *(c for c in (pp, 2 * pp - 1, most // 2) if 1 <= c < most)}, key=str):
                yield greedy_orders(pp, microbatches, forward, backward_input, backward_weight, comm, limit,
                                    patient_weights=patient, warmup_cap=cap, cutoff=cutoff())
        for switches in itertools.product((True, False), repeat=3):
            yield heuristic_orders(pp, microbatches, forward, backward_input, backward_weight, comm, limit,
                                   weight_memory, *switches, cutoff=cutoff())
        for handcrafted in (zb_h1, zb_h2):
            programs = handcrafted(pp, microbatches).programs
            if fits(programs, limit, weight_memory):
                yield programs

    return fastest(candidates, cost, lambda best: Cutoff(span=best[0]))


def per_stage(name: str, value: float | Sequence[float], stages: int, schedule: str = "zb-auto",
              sizes: str | None = None) -> list[float]:
    """``value`` for each of ``stages`` stages (one number for all, or one each), checked;
    ``sizes`` says how the stage count follows from the sizes (default ``pp=stages``)."""
    values = [float(value)] * stages if isinstance(value, (int, float)) else [float(item) for item in value]
    if len(values) != stages:
        raise ScheduleUnavailableError(
            f"{schedule}: {len(values)} {name} costs given for {sizes or f'pp={stages}'} stages")
    if min(values) < 0:
        raise ScheduleUnavailableError(f"{schedule}: {name} costs must be >= 0, got {values}")
    return values
