"""Automatic V-shaped zero-bubble scheduling (Qi et al., "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024): the V order chosen for the stage costs at hand and
a memory limit.

``zbv`` is the paper's handcrafted V-ZB order: two chunks per rank in a V (rank ``r``
holds stage ``r`` and ``2p - 1 - r``), bubble-free when ``F = I = W`` per chunk, links
are free and ``m >= 2p``, holding 1F1B's memory (``p`` microbatches per rank). Real
chunks differ (``W`` is often shorter than ``I``), transfers take time, and the paper's
point is that the memory is a knob: its V-Half and V-Min hold about 1/2 and 1/3 of
1F1B's activations for some bubble. ``zbv-auto`` builds the order for the given
per-stage ``F``, ``I``, ``W`` and hop time ``comm`` under a limit, as ``zb-auto`` does
for one stage per rank:

1. candidates: the handcrafted ``zbv`` order where its stashes fit the limit (else the
   paper's V-Half and V-Min orders that fit it), the same orders with their ``W`` passes
   placed for these costs (eager and patient), and the
   greedy list scheduler on the V placement (``greedy_zero_bubble``) in its variants:
   eager and patient ``W``, a ``W`` before a ready ``I`` when memory stops the next
   forward or not, the later or the earlier chunk first when both are ready, room kept
   for one returning microbatch or for all of them, several warm-up depths;
2. every candidate timed by the engine with free-flowing transfers (each ``comm`` after
   its producer, none at the V's turn on the last rank, where stage ``p - 1`` hands its
   output to stage ``p`` on the same rank), the best kept: the shortest step, then the
   shortest longest rank span (the order ``adapt`` ranks zb-h1's candidates in; with the
   first and last stage on rank 0 the two mostly coincide).

Because ``zbv`` is among the candidates whenever it fits, ``zbv-auto``'s step is never
longer than ``zbv``'s there. There is no optimising pass: the V's ``2p`` stages make the
constraint model of ``zb_refine`` twice as large, and it would not fit the time a
planner gives each schedule. Below zbv's memory the paper's building-block orders,
V-Half and V-Min (``schedules.generators.v_blocks``), are candidates too where they fit
the limit, each also with its W passes placed again for the costs; below theirs only the
greedy orders remain (docs/schedules.md gives the numbers).

``memory_limit`` counts microbatches' activations per rank, as ``zbv``'s own count
does: a microbatch's stash on one of the rank's two chunks is half of it, held from the
chunk's ``F`` until its ``W`` (pipesim's stash), so a limit of ``L`` allows ``2L``
chunk stashes (``L`` may be a half). The default is ``p``, what ``zbv`` holds; the least
is 1, one microbatch on both chunks at a time (the turn needs it). ``weight_memory`` is
the share of a chunk's stash still held between its ``I`` and its ``W``, as for
``zb-auto`` (1: all of it; a transformer keeps its matrix products' inputs): the greedy
scheduler and the fit of the fixed candidates count it, so a limit from a memory budget
admits the orders that hold the budget as the memory report counts it, not only those
that would hold it with every stash whole until its ``W``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

from schedules.action import Action, ActionKind
from schedules.generators.common import Cutoff, ScheduleUnavailableError, fastest, per_rank_limits, require_positive
from schedules.generators.greedy_zero_bubble import STASH_UNITS, placed_greedy_orders, weight_units
from schedules.generators.v_blocks import BLOCKS, v_block_order
from schedules.generators.zb_auto import fits as fits_limit
from schedules.generators.zb_auto import order_cost, per_stage
from schedules.generators.zbv import zbv
from schedules.schedule import Schedule, v_shape_placement

NAME = "zbv-auto"
# Above this many (stage, microbatch) pairs the greedy runs in its variants that win most
# often only (W before a ready I when memory stops a forward, the later chunk first, room
# for one returning microbatch, no warm-up cap): the full set takes tens of seconds at
# p = 32, m = 256, which a planner cannot spend on every layout.
FULL_SEARCH_PASSES = 1024
# above this many (stage, microbatch) pairs the building-block orders are not built
BLOCK_PASSES = 16384


def zbv_auto(
    pp: int,
    microbatches: int,
    forward: float | Sequence[float],
    backward_input: float | Sequence[float],
    backward_weight: float | Sequence[float],
    comm: float = 0.0,
    memory_limit: float | Sequence[float] | None = None,
    quick: bool = False,
    weight_memory: float = 1.0,
) -> Schedule:
    """The fastest V order found for these per-stage seconds (one number for every one of
    the ``2p`` stages, or one per stage in pipeline order: stage ``s`` sits on rank ``s``
    going down and on rank ``2p - 1 - s`` coming back), ``comm`` seconds per hop between
    ranks, at most ``memory_limit`` microbatches' activations on a rank (default ``p``; one
    number for every rank, or one each).
    ``quick`` tries only the variants that win most often (those of large sizes, a subset
    of the full set, so the step is the full search's or a little longer): what a planner
    screens thousands of layouts with before searching its finalists in full.
    ``weight_memory`` is the share of a stash held between ``I`` and ``W``, counted in
    tenths, rounded up."""
    require_positive(NAME, pp, microbatches, 2)
    if not 0.0 <= weight_memory <= 1.0:
        raise ScheduleUnavailableError(f"{NAME}: weight memory must be a share in [0, 1], got {weight_memory!r}")
    chunk_stashes = chunk_limits(pp, memory_limit)
    stages = 2 * pp
    sizes = f"the V's 2 x pp={pp} = {stages}"
    costs = {kind: per_stage(name, value, stages, NAME, sizes) for kind, name, value in (
        (ActionKind.F, "forward", forward), (ActionKind.I, "input-gradient", backward_input),
        (ActionKind.W, "weight-gradient", backward_weight))}
    if not comm >= 0:
        raise ScheduleUnavailableError(f"{NAME}: communication time must be >= 0, got {comm!r}")
    return _fastest_order(pp, microbatches, tuple(costs["F"]), tuple(costs["I"]), tuple(costs["W"]), float(comm),
                          chunk_stashes, quick or 2 * pp * microbatches > FULL_SEARCH_PASSES,
                          weight_units(weight_memory) / STASH_UNITS)


def chunk_limits(pp: int, memory_limit: float | Sequence[float] | None) -> int | tuple[int, ...]:
    """``memory_limit`` (microbatches per rank, default ``p``: one number for every rank, or
    one each) checked and counted in chunk stashes, ``2L`` each (kept as one number where
    they are all equal, which is the same order)."""
    limits = per_rank_limits(NAME, pp, pp if memory_limit is None else memory_limit, "microbatches' activations")
    if min(limits) < 1:
        raise ScheduleUnavailableError(
            f"{NAME}: --memory-limit {min(limits):g} is below the least a V order can run with, 1 microbatch per "
            f"rank (its stash on both of the rank's chunks: a microbatch turns at the last rank and comes back to "
            f"the rank's second chunk while the first still holds it)")
    chunks = [math.floor(2 * value + 1e-9) for value in limits]
    return chunks[0] if len(set(chunks)) == 1 else tuple(chunks)


@functools.lru_cache(maxsize=256)
def _fastest_order(pp: int, microbatches: int, forward: tuple[float, ...], backward_input: tuple[float, ...],
                   backward_weight: tuple[float, ...], comm: float, chunk_stashes: int | tuple[int, ...],
                   quick: bool, weight_memory: float) -> Schedule:
    """The search, kept per distinct input (a pure function of them; a schedule never
    changes), so layouts that differ only in what the order does not read share it."""
    placement = v_shape_placement(pp, 2)
    cost = order_cost(placement, microbatches, forward, backward_input, backward_weight, comm)
    handcrafted = zbv(pp, microbatches).programs
    per_rank = [chunk_stashes] * pp if isinstance(chunk_stashes, int) else list(chunk_stashes)
    fits = fits_limit(handcrafted, chunk_stashes, weight_memory)
    # below zbv's memory, the paper's building-block orders where they fit (V-Half, V-Min;
    # both built in 1.7 s at p 32, m 256 on 2 cores, kept per size)
    blocks = [] if fits or 2 * pp * microbatches > BLOCK_PASSES else \
        [programs for programs in (v_block_order(name, pp, microbatches).programs for name in BLOCKS)
         if fits_limit(programs, chunk_stashes, weight_memory)]
    caps = [None, *sorted({cap for cap in (pp, 2 * pp - 1) if 2 <= cap < max(per_rank)})]
    variants = list(itertools.product((True,), (False,), (True,), (False, True), (None,)) if quick else
                    itertools.product((True, False), (False, True), (True, False), (False, True), caps))
    # the greedy counts the share kept between I and W, and where it is below 1 also the
    # whole stash (a safe count too): neither always wins, and the whole count's orders,
    # what zbv-auto built before it took the share, come first, so the first of equals is
    # theirs and taking the share never makes the step longer
    counts = (1.0,) if weight_memory >= 1.0 else (1.0, weight_memory)

    def candidates(cutoff) -> Iterator[Sequence[Sequence[Action]] | None]:
        """The candidates in turn, each greedy run stopped once it cannot beat ``cutoff()``
        (read as each starts: the best so far)."""
        for fixed in ([handcrafted] if fits else blocks):
            yield fixed
            for kept, patient in itertools.product(counts, (False, True)):  # its F and I order, W placed anew
                yield placed_greedy_orders(placement, microbatches, forward, backward_input, backward_weight, comm,
                                           chunk_stashes, patient_weights=patient, follow=fixed,
                                           cutoff=cutoff(), weight_memory=kept)
        for kept, (free_first, reserve_all, late_first, patient, cap) in itertools.product(counts, variants):
            yield placed_greedy_orders(placement, microbatches, forward, backward_input, backward_weight, comm,
                                       chunk_stashes, patient_weights=patient, warmup_cap=cap,
                                       reserve_all=reserve_all, late_first=late_first, free_first=free_first,
                                       cutoff=cutoff(), weight_memory=kept)

    # the step first, then the longest rank span (as ``adapt`` ranks zb-h1's orders): with the
    # first and last stage on rank 0 the two mostly coincide, and the step is what pipesim runs;
    # the first of equals: zbv where it ties. A run whose step must exceed the best one's is
    # stopped: it could not be chosen.
    best = fastest(lambda cutoff: _distinct_orders(candidates(cutoff)), lambda orders: cost(orders)[::-1],
                   lambda key: Cutoff(step=key[0]))
    if best is None:  # every greedy variant waited for room its ranks could not free
        within = ", ".join(f"{most / 2:g}" for most in per_rank) if len(set(per_rank)) > 1 else f"{per_rank[0] / 2:g}"
        raise ScheduleUnavailableError(f"{NAME}: no order of pp={pp}, m={microbatches} runs within "
                                       f"{within} microbatches' activations per rank")
    held = chunk_stashes / 2 if isinstance(chunk_stashes, int) else tuple(most / 2 for most in chunk_stashes)
    return Schedule(pp, microbatches, placement, best, name=NAME,
                    meta={"memory_microbatches": held, "weight_memory": weight_memory})


def _distinct_orders(candidates: Iterable[Sequence[Sequence[Action]] | None]) -> Iterator[Sequence[Sequence[Action]]]:
    """The candidates that are orders (not None), each order once, the first of equals
    where several variants build the same one: timing an order is the search's dearest
    step after the greedy runs, and ``min`` keeps the first of equals anyway. Orders are
    grouped by each rank's middle action (a few hashes; hashing whole orders would cost
    a tenth of a timing) and compared whole only within a group."""
    seen: dict[tuple[Action, ...], list[Sequence[Sequence[Action]]]] = {}
    for orders in candidates:
        if orders is None:
            continue
        group = seen.setdefault(tuple(program[len(program) // 2] for program in orders if program), [])
        if not any(_same_order(orders, other) for other in group):
            group.append(orders)
            yield orders


def _same_order(one: Sequence[Sequence[Action]], other: Sequence[Sequence[Action]]) -> bool:
    """Whether two orders have the same programs (lists or tuples alike)."""
    return len(one) == len(other) and all(tuple(a) == tuple(b) for a, b in zip(one, other, strict=True))
