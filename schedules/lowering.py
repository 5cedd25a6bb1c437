"""Lowering: add the SEND/RECV actions that a compute-only schedule implies, grouped
into the P2P batches that are posted together.

Every dependency that crosses ranks (a forward output going to the next stage, an
input gradient going back to the previous one) becomes a SEND on the producer's rank
and a RECV on the consumer's. Where they go, and which of them are posted together as
one ``batch_isend_irecv``, decides whether the step can hang on NCCL: NCCL matches the
P2P operations of a rank pair in posting order, and a send may wait until its receive
is posted (rendezvous). gloo, which matches by tag and buffers sends, forgives orders
that NCCL does not.

The construction is Megatron's lock-step, generalised to any compute order. Each
compute action gets a *round*: one more than the round of the rank's previous action,
and at least one more than the round of the action on another rank whose output it
needs (as soon as possible, so the rounds follow the schedule's own order). A transfer
produced in round ``p`` and consumed in round ``c`` is exchanged at the *boundary*
``c - 1``: both ends post it between their last compute action of a round ``<= c - 1``
and their first of a round ``>= c``, so the receive sits right before its consumer, as
Megatron's ``send_forward_recv_backward`` pairs them. All transfers a rank posts
between two compute actions form one group, ordered by (boundary, sending stage,
direction, microbatch) on both ends of every pair. Every rank meets the boundaries in
increasing order, so a group never waits for a peer that is itself waiting for a later
boundary: every generated schedule is deadlock-free under rendezvous semantics, and the
posting order of every pair matches (``docs/schedules.md`` has the argument; the
validator checks it for any schedule).
"""

from __future__ import annotations

import os
from bisect import bisect_right

from schedules.action import COMPUTE_KINDS, Action, ActionKind
from schedules.collector import without_collector
from schedules.overlap import keep_pairs_together, pair_times
from schedules.schedule import Schedule

_F, _B, _I = ActionKind.F, ActionKind.B, ActionKind.I
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B

# The durations the lowering plans with (a backward is about twice a forward, split in
# two equal halves by zero-bubble schedules). Lowering must not depend on a run's costs:
# the lowered programs are the one artifact that is simulated, validated and executed.
_INFINITY = float("inf")
try:  # the meeting-point construction in C, built by setup.py where a compiler is found
    from schedules import _lowering as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

# Whether ``lower`` asks the C version first (PIPESIM_PURE_PYTHON=1: Python only).
ACCELERATED = _native is not None and os.environ.get("PIPESIM_PURE_PYTHON", "") in ("", "0")
# Every kind, in the order the C version reads them.
_KINDS = (_F, _B, _I, ActionKind.W, _SEND_F, _RECV_F, _SEND_B, _RECV_B)
NOMINAL_SECONDS = {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.I: 1.0, ActionKind.W: 1.0}


@without_collector
def lower(schedule: Schedule) -> Schedule:
    """The schedule with communication actions inserted and grouped; already-lowered
    schedules (for instance a CSV written by hand with its own SEND/RECV order) come back
    as they are.

    A compute-only schedule that cannot run at all (a cycle between ranks, a missing
    producer) is lowered naively, each RECV right before its consumer, so that
    ``validate`` reports the problem in the user's terms instead of lowering failing."""
    if schedule.is_lowered:
        return schedule
    return keep_pairs_together(_lower(schedule), schedule)  # overlapped pairs: schedules/overlap.py


def _lower(schedule: Schedule) -> Schedule:
    if ACCELERATED and not any(schedule.fused):
        # the same construction in C; None where something is unusual and Python decides
        native = _native.lower(schedule.programs, tuple(schedule.placement), schedule.num_stages,
                               schedule.microbatches, _KINDS, Action)
        if native is not None:
            programs, joins = native
            return schedule.with_programs(programs, [frozenset(joined) for joined in joins])
    return _lower_in_python(schedule)


def _lower_in_python(schedule: Schedule) -> Schedule:
    times = pair_times(nominal_times(schedule), schedule)
    if times is not None:
        try:
            return _lower_at_meeting_points(schedule, times)
        except KeyError:  # a consumer that does not exist: validation names it
            pass
    return _lower_naively(schedule)


def nominal_times(schedule: Schedule) -> dict[Action, tuple[float, float]] | None:
    """Each compute action's (start, end) when every action starts as soon as its rank
    is free and its input exists, with the nominal durations and free transfers; None if
    some rank can never run its next action (the compute order itself deadlocks or lacks
    a producer)."""
    programs = schedule.programs
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    backward_of = {(action[0], action[2]): action for program in programs for action in program
                   if action[1] == _B or action[1] == _I}
    times: dict[Action, tuple[float, float]] = {}
    pointer = [0] * schedule.pp
    free_at = [0.0] * schedule.pp
    waiters: dict[tuple, list[int]] = {}
    runnable = list(range(schedule.pp))
    while runnable:
        rank = runnable.pop()
        program = programs[rank]
        index, clock = pointer[rank], free_at[rank]
        end = len(program)
        while index < end:
            action = program[index]
            stage, kind, microbatch = action
            needed = None
            if kind == _F:
                if stage > 0 and placement[stage - 1] != rank:
                    needed = (stage - 1, _F, microbatch)
            elif kind == _B or kind == _I:
                if stage < last_stage and placement[stage + 1] != rank:
                    needed = backward_of.get((stage + 1, microbatch), (stage + 1, _B, microbatch))
            start = clock
            if needed is not None:
                produced = times.get(needed)
                if produced is None:
                    waiters.setdefault(needed, []).append(rank)
                    break
                if produced[1] > start:
                    start = produced[1]
            clock = start + NOMINAL_SECONDS.get(kind, 1.0)
            times[action] = (start, clock)
            index += 1
            woken = waiters.pop(action, None)
            if woken:
                runnable.extend(woken)
        pointer[rank], free_at[rank] = index, clock
    if any(pointer[rank] < len(programs[rank]) for rank in range(schedule.pp)):
        return None
    return times


def _meeting_point(ready: float, needed: float, sender: list, receiver: list) -> float:
    """Where both ends post a transfer that is ready at ``ready`` and needed at
    ``needed``: the earliest moment in that window at which neither rank is inside a
    compute action, so neither waits for the other. Failing that, the moment at which
    one rank is free and the other finishes its running action soonest (the shortest
    wait). ``sender``/``receiver`` are a rank's sorted (start, end) pairs."""
    # the common case, inlined (it runs once per transfer): neither rank is inside an action at ``ready``
    key = (ready, _INFINITY)
    at = bisect_right(receiver, key) - 1
    if at < 0 or not receiver[at][0] < ready < receiver[at][1]:
        at = bisect_right(sender, key) - 1
        if at < 0 or not sender[at][0] < ready < sender[at][1]:
            return ready
    best, best_wait = ready, float("inf")
    candidates = [ready, needed]
    for intervals in (sender, receiver):
        first = bisect_right(intervals, (ready, float("inf"))) - 1
        for _start, end in intervals[max(first, 0):]:
            if end > needed:
                break
            if end >= ready:
                candidates.append(end)
    for moment in sorted(candidates):
        wait = 0.0
        for intervals in (sender, receiver):
            inside = _busy_until(intervals, moment)
            if inside is not None:
                wait = max(wait, inside - moment)
        if wait == 0.0:
            return moment
        if wait < best_wait:
            best, best_wait = moment, wait
    return best


def _busy_until(intervals: list, moment: float) -> float | None:
    """The end of the compute action that is running at ``moment`` (strictly inside it)."""
    at = bisect_right(intervals, (moment, float("inf"))) - 1
    if at >= 0:
        start, end = intervals[at]
        if start < moment < end:
            return end
    return None


def _lower_at_meeting_points(schedule: Schedule, times: dict[Action, tuple[float, float]]) -> Schedule:
    """Place every transfer at its meeting point on both ends and group what falls
    between two compute actions."""
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    intervals = [sorted(times[action] for action in program) for program in schedule.programs]
    backward_of = {(action[0], action[2]): action for program in schedule.programs for action in program
                   if action[1] == _B or action[1] == _I}
    # Per rank: (moment, sending stage, direction, microbatch, action) of every transfer end.
    ops: list[list[tuple[float, int, int, int, Action]]] = [[] for _ in range(schedule.pp)]
    new = tuple.__new__  # Actions built directly: NamedTuple's own constructor is several times slower
    for rank, program in enumerate(schedule.programs):
        rank_ops, rank_intervals = ops[rank], intervals[rank]
        for action in program:
            stage, kind, microbatch = action
            if kind == _F:
                if stage < last_stage and placement[stage + 1] != rank:
                    peer = placement[stage + 1]
                    moment = _meeting_point(times[action][1], times[(stage + 1, _F, microbatch)][0],
                                            rank_intervals, intervals[peer])
                    rank_ops.append((moment, stage, 0, microbatch, new(Action, (stage, _SEND_F, microbatch))))
                    ops[peer].append((moment, stage, 0, microbatch, new(Action, (stage + 1, _RECV_F, microbatch))))
            elif kind == _B or kind == _I:
                if stage > 0 and placement[stage - 1] != rank:
                    peer = placement[stage - 1]
                    moment = _meeting_point(times[action][1], times[backward_of[stage - 1, microbatch]][0],
                                            rank_intervals, intervals[peer])
                    rank_ops.append((moment, stage, 1, microbatch, new(Action, (stage, _SEND_B, microbatch))))
                    ops[peer].append((moment, stage, 1, microbatch, new(Action, (stage - 1, _RECV_B, microbatch))))
    programs, joins = [], []
    for rank, program in enumerate(schedule.programs):
        transfers = sorted(ops[rank])
        lowered: list[Action] = []
        joined: set[int] = set()
        taken, count = 0, len(transfers)
        compute = COMPUTE_KINDS
        for action in program:
            if action[1] in compute:
                limit = times[action][0]
                first = len(lowered)
                while taken < count and transfers[taken][0] <= limit:
                    lowered.append(transfers[taken][4])
                    taken += 1
                joined.update(range(first + 1, len(lowered)))
            lowered.append(action)
        first = len(lowered)
        lowered.extend(transfer[4] for transfer in transfers[taken:])
        joined.update(range(first + 1, len(lowered)))
        programs.append(lowered)
        joins.append(frozenset(joined))
    return schedule.with_programs(programs, joins)


def _lower_naively(schedule: Schedule) -> Schedule:
    """Each SEND right after its producer and each RECV right before its consumer, every
    transfer a group of its own: the order validation can explain when the compute order
    itself is broken."""
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    lowered = []
    for rank, program in enumerate(schedule.programs):
        actions: list[Action] = []
        append = actions.append
        for action in program:
            stage, kind, microbatch = action
            if kind == _F:
                if stage > 0 and placement[stage - 1] != rank:
                    append(Action(stage, _RECV_F, microbatch))
                append(action)
                if stage < last_stage and placement[stage + 1] != rank:
                    append(Action(stage, _SEND_F, microbatch))
            elif kind == _B or kind == _I:
                if stage < last_stage and placement[stage + 1] != rank:
                    append(Action(stage, _RECV_B, microbatch))
                append(action)
                if stage > 0 and placement[stage - 1] != rank:
                    append(Action(stage, _SEND_B, microbatch))
            else:
                append(action)
        lowered.append(actions)
    return schedule.with_programs(lowered)
