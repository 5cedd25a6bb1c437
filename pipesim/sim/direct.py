"""The rendezvous (NCCL) step computed directly, without processes or an event kernel.

Under rendezvous semantics everything about a step follows from dependencies except
one thing: the order in which transfers reserve a link that several of them cross,
which is the order of the moments they leave. So only those moments need a clock.
Here each rank runs through its program as far as what it knows allows (compute
actions, posting P2P groups, a receive whose group has completed) and stops where it
needs a group that has not completed; the one queue holds the moments at which
communication groups *start*, and is worked through in time order. Starting a group
pairs its transfers with the peers' groups that have already started (the later side
starts the transfer, at its own start, reserving the links then), and a group whose
transfers have all arrived completes, which lets its stream start the next group and
lets a rank waiting for it carry on. A completion is never earlier than the moment
that caused it, so nothing is ever scheduled in the past and links are reserved in
true time order, as in the process engine.

The rules are the process engine's (``pipesim.sim.engine``, ``kernel="simpy"``), which
this is tested against on random schedules, costs, clusters and placements
(``tests/test_engine_fast.py``); what differs is the work per action: a heap entry per
group instead of a handful of events, resumed generators and store operations, which
makes the rendezvous step about twice as fast. Groups that start at the same moment
start in rank order in both engines (the process engine gives their start events a
priority after everything else of that moment), so when their transfers cross one link
the same one goes first, whatever order the moments were discovered in.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from heapq import heappop, heappush

from schedules.action import SEND_KINDS, ActionKind
from schedules.schedule import Schedule
from schedules.trace import TraceEvent

try:  # the same engine's inner loop in C, built by setup.py where a compiler is found
    from pipesim import _rendezvous as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

# Whether ``run_rendezvous`` runs the C inner loop by default: built, and not switched
# off with PIPESIM_PURE_PYTHON=1 (to compare, or to debug in Python).
ACCELERATED = _native is not None and os.environ.get("PIPESIM_PURE_PYTHON", "") in ("", "0")

# The receive a compute kind may need from another rank.
RECEIVE_OF = {ActionKind.F: ActionKind.RECV_F, ActionKind.B: ActionKind.RECV_B, ActionKind.I: ActionKind.RECV_B}


class UnknownActionError(ValueError):
    """A program holds an action that is neither compute nor a P2P transfer."""


class _Group:
    """One posted P2P group: its transfers still to arrive, its start, its completion."""

    __slots__ = ("rank", "transfers", "posted", "start", "outstanding", "latest", "done")

    def __init__(self, rank: int, transfers: tuple, posted: float) -> None:
        self.rank = rank
        self.transfers = transfers
        self.posted = posted
        self.start = 0.0
        self.outstanding = 0
        self.latest = 0.0  # the latest arrival so far
        self.done: float | None = None  # the completion moment, once known


# What a compiled program entry is: a compute action or a P2P group.
_COMPUTE, _GROUP = 0, 1
# The compute kinds a stage has a cost for, in the order of their cost slots.
_COST_KINDS = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
# Every kind, in the order the C compile reads them.
_KINDS = (*_COST_KINDS, ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)
# The send kinds, in the order of their wire slots (``stage * 2 + position``).
_WIRE_KINDS = (ActionKind.SEND_F, ActionKind.SEND_B)


def compiled_programs(schedule: Schedule) -> tuple[tuple[tuple, ...], ...]:
    """Each rank's program as the direct engine walks it, with everything that follows
    from the schedule alone worked out once (and kept with the schedule, see
    ``Schedule.derived``): the Trace text of every action, and for each compute action
    which earlier group holds the receive it needs.

    Compute: ``(_COMPUTE, action, stage, kind, microbatch, text, group ordinal or -1,
    receive kind, receive text, cost slot)``, the slot indexing per-run cost lists
    (``stage * 4 + position of the kind in _COST_KINDS``, -1 for a kind with no cost).
    Group: ``(_GROUP, ordinal, size, transfers)`` with one ``(transfer, is_send, stage,
    kind, microbatch, text, wire)`` per action, ``transfer`` a number both ends of the
    transfer share (0, 1, ... over the schedule), ``wire`` the slot of its SEND's route
    (``wire_slots``)."""
    return schedule.derived("direct_programs", _compile)[0]


def _compile(schedule: Schedule) -> tuple[tuple[tuple[tuple, ...], ...], int]:
    """The compiled programs (see ``compiled_programs``) and how many transfers they number
    (in C where it is built: the same tuples, tested equal)."""
    if ACCELERATED:  # None: an action outside the schedule's stages or microbatches, Python decides
        compiled = _native.compile(schedule.programs, tuple(schedule.joins), schedule.num_stages,
                                   schedule.microbatches, _KINDS)
        if compiled is not None:
            return compiled
    return _compile_in_python(schedule)


def _compile_in_python(schedule: Schedule) -> tuple[tuple[tuple[tuple, ...], ...], int]:
    programs = []
    numbers: dict[tuple, int] = {}  # SEND -> its number, shared by both ends of the transfer
    for rank in range(schedule.pp):
        entries: list[tuple] = []
        posted: dict[tuple, int] = {}  # receive action -> ordinal of the group that posts it
        ordinal = 0
        for item in schedule.program_items(rank):
            if type(item) is not tuple:
                stage, kind, microbatch = item
                receive_kind = RECEIVE_OF.get(kind)
                needed = (stage, receive_kind, microbatch)
                source = posted.pop(needed, -1)
                slot = stage * len(_COST_KINDS) + _COST_KINDS.index(kind) if kind in _COST_KINDS else -1
                entries.append((_COMPUTE, item, stage, kind, microbatch, f"{stage}{kind}{microbatch}", source,
                                receive_kind, f"{stage}{receive_kind}{microbatch}", slot))
                continue
            transfers = []
            for action in item:
                stage, kind, microbatch = action
                is_send = kind in SEND_KINDS
                send = action if is_send else action.matching()  # both ends name the SEND
                number = numbers.setdefault(send, len(numbers))
                if not is_send:
                    posted[action] = ordinal
                wire = send[0] * len(_WIRE_KINDS) + _WIRE_KINDS.index(send[1])
                transfers.append((number, is_send, stage, kind, microbatch, f"{stage}{kind}{microbatch}", wire))
            entries.append((_GROUP, ordinal, len(item), tuple(transfers)))
            ordinal += 1
        programs.append(tuple(entries))
    return tuple(programs), len(numbers)


def wire_slots(wires: dict[tuple[int, str], tuple[tuple, float, float]],
               num_stages: int) -> tuple[list[tuple[tuple[int, ...], float, float] | None], int]:
    """The routes of ``wires`` ((stage, SEND kind) -> (links, seconds, latency)) by wire
    slot (``stage * 2 + position of the kind``), their links numbered 0, 1, ...; and how
    many links there are. What the C loop reads instead of the dict of link names."""
    numbers: dict = {}
    slots: list = [None] * (num_stages * len(_WIRE_KINDS))
    for (stage, kind), (links, seconds, latency) in wires.items():
        slots[stage * len(_WIRE_KINDS) + _WIRE_KINDS.index(kind)] = (
            tuple(numbers.setdefault(link, len(numbers)) for link in links), float(seconds), float(latency))
    return slots, len(numbers)


def run_rendezvous(
    schedule: Schedule,
    durations: dict,
    paired: dict,
    tp_seconds: dict,
    comm_overhead: float,
    arrival_of: Callable[[int, str, int, float], float],
    events: list[TraceEvent],
    tp_events: list[TraceEvent],
    wires: dict[tuple[int, str], tuple[tuple, float, float]] | None = None,
    tp_kind: str = "TP",
) -> list[tuple[int, int]]:
    """Run every rank's lowered program (``Schedule.program_items``) under rendezvous
    semantics, appending Trace events to ``events`` and each compute action's tp
    collectives as an event to ``tp_events`` (``{tp_kind}({action})``, stream ``tp``).
    ``arrival_of(stage, kind, sender, now)`` reserves a send's links at ``now`` and
    returns its arrival; ``wires`` (the route's links, seconds and latency of every
    (stage, SEND kind), when the transfers reserve their links one after another and
    nothing else) lets the C loop reserve them itself instead of calling back. The C loop
    runs where ``ACCELERATED`` says. Returns (rank, item index) of every rank that can
    never finish (empty unless the programs deadlock)."""
    programs, transfer_count = schedule.derived("direct_programs", _compile)
    ranks = len(programs)
    # seconds and tp seconds by cost slot (see ``compiled_programs``): list lookups per action
    slot_seconds = [durations.get((stage, kind)) for stage in range(schedule.num_stages) for kind in _COST_KINDS]
    slot_tp = [tp_seconds.get((stage, kind), 0.0) for stage in range(schedule.num_stages) for kind in _COST_KINDS]
    if ACCELERATED:
        table, link_count = wire_slots(wires, schedule.num_stages) if wires is not None else (None, 0)
        return _native.run(programs, transfer_count, slot_seconds, slot_tp, dict(paired), float(comm_overhead),
                           table, link_count, arrival_of, events, tp_events, TraceEvent, UnknownActionError,
                           tp_kind)
    record = events.append
    new_event, event_type = tuple.__new__, TraceEvent  # locals: looked up once per event otherwise
    starts: list = []  # heap of (start moment, rank, group)
    # per stream: the next of its posted groups to start (they start in posting order), and
    # whether one has started and not completed
    next_start = [0] * ranks
    stream_busy = [False] * ranks
    stream_free = [0.0] * ranks  # when the stream's last group completed
    # transfer number -> (group, transfer entry) of the side that started first
    offers: list[tuple | None] = [None] * transfer_count
    # per rank: where it stands (entry index, clock), the groups it posted (by ordinal; the
    # step cannot end before the last one completes), and the group it waits for
    position = [0] * ranks
    clocks = [0.0] * ranks
    posted_groups: list[list[_Group]] = [[] for _ in range(ranks)]
    blocked_on: list[_Group | None] = [None] * ranks
    finished = [False] * ranks

    def schedule_next(rank: int) -> None:
        """Start the stream's next posted group once the previous one has completed."""
        groups = posted_groups[rank]
        index = next_start[rank]
        if index == len(groups):
            stream_busy[rank] = False
            return
        group = groups[index]
        next_start[rank] = index + 1
        stream_busy[rank] = True
        group.start = group.posted if group.posted > stream_free[rank] else stream_free[rank]
        # (moment, rank): a stream has one group waiting to start at most, and groups that
        # start at one moment start in rank order, as in the process engine
        heappush(starts, (group.start, rank, group))

    def complete(group: _Group) -> None:
        done = group.start if group.start > group.latest else group.latest
        group.done = done
        rank = group.rank
        stream_free[rank] = done
        schedule_next(rank)
        if blocked_on[rank] is group:
            blocked_on[rank] = None
            advance(rank)

    def advance(rank: int) -> None:
        """Run rank ``rank`` until it needs a group that has not completed, or to its end."""
        entries = programs[rank]
        index, clock = position[rank], clocks[rank]
        groups = posted_groups[rank]
        count = len(entries)
        while index < count:
            entry = entries[index]
            if not entry[0]:  # _COMPUTE
                _, item, stage, kind, microbatch, text, source, receive_kind, receive_text, slot = entry
                if source >= 0:
                    done = groups[source].done
                    if done is None:
                        position[rank], clocks[rank] = index, clock
                        blocked_on[rank] = groups[source]
                        return
                    start = clock
                    if done > clock:
                        clock = done
                    record(new_event(event_type, (rank, receive_text, receive_kind, stage, microbatch, start, clock,
                                                  "recv")))
                if paired and item in paired:
                    end = clock + paired[item]
                else:
                    seconds = slot_seconds[slot] if slot >= 0 else None
                    if seconds is None:  # not a compute kind: the only check, on the way out
                        raise UnknownActionError(f"rank {rank}: cannot simulate action {item} (unknown kind {kind!r})")
                    end = clock + seconds
                record(new_event(event_type, (rank, text, kind, stage, microbatch, clock, end, "compute")))
                clock = end
                if tp_seconds:
                    collectives = slot_tp[slot]
                    if collectives:
                        tp_events.append(new_event(event_type, (rank, f"{tp_kind}({text})", tp_kind, stage, microbatch,
                                                                clock, clock + collectives, "tp")))
                        clock += collectives
                index += 1
                continue
            clock += comm_overhead * entry[2]
            group = _Group(rank, entry[3], clock)
            groups.append(group)
            if not stream_busy[rank]:
                schedule_next(rank)
            index += 1
        position[rank], clocks[rank] = index, clock
        if groups and groups[-1].done is None:
            blocked_on[rank] = groups[-1]  # the step cannot end before the rank's last transfers
            return
        _finish(rank)

    def _finish(rank: int) -> None:
        clock = clocks[rank]
        groups = posted_groups[rank]
        if groups and groups[-1].done > clock:
            last = programs[rank][-1]
            stage, kind, microbatch, text = last[3][-1][2:6] if last[0] == _GROUP else last[2:6]
            record(TraceEvent(rank, text, kind, stage, microbatch, clock, groups[-1].done, "wait"))
            clocks[rank] = groups[-1].done
        finished[rank] = True

    def begin(group: _Group) -> None:
        """The group starts: pair each transfer with a peer group that already started."""
        start = group.start
        for entry in group.transfers:
            transfer = entry[0]
            peer = offers[transfer]
            if peer is None:
                offers[transfer] = (group, entry)
                group.outstanding += 1
                continue
            peer_group, peer_entry = peer
            if entry[1]:
                sender, sent_at, send = group.rank, group.posted, entry
            else:
                sender, sent_at, send = peer_group.rank, peer_group.posted, peer_entry
            _, _, send_stage, send_kind, send_microbatch, send_text, _ = send
            arrival = arrival_of(send_stage, send_kind, sender, start)
            record(new_event(event_type, (sender, send_text, send_kind, send_stage, send_microbatch, sent_at, arrival,
                                          "send")))
            if arrival > group.latest:
                group.latest = arrival
            if arrival > peer_group.latest:
                peer_group.latest = arrival
            peer_group.outstanding -= 1
            if peer_group.outstanding == 0:
                complete(peer_group)
        if group.outstanding == 0:
            complete(group)

    for rank in range(ranks):
        advance(rank)
    while starts:
        _, _, group = heappop(starts)
        begin(group)
    return [(rank, min(position[rank], len(programs[rank]) - 1)) for rank in range(ranks) if not finished[rank]]


