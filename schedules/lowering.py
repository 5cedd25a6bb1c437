"""Lowering: add the SEND/RECV actions that a compute-only schedule implies, grouped
into the P2P batches that are posted together.

Every dependency that crosses ranks (a forward output going to the next stage, an
input gradient going back to the previous one) becomes a SEND on the producer's rank
and a RECV on the consumer's. Where they go, and which of them are posted together as
one ``batch_isend_irecv``, decides whether the step can hang on NCCL: NCCL matches the
P2P operations of a rank pair in posting order, and a send may wait until its receive
is posted (rendezvous). gloo, which matches by tag and buffers sends, forgives orders
that NCCL does not.

The construction generalises Megatron's lock-step pairing to any compute order. The
engine times the compute-only schedule (``schedules.engine``, free transfers; nominal
durations unless the caller gives the step's own). Each transfer is ready when its
producer ends and needed when its consumer starts, and is exchanged at its *meeting
point*: the earliest moment in that window at which neither rank is inside a compute
action (failing that, the moment with the shortest wait). Both ends place it at that
moment of their own timeline, and everything a rank posts between two compute actions is
one group, ordered by (meeting point, sending stage, direction, microbatch) on both ends
of every pair. Every rank meets the meeting points in increasing order, so a group never
waits for a peer that is itself waiting for a later one: every generated schedule is
deadlock-free under rendezvous semantics, and the posting order of every pair matches
(``docs/schedules.md`` has the argument; the validator checks it for any schedule).
"""

from __future__ import annotations

from bisect import bisect_right
from functools import partial
from itertools import chain

import numpy as np

from schedules import engine
from schedules.action import Action, ActionKind
from schedules.collector import without_collector
from schedules.overlap import keep_pairs_together
from schedules.program_arrays import BACKWARD, program_arrays
from schedules.schedule import Schedule

_F, _B, _I = ActionKind.F, ActionKind.B, ActionKind.I
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
_INFINITY = float("inf")

# The durations lowering plans with when it is given none: a backward about twice a
# forward, split in two equal halves by zero-bubble schedules.
NOMINAL_SECONDS = {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.I: 1.0, ActionKind.W: 1.0}


def nominal_timing(schedule: Schedule) -> engine.StepTiming:
    """``NOMINAL_SECONDS`` on every stage, transfers free."""
    row = [NOMINAL_SECONDS[kind] for kind in engine.COMPUTE_KINDS]
    return engine.StepTiming(np.tile(np.array(row), (schedule.num_stages, 1)))


@without_collector
def lower(schedule: Schedule, timing: engine.StepTiming | None = None) -> Schedule:
    """The schedule with communication actions inserted and grouped; already-lowered
    schedules (for instance a CSV written by hand with its own SEND/RECV order) come back
    as they are. ``timing`` is what the step's actions cost, to plan the meeting points
    with (default: ``NOMINAL_SECONDS``, free transfers).

    A compute-only schedule that cannot run at all (a cycle between ranks, a missing
    producer) is lowered naively, each RECV right before its consumer, so that
    ``validate`` reports the problem in the user's terms instead of lowering failing."""
    try:
        arrays = program_arrays(schedule)
    except (ValueError, TypeError):  # an action that is no action: validation names it
        return _lower_naively(schedule)
    if not arrays.is_compute.all():
        return schedule
    step = _timed(schedule, timing)
    if step is None:
        return _lower_naively(schedule)
    return keep_pairs_together(_lower_at_meeting_points(schedule, step), schedule)


def _timed(schedule: Schedule, timing: engine.StepTiming | None) -> engine.StepRun | None:
    """The engine's timing of the compute-only order, overlapped pairs spanning their
    whole pair (both inputs needed when it starts, both outputs there when it ends); None
    if it cannot finish."""
    try:
        step = engine.run(schedule, timing or nominal_timing(schedule), engine.FREE)
    except (ValueError, IndexError):  # an action outside the schedule's stages: validation names it
        return None
    if step.stuck or np.isnan(step.start).any():
        return None
    if any(schedule.fused):
        program = step.program
        row_of = {int(row): index for index, row in enumerate(program.compute_row)}
        for rank in range(schedule.pp):
            for position in schedule.fused[rank]:
                backward = row_of[int(program.arrays.rank_start[rank] + position)]
                forward = row_of[int(program.arrays.rank_start[rank] + position - 1)]
                step.end[forward] = step.end[backward]
                step.start[backward] = step.start[forward]
    return step


def _lower_at_meeting_points(schedule: Schedule, step: engine.StepRun) -> Schedule:
    """Place every transfer at its meeting point on both ends and group what falls
    between two compute actions."""
    program = step.program
    arrays = program.arrays
    microbatches = arrays.microbatches
    # each transfer: its producer (compute_send) and its consumer (compute_need, free mode)
    producer = np.flatnonzero(program.compute_send >= 0)
    key = program.compute_send[producer]
    consumer_of = np.full(arrays.transfers, -1, dtype=np.int64)
    consumers = np.flatnonzero(program.compute_need >= 0)
    consumer_of[program.compute_need[consumers]] = consumers
    consumer = consumer_of[key]
    sending_stage, direction = np.divmod(key // microbatches, 2)
    microbatch = key % microbatches
    sender, receiver = program.compute_rank[producer], program.compute_rank[consumer]
    moment = _meeting_points(step, sender, receiver, step.end[producer], step.start[consumer])
    # both ends of each transfer: the SEND on the sender, the RECV on the receiver
    receiving_stage = np.where(direction == BACKWARD, sending_stage - 1, sending_stage + 1)
    end_rank = np.concatenate([sender, receiver])
    end_stage = np.concatenate([sending_stage, receiving_stage])
    backward = np.concatenate([direction, direction]) == BACKWARD
    is_send = np.r_[np.ones(len(key), dtype=bool), np.zeros(len(key), dtype=bool)]
    end_kind = np.where(is_send, np.where(backward, 2, 0), np.where(backward, 3, 1))  # into _TRANSFER_KINDS
    end_moment = np.concatenate([moment, moment])
    # an end goes right before the first compute action of its rank that starts at or after its moment
    compute_rank, compute_start = program.compute_rank, step.start
    first_compute = np.searchsorted(compute_rank, np.arange(schedule.pp))
    slot = np.empty(len(end_rank), dtype=np.int64)
    for rank in range(schedule.pp):
        ends = np.flatnonzero(end_rank == rank)
        starts = compute_start[first_compute[rank]:first_compute[rank + 1] if rank + 1 < schedule.pp else None]
        slot[ends] = np.searchsorted(starts, end_moment[ends], side="left")
    count = len(program.compute_row)
    within = np.arange(count) - first_compute[compute_rank]
    # one merged order per rank: by slot, transfers before the compute action of their slot,
    # then (meeting point, sending stage, direction, microbatch) as both ends of a pair agree
    rank_key = np.concatenate([compute_rank, end_rank])
    slot_key = np.concatenate([within, slot])
    is_transfer = np.r_[np.zeros(count, dtype=bool), np.ones(len(end_rank), dtype=bool)]
    zeros = np.zeros(count)
    order = np.lexsort((np.concatenate([zeros, np.concatenate([microbatch, microbatch])]),
                        np.concatenate([zeros, np.concatenate([direction, direction])]),
                        np.concatenate([zeros, np.concatenate([sending_stage, sending_stage])]),
                        np.concatenate([zeros, end_moment]), ~is_transfer, slot_key, rank_key))
    return _programs_in_order(schedule, program, order, end_stage, end_kind,
                              np.concatenate([microbatch, microbatch]), rank_key, slot_key, is_transfer)


_TRANSFER_KINDS = (_SEND_F, _RECV_F, _SEND_B, _RECV_B)


def _programs_in_order(schedule: Schedule, program: engine.EngineProgram, order: np.ndarray,
                       end_stage: np.ndarray, end_kind: np.ndarray, end_microbatch: np.ndarray,
                       rank_key: np.ndarray, slot_key: np.ndarray, is_transfer: np.ndarray) -> Schedule:
    """The lowered programs and their P2P groups from the merged order."""
    originals = list(chain.from_iterable(schedule.programs))
    compute_action = list(map(originals.__getitem__, program.compute_row.tolist()))
    kinds = list(map(_TRANSFER_KINDS.__getitem__, end_kind.tolist()))
    # Actions built directly: NamedTuple's own constructor is several times slower
    ends = zip(end_stage.tolist(), kinds, end_microbatch.tolist(), strict=True)
    transfer = list(map(partial(tuple.__new__, Action), ends))
    actions = compute_action + transfer
    ordered_rank = rank_key[order]
    ordered_transfer = is_transfer[order]
    # a transfer joins the group of the one before it when both sit in the same slot of one rank
    joined = ordered_transfer[1:] & ordered_transfer[:-1] & (ordered_rank[1:] == ordered_rank[:-1]) & (
        slot_key[order][1:] == slot_key[order][:-1])
    rank_start = np.searchsorted(ordered_rank, np.arange(schedule.pp + 1))
    sequence = list(map(actions.__getitem__, order.tolist()))
    joined_at = np.flatnonzero(joined) + 1
    programs, joins = [], []
    for rank in range(schedule.pp):
        first, stop = int(rank_start[rank]), int(rank_start[rank + 1])
        programs.append(sequence[first:stop])
        inside = joined_at[(joined_at > first) & (joined_at < stop)] - first
        joins.append(frozenset(inside.tolist()))
    return schedule.with_programs(programs, joins)


def _meeting_points(step: engine.StepRun, sender: np.ndarray, receiver: np.ndarray, ready: np.ndarray,
                    needed: np.ndarray) -> np.ndarray:
    """Each transfer's meeting point (see the module): the earliest moment from ``ready``
    at which neither rank is inside a compute action, if that comes by ``needed``; else
    the moment of the shortest wait (``_meeting_point``, one transfer at a time: rare)."""
    program = step.program
    bounds = np.r_[np.searchsorted(program.compute_rank, np.arange(program.ranks)), len(program.compute_rank)]
    intervals = [(step.start[bounds[rank]:bounds[rank + 1]], step.end[bounds[rank]:bounds[rank + 1]])
                 for rank in range(program.ranks)]
    moment = ready.copy()
    if not len(moment):
        return moment
    pair = sender * program.ranks + receiver
    order = np.argsort(pair, kind="stable")
    cuts = np.flatnonzero(np.r_[True, pair[order][1:] != pair[order][:-1], True])
    for first, stop in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        transfers = order[first:stop]
        starts, ends = _busy_union(intervals[sender[transfers[0]]], intervals[receiver[transfers[0]]])
        at = np.searchsorted(starts, moment[transfers], side="left") - 1
        inside = (at >= 0) & (moment[transfers] < ends[np.maximum(at, 0)])
        moment[transfers[inside]] = ends[at[inside]]
    late = np.flatnonzero(moment > needed)
    if len(late):
        pairs = {}
        for index in late.tolist():
            for rank in (int(sender[index]), int(receiver[index])):
                if rank not in pairs:
                    pairs[rank] = list(zip(*(part.tolist() for part in intervals[rank]), strict=True))
            moment[index] = _meeting_point(float(ready[index]), float(needed[index]), pairs[int(sender[index])],
                                           pairs[int(receiver[index])])
    return moment


def _busy_union(first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray]:
    """The stretches in which one of two ranks is inside a compute action: their actions'
    open intervals merged where they overlap (not where they only touch: the moment
    between two actions is free)."""
    starts = np.concatenate([first[0], second[0]])
    ends = np.concatenate([first[1], second[1]])
    busy = ends > starts
    starts, ends = starts[busy], ends[busy]
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends) if len(ends) else ends
    opens = np.r_[True, starts[1:] >= reach[:-1]] if len(starts) else np.zeros(0, dtype=bool)
    group = np.cumsum(opens) - 1
    merged_ends = np.full(int(group[-1]) + 1 if len(group) else 0, -np.inf)
    np.maximum.at(merged_ends, group, ends)
    return starts[opens], merged_ends


def _meeting_point(ready: float, needed: float, sender: list, receiver: list) -> float:
    """The meeting point of a transfer ready at ``ready`` and needed at ``needed``:
    among ``ready``, ``needed`` and the ends of either rank's actions in between, the
    earliest at which neither rank is inside an action, else the one at which the longer
    of the two ranks' waits for its running action is shortest.
    ``sender``/``receiver`` are a rank's sorted (start, end) pairs."""
    best, best_wait = ready, _INFINITY
    candidates = [ready, needed]
    for intervals in (sender, receiver):
        first = bisect_right(intervals, (ready, _INFINITY)) - 1
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
    at = bisect_right(intervals, (moment, _INFINITY)) - 1
    if at >= 0:
        start, end = intervals[at]
        if start < moment < end:
            return end
    return None


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
