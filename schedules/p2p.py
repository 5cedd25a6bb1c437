"""Point-to-point semantics, named: what a P2P group waits for, and the checks that a
lowered schedule cannot hang under them.

- ``rendezvous`` (NCCL): between a pair of ranks, operations match in the order they
  are posted, and a send may wait until its receive is posted. A rank's groups run one
  after another on its communication stream: a group starts once it is posted and the
  previous group has completed, and completes once every peer's group holding a
  matching operation has started. Posting does not block the host: it waits for a
  group right before the compute action that consumes one of its receives.
- ``buffered`` (gloo): transfers match by tag and a send never waits; a receive blocks
  until its send has been posted.

A schedule that runs under rendezvous runs under buffered too, not the other way round:
gloo hides orders that hang on GPUs, so a schedule is checked under the semantics of the
backend it will run on before any process starts.
"""

from __future__ import annotations

from collections.abc import Sequence

from schedules.action import SEND_KINDS, Action, ActionKind, format_group
from schedules.schedule import Schedule

RENDEZVOUS = "rendezvous"
BUFFERED = "buffered"
P2P_SEMANTICS = (RENDEZVOUS, BUFFERED)

_F, _B, _I = ActionKind.F, ActionKind.B, ActionKind.I


class P2PError(ValueError):
    """A lowered schedule that mismatches or hangs under a P2P semantics. Raised as a
    ``ScheduleValidationError`` by ``validate``; this base keeps the module free of it."""

    def __init__(self, message: str, action: Action, rank: int, position: int, cycle: Sequence[Action] = ()) -> None:
        super().__init__(message)
        self.action, self.rank, self.position, self.cycle = action, rank, position, tuple(cycle)


def default_semantics(backend: str) -> str:
    """The semantics of a torch.distributed backend: NCCL's rendezvous for ``nccl``
    (and any GPU backend), gloo's buffered matching for ``gloo``."""
    return BUFFERED if backend == "gloo" else RENDEZVOUS


def require_semantics(p2p: str) -> str:
    """``p2p`` if it names a semantics; a clear error otherwise."""
    if p2p not in P2P_SEMANTICS:
        raise ValueError(f"unknown P2P semantics {p2p!r}; choose one of: {', '.join(P2P_SEMANTICS)}")
    return p2p


# (kind) -> (offset of the peer stage, kind of the matching action)
_PEER = {
    ActionKind.SEND_F: (1, ActionKind.RECV_F),
    ActionKind.RECV_F: (-1, ActionKind.SEND_F),
    ActionKind.SEND_B: (-1, ActionKind.RECV_B),
    ActionKind.RECV_B: (1, ActionKind.SEND_B),
}


def check_pair_order(schedule: Schedule) -> None:
    """Under rendezvous, the k-th send from rank r to rank r' must be the transfer of the
    k-th receive on r' from r: NCCL pairs them by position, not by what they carry.
    Raise naming both actions of the first pair that disagrees."""
    placement = schedule.placement
    peer_of = _PEER
    sends: dict[tuple[int, int], list[tuple]] = {}
    recvs: dict[tuple[int, int], list[tuple]] = {}
    for rank, program in enumerate(schedule.programs):
        for action in program:
            kind = action[1]
            if kind in peer_of:
                offset, matching = peer_of[kind]
                peer_stage = action[0] + offset
                if kind in SEND_KINDS:
                    sends.setdefault((rank, placement[peer_stage]), []).append((peer_stage, matching, action[2]))
                else:
                    recvs.setdefault((placement[peer_stage], rank), []).append(action)
    for pair, expected in sends.items():
        received = recvs.get(pair, [])
        if expected != received[: len(expected)]:
            _explain_pair_order(schedule, pair, expected, received)


def _explain_pair_order(schedule: Schedule, pair: tuple[int, int], expected: list, received: list) -> None:
    sender, receiver = pair
    for index, (wanted, recv) in enumerate(zip(expected, received, strict=False)):
        if wanted == recv:
            continue
        send = Action(*wanted).matching()
        recv = Action(*recv)
        at_send = schedule.programs[sender].index(send)
        at_recv = schedule.programs[receiver].index(recv)
        raise P2PError(
            f"rank {sender}, position {at_send}: {send} is rank {sender}'s send number {index + 1} to rank "
            f"{receiver}, but rank {receiver}'s receive number {index + 1} from rank {sender} is {recv} "
            f"(position {at_recv}); NCCL pairs a rank pair's transfers in posting order, so {send} would "
            f"fill {recv}'s buffer. Post {send.matching()} in that place on rank {receiver}, or reorder "
            f"rank {sender}'s sends",
            action=send, rank=sender, position=at_send,
        )
    # More sends than receives: the transfer check names the send without a receive.


def check_progress(schedule: Schedule, semantics: str) -> None:
    """Walk every rank's items (compute actions and P2P groups) as the runtime does,
    each as far as the semantics lets it, and raise naming the cycle if some rank can
    never finish. The schedule is lowered and already passed the action, completeness
    and transfer checks, so every cross-rank input arrives through a RECV."""
    rendezvous = require_semantics(semantics) == RENDEZVOUS
    items = [schedule.program_items(rank) for rank in range(schedule.pp)]
    if rendezvous:
        _progress_on_streams(schedule, items)
        return
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    peer_of = _PEER
    # Per rank and item: the matching actions the item waits for (a group), or the
    # same-rank action it consumes directly (a compute action of a V-shaped placement).
    needs: list[list] = []
    item_of: dict[tuple, tuple[int, int]] = {}  # comm action -> (rank, item index)
    local_position: dict[Action, int] = {}  # compute action -> item index
    for rank, rank_items in enumerate(items):
        rank_needs = []
        for index, item in enumerate(rank_items):
            if type(item) is tuple:
                waits = []
                for action in item:
                    item_of[action] = (rank, index)
                    stage, kind, microbatch = action
                    if kind not in SEND_KINDS:
                        offset, matching = peer_of[kind]
                        waits.append((stage + offset, matching, microbatch))
                rank_needs.append(waits)
            else:
                rank_needs.append(None)
                local_position[item] = index
        needs.append(rank_needs)
    counters = [0] * schedule.pp  # items of rank r fully done
    posted = [False] * schedule.pp  # whether rank r has posted the group it stands at
    blocked_on: dict[int, Action] = {}
    waiters: dict[tuple, list[int]] = {}
    runnable = list(range(schedule.pp))
    while runnable:
        rank = runnable.pop()
        rank_items, rank_needs = items[rank], needs[rank]
        index = counters[rank]
        end = len(rank_items)
        while index < end:
            waits = rank_needs[index]
            needed = None
            if waits is not None:
                if not posted[rank]:
                    posted[rank] = True
                    if waiters:
                        for action in rank_items[index]:
                            woken = waiters.pop(action, None)
                            if woken:
                                runnable.extend(woken)
                for match in waits:
                    owner, at = item_of[match]
                    if counters[owner] < at or (counters[owner] == at and not posted[owner]):
                        needed = match
                        break
            else:
                same_rank = _same_rank_input(rank_items[index], placement, last_stage, local_position)
                if same_rank is not None and local_position[same_rank] > index:
                    needed = same_rank
            if needed is not None:
                blocked_on[rank] = Action(*needed)
                waiters.setdefault(needed, []).append(rank)
                break
            index += 1
            posted[rank] = False
            counters[rank] = index
    stuck = [rank for rank in range(schedule.pp) if counters[rank] < len(items[rank])]
    if stuck:
        where = {**item_of, **{action: (placement[action[0]], at) for action, at in local_position.items()}}
        _explain(schedule, items, [_item_starts(rank_items) for rank_items in items], counters, blocked_on,
                 where, stuck[0])


def _progress_on_streams(schedule: Schedule, items: list[list]) -> None:
    """The rendezvous walk. Each rank posts its groups, in program order, onto one
    communication stream, where they run one after another (NCCL's P2P kernels of one
    communicator are serialised). A group *starts* once the host has posted it and the
    rank's previous group has completed; it *completes* once every peer's group holding
    a matching operation has started. Posting never blocks the host: it waits for a
    group only right before a compute action whose input one of the group's receives
    brings (and for every group at the end of the step)."""
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    group_items: list[list[int]] = []  # per rank: the item index of each of its groups
    matches: list[list[list[tuple]]] = []  # per rank and group: the matching actions it waits for
    group_of: dict[tuple, tuple[int, int]] = {}  # comm action -> (rank, group number)
    local_position: dict[Action, int] = {}
    for rank, rank_items in enumerate(items):
        indices, waits = [], []
        for index, item in enumerate(rank_items):
            if type(item) is tuple:
                number = len(indices)
                indices.append(index)
                group_waits = []
                for action in item:
                    group_of[action] = (rank, number)
                    offset, matching = _PEER[action[1]]
                    group_waits.append((action[0] + offset, matching, action[2]))
                waits.append(group_waits)
            else:
                local_position[item] = index
        group_items.append(indices)
        matches.append(waits)
    done = [0] * schedule.pp  # groups completed on rank r's stream
    host = [0] * schedule.pp  # the host's item index on rank r (a group there is posted)
    watchers: list[set[int]] = [set() for _ in range(schedule.pp)]
    stream_wait: dict[int, tuple] = {}  # rank -> the matching action its stream waits for
    host_wait: dict[int, tuple] = {}  # rank -> the same-rank action its host waits for

    def started(rank: int, number: int) -> bool:
        return done[rank] > number or (done[rank] == number and host[rank] >= group_items[rank][number])

    runnable = list(range(schedule.pp))
    while runnable:
        rank = runnable.pop()
        moved = True
        progressed = False
        while moved:
            moved = False
            groups, rank_matches = group_items[rank], matches[rank]
            while done[rank] < len(groups) and host[rank] >= groups[done[rank]]:
                blocker = None
                for match in rank_matches[done[rank]]:
                    owner, number = group_of[match]
                    if not started(owner, number):
                        blocker = match
                        watchers[owner].add(rank)
                        break
                if blocker is not None:
                    stream_wait[rank] = blocker
                    break
                stream_wait.pop(rank, None)
                done[rank] += 1
                moved = progressed = True
            rank_items = items[rank]
            while host[rank] < len(rank_items):
                item = rank_items[host[rank]]
                if type(item) is not tuple:
                    receive = _receive_of(item, placement, last_stage)
                    if receive is not None:
                        number = group_of[receive][1]
                        if done[rank] <= number:
                            break  # the host waits for the group holding this action's input
                    same_rank = _same_rank_input(item, placement, last_stage, local_position)
                    if same_rank is not None and local_position[same_rank] > host[rank]:
                        host_wait[rank] = same_rank
                        break
                host[rank] += 1  # a group is posted and the host goes on
                moved = progressed = True
        if progressed:
            runnable.extend(watchers[rank])
            watchers[rank].clear()
    stuck = [rank for rank in range(schedule.pp)
             if host[rank] < len(items[rank]) or done[rank] < len(group_items[rank])]
    if stuck:
        _explain_streams(schedule, items, group_items, done, host, stream_wait, host_wait, group_of, stuck[0])


def _explain_streams(schedule, items, group_items, done, host, stream_wait, host_wait, group_of, start) -> None:
    """Follow "rank r's stream waits for rank r' to start a group" from ``start`` until a
    rank repeats, and raise naming each wait on that cycle."""
    placement = schedule.placement
    starts = [_item_starts(rank_items) for rank_items in items]

    def waits_for(rank: int) -> int:
        if rank in stream_wait:
            return group_of[stream_wait[rank]][0]
        return placement[host_wait[rank][0]]

    order: list[int] = []
    rank = start
    while rank not in order:
        order.append(rank)
        rank = waits_for(rank)
    cycle_ranks = order[order.index(rank):]
    clauses, cycle = [], []
    for rank in cycle_ranks:
        if rank not in stream_wait:
            needed = Action(*host_wait[rank])
            head = items[rank][host[rank]]
            cycle.extend((head, needed))
            clauses.append(f"rank {rank} waits at {head} (position {starts[rank][host[rank]]}) for {needed}, which "
                           f"comes later in its own program")
            continue
        needed = Action(*stream_wait[rank])
        group_index = group_items[rank][done[rank]]
        head = items[rank][group_index]
        owner, number = group_of[needed]
        owner_group = group_items[owner][number]
        cycle.extend((*head, needed))
        clause = (f"rank {rank}'s group {format_group(head)} (position {starts[rank][group_index]}) waits for rank "
                  f"{owner} to post {needed} (in {format_group(items[owner][owner_group])}, position "
                  f"{starts[owner][owner_group]}), ")
        if done[owner] < number and host[owner] >= group_items[owner][done[owner]]:
            earlier = group_items[owner][done[owner]]
            clause += (f"which cannot start before rank {owner}'s earlier group {format_group(items[owner][earlier])} "
                       f"(position {starts[owner][earlier]}) completes")
        else:
            at = min(host[owner], len(items[owner]) - 1)
            clause += (f"which rank {owner} only reaches after {_describe(items[owner][at])} "
                       f"(position {starts[owner][at]})")
        clauses.append(clause)
    first = cycle_ranks[0]
    raise P2PError(
        "deadlock under rendezvous semantics (NCCL: transfers of a rank pair match in posting order, a group "
        "completes only once each peer has posted the matching operations, and a rank's groups run one after "
        "another): " + "; ".join(clauses) + ". Post the transfers of each pair together (one group on each "
        "side), as lower() does",
        action=cycle[0], rank=first, position=starts[first][host[first] if host[first] < len(items[first]) else 0],
        cycle=cycle,
    )


def _receive_of(action: Action, placement: Sequence[int], last_stage: int) -> tuple | None:
    """The RECV that brings ``action`` its input from another rank, if any."""
    stage, kind, microbatch = action
    rank = placement[stage]
    if kind == _F and stage > 0 and placement[stage - 1] != rank:
        return (stage, ActionKind.RECV_F, microbatch)
    if (kind == _B or kind == _I) and stage < last_stage and placement[stage + 1] != rank:
        return (stage, ActionKind.RECV_B, microbatch)
    return None


def _same_rank_input(action: Action, placement: Sequence[int], last_stage: int, known) -> tuple | None:
    """The action of a neighbouring stage on the same rank that ``action`` consumes
    directly (no transfer), if any: stages that share a rank in a V-shaped placement."""
    stage, kind, microbatch = action
    rank = placement[stage]
    if kind == _F and stage > 0 and placement[stage - 1] == rank:
        return (stage - 1, _F, microbatch)
    if (kind == _B or kind == _I) and stage < last_stage and placement[stage + 1] == rank:
        full = (stage + 1, _B, microbatch)
        return full if full in known else (stage + 1, _I, microbatch)
    return None


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
