"""A greedy list scheduler for split-backward pipelines: the engine behind ``zb-h2``,
``zb-auto`` and ``zbv-auto``.

Stages sit on ranks as a placement says (one stage per rank, or the V of ``zbv``: stage
``s`` and ``2p - 1 - s`` on one rank); a transfer between stages on different ranks
takes ``comm``, one between stages on the same rank (the V's turn) nothing. Each rank
runs, whenever it is free, the first of:

1. an input-gradient pass ``I`` whose gradient has arrived: ``I`` is on the critical
   path, every earlier stage waits for it;
2. a forward ``F`` whose input has arrived, if memory allows it (a stash is held from
   ``F`` until ``W``; below);
3. a pending weight-gradient pass ``W``: it depends on nothing remote, so it fills time
   that would otherwise be a bubble, and it frees a stash.

Otherwise it waits for the next arrival. Where a rank holds several stages and more than
one ``I`` (or ``F``) is ready, the later stage goes first (``late_first``: the pass with
the most of the pipeline still behind it) or the earlier one; pending ``W`` passes run in
the order of their ``I``. With ``patient_weights`` a ``W`` (or an ``F``) is only started
if it ends before the ``I`` that is known to be on its way, which keeps the critical path
free when ``W`` is long (the paper's "no bubble before B" rule).

Memory: at most ``memory_limit`` stashes per rank, one per stage a microbatch's forward
has passed on it. A microbatch that enters a rank at its first stage comes back for the
rank's later stages and needs a stash there too, so a forward on a rank's first stage
keeps room for them: for one of them (the default; enough for the V, where returning
microbatches take their stash in order and each frees it with its own ``W``) or for
all of them (``reserve_all``: every started microbatch can always come back). A forward
on a later stage uses the room kept for it. ``warmup_cap`` bounds the stashes a rank may
take on its first stage before its first ``I``. With one stage per rank there is nothing
to come back for and the rule is the plain limit. With ``free_first`` a rank that has no
room for its next forward runs a pending ``W`` before a ready ``I`` (on the V, where
every rank's ``I`` passes can otherwise keep all stashes held while forwards wait).

``follow`` keeps each rank's ``F`` and ``I`` passes in the order of a given schedule
(``zbv``'s) and places only the ``W`` passes, by the same rule: the handcrafted order
with its weight passes moved where these costs leave gaps.

Times are computed with the costs given, so the order is the one that runs as soon as
possible under them: the engine's ``free`` timing of a fixed order (``schedules.engine``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from schedules.action import Action, F, I, W


def greedy_orders(
    pp: int,
    microbatches: int,
    forward: Sequence[float],
    backward_input: Sequence[float],
    backward_weight: Sequence[float],
    comm: float,
    memory_limit: int | Sequence[int],
    patient_weights: bool = False,
    warmup_cap: int | None = None,
) -> list[list[Action]]:
    """Each rank's order of F, I and W, one stage per rank (stage = rank).
    ``memory_limit`` is one number for every rank or one per rank; ``warmup_cap``
    bounds the stashes a rank may take before its first ``I``."""
    orders = placed_greedy_orders(tuple(range(pp)), microbatches, forward, backward_input, backward_weight, comm,
                                  memory_limit, patient_weights=patient_weights, warmup_cap=warmup_cap)
    if orders is None:  # pragma: no cover - one stage per rank never waits for room it cannot free
        raise AssertionError("greedy scheduler left a stage unfinished")
    return orders


def placed_greedy_orders(
    placement: Sequence[int],
    microbatches: int,
    forward: Sequence[float],
    backward_input: Sequence[float],
    backward_weight: Sequence[float],
    comm: float,
    memory_limit: int | Sequence[int],
    patient_weights: bool = False,
    warmup_cap: int | None = None,
    reserve_all: bool = False,
    late_first: bool = True,
    follow: Sequence[Sequence[Action]] | None = None,
    free_first: bool = False,
) -> list[list[Action]] | None:
    """Each rank's order of F, I and W for stages placed on ranks by ``placement``
    (``placement[stage]`` is its rank), per-stage costs; None when the ranks wait on
    each other with no stash left to free (possible only without ``reserve_all``, or
    with ``follow``). ``follow`` (each rank's order) fixes the order of every rank's
    ``F`` and ``I`` passes as it has them, and the scheduler places the ``W`` passes."""
    stages = len(placement)
    pp = max(placement) + 1
    limits = [memory_limit] * pp if isinstance(memory_limit, int) else list(memory_limit)
    if min(limits) < 1:
        raise ValueError(f"memory limit must allow at least one stash per rank, got {memory_limit}")
    held_by = [sorted(stage for stage in range(stages) if placement[stage] == rank) for rank in range(pp)]
    first = [owned[0] for owned in held_by]
    returning = [owned[1:] for owned in held_by]
    priority = [sorted(owned, reverse=late_first) for owned in held_by]
    costs = {"F": forward, "I": backward_input, "W": backward_weight}
    hop = [0.0 if stage + 1 >= stages or placement[stage] == placement[stage + 1] else comm
           for stage in range(stages)]  # hop[s]: between stages s and s + 1
    forward_end = [[None] * microbatches for _ in range(stages)]
    input_end = [[None] * microbatches for _ in range(stages)]
    done = {kind: [0] * stages for kind in "FIW"}
    held = [0] * pp
    inputs_done = [0] * pp
    weights_due: list[list[tuple[float, int]]] = [[] for _ in range(pp)]  # (I end, stage) per pending W
    clock = [0.0] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]
    wakeups = [(0.0, rank) for rank in range(pp)]
    heapq.heapify(wakeups)

    def forward_ready(stage: int, microbatch: int) -> float | None:
        if stage == 0:
            return 0.0
        end = forward_end[stage - 1][microbatch]
        return None if end is None else end + hop[stage - 1]

    def input_ready(stage: int, microbatch: int) -> float | None:
        own = forward_end[stage][microbatch]
        if own is None:
            return None
        if stage == stages - 1:
            return own
        end = input_end[stage + 1][microbatch]
        return None if end is None else max(own, end + hop[stage])

    def room(rank: int, stage: int) -> bool:
        """Whether a forward on ``stage`` fits ``rank``'s memory now."""
        if stage != first[rank]:
            return held[rank] < limits[rank]  # the room kept for it
        limit = limits[rank] if inputs_done[rank] or warmup_cap is None else min(limits[rank], warmup_cap)
        started = done["F"][stage] + 1
        coming = sum(started - done["F"][later] for later in returning[rank])
        return held[rank] + 1 + (coming if reserve_all else min(coming, 1)) <= limit

    def run(rank: int, stage: int, kind: str, now: float) -> None:
        microbatch = done[kind][stage]
        end = now + costs[kind][stage]
        if kind == "F":
            forward_end[stage][microbatch] = end
            orders[rank].append(F(stage, microbatch))
            held[rank] += 1
            if stage + 1 < stages:
                heapq.heappush(wakeups, (end + hop[stage], placement[stage + 1]))
        elif kind == "I":
            input_end[stage][microbatch] = end
            orders[rank].append(I(stage, microbatch))
            inputs_done[rank] += 1
            heapq.heappush(weights_due[rank], (end, stage))
            if stage > 0:
                heapq.heappush(wakeups, (end + hop[stage - 1], placement[stage - 1]))
        else:
            orders[rank].append(W(stage, microbatch))
            held[rank] -= 1
        done[kind][stage] += 1
        clock[rank] = end
        heapq.heappush(wakeups, (end, rank))

    sequences = None if follow is None else [[(action.stage, action.kind) for action in program if action.kind != "W"]
                                             for program in follow]
    position = [0] * pp

    def step(rank: int, now: float) -> None:
        """Run ``rank``'s next pass at ``now``, if it has one to run."""
        if sequences is not None:
            follow_step(rank, now)
            return
        if free_first and weights_due[rank] and any(
                done["F"][stage] < microbatches and not room(rank, stage) for stage in held_by[rank]):
            run(rank, heapq.heappop(weights_due[rank])[1], "W", now)
            return
        next_input = None
        for stage in priority[rank]:
            if done["I"][stage] < done["F"][stage]:
                ready = input_ready(stage, done["I"][stage])
                if ready is not None and ready <= now:
                    run(rank, stage, "I", now)
                    return
                if ready is not None and (next_input is None or ready < next_input):
                    next_input = ready
        blocked = False
        for stage in priority[rank]:
            if done["F"][stage] >= microbatches:
                continue
            if not room(rank, stage):
                blocked = True
                continue
            ready = forward_ready(stage, done["F"][stage])
            fits = not patient_weights or next_input is None or now + costs["F"][stage] <= next_input
            if ready is not None and ready <= now and fits:
                run(rank, stage, "F", now)
                return
        weigh(rank, now, next_input, blocked)

    def follow_step(rank: int, now: float) -> None:
        """``step`` with the rank's ``F`` and ``I`` passes in the order followed."""
        next_input, blocked = None, False
        if position[rank] < len(sequences[rank]):
            stage, kind = sequences[rank][position[rank]]
            ready = (forward_ready if kind == "F" else input_ready)(stage, done[kind][stage])
            blocked = kind == "F" and held[rank] >= (limits[rank] if inputs_done[rank] or warmup_cap is None
                                                     else min(limits[rank], warmup_cap))
            if ready is not None and ready <= now and not blocked:
                position[rank] += 1
                run(rank, stage, kind, now)
                return
            next_input = ready
        weigh(rank, now, next_input, blocked)

    def weigh(rank: int, now: float, next_input: float | None, blocked: bool) -> None:
        """A pending ``W`` at ``now``, if one is due (see the module), else a wait."""
        if weights_due[rank]:
            stage = weights_due[rank][0][1]
            fits = not patient_weights or next_input is None or now + costs["W"][stage] <= next_input
            if fits or blocked or inputs_done[rank] == microbatches * len(held_by[rank]):
                heapq.heappop(weights_due[rank])
                run(rank, stage, "W", now)
                return
        if patient_weights and next_input is not None and next_input > now:
            heapq.heappush(wakeups, (next_input, rank))
        # otherwise idle until an arrival wakes this rank

    while wakeups:
        now, rank = heapq.heappop(wakeups)
        if clock[rank] > now:
            continue  # busy; it has its own wake-up when it is free
        step(rank, now)
    if any(count != microbatches for count in done["W"]):
        return None
    return orders
