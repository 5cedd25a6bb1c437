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
has passed on it. With ``weight_memory`` below 1 an ``I`` frees all but that share of
its stash and its ``W`` the rest, as a transformer layer keeps only its matrix products'
inputs for the weight gradients (``schedules.metrics.stash_moves``' rule); the share is
counted in tenths of a stash, rounded up, so the scheduler never counts less than the
memory model does. A microbatch that enters a rank at its first stage comes back for the
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
possible under them: the engine's ``free`` timing of a fixed order (``schedules.engine``),
moment for moment (``tests/test_zbv_auto.py`` holds every action's end to the engine's).

A search that keeps the fastest of several runs can stop a run once it cannot win
(``cutoff``): when a rank ends an action at ``e`` with ``r`` seconds of its passes still
to run, its last pass cannot end before ``e + r``, so the step cannot be shorter, nor the
rank's span (from its first pass's start) shorter than ``e + r`` less that start. A run
stopped that way returns None, as one that cannot finish does.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from schedules.action import OUTPUT_OFFSET, Action, ActionKind
from schedules.dataflow import crossing_boundaries
from schedules.generators.common import Cutoff


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
    cutoff: Cutoff | None = None,
) -> list[list[Action]] | None:
    """Each rank's order of F, I and W, one stage per rank (stage = rank).
    ``memory_limit`` is one number for every rank or one per rank; ``warmup_cap``
    bounds the stashes a rank may take before its first ``I``; None only where
    ``cutoff`` stopped the run (one stage per rank never waits for room it cannot free)."""
    orders = placed_greedy_orders(tuple(range(pp)), microbatches, forward, backward_input, backward_weight, comm,
                                  memory_limit, patient_weights=patient_weights, warmup_cap=warmup_cap, cutoff=cutoff)
    if orders is None and cutoff is None:  # pragma: no cover - one stage per rank always finishes
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
    cutoff: Cutoff | None = None,
    weight_memory: float = 1.0,
) -> list[list[Action]] | None:
    """Each rank's order of F, I and W for stages placed on ranks by ``placement``
    (``placement[stage]`` is its rank), per-stage costs; None when the ranks wait on
    each other with no stash left to free (possible only without ``reserve_all``, or
    with ``follow``), or when ``cutoff`` stopped the run. ``follow`` (each rank's order)
    fixes the order of every rank's ``F`` and ``I`` passes as it has them, and the
    scheduler places the ``W`` passes. ``weight_memory`` is the share of a stash held
    between a pass's ``I`` and its ``W`` (1: all of it)."""
    pp = max(placement) + 1
    if not 0.0 <= weight_memory <= 1.0:
        raise ValueError(f"greedy scheduler: weight memory must be a share in [0, 1], got {weight_memory!r}")
    limits = [memory_limit] * pp if isinstance(memory_limit, int) else list(memory_limit)
    if min(limits) < 1:
        raise ValueError(f"memory limit must allow at least one stash per rank, got {memory_limit}")
    # the event loop leaves out wake-ups that only a pass of negative time could need
    for name, values in (("forward", forward), ("input-gradient", backward_input),
                         ("weight-gradient", backward_weight), ("communication", (comm,))):
        if min(values, default=0.0) < 0:
            raise ValueError(f"greedy scheduler: {name} seconds must be >= 0, got {min(values)}")
    sequences = None if follow is None else [[(action.stage, action.kind == ActionKind.F) for action in program
                                              if action.kind != ActionKind.W] for program in follow]
    run = _Run(tuple(placement), microbatches, comm, limits, warmup_cap, late_first)
    _schedule(run, (tuple(forward), tuple(backward_input), tuple(backward_weight)), patient_weights, reserve_all,
              free_first, sequences, (cutoff or Cutoff()).with_margin(), weight_units(weight_memory))
    if any(count != microbatches for count in run.weights_done):
        return None
    return run.orders


# A stash counts this many units in the event loop, so a share held between I and W is a
# whole number of them (integers keep the room rules exact).
STASH_UNITS = 10


def weight_units(weight_memory: float) -> int:
    """The share of a stash held between ``I`` and ``W`` in ``STASH_UNITS``, rounded up:
    never less than the memory model counts."""
    return min(STASH_UNITS, math.ceil(weight_memory * STASH_UNITS - 1e-9))


class _Run:
    """One greedy run's tables, as plain lists indexed by stage (or by stage and then
    microbatch, or by rank): the event loop reads them into locals, and a list index is
    the cheapest lookup Python has (the loop handles hundreds of thousands of events in
    a planner's zbv-auto searches)."""

    def __init__(self, placement: tuple[int, ...], microbatches: int, comm: float, limits: list[int],
                 warmup_cap: int | None, late_first: bool) -> None:
        stages = len(placement)
        pp = len(limits)
        self.placement = placement
        self.microbatches = microbatches
        self.limits = limits
        held_by = [tuple(stage for stage in range(stages) if placement[stage] == rank) for rank in range(pp)]
        self.held_by = held_by
        self.first = [owned[0] for owned in held_by]
        self.returning = [len(owned) - 1 for owned in held_by]  # the rank's stages after its first
        self.priority = [tuple(sorted(owned, reverse=late_first)) for owned in held_by]
        crossing = set(crossing_boundaries(placement))
        self.hop = [comm if stage in crossing else 0.0 for stage in range(stages)]  # hop[s]: between s and s + 1
        # The limit a forward on the rank's first stage counts against: the warm-up cap
        # until the rank's first I, the plain limit after it.
        self.first_limit = list(limits) if warmup_cap is None else [min(limit, warmup_cap) for limit in limits]
        # When each pass may start, once known (None until then; one more slot than
        # microbatches, so a stage that has run all its passes reads None): a forward's
        # input arrival, an input gradient's own forward and the gradient from the stage
        # after, both there.
        self.forward_ready = [[0.0 if stage == 0 else None] * microbatches + [None] for stage in range(stages)]
        self.input_ready = [[None] * (microbatches + 1) for _ in range(stages)]
        self.forward_end = [[0.0] * microbatches for _ in range(stages)]
        self.forwards_done = [0] * stages
        self.inputs_done = [0] * stages
        self.weights_done = [0] * stages
        self.orders: list[list[Action]] = [[] for _ in range(pp)]


def _schedule(run: _Run, costs: tuple[tuple[float, ...], ...], patient_weights: bool, reserve_all: bool,
              free_first: bool, sequences: list[list[tuple[int, bool]]] | None, cutoff: tuple[float, float],
              weight_held: int = STASH_UNITS) -> None:
    """The event loop of the module's rules, filling ``run.orders``: each rank steps when
    it is free or something arrives for it, in (time, rank) order. One function with
    its tables in locals and the rules written out inline: the scheduler runs some 50
    times per zbv-auto search and hundreds of times per plan, and a call or a dict
    lookup per event was most of its time.

    Shortcuts that leave every decision as it was (costs are never negative, so a
    rank's clock never goes back):

    - no wake-up is queued for a rank busy past it (it would be popped and skipped);
    - a patient rank queues no wake-up for the input gradient it waits for: the
      gradient's arrival queued one at that time already;
    - a rank with no pass whose input has been sent skips looking through its stages
      for one (``forwards_known``, ``inputs_known``);
    - a rank's room is kept as counts (``ahead``: the forwards its first stage has run
      beyond each later stage, summed; ``later_forwards``) instead of sums over its
      stages at every event.

    Memory is counted in ``STASH_UNITS`` per stash: a forward takes them all, an ``I``
    frees all but ``weight_held`` of them, its ``W`` the rest.

    ``cutoff`` is (step, span) with their margins; a rank's pass that ends later than
    its ``bound`` less its remaining seconds stops the run (the loop returns with
    stages unfinished): ``bound`` is the step's cutoff, or once the rank has started,
    the lesser of it and its first start plus the span's.
    """
    placement, microbatches, hop = run.placement, run.microbatches, run.hop
    unit = STASH_UNITS
    limits = [limit * unit for limit in run.limits]
    input_frees = unit - weight_held
    first, returning, priority, held_by = run.first, run.returning, run.priority, run.held_by
    forward_ready, input_ready, forward_end = run.forward_ready, run.input_ready, run.forward_end
    forwards_done, inputs_done, weights_done, orders = run.forwards_done, run.inputs_done, run.weights_done, run.orders
    forward_cost, input_cost, weight_cost = costs
    pp = len(limits)
    last = len(placement) - 1
    forward_to, gradient_to = OUTPUT_OFFSET[ActionKind.F], OUTPUT_OFFSET[ActionKind.I]  # the dataflow rule's steps
    # A forward on a rank's first stage fits when the stashes held, its own and the room
    # kept for the microbatch's return to the rank's later stages (one, or with
    # ``reserve_all`` every one: ``returning + ahead``) are within the rank's limit
    # for it (the warm-up cap until its first I).
    kept = [unit * (1 + (count if reserve_all else min(count, 1))) for count in returning]
    first_room = [limit * unit - count for limit, count in zip(run.first_limit, kept, strict=True)]
    ahead = [0] * pp  # stays 0 without ``reserve_all``
    later_forwards = [microbatches * count for count in returning]  # forwards left on a rank's later stages
    held = [0] * pp
    rank_inputs = [0] * pp
    all_inputs = [microbatches * len(owned) for owned in held_by]
    weights_due: list[list[tuple[float, int]]] = [[] for _ in range(pp)]  # (I end, stage) per pending W
    clock = [0.0] * pp
    position = [0] * pp
    # passes whose start time is known (their input has been sent) and that have not run,
    # per rank: a rank with none skips looking through its stages for one
    forwards_known = [microbatches if rank == placement[0] else 0 for rank in range(pp)]
    inputs_known = [0] * pp
    # the seconds of each rank's passes not yet started (``cutoff``)
    remaining = [microbatches * sum(forward_cost[stage] + input_cost[stage] + weight_cost[stage] for stage in owned)
                 for owned in held_by]
    step_cutoff, span_cutoff = cutoff
    bound = [step_cutoff] * pp  # the rank's ``cutoff``, its span's once it starts
    started = [False] * pp
    wakeups = [(0.0, rank) for rank in range(pp)]
    heapq.heapify(wakeups)
    heappush, heappop, new = heapq.heappush, heapq.heappop, tuple.__new__
    kind_f, kind_i, kind_w = ActionKind.F, ActionKind.I, ActionKind.W

    def no_room(rank: int) -> bool:
        """Whether a stage of ``rank`` with forwards left has no room for its next one: its
        first stage, or any later one (they all fit while the rank's limit does)."""
        load = held[rank]
        return (load + ahead[rank] > first_room[rank] and forwards_done[first[rank]] < microbatches
                or load + unit > limits[rank] and later_forwards[rank] > 0)

    while wakeups:
        now, rank = heappop(wakeups)
        if clock[rank] > now:
            continue  # busy; it has its own wake-up when it is free
        next_input = None
        blocked = False
        if sequences is not None:  # the followed order's next F or I, if it can run now
            sequence = sequences[rank]
            stage = -1
            if position[rank] < len(sequence):
                stage, is_forward = sequence[position[rank]]
                if is_forward:
                    ready = forward_ready[stage][forwards_done[stage]]
                    blocked = held[rank] + unit > first_room[rank] + kept[rank]
                else:
                    ready = input_ready[stage][inputs_done[stage]]
                if ready is not None and ready <= now and not blocked:
                    position[rank] += 1
                else:
                    next_input = ready
                    stage = -1
            forward = stage >= 0 and is_forward
        else:
            stage = -1
            if free_first and weights_due[rank]:  # no room for a forward: a W first, freeing a stash
                load = held[rank]  # (``no_room``, written out: the W runs below)
                blocked = (load + ahead[rank] > first_room[rank] and forwards_done[first[rank]] < microbatches
                           or load + unit > limits[rank] and later_forwards[rank] > 0)
            if not blocked:
                if inputs_known[rank]:
                    for stage in priority[rank]:  # an I whose gradient has arrived
                        ready = input_ready[stage][inputs_done[stage]]
                        if ready is not None:
                            if ready <= now:
                                forward = False
                                break
                            if next_input is None or ready < next_input:
                                next_input = ready
                    else:
                        stage = -1
                if stage < 0:
                    # a patient W waits for the I unless a forward has no room (checked below, when it counts)
                    blocked = None
                    if forwards_known[rank]:
                        for stage in priority[rank]:  # a forward whose input has arrived, if it fits
                            ready = forward_ready[stage][forwards_done[stage]]
                            if ready is not None and ready <= now and (
                                    not patient_weights or next_input is None
                                    or now + forward_cost[stage] <= next_input
                            ) and (held[rank] + ahead[rank] <= first_room[rank] if stage == first[rank]
                                   else held[rank] + unit <= limits[rank]):
                                forward = True
                                break
                        else:
                            stage = -1
        if stage < 0:  # a pending W, if one is due
            due = weights_due[rank]
            if due:
                stage = due[0][1]
                if (not patient_weights or next_input is None or now + weight_cost[stage] <= next_input
                        or rank_inputs[rank] == all_inputs[rank] or (no_room(rank) if blocked is None else blocked)):
                    heappop(due)
                    microbatch = weights_done[stage]
                    end = now + weight_cost[stage]
                    left = remaining[rank] = remaining[rank] - weight_cost[stage]
                    if end + left > bound[rank]:
                        return  # this order's step or span cannot beat the cutoff
                    orders[rank].append(new(Action, (stage, kind_w, microbatch)))
                    held[rank] -= weight_held
                    weights_done[stage] = microbatch + 1
                    clock[rank] = end
                    heappush(wakeups, (end, rank))
                    continue
            # Otherwise idle until an arrival wakes this rank. (A patient rank waits for the
            # pass that becomes ready at ``next_input``: its input's arrival then, whose
            # wake-up was queued when it was sent, as this rank was not busy past it.)
            continue
        if not started[rank]:  # the rank's first pass: its span counts from here
            started[rank] = True
            if now + span_cutoff < bound[rank]:
                bound[rank] = now + span_cutoff
        if forward:
            microbatch = forwards_done[stage]
            end = now + forward_cost[stage]
            left = remaining[rank] = remaining[rank] - forward_cost[stage]
            if end + left > bound[rank]:
                return  # this order's step or span cannot beat the cutoff
            orders[rank].append(new(Action, (stage, kind_f, microbatch)))
            held[rank] += unit
            forwards_done[stage] = microbatch + 1
            forwards_known[rank] -= 1
            if stage == first[rank]:
                if reserve_all:
                    ahead[rank] += returning[rank] * unit
            else:
                later_forwards[rank] -= 1
                if reserve_all:
                    ahead[rank] -= unit
            forward_end[stage][microbatch] = end
            if stage < last:
                arrival = end + hop[stage]
                consumer = stage + forward_to
                forward_ready[consumer][microbatch] = arrival
                target = placement[consumer]
                forwards_known[target] += 1
                if clock[target] <= arrival:
                    heappush(wakeups, (arrival, target))
            else:
                input_ready[stage][microbatch] = end
                inputs_known[rank] += 1
        else:
            microbatch = inputs_done[stage]
            end = now + input_cost[stage]
            left = remaining[rank] = remaining[rank] - input_cost[stage]
            if end + left > bound[rank]:
                return  # this order's step or span cannot beat the cutoff
            orders[rank].append(new(Action, (stage, kind_i, microbatch)))
            rank_inputs[rank] += 1
            inputs_known[rank] -= 1
            held[rank] -= input_frees
            first_room[rank] = limits[rank] - kept[rank]
            heappush(weights_due[rank], (end, stage))
            inputs_done[stage] = microbatch + 1
            if stage:
                consumer = stage + gradient_to
                arrival = end + hop[consumer]
                own = forward_end[consumer][microbatch]
                input_ready[consumer][microbatch] = arrival if arrival > own else own
                target = placement[consumer]
                inputs_known[target] += 1
                if clock[target] <= arrival:
                    heappush(wakeups, (arrival, target))
        clock[rank] = end
        heappush(wakeups, (end, rank))
