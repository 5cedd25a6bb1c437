"""The SimPy engine: each rank is a process walking its lowered program, compute
actions and P2P groups as the executor posts them.

Compute actions hold the rank for their duration. A transfer reserves its route's
links first-come first-served and arrives ``latency + bytes / bandwidth`` after the
links are free. When it leaves, and what it holds, follows the P2P semantics of the
backend predicted: under rendezvous (NCCL) a rank's groups run in posting order on
its communication stream, a transfer leaves only once both ends' groups have started,
and the rank waits for a group that holds receives (``schedules.p2p``); under buffered
(gloo) a send leaves at once and a receive holds the rank until its data arrives. A
rank that ends its program while its last sends are still unmatched or in flight waits
for them (a ``wait`` event), as the step cannot end before its transfers do.

Events are recorded as the executor records them. A send's runs from the moment its
group was posted (its data was ready) to its arrival, however long it then waited for
its receive or for busy links; a receive's from the moment its group was posted to the
moment the rank can go on (under rendezvous, when its whole group has completed). The
posting cost (``comm_overhead``) is paid before either starts. Bubble and exposed
communication are told apart from those moments (``schedules.accounting``).

Transfers are scheduled directly from their arrival time instead
of as SimPy processes with resource requests, which keeps the engine several times
faster on the ~400k-action schedules of large pipelines (see benchmarks/).

Under rendezvous the default (``kernel="direct"``) computes the step without processes
(``pipesim.sim.direct``), with the same rules; the processes here stay as the reference it is
tested against and run every buffered step.

With a ``CommPlan`` (``pipesim.sim.parallel``) a compute action is followed by its
tensor-parallel collectives on a ``tp`` event, and the step ends with each stage's
data-parallel gradient all-reduce (``dp``) and the optimizer step (``step``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import simpy

from pipesim.cluster.topology import Topology
from pipesim.cluster.twins import boundary_rank_pairs
from pipesim.model.costs import Costs
from pipesim.sim import kernel as kernel_module
from pipesim.sim.direct import RECEIVE_OF, UnknownActionError, run_rendezvous
from pipesim.sim.parallel import TP_KIND, CommPlan, step_tail_events
from schedules.action import COMPUTE_KINDS, SEND_KINDS, Action, ActionKind, format_group
from schedules.collector import collector_paused
from schedules.lowering import lower
from schedules.p2p import RENDEZVOUS, require_semantics
from schedules.schedule import Schedule
from schedules.trace import Trace, TraceEvent

_KERNELS = {"fast": kernel_module, "simpy": simpy}
KERNELS = ("direct", *_KERNELS)

# The SEND that feeds each RECV kind: (stage offset, SEND kind).
MATCHING_SEND = {ActionKind.RECV_F: (-1, ActionKind.SEND_F), ActionKind.RECV_B: (1, ActionKind.SEND_B)}


# Priority of a P2P group's start among the events of its moment, plus the rank: after
# SimPy's URGENT (0) and NORMAL (1) events, in rank order.
GROUP_START_PRIORITY = 2


class _SimpyGroupStart(simpy.events.Event):
    """SimPy's ``Timeout`` with a priority of its own (SimPy gives timeouts NORMAL)."""

    def __init__(self, env: simpy.Environment, delay: float, priority: int) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, priority, delay)


def start_at(env, delay: float, priority: int):
    """A timeout of ``delay`` at ``priority`` on either kernel."""
    if isinstance(env, kernel_module.Environment):
        return env.timeout(delay, None, priority)
    return _SimpyGroupStart(env, delay, priority)


class SimulationError(RuntimeError):
    """The programs could not run to completion (a deadlock the validator did not see)."""


class Transfer(NamedTuple):
    """One SEND's timing: queued at ``posted``, on the wire from ``start``, at the peer
    at ``arrival``."""

    posted: float
    start: float
    arrival: float


class LinkScheduler:
    """First-come first-served use of every link direction.

    A transfer holds every link of its route for ``bytes / bandwidth`` (the slowest link
    sets the pace) from the moment all of them are free; the route's latency is paid on
    top. FIFO rather than fair sharing because NCCL and gloo run the P2P operations of a
    rank pair in the order they are posted: a second send waits for the first rather
    than splitting the link with it."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.free_at: dict[tuple[str, str], float] = {}

    def transfer(self, src: str, dst: str, num_bytes: float, now: float) -> Transfer:
        route = self.topology.route(src, dst)
        if not route.links:
            return Transfer(now, now, now)
        free_at = self.free_at
        start = now
        for link in route.links:
            busy_until = free_at.get(link, 0.0)
            if busy_until > start:
                start = busy_until
        done = start + num_bytes / route.bandwidth
        for link in route.links:
            free_at[link] = done
        return Transfer(now, start, done + route.latency)

    def transfer_with_twins(self, src: str, dst: str, num_bytes: float, now: float,
                            twins: dict[tuple[str, str], list[tuple[str, str]]]) -> Transfer:
        """``transfer``, also reserving the links for the same send of the pipelines
        the engine does not simulate (``pipesim.cluster.twins``); the data counts as arrived
        when every twin's has."""
        result = self.transfer(src, dst, num_bytes, now)
        for twin_src, twin_dst in twins.get((src, dst), ()):
            twin = self.transfer(twin_src, twin_dst, num_bytes, now)
            if twin.arrival > result.arrival:
                result = Transfer(result.posted, result.start, twin.arrival)
        return result


def transfer_bytes(action: Action, costs: Costs) -> float:
    """Bytes a SEND moves: a stage's output activation forward, or the gradient of the
    previous stage's output backward (the same size)."""
    if action.kind == ActionKind.SEND_F:
        return costs.stages[action.stage].act_bytes
    return costs.stages[action.stage - 1].act_bytes


def simulate(
    schedule: Schedule,
    costs: Costs,
    topology: Topology,
    rank_devices: Sequence[str] | None = None,
    plan: CommPlan | None = None,
    p2p: str = RENDEZVOUS,
    kernel: str = "direct",
) -> Trace:
    """Simulate one step of ``schedule`` (lowered here if it is not) and return its Trace.

    ``rank_devices[r]`` is the device pipeline rank ``r`` runs on; by default the
    topology's first ``pp`` devices in order. ``plan`` adds tp and dp collectives.
    ``p2p`` is the point-to-point semantics of the backend predicted
    (``schedules.p2p``): under ``rendezvous`` (NCCL) each rank's groups run in order on
    a communication stream (a SimPy process of its own) and a transfer leaves only once
    both ends' groups have started; under ``buffered`` (gloo) the group's sends leave at
    once without holding the rank and its receives wait for their data.

    Each rank keeps its own clock and runs ahead of SimPy's through actions that cannot
    be affected by other ranks (compute, a receive whose data has already been sent, a
    buffered send whose links no other rank uses). It hands control back to SimPy only
    where order across ranks matters: before a send over a link that other ranks also
    send on (so links are reserved in true time order), when it must wait for data not
    yet sent, and at every rendezvous group (whose transfers start when the later side
    starts its group). Every rank's timing is exactly what a process yielding on every action would
    get; the saving is SimPy events, which dominate the cost of large schedules.

    ``kernel`` runs the processes on the engine's own event kernel (``fast``,
    ``pipesim.sim.kernel``: SimPy's scheduling rules, far less machinery) or on SimPy
    (``simpy``, the reference the others are tested against); ``direct`` (the default)
    computes a rendezvous step without processes (``pipesim.sim.direct``) and runs a
    buffered one on the fast kernel.
    """
    rendezvous = require_semantics(p2p) == RENDEZVOUS
    lowered = lower(schedule)
    if costs.num_stages != lowered.num_stages:
        raise ValueError(f"costs describe {costs.num_stages} stages but the schedule has {lowered.num_stages}")
    devices = _rank_devices(lowered, topology, rank_devices)
    if kernel not in KERNELS:
        raise ValueError(f"unknown simulation kernel {kernel!r}: use one of {', '.join(KERNELS)}")
    direct = kernel == "direct" and rendezvous
    events_module = _KERNELS.get(kernel, kernel_module)
    env = events_module.Environment()
    durations = costs.durations()
    paired = _overlapped_pair_seconds(lowered, costs, durations)
    comm_overhead = costs.comm_overhead
    links = LinkScheduler(topology)
    twins = plan.twin_transfers if plan is not None else {}
    shared_pairs = _pairs_on_shared_links(lowered, topology, devices, bool(twins))
    send_info = _send_table(lowered, devices, costs, shared_pairs)
    wires = _wire_table(lowered, devices, costs, topology)
    free_links = links.free_at  # the scheduler's own table: the inlined reservation below shares it
    mailbox: dict[tuple, object] = {}
    # rendezvous: transfer -> (rank, action, event, posted at) of the side that posted first
    offers: dict[tuple, tuple] = {}
    events: list[TraceEvent] = []
    record = events.append
    new_event = tuple.__new__  # TraceEvent(...) without the NamedTuple's Python-level __new__
    tp_seconds = plan.tp_seconds if plan is not None else {}
    tp_records: list[tuple] = []
    finished = [False] * lowered.pp
    position = [0] * lowered.pp

    def arrival_of(stage: int, kind: str, sender: int, now: float) -> float:
        """Reserve the links of stage ``stage``'s ``kind`` SEND from rank ``sender`` at
        ``now`` and return its arrival: ``LinkScheduler.transfer`` with the route and
        wire time looked up once per run (``_wire_table``)."""
        if twins:
            _, _, destination, num_bytes, _ = send_info[stage, kind]
            return links.transfer_with_twins(devices[sender], destination, num_bytes, now, twins).arrival
        route_links, seconds, latency = wires[stage, kind]
        if not route_links:
            return now
        start = now
        for link in route_links:
            busy_until = free_links.get(link, 0.0)
            if busy_until > start:
                start = busy_until
        done = start + seconds
        for link in route_links:
            free_links[link] = done
        return done + latency

    def start_transfer(action: Action, sender: int, clock: float, posted_at: float) -> float:
        """Put a SEND on the wire at ``clock``; record it from ``posted_at`` (when its
        group was posted); return its arrival."""
        stage, kind, microbatch = action
        arrival = arrival_of(stage, kind, sender, clock)
        record(new_event(TraceEvent, (sender, f"{stage}{kind}{microbatch}", kind, stage, microbatch, posted_at,
                                      arrival, "send")))
        return arrival

    def stream_process(rank: int, queue):
        """Rank ``rank``'s communication stream under rendezvous: groups in posting
        order, each starting once posted and once the previous one completed, each
        operation paired with its peer's as both are started."""
        free_at = 0.0
        send_kinds = SEND_KINDS
        while True:
            posted_at, group, completed = yield queue.get()
            if group is None:
                return
            start = max(posted_at, free_at)
            # groups that start at one moment start in rank order, after everything else of
            # that moment: which of two transfers on one link goes first never depends on the
            # order the kernel happened to learn of them (``pipesim.sim.direct`` does the same)
            yield start_at(env, start - env.now, GROUP_START_PRIORITY + rank)
            waiting = []
            arrivals: dict[Action, float] = {}
            for action in group:
                stage, kind, microbatch = action
                is_send = kind in send_kinds
                if is_send:
                    transfer = (stage, kind, microbatch)
                else:
                    offset, sender_kind = MATCHING_SEND[kind]
                    transfer = (stage + offset, sender_kind, microbatch)
                peer = offers.pop(transfer, None)
                if peer is None:
                    event = env.event()
                    offers[transfer] = (rank, action, event, posted_at)
                    waiting.append((action, event))
                    continue
                peer_rank, peer_action, peer_event, peer_posted = peer
                send, sender, sent_at = (action, rank, posted_at) if is_send else (peer_action, peer_rank, peer_posted)
                arrival = start_transfer(send, sender, start, sent_at)
                peer_event.succeed(arrival)
                arrivals[action] = arrival
            for action, event in waiting:
                arrivals[action] = yield event
            free_at = max(start, *arrivals.values())
            completed.succeed(free_at)

    def rank_process(rank: int, items: list):
        clock = 0.0
        awaiting: dict[tuple, object] = {}  # rendezvous: posted receive -> its group's completion
        compute_kinds, send_kinds = COMPUTE_KINDS, SEND_KINDS
        for index, item in enumerate(items):
            if type(item) is not tuple:
                stage, kind, microbatch = item
                if kind not in compute_kinds:
                    raise SimulationError(f"rank {rank}: cannot simulate action {item} (unknown kind {kind!r})")
                if awaiting:
                    # rendezvous: a receive is waited for right before the action that needs it
                    needed = (stage, RECEIVE_OF.get(kind), microbatch)
                    pending = awaiting.pop(needed, None)
                    if pending is not None:
                        start = clock
                        if not pending.processed:
                            position[rank] = index
                            arrived = yield pending
                        else:
                            arrived = pending.value
                        if arrived > clock:
                            clock = arrived
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
                continue
            if rendezvous:
                clock += comm_overhead * len(item)
                completed = env.event()
                streams[rank].put((clock, item, completed))
                last_group[rank] = completed
                for action in item:
                    if action.kind not in send_kinds:
                        awaiting[action] = completed
                continue
            # buffered: the group's sends leave as it is posted, then its receives wait
            for action in item:
                stage, kind, microbatch = action
                if kind not in send_kinds:
                    continue
                clock += comm_overhead
                receiver_stage, receiver_kind, _, _, shared = send_info[stage, kind]
                if shared and clock > env.now:
                    position[rank] = index
                    yield env.timeout(clock - env.now)
                arrival = arrival_of(stage, kind, rank, clock)
                record(new_event(TraceEvent, (rank, f"{stage}{kind}{microbatch}", kind, stage, microbatch, clock,
                                              arrival, "send")))
                # plain tuples hash and compare equal to the RECV's Action
                receiver = (receiver_stage, receiver_kind, microbatch)
                waiting = mailbox.pop(receiver, None)
                if waiting is None:
                    mailbox[receiver] = arrival
                else:
                    waiting.succeed(arrival)
            for action in item:
                stage, kind, microbatch = action
                if kind in send_kinds:
                    continue
                clock += comm_overhead  # posting the receive: overhead, not waiting
                start = clock
                arrival = mailbox.pop(action, None)
                if arrival is None:
                    waiting = env.event()
                    mailbox[action] = waiting
                    position[rank] = index
                    arrival = yield waiting
                if arrival > clock:
                    clock = arrival
                record(new_event(TraceEvent, (rank, f"{stage}{kind}{microbatch}", kind, stage, microbatch, start, clock,
                                              "recv")))
        if rendezvous:
            streams[rank].put((clock, None, None))
            pending = last_group[rank]
            if pending is not None:
                if pending.processed:  # completed already, possibly later than this rank's clock
                    arrived = pending.value
                else:
                    position[rank] = len(items) - 1
                    arrived = yield pending
                if arrived > clock:
                    stage, kind, microbatch = items[-1][-1] if type(items[-1]) is tuple else items[-1]
                    record(TraceEvent(rank, f"{stage}{kind}{microbatch}", kind, stage, microbatch, clock, arrived,
                                      "wait"))
                    clock = arrived
        finished[rank] = True

    with collector_paused():  # schedules.collector: a large step builds millions of acyclic objects
        if direct:
            try:
                tp_events: list[TraceEvent] = []
                stuck = dict(run_rendezvous(lowered, durations, paired, tp_seconds, comm_overhead, arrival_of,
                                            events, tp_events, wires=None if twins else wires, tp_kind=TP_KIND))
                events += tp_events  # after the pipeline's events, as the process engine's below
            except UnknownActionError as error:
                raise SimulationError(str(error)) from None
        else:
            streams = [events_module.Store(env) for _ in range(lowered.pp)]
            last_group: list = [None] * lowered.pp
            for rank in range(lowered.pp):
                items = lowered.program_items(rank)
                env.process(rank_process(rank, items))
                if rendezvous:
                    env.process(stream_process(rank, streams[rank]))
            env.run()
            stuck = {rank: position[rank] for rank in range(lowered.pp) if not finished[rank]}
    if stuck:
        where = [f"rank {rank} at {_describe_item(lowered.program_items(rank)[index])}"
                 for rank, index in sorted(stuck.items())]
        raise SimulationError(f"deadlock under {p2p} semantics: ranks wait forever: " + "; ".join(where))
    if tp_records:
        events += [  # one tp event per compute action with tp collectives
            new_event(TraceEvent, (rank, f"{TP_KIND}({stage}{kind}{microbatch})", TP_KIND, stage, microbatch, start,
                                   end, "tp"))
            for rank, (stage, kind, microbatch), start, end in tp_records
        ]
    events += step_tail_events(events, lowered.pp, plan, costs.step_overhead)
    meta = {
        "source": "simulated",
        "schedule": lowered.name,
        "pp": lowered.pp,
        "microbatches": lowered.microbatches,
        "virtual_stages": lowered.virtual_stages,
        "topology": topology.name,
        "devices": list(devices),
        "p2p": p2p,
    }
    return Trace(events, meta)


def _sends(schedule: Schedule):
    """Every (stage, SEND kind) that exists, with its receiving action (microbatch 0),
    the sending rank and the receiving rank: the transfers the placement implies."""
    for stage, rank in enumerate(schedule.placement):
        for kind in SEND_KINDS:
            receiver = Action(stage, kind, 0).matching()
            if 0 <= receiver.stage < schedule.num_stages:
                yield stage, kind, receiver, rank, schedule.placement[receiver.stage]


def _wire_table(schedule: Schedule, devices: Sequence[str], costs: Costs,
                topology: Topology) -> dict[tuple[int, str], tuple[tuple, float, float]]:
    """For every (stage, SEND kind): the links of its route from the stage's rank to
    the receiver's, the seconds its bytes take on them (``bytes / bandwidth``, the
    slowest link's pace) and the route's latency, computed once per run."""
    table = {}
    for stage, kind, _, rank, peer in _sends(schedule):
        route = topology.route(devices[rank], devices[peer])
        seconds = transfer_bytes(Action(stage, kind, 0), costs) / route.bandwidth if route.links else 0.0
        table[stage, kind] = (route.links, seconds, route.latency)
    return table


def _describe_item(item) -> str:
    return format_group(item) if type(item) is tuple else str(item)


def _overlapped_pair_seconds(schedule: Schedule, costs: Costs, durations: dict) -> dict[Action, float]:
    """Seconds of each action of an overlapped pair (``Schedule.fused``): the pair costs
    ``costs.overlap_seconds``, shared between its forward and backward in proportion to
    their own durations, so the Trace keeps both actions and their sum is the pair's."""
    shares: dict[Action, float] = {}
    for rank in range(schedule.pp):
        for forward, backward in schedule.fused_pairs(rank):
            alone_f, alone_b = durations[forward[0], forward[1]], durations[backward[0], backward[1]]
            pair = costs.overlap_seconds(forward.stage, backward.stage, backward.kind)
            share = alone_f / (alone_f + alone_b) if alone_f + alone_b > 0 else 0.5
            shares[forward], shares[backward] = pair * share, pair * (1 - share)
    return shares


def _send_table(
    schedule: Schedule, devices: Sequence[str], costs: Costs, shared_pairs: set[tuple[int, int]]
) -> dict[tuple[int, str], tuple[int, str, str, float, bool]]:
    """For every (stage, SEND kind): the receiving stage and kind, the receiver's device,
    the bytes moved and whether the route shares links with other senders. Looked up
    once per send instead of recomputed."""
    table = {}
    for stage, kind, receiver, rank, peer in _sends(schedule):
        table[stage, kind] = (
            receiver.stage,
            receiver.kind,
            devices[peer],
            transfer_bytes(Action(stage, kind, 0), costs),
            (rank, peer) in shared_pairs,
        )
    return table


def _pairs_on_shared_links(schedule: Schedule, topology: Topology, devices: Sequence[str],
                           with_twins: bool = False) -> set[tuple[int, int]]:
    """The (sender, receiver) rank pairs whose route crosses a link that another sender
    also uses: only their sends must be ordered against other ranks' in time. Transfers
    only cross stage boundaries, so the pairs follow from the placement. With twin
    transfers (other replicas' and shards') every pair is ordered."""
    pairs = boundary_rank_pairs(schedule)
    if with_twins:
        return pairs
    links = {pair: topology.route(devices[pair[0]], devices[pair[1]]).links for pair in pairs}
    senders: dict[tuple[str, str], set[int]] = {}
    for (sender, _), route_links in links.items():
        for link in route_links:
            senders.setdefault(link, set()).add(sender)
    return {pair for pair, route_links in links.items() if any(len(senders[link]) > 1 for link in route_links)}


def _rank_devices(schedule: Schedule, topology: Topology, rank_devices: Sequence[str] | None) -> list[str]:
    if rank_devices is not None:
        devices = list(rank_devices)
        if len(devices) != schedule.pp:
            raise ValueError(f"{len(devices)} devices given for {schedule.pp} pipeline ranks")
        return devices
    if topology.ideal:
        return [f"gpu{rank}" for rank in range(schedule.pp)]
    topology.require_devices(schedule.pp, "pipeline ranks")
    return topology.devices[: schedule.pp]
