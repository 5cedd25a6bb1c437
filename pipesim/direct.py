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

The rules are the process engine's (``pipesim.engine``, ``kernel="simpy"``), which
this is tested against on random schedules, costs, clusters and placements
(``tests/test_engine_fast.py``); what differs is the work per action: a heap entry per
group instead of a handful of events, resumed generators and store operations, which
makes the rendezvous step about twice as fast. Groups that start at the same moment
start in rank order in both engines (the process engine gives their start events a
priority after everything else of that moment), so when their transfers cross one link
the same one goes first, whatever order the moments were discovered in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from heapq import heappop, heappush

from schedules.action import COMPUTE_KINDS, SEND_KINDS, ActionKind
from schedules.trace import TraceEvent

# The SEND that feeds each RECV kind: (stage offset, SEND kind).
_MATCHING_SEND = {ActionKind.RECV_F: (-1, ActionKind.SEND_F), ActionKind.RECV_B: (1, ActionKind.SEND_B)}
_RECV_OF = {ActionKind.F: ActionKind.RECV_F, ActionKind.B: ActionKind.RECV_B, ActionKind.I: ActionKind.RECV_B}


class UnknownActionError(ValueError):
    """A program holds an action that is neither compute nor a P2P transfer."""


class _Group:
    """One posted P2P group: its transfers still to arrive, its start, its completion."""

    __slots__ = ("rank", "actions", "posted", "start", "outstanding", "latest", "done")

    def __init__(self, rank: int, actions: tuple, posted: float) -> None:
        self.rank = rank
        self.actions = actions
        self.posted = posted
        self.start = 0.0
        self.outstanding = 0
        self.latest = 0.0  # the latest arrival so far
        self.done: float | None = None  # the completion moment, once known


def run_rendezvous(
    all_items: Sequence[list],
    durations: dict,
    paired: dict,
    tp_seconds: dict,
    comm_overhead: float,
    arrival_of: Callable[[int, str, int, float], float],
    record: Callable[[TraceEvent], None],
    tp_records: list,
) -> list[tuple[int, int]]:
    """Run every rank's lowered program (``Schedule.program_items``) under rendezvous
    semantics, recording Trace events with ``record`` and tp collectives in
    ``tp_records`` as the process engine does. ``arrival_of(stage, kind, sender, now)``
    reserves a send's links at ``now`` and returns its arrival. Returns (rank, item
    index) of every rank that can never finish (empty unless the programs deadlock)."""
    ranks = len(all_items)
    new_event = tuple.__new__
    compute_kinds, send_kinds = COMPUTE_KINDS, SEND_KINDS
    starts: list = []  # heap of (start moment, rank, group)
    queues: list[deque] = [deque() for _ in range(ranks)]  # posted groups not started, per stream
    stream_busy = [False] * ranks  # a group of the stream has started and not completed
    stream_free = [0.0] * ranks  # when the stream's last group completed
    offers: dict[tuple, tuple] = {}  # transfer -> (group, action) of the side that started first
    # per rank: where it stands (item index, clock), the receives posted and not yet waited
    # for (action -> group), its last group, and the group it waits for
    position = [0] * ranks
    clocks = [0.0] * ranks
    awaiting: list[dict] = [{} for _ in range(ranks)]
    last_group: list[_Group | None] = [None] * ranks
    blocked_on: list[_Group | None] = [None] * ranks
    finished = [False] * ranks

    def schedule_next(rank: int) -> None:
        """Start the stream's next posted group once the previous one has completed."""
        queue = queues[rank]
        if not queue:
            stream_busy[rank] = False
            return
        group = queue.popleft()
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
        items = all_items[rank]
        index, clock = position[rank], clocks[rank]
        waiting = awaiting[rank]
        count = len(items)
        while index < count:
            item = items[index]
            if type(item) is not tuple:
                stage, kind, microbatch = item
                if kind not in compute_kinds:
                    raise UnknownActionError(f"rank {rank}: cannot simulate action {item} (unknown kind {kind!r})")
                if waiting:
                    needed = (stage, _RECV_OF.get(kind), microbatch)
                    group = waiting.get(needed)
                    if group is not None:
                        if group.done is None:
                            position[rank], clocks[rank] = index, clock
                            blocked_on[rank] = group
                            return
                        del waiting[needed]
                        start = clock
                        if group.done > clock:
                            clock = group.done
                        record(TraceEvent(rank, f"{stage}{needed[1]}{microbatch}", needed[1], stage, microbatch,
                                          start, clock, "recv"))
                end = clock + (paired[item] if paired and item in paired else durations[stage, kind])
                record(new_event(TraceEvent, (rank, f"{stage}{kind}{microbatch}", kind, stage, microbatch, clock, end,
                                              "compute")))
                clock = end
                if tp_seconds:
                    collectives = tp_seconds.get((stage, kind))
                    if collectives:
                        tp_records.append((rank, item, clock, clock + collectives))
                        clock += collectives
                index += 1
                continue
            clock += comm_overhead * len(item)
            group = _Group(rank, item, clock)
            queues[rank].append(group)
            last_group[rank] = group
            for action in item:
                if action[1] not in send_kinds:
                    waiting[action] = group
            if not stream_busy[rank]:
                schedule_next(rank)
            index += 1
        position[rank], clocks[rank] = index, clock
        group = last_group[rank]
        if group is not None and group.done is None:
            blocked_on[rank] = group  # the step cannot end before the rank's last transfers
            return
        _finish(rank)

    def _finish(rank: int) -> None:
        items = all_items[rank]
        clock = clocks[rank]
        group = last_group[rank]
        if group is not None and group.done > clock:
            stage, kind, microbatch = items[-1][-1] if type(items[-1]) is tuple else items[-1]
            record(TraceEvent(rank, f"{stage}{kind}{microbatch}", kind, stage, microbatch, clock, group.done, "wait"))
            clocks[rank] = group.done
        finished[rank] = True

    def begin(group: _Group) -> None:
        """The group starts: pair each transfer with a peer group that already started."""
        start = group.start
        for action in group.actions:
            stage, kind, microbatch = action
            if kind in send_kinds:
                transfer = (stage, kind, microbatch)
            else:
                offset, sender_kind = _MATCHING_SEND[kind]
                transfer = (stage + offset, sender_kind, microbatch)
            peer = offers.pop(transfer, None)
            if peer is None:
                offers[transfer] = (group, action)
                group.outstanding += 1
                continue
            peer_group, peer_action = peer
            if kind in send_kinds:
                send, sender, sent_at = action, group.rank, group.posted
            else:
                send, sender, sent_at = peer_action, peer_group.rank, peer_group.posted
            send_stage, send_kind, send_microbatch = send
            arrival = arrival_of(send_stage, send_kind, sender, start)
            record(new_event(TraceEvent, (sender, f"{send_stage}{send_kind}{send_microbatch}", send_kind, send_stage,
                                          send_microbatch, sent_at, arrival, "send")))
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
    for rank in range(ranks):  # ranks that waited for their last group, now complete
        if not finished[rank] and blocked_on[rank] is None and position[rank] >= len(all_items[rank]):
            _finish(rank)
    return [(rank, min(position[rank], len(all_items[rank]) - 1)) for rank in range(ranks) if not finished[rank]]


