"""A greedy list scheduler for split-backward pipelines: the engine behind ``zb-h2``
and ``zb-auto``.

Each rank (one stage per rank) runs, whenever it is free, the first of:

1. the input-gradient pass ``I`` of its next microbatch, if its gradient has arrived:
   ``I`` is on the critical path, every earlier stage waits for it;
2. the next forward ``F``, if its input has arrived and the rank holds fewer than
   ``memory_limit`` stashes (a stash is held from ``F`` until ``W``);
3. a pending weight-gradient pass ``W``: it depends on nothing remote, so it fills time
   that would otherwise be a bubble, and it frees a stash.

Otherwise it waits for the next arrival. With ``patient_weights`` a ``W`` (or an ``F``)
is only started if it ends before the ``I`` that is known to be on its way, which keeps
the critical path free when ``W`` is long (the paper's "no bubble before B" rule).
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
    """Each rank's order of F, I and W (stage = rank). ``memory_limit`` is one number for
    every rank or one per rank; ``warmup_cap`` bounds the stashes a rank may take before
    its first ``I``."""
    limits = [memory_limit] * pp if isinstance(memory_limit, int) else list(memory_limit)
    if min(limits) < 1:
        raise ValueError(f"memory limit must allow at least one stash per rank, got {memory_limit}")
    costs = {"F": forward, "I": backward_input, "W": backward_weight}
    forward_end = [[None] * microbatches for _ in range(pp)]
    input_end = [[None] * microbatches for _ in range(pp)]
    done = {kind: [0] * pp for kind in "FIW"}
    clock = [0.0] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]
    wakeups = [(0.0, stage) for stage in range(pp)]
    heapq.heapify(wakeups)

    def forward_ready(stage: int, microbatch: int) -> float | None:
        if stage == 0:
            return 0.0
        end = forward_end[stage - 1][microbatch]
        return None if end is None else end + comm

    def input_ready(stage: int, microbatch: int) -> float | None:
        own = forward_end[stage][microbatch]
        if own is None:
            return None
        if stage == pp - 1:
            return own
        end = input_end[stage + 1][microbatch]
        return None if end is None else max(own, end + comm)

    def run(stage: int, kind: str, now: float) -> None:
        microbatch = done[kind][stage]
        end = now + costs[kind][stage]
        if kind == "F":
            forward_end[stage][microbatch] = end
            orders[stage].append(F(stage, microbatch))
            if stage + 1 < pp:
                heapq.heappush(wakeups, (end + comm, stage + 1))
        elif kind == "I":
            input_end[stage][microbatch] = end
            orders[stage].append(I(stage, microbatch))
            if stage > 0:
                heapq.heappush(wakeups, (end + comm, stage - 1))
        else:
            orders[stage].append(W(stage, microbatch))
        done[kind][stage] += 1
        clock[stage] = end
        heapq.heappush(wakeups, (end, stage))

    while wakeups:
        now, stage = heapq.heappop(wakeups)
        if clock[stage] > now:
            continue  # busy; it has its own wake-up when it is free
        forwards, inputs, weights = done["F"][stage], done["I"][stage], done["W"][stage]
        if inputs < forwards:
            ready = input_ready(stage, inputs)
            if ready is not None and ready <= now:
                run(stage, "I", now)
                continue
        limit = limits[stage] if inputs or warmup_cap is None else min(limits[stage], warmup_cap)
        next_input = input_ready(stage, inputs) if inputs < forwards else None
        if forwards < microbatches and forwards - weights < limit:
            ready = forward_ready(stage, forwards)
            fits = not patient_weights or next_input is None or now + costs["F"][stage] <= next_input
            if ready is not None and ready <= now and fits:
                run(stage, "F", now)
                continue
        if weights < inputs:
            fits = not patient_weights or next_input is None or now + costs["W"][stage] <= next_input
            blocked = forwards < microbatches and forwards - weights >= limit
            if fits or blocked or inputs == microbatches:
                run(stage, "W", now)
                continue
        if patient_weights and next_input is not None and next_input > now:
            heapq.heappush(wakeups, (next_input, stage))
        # otherwise idle until an arrival wakes this rank
    for stage in range(pp):
        if done["W"][stage] != microbatches:
            raise AssertionError(f"greedy scheduler left stage {stage} unfinished")  # pragma: no cover
    return orders
