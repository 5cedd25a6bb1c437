"""Validation: reject schedules that cannot run, and say why in the user's terms.

A schedule can be wrong in four ways, checked in this order so that the first error a
user sees is the most basic one:

1. malformed actions: an unknown kind, a stage or microbatch out of range, an action on
   a rank that does not hold its stage, a transfer no stage needs, a duplicate;
2. an incomplete step: every (stage, microbatch) needs one ``F`` and either one ``B`` or
   one ``I`` plus one ``W``, with the backward after its forward (and ``W`` after ``I``)
   in program order;
3. in lowered schedules, every dependency that crosses ranks needs its SEND after the
   producer and its matching RECV before the consumer, and under rendezvous (NCCL) each
   rank pair's sends and receives are posted in the same order;
4. a deadlock: an order in which some ranks wait for each other forever, under the P2P
   semantics of the backend (``schedules.p2p``).

The first three are checks over the programs as arrays (``schedules.program_arrays``):
hundreds of thousands of actions validate in a few tens of milliseconds, and only a
schedule that fails is walked action by action, to name what is wrong. The fourth asks
the timing engine (``schedules.engine``) to run the programs: a rank it leaves stuck can
never finish, whatever the costs, and following who waits for whom from the engine's
stuck state names the cycle.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from schedules import dataflow, engine
from schedules.action import ALL_KINDS, COMM_KINDS, KIND_CODES, KINDS, RECV_OF, Action, ActionKind, format_group
from schedules.collector import without_collector
from schedules.graph import producers
from schedules.p2p import RENDEZVOUS, TORCH_RUNTIME, P2PError, check_pair_order, require_semantics
from schedules.program_arrays import (
    B_CODE,
    F_CODE,
    I_CODE,
    RECV_B_CODE,
    RECV_F_CODE,
    SEND_B_CODE,
    SEND_F_CODE,
    W_CODE,
    ProgramArrays,
    program_arrays,
)
from schedules.schedule import Schedule

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
_MISSING = -1


class ScheduleValidationError(ValueError):
    """A schedule that cannot run as written.

    ``action``, ``rank`` and ``position`` (0-based index in that rank's program) point at
    the offending action where there is one; for a missing action ``position`` is None.
    ``cycle`` lists the actions of a deadlock cycle, in waiting order.
    """

    def __init__(
        self,
        message: str,
        *,
        action: Action | None = None,
        rank: int | None = None,
        position: int | None = None,
        cycle: Sequence[Action] = (),
    ) -> None:
        super().__init__(message)
        self.action = action
        self.rank = rank
        self.position = position
        self.cycle = tuple(cycle)


def is_valid(schedule: Schedule, p2p: str = RENDEZVOUS) -> bool:
    """Whether ``validate`` accepts the schedule."""
    try:
        validate(schedule, p2p)
    except ScheduleValidationError:
        return False
    return True


@without_collector
def validate(schedule: Schedule, p2p: str = RENDEZVOUS, finishes: bool = True) -> Schedule:
    """Raise ``ScheduleValidationError`` naming the first problem found; return the
    schedule if it can run. Accepts compute-only and lowered schedules.

    ``p2p`` is the point-to-point semantics of the backend the schedule will run on
    (``schedules.p2p``): a lowered schedule is checked for matching posting order and
    for deadlocks under it. The default, rendezvous (NCCL), is the strict one: what
    passes it runs on gloo too. ``finishes=False`` leaves out the deadlock check, for a
    caller about to run the engine itself (a rank it leaves stuck is then explained by
    ``explain_stuck``)."""
    require_semantics(p2p)
    arrays = _check_actions(schedule)
    _check_complete(schedule, arrays)
    lowered = not arrays.is_compute.all()
    if lowered:
        _check_transfers(schedule, arrays)
        if p2p in (RENDEZVOUS, TORCH_RUNTIME):
            try:
                check_pair_order(schedule)
            except P2PError as error:
                raise _as_validation_error(error) from None
    if finishes:
        check_finishes(schedule, p2p)
    return schedule


def check_finishes(schedule: Schedule, p2p: str = RENDEZVOUS) -> None:
    """Run the programs on the engine (unit durations, free transfers: whether a step
    can finish does not depend on what its actions cost) and explain any rank left stuck."""
    lowered = not program_arrays(schedule).is_compute.all()
    semantics = p2p if lowered else engine.FREE
    timing = engine.StepTiming.uniform(schedule.num_stages, 1.0, 2.0, 1.0)
    step = engine.run(schedule, timing, semantics)
    if step.stuck:
        explain_stuck(step)


def _as_validation_error(error: P2PError) -> ScheduleValidationError:
    return ScheduleValidationError(str(error), action=error.action, rank=error.rank, position=error.position,
                                   cycle=error.cycle)


# --- 1. malformed actions -------------------------------------------------------------


def _check_actions(schedule: Schedule) -> ProgramArrays:
    """Check every action on its own and return the programs as arrays. The checks run
    over whole arrays; the rank with the first failure is walked for the message."""
    try:
        arrays = program_arrays(schedule)
    except (ValueError, TypeError):  # a kind that does not exist, or a stage that is no number
        for rank, program in enumerate(schedule.programs):
            _explain_bad_action(schedule, rank, program, all_checks=True)
        raise
    num_stages, microbatches = schedule.num_stages, schedule.microbatches
    placement = np.asarray(schedule.placement, dtype=np.int64)
    stage, kind, microbatch, rank = arrays.stage, arrays.kind, arrays.microbatch, arrays.rank
    in_range = (stage >= 0) & (stage < num_stages) & (microbatch >= 0) & (microbatch < microbatches)
    placed = in_range & (placement[np.clip(stage, 0, num_stages - 1)] == rank)
    peer = stage + dataflow.PEER_OFFSET_CODES[kind]
    peer_exists = (peer >= 0) & (peer < num_stages)
    peer_elsewhere = peer_exists & (placement[np.clip(peer, 0, num_stages - 1)] != rank)
    good = placed & (arrays.is_compute | peer_elsewhere)
    bad_rank = int(rank[np.argmin(good)]) if not good.all() else schedule.pp
    key = (np.where(in_range, stage, 0) * 8 + kind) * microbatches + np.where(in_range, microbatch, 0)
    duplicate_rank = _duplicate_rank(key, rank, schedule.pp)
    if bad_rank <= duplicate_rank and bad_rank < schedule.pp:
        _explain_bad_action(schedule, bad_rank, schedule.programs[bad_rank])
    if duplicate_rank < schedule.pp:
        _explain_duplicate(duplicate_rank, schedule.programs[duplicate_rank])
    return arrays


def _duplicate_rank(key: np.ndarray, rank: np.ndarray, ranks: int) -> int:
    """The first rank whose program repeats an action (``ranks`` if none does): among the
    rows whose key an earlier row already has, the lowest rank. Whether any repeats is
    asked of the keys sorted alone first, which is cheaper than sorting their rows."""
    ordered = np.sort(key)
    if not (ordered[1:] == ordered[:-1]).any():
        return ranks
    order = np.argsort(key, kind="stable")
    repeated = np.flatnonzero(key[order][1:] == key[order][:-1])
    return int(rank[order][repeated + 1].min())


def _explain_bad_action(schedule: Schedule, rank: int, program: Sequence[Action], all_checks: bool = False) -> None:
    """Raise for the first action of ``program`` that is malformed on its own (with
    ``all_checks``, return if none is: the caller looks at the next rank)."""
    stages = schedule.num_stages
    placement = schedule.placement
    for position, action in enumerate(program):
        stage, kind, microbatch = action

        def fail(problem: str, action: Action = action, position: int = position) -> None:
            raise ScheduleValidationError(
                f"rank {rank}, position {position}: {action} {problem}", action=action, rank=rank, position=position
            )

        if kind not in ALL_KINDS:
            fail(f"has unknown kind {kind!r}; valid kinds: {', '.join(sorted(ALL_KINDS))}")
        if not isinstance(stage, int) or not 0 <= stage < stages:
            fail(f"names stage {stage!r}, but the schedule has {stages} stages (0..{stages - 1})")
        if not isinstance(microbatch, int) or not 0 <= microbatch < schedule.microbatches:
            fail(
                f"names microbatch {microbatch!r}, but the schedule has {schedule.microbatches} "
                f"microbatches (0..{schedule.microbatches - 1})"
            )
        if placement[stage] != rank:
            held = ", ".join(map(str, schedule.stages_of(rank))) or "none"
            fail(
                f"runs stage {stage}, which is placed on rank {placement[stage]}; it belongs in rank "
                f"{placement[stage]}'s program (rank {rank} holds stages: {held})"
            )
        if kind in COMM_KINDS:
            peer = action.peer_stage()
            verb = "sends to" if kind in (_SEND_F, _SEND_B) else "receives from"
            if not 0 <= peer < stages:
                fail(
                    f"{verb} stage {peer}, which does not exist (stages 0..{stages - 1}); "
                    f"remove it: the first stage reads its input and the last stage computes the loss locally"
                )
            if placement[peer] == rank:
                fail(
                    f"{verb} stage {peer}, which is on the same rank {rank}; a dependency within a rank "
                    f"needs no transfer, remove it"
                )
    if not all_checks:
        raise AssertionError("whole-program check failed but no single action is malformed")  # pragma: no cover


def _explain_duplicate(rank: int, program: Sequence[Action]) -> None:
    """Raise for the first action that appears twice in ``program``."""
    first_seen: dict[Action, int] = {}
    for position, action in enumerate(program):
        if action in first_seen:
            raise ScheduleValidationError(
                f"rank {rank}, position {position}: {action} appears twice in rank {rank}'s program "
                f"(positions {first_seen[action]} and {position}); each action runs exactly once",
                action=action,
                rank=rank,
                position=position,
            )
        first_seen[action] = position
    raise AssertionError("size check found a duplicate but the scan did not")  # pragma: no cover


# --- 2. a complete step, backwards after forwards -----------------------------------


def _positions(schedule: Schedule, arrays: ProgramArrays) -> np.ndarray:
    """(kind code, stage * microbatches + microbatch) -> program position, -1 where the
    schedule has no such action (actions are known valid and unique by now)."""
    microbatches = schedule.microbatches
    table = np.full((8, schedule.num_stages * microbatches), _MISSING, dtype=np.int64)
    table[arrays.kind, arrays.stage * microbatches + arrays.microbatch] = arrays.position
    return table


def _getter(schedule: Schedule, table: np.ndarray):
    """``get((stage, kind, microbatch))`` -> position or None, over ``_positions``."""
    def get(action) -> int | None:
        stage, kind, microbatch = action
        position = int(table[KIND_CODES[kind], stage * schedule.microbatches + microbatch])
        return None if position == _MISSING else position

    return get


def _check_complete(schedule: Schedule, arrays: ProgramArrays) -> None:
    """Every (stage, microbatch) has F and B, or F, I and W, each in a valid order; the
    first (stage, microbatch) that has not is walked for the message."""
    table = _positions(schedule, arrays)
    forward, full, split, weight = table[F_CODE], table[B_CODE], table[I_CODE], table[W_CODE]
    whole = (full >= 0) & (split < 0) & (weight < 0) & (forward < full)
    halves = (full < 0) & (split >= 0) & (weight >= 0) & (forward < split) & (split < weight)
    good = (forward >= 0) & (whole | halves)
    if good.all():
        return
    first = int(np.argmin(good))
    stage, microbatch = divmod(first, schedule.microbatches)
    _check_pair(_getter(schedule, table), stage, schedule.placement[stage], microbatch)
    raise AssertionError("completeness check failed but the pair is complete")  # pragma: no cover


def _check_pair(get, stage: int, rank: int, microbatch: int) -> None:
    """The full check of one (stage, microbatch), raising on the first problem."""
    forward = Action(stage, _F, microbatch)
    at_forward = get(forward)
    at_b = get((stage, _B, microbatch))
    at_i = get((stage, _I, microbatch))
    at_w = get((stage, _W, microbatch))
    if at_forward is None:
        _missing(forward, rank, "every stage runs one forward per microbatch")
    if at_b is not None:
        backward = Action(stage, _B, microbatch)
        if at_i is not None:
            _fail(
                rank, at_i, Action(stage, _I, microbatch),
                f"but {backward} (position {at_b}) already does the full backward; use either "
                f"{backward} alone or {stage}I{microbatch} plus {stage}W{microbatch}",
            )
        if at_w is not None:
            _fail(
                rank, at_w, Action(stage, _W, microbatch),
                f"but {backward} (position {at_b}) already computes the weight gradient; "
                f"{stage}W{microbatch} only follows an {stage}I{microbatch}",
            )
        _require_after(rank, backward, at_b, forward, at_forward)
    elif at_i is not None:
        split = Action(stage, _I, microbatch)
        weight = Action(stage, _W, microbatch)
        _require_after(rank, split, at_i, forward, at_forward)
        if at_w is None:
            _missing(weight, rank, f"{split} (position {at_i}) computes only the input gradient")
        _require_after(rank, weight, at_w, split, at_i)
    elif at_w is not None:
        _fail(
            rank, at_w, Action(stage, _W, microbatch),
            f"but there is no {stage}I{microbatch} before it; a weight-gradient step follows its "
            f"input-gradient step",
        )
    else:
        _missing(
            Action(stage, _B, microbatch), rank,
            f"every stage runs a backward per microbatch: {stage}B{microbatch}, or "
            f"{stage}I{microbatch} followed by {stage}W{microbatch}",
        )


def _fail(rank: int, position: int, action: Action, problem: str) -> None:
    raise ScheduleValidationError(
        f"rank {rank}, position {position}: {action} {problem}", action=action, rank=rank, position=position
    )


def _missing(action: Action, rank: int, why: str) -> None:
    raise ScheduleValidationError(
        f"rank {rank}'s program has no {action}; {why}", action=action, rank=rank, position=None
    )


def _require_after(rank: int, action: Action, at: int, earlier: Action, at_earlier: int) -> None:
    if at < at_earlier:
        _fail(
            rank, at, action,
            f"comes before {earlier} (position {at_earlier}), which it needs; move it after {earlier}",
        )


# --- 3. transfers in lowered schedules -----------------------------------------------


def _check_transfers(schedule: Schedule, arrays: ProgramArrays) -> None:
    """Each cross-rank dependency has SEND after its producer and RECV before its
    consumer; the first boundary and microbatch that has not is walked for the message."""
    placement = schedule.placement
    microbatches = schedule.microbatches
    table = _positions(schedule, arrays)
    get = _getter(schedule, table)
    for stage in dataflow.crossing_boundaries(placement, schedule.copies):
        above = dataflow.output_stage(stage, _F)
        here, there = slice(stage * microbatches, above * microbatches), slice(above * microbatches,
                                                                                (above + 1) * microbatches)
        send, recv = table[SEND_F_CODE, here], table[RECV_F_CODE, there]
        forward_good = (send >= 0) & (recv >= 0) & (send > table[F_CODE, here]) & (recv < table[F_CODE, there])
        producer = np.maximum(table[B_CODE, there], table[I_CODE, there])
        consumer = np.maximum(table[B_CODE, here], table[I_CODE, here])
        send, recv = table[SEND_B_CODE, there], table[RECV_B_CODE, here]
        backward_good = (send >= 0) & (recv >= 0) & (send > producer) & (recv < consumer)
        if forward_good.all() and backward_good.all():
            continue
        for microbatch in range(microbatches):
            if not forward_good[microbatch]:
                _check_transfer(placement, get, Action(stage, _F, microbatch), Action(above, _F, microbatch),
                                _SEND_F, _RECV_F)
            if not backward_good[microbatch]:
                _check_transfer(placement, get, _backward_of(get, above, microbatch),
                                _backward_of(get, stage, microbatch), _SEND_B, _RECV_B)


def _backward_of(get, stage: int, microbatch: int) -> Action:
    """The B or I of (stage, microbatch); ``_check_complete`` made sure one exists."""
    full = Action(stage, _B, microbatch)
    return full if get(full) is not None else Action(stage, _I, microbatch)


def _check_transfer(placement, get, producer: Action, consumer: Action, send_kind: str, recv_kind: str) -> None:
    """One producer -> SEND -> RECV -> consumer chain across two ranks."""
    send = Action(producer.stage, send_kind, producer.microbatch)
    recv = Action(consumer.stage, recv_kind, consumer.microbatch)
    source, target = placement[producer.stage], placement[consumer.stage]
    at_send, at_recv = get(send), get(recv)
    at_producer, at_consumer = get(producer), get(consumer)
    if at_send is None and at_recv is None:
        raise ScheduleValidationError(
            f"rank {target}, position {at_consumer}: {consumer} needs {producer} from rank {source}, but "
            f"there is no {send}/{recv} pair to carry it; add {send} after {producer} on rank {source} and "
            f"{recv} before {consumer} on rank {target} (lower() inserts them for a compute-only schedule)",
            action=consumer, rank=target, position=at_consumer,
        )
    if at_send is None:
        raise ScheduleValidationError(
            f"rank {target}, position {at_recv}: {recv} has no matching {send} on rank {source}; add {send} "
            f"after {producer} (position {at_producer}) in rank {source}'s program",
            action=recv, rank=target, position=at_recv,
        )
    if at_recv is None:
        raise ScheduleValidationError(
            f"rank {source}, position {at_send}: {send} has no matching {recv} on rank {target}; add {recv} "
            f"before {consumer} (position {at_consumer}) in rank {target}'s program",
            action=send, rank=source, position=at_send,
        )
    if at_send < at_producer:
        _fail(source, at_send, send, f"comes before {producer} (position {at_producer}), whose result it sends; "
                                     f"move it after {producer}")
    if at_recv > at_consumer:
        _fail(target, at_recv, recv, f"comes after {consumer} (position {at_consumer}), which needs what it "
                                     f"receives; move it before {consumer}")


# --- 4. deadlock ----------------------------------------------------------------------


def explain_stuck(step: engine.StepRun) -> None:
    """Raise ``ScheduleValidationError`` naming the cycle of waits that leaves the
    engine's stuck ranks where they are."""
    program = step.program
    schedule = program.arrays.schedule
    try:
        if program.semantics == engine.FREE:
            _explain_compute_only(step)
        elif program.semantics in (RENDEZVOUS, TORCH_RUNTIME):
            _explain_streams(step)
        else:
            _explain_buffered(step)
    except P2PError as error:
        raise _as_validation_error(error) from None
    stuck = step.stuck  # every explainer raises; this is for a state none of them recognises
    raise ScheduleValidationError(f"deadlock: ranks {stuck} of {schedule.name} wait forever",
                                  rank=stuck[0] if stuck else None)


def _input_of(schedule: Schedule, action: Action, known) -> Action:
    """The action of the neighbouring stage whose output ``action`` consumes (the forward
    of the stage before, or the backward piece, B or I, of the stage after): its data
    edge in the dependency graph (``schedules.graph.producers``), the one the schedule holds."""
    rank = schedule.placement[action.stage]
    candidates = [producer for producer, _ in producers(action, rank, schedule, lowered=False)
                  if producer.stage != action.stage]
    return next((candidate for candidate in candidates if candidate in known), candidates[-1])


def _stuck_compute(step: engine.StepRun, rank: int) -> tuple[int, Action] | None:
    """The compute row and action ``rank`` is stuck at, None if it waits at its end."""
    program = step.program
    item = int(program.rank_item_start[rank] + step.stuck_item[rank])
    if item >= program.rank_item_start[rank + 1] or program.item_is_group[item]:
        return None
    row = int(program.compute_row[program.item_ref[item]])
    arrays = program.arrays
    return row, Action(int(arrays.stage[row]), KINDS[arrays.kind[row]], int(arrays.microbatch[row]))


def _explain_compute_only(step: engine.StepRun) -> None:
    """A compute-only schedule: each stuck rank waits for the producer of its input."""
    schedule = step.program.arrays.schedule
    arrays = step.program.arrays
    known = {action for program in schedule.programs for action in program}
    counters = [len(program) for program in schedule.programs]
    blocked_on: dict[int, Action] = {}
    for rank in step.stuck:
        row, action = _stuck_compute(step, rank)
        counters[rank] = int(arrays.position[row])
        blocked_on[rank] = _input_of(schedule, action, known)
    _explain_deadlock(schedule, counters, blocked_on, step.stuck[0])


def _explain_buffered(step: engine.StepRun) -> None:
    """Buffered: each stuck rank waits, at the compute action that needs it, for a send
    its peer never posts (or for an input its own program produces later)."""
    schedule = step.program.arrays.schedule
    items = [schedule.program_items(rank) for rank in range(schedule.pp)]
    known = {action for program in schedule.programs for action in program}
    item_of: dict[tuple, tuple[int, int]] = {}
    for rank, rank_items in enumerate(items):
        for index, item in enumerate(rank_items):
            for action in (item if type(item) is tuple else (item,)):
                item_of[action] = (rank, index)
    counters = [len(rank_items) for rank_items in items]
    blocked_on: dict[int, Action] = {}
    for rank in step.stuck:
        counters[rank] = int(step.stuck_item[rank])
        _, action = _stuck_compute(step, rank)
        producer = _input_of(schedule, action, known)
        if schedule.placement[producer.stage] == rank:
            blocked_on[rank] = producer
            continue
        # the rank waits on the receive that brings the input: named at its group
        receive = Action(action.stage, RECV_OF[action.kind], action.microbatch)
        counters[rank] = item_of[receive][1]
        blocked_on[rank] = receive.matching()
    _explain(schedule, items, [_item_starts(rank_items) for rank_items in items], counters, blocked_on, item_of,
             step.stuck[0])


def _explain_deadlock(schedule: Schedule, counters: list[int], blocked_on: dict[int, Action], start: int) -> None:
    """Follow "rank r waits for an action of rank r'" from ``start`` until a rank repeats,
    and raise naming each wait on that cycle."""
    placement = schedule.placement
    order: list[int] = []
    rank = start
    while rank not in order:
        order.append(rank)
        rank = placement[blocked_on[rank].stage]
    cycle_ranks = order[order.index(rank):]
    clauses = []
    cycle: list[Action] = []
    for rank in cycle_ranks:
        head = schedule.programs[rank][counters[rank]]
        needed = blocked_on[rank]
        owner = placement[needed.stage]
        owner_head = schedule.programs[owner][counters[owner]]
        at_needed = schedule.programs[owner].index(needed, counters[owner])
        cycle.extend((head, needed))
        clause = f"rank {rank} waits at {head} (position {counters[rank]}) for {needed}"
        if owner == rank:
            clause += f", which comes later in its own program (position {at_needed})"
        elif owner_head == needed:
            clause += f" on rank {owner}, where rank {owner} is itself stuck"
        else:
            clause += (f" on rank {owner} (position {at_needed}), which rank {owner} only reaches after {owner_head} "
                       f"(position {counters[owner]})")
        clauses.append(clause)
    first = cycle_ranks[0]
    raise ScheduleValidationError(
        "deadlock: " + "; ".join(clauses) + ". None of these ranks can move; reorder a program so that an "
        "awaited action comes before that rank's own wait",
        action=cycle[0], rank=first, position=counters[first], cycle=cycle,
    )


def _explain_streams(step: engine.StepRun) -> None:
    """Rendezvous (and torch's runtime): follow who waits for whom from the engine's stuck
    state until a rank repeats, and raise naming each wait on that cycle. A stuck rank's
    host waits for a group (its input's, or at its end all of them); the head of that
    group's stream has started and waits for a peer to start the group holding the
    matching operation, which cannot start before that peer's earlier group on its stream
    completes, or which the peer's host has not posted yet."""
    program = step.program
    arrays = program.arrays
    schedule = arrays.schedule
    programs = schedule.programs
    known = {action for rank_program in programs for action in rank_program}
    rows = [program.endpoint_row[program.group_endpoint_start[group]:program.group_endpoint_start[group + 1]]
            for group in range(program.groups)]

    def actions(group: int) -> list[Action]:
        rank, first = int(program.group_rank[group]), int(arrays.rank_start[program.group_rank[group]])
        return [programs[rank][row - first] for row in rows[group].tolist()]

    def position(group: int) -> int:
        return int(arrays.position[rows[group][0]])

    def head(stream: int) -> int | None:
        """The stream's first group not completed."""
        for group in program.stream_groups[program.stream_group_start[stream]:program.stream_group_start[stream + 1]]:
            if np.isnan(step.group_done[group]):
                return int(group)
        return None

    group_of = {tuple(action): group for group in range(program.groups) for action in actions(group)}

    def wait_of(rank: int) -> tuple[str, int, list[Action]]:
        """One rank's wait: the clause, the rank it waits for, the actions on the cycle."""
        stuck = _stuck_compute(step, rank)
        if stuck is not None:
            compute = int(program.item_ref[program.rank_item_start[rank] + step.stuck_item[rank]])
            if program.compute_blocked[compute]:
                needed = _input_of(schedule, stuck[1], known)
                later = programs[rank].index(needed)
                return (f"rank {rank} waits at {stuck[1]} (position {arrays.position[stuck[0]]}) for {needed}, which "
                        f"comes later in its own program (position {later})", rank, [stuck[1], needed])
            waited = int(program.compute_need[compute])
        else:  # at its end, waiting for every group it posted
            waited = next(group for group in np.flatnonzero(program.group_rank == rank).tolist()
                          if np.isnan(step.group_done[group]))
        group = head(int(program.group_stream[waited]))
        for action in actions(group):
            matching = action.matching()
            peer_group = group_of[tuple(matching)]
            if np.isnan(step.group_start[peer_group]):
                break
        owner = int(program.group_rank[peer_group])
        clause = (f"rank {rank}'s group {format_group(actions(group))} (position {position(group)}) waits for rank "
                  f"{owner} to post {matching} (in {format_group(actions(peer_group))}, position "
                  f"{position(peer_group)}), ")
        earlier = head(int(program.group_stream[peer_group]))
        if earlier is not None and earlier != peer_group and not np.isnan(step.group_posted[earlier]):
            clause += (f"which cannot start before rank {owner}'s earlier group {format_group(actions(earlier))} "
                       f"(position {position(earlier)}) completes")
        else:
            items = schedule.program_items(owner)
            at = min(int(step.stuck_item[owner]), len(items) - 1)
            clause += f"which rank {owner} only reaches after {_describe(items[at])} (position " \
                      f"{_item_starts(items)[at]})"
        return clause, owner, [*actions(group), matching]

    order: list[int] = []
    rank = step.stuck[0]
    waits: dict[int, tuple[str, int, list[Action]]] = {}
    while rank not in order:
        order.append(rank)
        waits[rank] = wait_of(rank)
        rank = waits[rank][1]
    cycle_ranks = order[order.index(rank):]
    clauses = [waits[rank][0] for rank in cycle_ranks]
    cycle = [action for rank in cycle_ranks for action in waits[rank][2]]
    first = cycle_ranks[0]
    if program.semantics == TORCH_RUNTIME:
        rule = ("can hang torch's _PipelineScheduleRuntime on NCCL (each SEND/RECV posted alone in file order, one "
                "stream per rank pair, a transfer completes only once its peer has started the matching one): ")
        remedy = ". Write the file with `pipesim export --lowered`, whose transfers cannot hang it"
    else:
        rule = ("deadlock under rendezvous semantics (NCCL: transfers of a rank pair match in posting order, a group "
                "completes only once each peer has posted the matching operations, and a rank's groups run one after "
                "another): ")
        remedy = ". Post the transfers of each pair together (one group on each side), as lower() does"
    raise P2PError(rule + "; ".join(clauses) + remedy, action=cycle[0], rank=first,
                   position=programs[first].index(cycle[0]), cycle=cycle)


def _item_starts(rank_items: list) -> list[int]:
    """The program position where each item begins."""
    starts, position = [], 0
    for item in rank_items:
        starts.append(position)
        position += len(item) if type(item) is tuple else 1
    return starts


def _describe(item) -> str:
    return format_group(item) if type(item) is tuple else str(item)


def _explain(schedule, items, starts, counters, blocked_on, item_of, start: int) -> None:
    """Follow "rank r waits for an action of rank r'" from ``start`` until a rank repeats,
    and raise naming each wait on that cycle."""
    order: list[int] = []
    rank = start
    while rank not in order:
        order.append(rank)
        rank = item_of[blocked_on[rank]][0]
    cycle_ranks = order[order.index(rank):]
    clauses, cycle = [], []
    for rank in cycle_ranks:
        head = items[rank][counters[rank]]
        needed = blocked_on[rank]
        owner, at_needed = item_of[needed]
        owner_head = items[owner][counters[owner]]
        cycle.extend((*(head if type(head) is tuple else (head,)), needed))
        verb = "to send"
        clause = f"rank {rank} waits at {_describe(head)} (position {starts[rank][counters[rank]]}) for {needed}"
        if owner == rank:
            clause += f", which comes later in its own program (position {starts[owner][at_needed]})"
        else:
            clause = (f"rank {rank} waits at {_describe(head)} (position {starts[rank][counters[rank]]}) for rank "
                      f"{owner} {verb} {needed} (position {starts[owner][at_needed]}), which rank {owner} only "
                      f"reaches after {_describe(owner_head)} (position {starts[owner][counters[owner]]})")
        clauses.append(clause)
    first = cycle_ranks[0]
    rule = "under buffered semantics (gloo: a receive waits until its send is posted)"
    raise P2PError(
        f"deadlock {rule}: " + "; ".join(clauses) + ". None of these ranks can move; post the transfers of "
        "each pair together (one group on each side), as lower() does",
        action=cycle[0], rank=first, position=starts[first][counters[first]], cycle=cycle,
    )
