"""Interleaved 1F1B within a memory limit: the looped placement's fastest order that fits.

Megatron's interleaved order holds ``2(p - r - 1) + (v - 1)N + 1`` chunk stashes on rank
``r`` (``schedules.generators.interleaved``), and nothing in that order can hold fewer
without stalling: capping its warm-up below that, or taking groups ``N`` below ``p``,
leaves every steady-state backward waiting on a chain around the whole pipeline (tried at
p 16, v 8, m 32 while this was built: the bubble went from 10% to 75-90%). Meta ran Llama 3
405B's 8,192-GPU layout without activation checkpointing on a schedule it tuned "for the
best communication and memory efficiency" (Dubey et al. 2024, section 3.3.2), which
Megatron's order at that layout does not fit.

So the order here is searched, as zb-auto's and zbv-auto's are: the candidates are
Megatron's order (torch's groups, where it fits the limit) and the greedy list
scheduler's orders on the looped placement (``schedules.generators.greedy_zero_bubble``,
with the backward whole: its input-gradient pass is the backward, its weight-gradient pass
empty and holding nothing), each variant of the greedy (the later chunk first or the
earlier; room kept for every returning microbatch or for one); each order is timed by the
engine with free-flowing transfers, and the shortest step wins, the shortest longest rank
span breaking ties, Megatron's order first among equals.

The limit counts chunk stashes: one microbatch's activations on one of a rank's ``v``
chunks (``order_peak_stashes``' count); given each stage's stash size it is in that unit
instead (``pipesim`` passes bytes), so a chunk of unequal size (Meta's first, holding only
the embedding) counts as what it holds. A rank holds at least one microbatch on all its
chunks: a backward reaches its first chunk only after the forward has passed them all.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

from schedules.action import Action, ActionKind
from schedules.generators.common import Cutoff, ScheduleUnavailableError, fastest, per_rank_limits, require_positive
from schedules.generators.greedy_zero_bubble import placed_greedy_orders
from schedules.generators.interleaved import interleaved_1f1b
from schedules.generators.zb_auto import order_cost, per_stage
from schedules.metrics import order_peak_stashes
from schedules.schedule import Schedule, looped_placement

NAME = "interleaved-auto"
# orders in a row over the limit after which a greedy variant stops being given more room
MISSES = 3


def interleaved_auto(
    pp: int,
    microbatches: int,
    virtual_stages: int,
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    comm: float = 0.0,
    memory_limit: float | Sequence[float] | None = None,
    stash_sizes: Sequence[float] | None = None,
) -> Schedule:
    """The fastest looped order found for these per-stage seconds (one number for every one
    of the ``pp x virtual_stages`` stages, or one per stage: stage ``s`` on rank ``s mod
    pp``), ``comm`` seconds per hop between ranks, holding at most ``memory_limit`` chunk
    stashes on a rank (one number for every rank, or one each; default: what Megatron's
    order holds, so the search can only match or beat it). With ``stash_sizes`` (one per
    stage: its stash in any unit, bytes say) the limit is in that unit, so chunks of
    unequal size count as they are."""
    require_positive(NAME, pp, microbatches, 1)
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ScheduleUnavailableError(f"{NAME}: virtual stages must be a whole number >= 1, got {virtual_stages!r}")
    stages = pp * virtual_stages
    sizes = f"pp={pp} x v={virtual_stages} = {stages}"
    costs = {name: tuple(per_stage(name, value, stages, NAME, sizes))
             for name, value in (("forward", forward), ("backward", backward))}
    if not comm >= 0:
        raise ScheduleUnavailableError(f"{NAME}: communication time must be >= 0, got {comm!r}")
    sizes_of = (1.0,) * stages if stash_sizes is None else \
        tuple(per_stage("stash size", stash_sizes, stages, NAME, sizes))
    megatron = _megatron_order(pp, microbatches, virtual_stages)
    limits = _limits(pp, memory_limit, megatron, sizes_of)
    return _fastest_order(pp, microbatches, virtual_stages, costs["forward"], costs["backward"], float(comm), limits,
                          sizes_of)


def _megatron_order(pp: int, microbatches: int, virtual_stages: int) -> Schedule | None:
    """Megatron's order with torch's groups, or None where those groups do not split ``m``."""
    try:
        return interleaved_1f1b(pp, microbatches, virtual_stages)
    except ScheduleUnavailableError:
        return None


def _limits(pp: int, memory_limit: float | Sequence[float] | None, megatron: Schedule | None,
            stash_sizes: Sequence[float]) -> tuple[float, ...]:
    """Each rank's limit, checked."""
    if memory_limit is None:
        if megatron is None:
            raise ScheduleUnavailableError(
                f"{NAME}: give --memory-limit: without one the limit is Megatron's order's own, which does not exist "
                f"here (torch's rounds, max(1, m // pp), must divide the microbatches)")
        return tuple(order_peak_stashes(program, sizes=stash_sizes) for program in megatron.programs)
    limits = per_rank_limits(NAME, pp, memory_limit, "chunk stashes")
    # a microbatch's backward reaches a rank's first chunk only after its forward has passed
    # every chunk: a rank holds one microbatch's stash on all its chunks at least
    least = [sum(stash_sizes[rank::pp]) for rank in range(pp)]
    short = next((rank for rank in range(pp) if limits[rank] < least[rank] * (1 - 1e-12)), None)
    if short is not None:
        raise ScheduleUnavailableError(f"{NAME}: --memory-limit {limits[short]:g} on rank {short} is below one "
                                       f"microbatch's stashes on all its chunks ({least[short]:g}), the least an "
                                       f"order with whole backwards holds")
    return tuple(float(value) for value in limits)


@functools.lru_cache(maxsize=64)
def _fastest_order(pp: int, microbatches: int, virtual_stages: int, forward: tuple[float, ...],
                   backward: tuple[float, ...], comm: float, limits: tuple[float, ...],
                   stash_sizes: tuple[float, ...]) -> Schedule:
    """The search, kept per distinct input (a schedule never changes)."""
    placement = looped_placement(pp, virtual_stages)
    empty = (0.0,) * len(forward)
    cost = order_cost(placement, microbatches, forward, backward, empty, comm)
    megatron = _megatron_order(pp, microbatches, virtual_stages)

    def within(programs) -> bool:
        return all(order_peak_stashes(program, sizes=stash_sizes) <= limit * (1 + 1e-12)
                   for program, limit in zip(programs, limits, strict=True))

    fits = megatron is not None and within(megatron.programs)

    # the greedy counts whole stashes and keeps room for microbatches that may come back,
    # so its orders often hold less than the limit it is given: it is given each rank's
    # limit in its largest chunk's stashes, then one more stash at a time up to what
    # Megatron's order holds, and every order that still fits is a candidate; what an order
    # holds does not grow steadily with the limit given, so the climb stops only after
    # ``MISSES`` orders in a row that do not fit
    largest = [max(stash_sizes[stage] for stage in range(rank, len(stash_sizes), pp)) or 1.0 for rank in range(pp)]
    counts = [max(1, math.floor(limit / size + 1e-9)) for limit, size in zip(limits, largest, strict=True)]
    ceiling = max(counts) + 2 * pp if megatron is None else \
        max(order_peak_stashes(program) for program in megatron.programs)
    climbs = [[[count + extra for count in counts] for extra in range(max(ceiling - min(counts), 0) + 1)]]
    if len(set(counts)) > 1:  # each rank's own count and one count for all: either may fit better
        climbs.append([[count] * pp for count in range(min(counts), max(ceiling, min(counts)) + 1)])

    def candidates(_cutoff):
        if fits:
            yield [list(program) for program in megatron.programs]
        for (reserve_all, late_first), climb in itertools.product(
                itertools.product((True, False), (True, False)), climbs):
            misses = 0
            for internal in climb:
                orders = placed_greedy_orders(placement, microbatches, forward, backward, empty, comm, internal,
                                              reserve_all=reserve_all, late_first=late_first, weight_memory=0.0)
                programs = None if orders is None else whole_backwards(orders)
                if programs is not None and within(programs):
                    misses = 0
                    yield programs
                elif programs is not None:
                    misses += 1
                    if misses == MISSES:
                        break

    best = fastest(candidates, lambda programs: cost(programs)[::-1], lambda key: Cutoff(step=key[0]))
    if best is None:  # pragma: no cover - with room for one microbatch a rank, the greedy keeping room always runs
        most = ", ".join(f"{limit:g}" for limit in limits) if len(set(limits)) > 1 else f"{limits[0]:g}"
        raise ScheduleUnavailableError(f"{NAME}: no order of pp={pp}, v={virtual_stages}, m={microbatches} runs "
                                       f"within {most} per rank (chunk stashes, or the stash sizes' unit)")
    chosen = "megatron" if fits and _same(best, megatron.programs) else "greedy"
    return Schedule(pp, microbatches, placement, best, name=NAME, meta={"memory_stashes": limits, "order": chosen})


def whole_backwards(orders: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """A split-backward order whose weight passes are empty as whole backwards: each ``I``
    becomes the ``B`` it stands for and each (zero-second, stash-free) ``W`` goes."""
    return [[Action(action.stage, ActionKind.B, action.microbatch) if action.kind == ActionKind.I else action
             for action in program if action.kind != ActionKind.W] for program in orders]


def _same(programs: Sequence[Sequence[Action]], others: Sequence[Sequence[Action]]) -> bool:
    """Whether two orders are the same action for action."""
    return all(list(a) == list(b) for a, b in zip(programs, others, strict=True))
