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

Everything is O(number of actions): hundreds of thousands of actions validate in well
under a second. The deadlock check walks the programs like the runtime would (a rank
runs until it reaches an action whose input is not there yet, and is woken when it is),
so it needs no graph; when ranks are left stuck it follows who waits for whom to name
the cycle.
"""

from __future__ import annotations

from collections.abc import Sequence

from schedules.action import ALL_KINDS, COMM_KINDS, COMPUTE_KINDS, Action, ActionKind
from schedules.collector import without_collector
from schedules.p2p import RENDEZVOUS, P2PError, check_pair_order, check_progress, require_semantics
from schedules.schedule import Schedule

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B


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
def validate(schedule: Schedule, p2p: str = RENDEZVOUS) -> Schedule:
    """Raise ``ScheduleValidationError`` naming the first problem found; return the
    schedule if it can run. Accepts compute-only and lowered schedules.

    ``p2p`` is the point-to-point semantics of the backend the schedule will run on
    (``schedules.p2p``): a lowered schedule is checked for matching posting order and
    for deadlocks under it. The default, rendezvous (NCCL), is the strict one: what
    passes it runs on gloo too."""
    require_semantics(p2p)
    position, lowered, split = _check_actions(schedule)
    _check_complete(schedule, position, split)
    if lowered:
        _check_transfers(schedule, position)
        try:
            if p2p == RENDEZVOUS:
                check_pair_order(schedule)
            check_progress(schedule, p2p)
        except P2PError as error:
            raise ScheduleValidationError(
                str(error), action=error.action, rank=error.rank, position=error.position, cycle=error.cycle
            ) from None
    else:
        _check_deadlock(schedule, position)
    return schedule


# --- 1. malformed actions -------------------------------------------------------------


def _cross(placement: Sequence[int], stage: int, other: int) -> bool:
    """Whether ``other`` is a real stage held by a different rank than ``stage``."""
    return 0 <= other < len(placement) and placement[other] != placement[stage]


def _allowed(schedule: Schedule, rank: int) -> set[tuple[int, str]]:
    """The (stage, kind) pairs that may appear in ``rank``'s program."""
    placement = schedule.placement
    allowed = set()
    for stage in schedule.stages_of(rank):
        allowed.update((stage, kind) for kind in COMPUTE_KINDS)
        if _cross(placement, stage, stage + 1):
            allowed.update({(stage, _SEND_F), (stage, _RECV_B)})
        if _cross(placement, stage, stage - 1):
            allowed.update({(stage, _RECV_F), (stage, _SEND_B)})
    return allowed


def _check_actions(schedule: Schedule) -> tuple[dict[Action, int], bool, bool]:
    """Check every action on its own; return each action's program position, whether
    the schedule is lowered and whether it splits backwards into I and W. Uses
    whole-program set checks and only scans action by action (for the message) when
    one fails."""
    microbatches = set(range(schedule.microbatches))
    position: dict[Action, int] = {}
    lowered = split = False
    for rank, program in enumerate(schedule.programs):
        allowed = _allowed(schedule, rank)
        pairs = {(action[0], action[1]) for action in program}
        if not pairs <= allowed or not {action[2] for action in program} <= microbatches:
            _explain_bad_action(schedule, rank, program)
        kinds = {kind for _, kind in pairs}
        lowered = lowered or not kinds.isdisjoint(COMM_KINDS)
        split = split or _I in kinds or _W in kinds
        before = len(position)
        position.update(zip(program, range(len(program)), strict=True))
        if len(position) - before != len(program):
            _explain_duplicate(rank, program)
    return position, lowered, split


def _explain_bad_action(schedule: Schedule, rank: int, program: Sequence[Action]) -> None:
    """Raise for the first action of ``program`` that is malformed on its own."""
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


def _check_complete(schedule: Schedule, position: dict[Action, int], split: bool) -> None:
    """Every (stage, microbatch) has F and B, or F, I and W, each in a valid order.

    ``split``: whether the schedule has any I or W; without them the common case
    (F then B) is two lookups per pair."""
    get = position.get
    for stage, rank in enumerate(schedule.placement):
        for microbatch in range(schedule.microbatches):
            at_forward = get((stage, _F, microbatch))
            at_b = get((stage, _B, microbatch))
            if not split and at_forward is not None and at_b is not None and at_forward < at_b:
                continue
            _check_pair(get, stage, rank, microbatch)


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


def _check_transfers(schedule: Schedule, position: dict[Action, int]) -> None:
    """Each cross-rank dependency has SEND after its producer and RECV before its consumer.

    The loop looks up plain tuples (equal to Actions, and much cheaper to build) and only
    hands a boundary to ``_check_transfer`` for the message when something is off."""
    placement = schedule.placement
    get = position.get
    for stage in range(schedule.num_stages - 1):
        if placement[stage] == placement[stage + 1]:
            continue
        above = stage + 1
        for microbatch in range(schedule.microbatches):
            at_send = get((stage, _SEND_F, microbatch))
            at_recv = get((above, _RECV_F, microbatch))
            if (at_send is None or at_recv is None or at_send < get((stage, _F, microbatch))
                    or at_recv > get((above, _F, microbatch))):
                _check_transfer(
                    placement, get, Action(stage, _F, microbatch), Action(above, _F, microbatch), _SEND_F, _RECV_F
                )
            at_send = get((above, _SEND_B, microbatch))
            at_recv = get((stage, _RECV_B, microbatch))
            at_producer = get((above, _B, microbatch))
            if at_producer is None:
                at_producer = get((above, _I, microbatch))
            at_consumer = get((stage, _B, microbatch))
            if at_consumer is None:
                at_consumer = get((stage, _I, microbatch))
            if at_send is None or at_recv is None or at_send < at_producer or at_recv > at_consumer:
                later = _backward_of(get, above, microbatch)
                earlier = _backward_of(get, stage, microbatch)
                _check_transfer(placement, get, later, earlier, _SEND_B, _RECV_B)


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


def _check_deadlock(schedule: Schedule, position: dict[Action, int]) -> None:
    """Run every rank of a compute-only schedule as far as its inputs allow; ranks left
    unfinished are deadlocked. A cross-rank dependency blocks directly on the producer
    (lowered schedules are walked by ``schedules.p2p.check_progress`` instead, under the
    P2P semantics they will run with). Same-stage order (F before B, I before W) was
    checked already, so only waits on the neighbouring stage's F or B/I remain."""
    programs = schedule.programs
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    counters = [0] * schedule.pp  # counters[r]: how many of rank r's actions have run
    blocked_on: dict[int, Action] = {}
    waiters: dict[tuple, list[int]] = {}
    runnable = list(range(schedule.pp))
    while runnable:
        rank = runnable.pop()
        program = programs[rank]
        index = counters[rank]
        end = len(program)
        while index < end:
            stage, kind, microbatch = action = program[index]
            needed = None
            if kind == _F:
                if stage > 0:
                    needed = (stage - 1, _F, microbatch)
            elif kind == _B or kind == _I:
                if stage < last_stage:
                    needed = (stage + 1, _B, microbatch)
                    if needed not in position:
                        needed = (stage + 1, _I, microbatch)
            if needed is not None:
                owner = placement[needed[0]]
                at = position[needed]
                if (at > index) if owner == rank else (counters[owner] <= at):
                    blocked_on[rank] = Action(*needed)
                    waiters.setdefault(needed, []).append(rank)
                    break
            index += 1
            if waiters and action in waiters:
                runnable.extend(waiters.pop(action))
        counters[rank] = index
    stuck = [rank for rank in range(schedule.pp) if counters[rank] < len(programs[rank])]
    if stuck:
        _explain_deadlock(schedule, counters, blocked_on, stuck[0])


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
