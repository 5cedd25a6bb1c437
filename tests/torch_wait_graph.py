"""An independent formulation of torch's runtime P2P rule, for tests: the waits of a flat
file as a graph over events (an action done, a transfer started), searched for a cycle.
The engine decides the same question by running the programs (``schedules.engine``,
semantics ``torch-runtime``); the two are compared on generated and shuffled orders."""

from __future__ import annotations

from schedules.action import COMM_KINDS, SEND_KINDS, Action, ActionKind
from schedules.schedule import Schedule

_F, _B, _I = ActionKind.F, ActionKind.B, ActionKind.I
_PEER_OFFSET = {ActionKind.SEND_F: 1, ActionKind.RECV_F: -1, ActionKind.SEND_B: -1, ActionKind.RECV_B: 1}
_START, _DONE = "start", "done"

Node = tuple[str, int, int]  # (start|done, rank, program position)


def wait_cycle(schedule: Schedule, per_peer: bool = True) -> list[Node]:
    """The nodes of one cycle of waits when ``schedule``'s lowered programs run with every
    transfer posted alone (empty: every action completes). ``per_peer``: a rank's
    transfers run on one stream per peer rank (torch's runtime on NCCL); otherwise on one
    stream per rank (pipesim's rendezvous semantics). The schedule must have passed
    ``validate(..., "buffered")`` and the pair-order check."""
    base = [0]
    for program in schedule.programs:
        base.append(base[-1] + len(program))
    waits = _wait_graph(schedule, per_peer, base)  # node -> the nodes it waits for
    pending = [len(before) for before in waits]
    followers: list[list[int]] = [[] for _ in waits]
    for node, before in enumerate(waits):
        for earlier in before:
            followers[earlier].append(node)
    ready = [node for node, count in enumerate(pending) if count == 0]
    while ready:
        node = ready.pop()
        for later in followers[node]:
            pending[later] -= 1
            if pending[later] == 0:
                ready.append(later)
    left = [node for node, count in enumerate(pending) if count > 0]
    if not left:
        return []
    # Every node left waits for another node left: follow such waits until one repeats.
    node = left[0]
    path: list[int] = []
    seen: dict[int, int] = {}
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(earlier for earlier in waits[node] if pending[earlier] > 0)
    ranks = len(schedule.programs)

    def named(node: int) -> Node:
        position = node // 2
        rank = next(rank for rank in range(ranks) if base[rank] <= position < base[rank + 1])
        return (_START if node % 2 else _DONE, rank, position - base[rank])

    return [named(node) for node in path[seen[node]:]]


def _wait_graph(schedule: Schedule, per_peer: bool, base: list[int]) -> list[list[int]]:
    """Each event and the events it waits for (all of them: there are no alternatives,
    so the step finishes exactly when this graph has no cycle). The action at
    ``position`` of ``rank`` is event ``2 * (base[rank] + position)`` when it is done and,
    for a transfer, ``+ 1`` when it has started."""
    placement = schedule.placement
    last_stage = schedule.num_stages - 1
    waits: list[list[int]] = [[] for _ in range(2 * base[-1])]
    sends: dict[tuple[int, int], list[int]] = {}  # (sender, receiver) -> the sends' events
    recvs: dict[tuple[int, int], list[int]] = {}  # (sender, receiver) -> the receives' events
    for rank, program in enumerate(schedule.programs):
        position = {action: at for at, action in enumerate(program)}
        first = base[rank]
        last_compute = -1  # event of the rank's last compute action so far
        stream_tail: dict[int, int] = {}  # stream (peer, or -1 for the rank's one) -> its last op's event
        for at, action in enumerate(program):
            done = 2 * (first + at)
            stage, kind, _ = action
            if kind in COMM_KINDS:
                peer = placement[stage + _PEER_OFFSET[kind]]
                stream = peer if per_peer else -1
                started = waits[done + 1]
                if last_compute >= 0:
                    started.append(last_compute)
                if stream in stream_tail:
                    started.append(stream_tail[stream])
                stream_tail[stream] = done
                waits[done].append(done + 1)  # and the peer's matching op, below
                if kind in SEND_KINDS:
                    sends.setdefault((rank, peer), []).append(done)
                else:
                    recvs.setdefault((peer, rank), []).append(done)
                continue
            if last_compute >= 0:
                waits[done].append(last_compute)
            receive = _receive_of(action, placement, last_stage)
            if receive is not None:
                waits[done].append(2 * (first + position[receive]))
            last_compute = done
    for pair, send_events in sends.items():
        for send, recv in zip(send_events, recvs.get(pair, ()), strict=False):
            waits[send].append(recv + 1)
            waits[recv].append(send + 1)
    return waits


def _receive_of(action: Action, placement, last_stage: int) -> Action | None:
    """The RECV that brings ``action`` its input from another rank, if any."""
    stage, kind, microbatch = action
    rank = placement[stage]
    if kind == _F and stage > 0 and placement[stage - 1] != rank:
        return Action(stage, ActionKind.RECV_F, microbatch)
    if kind in (_B, _I) and stage < last_stage and placement[stage + 1] != rank:
        return Action(stage, ActionKind.RECV_B, microbatch)
    return None
