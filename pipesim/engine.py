"""The SimPy engine: each rank is a process walking its lowered program.

Compute actions hold the rank for their duration. A SEND does not hold the rank: it
reserves its route's links first-come first-served and computes when the data will
arrive, ``latency + bytes / bandwidth`` after the links are free; its event runs
from posting (the data is ready) to arrival. A RECV holds the rank until that
arrival. Transfers are scheduled directly from their arrival time instead of as
SimPy processes with resource requests, which keeps the engine several times faster
on the ~400k-action schedules of large pipelines (see benchmarks/).

With a ``CommPlan`` (``pipesim.parallel``) a compute action is followed by its
tensor-parallel collectives on a ``tp`` event, and the step ends with each stage's
data-parallel gradient all-reduce (``dp``) and the optimizer step (``step``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import simpy

from pipesim.costs import Costs
from pipesim.parallel import TP_KIND, CommPlan, step_tail_events
from pipesim.topology import Topology
from schedules.action import COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, Action, ActionKind
from schedules.lowering import lower
from schedules.schedule import Schedule
from schedules.trace import Trace, TraceEvent


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
        the engine does not simulate (``pipesim.twins``); the data counts as arrived
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
) -> Trace:
    """Simulate one step of ``schedule`` (lowered here if it is not) and return its Trace.

    ``rank_devices[r]`` is the device pipeline rank ``r`` runs on; by default the
    topology's first ``pp`` devices in order. ``plan`` adds tp and dp collectives.

    Each rank keeps its own clock and runs ahead of SimPy's through actions that cannot
    be affected by other ranks (compute, a receive whose data has already been sent, a
    send whose links no other rank uses). It hands control back to SimPy only where
    order across ranks matters: before a send over a link that other ranks also send on
    (so links are reserved in true time order) and when it must wait for data not yet
    sent. Every rank's timing is exactly what a process yielding on every action would
    get; the saving is SimPy events, which dominate the cost of large schedules.
    """
    lowered = lower(schedule)
    if costs.num_stages != lowered.num_stages:
        raise ValueError(f"costs describe {costs.num_stages} stages but the schedule has {lowered.num_stages}")
    devices = _rank_devices(lowered, topology, rank_devices)
    env = simpy.Environment()
    durations = costs.durations()
    comm_overhead = costs.comm_overhead
    links = LinkScheduler(topology)
    twins = plan.twin_transfers if plan is not None else {}
    shared_pairs = _pairs_on_shared_links(lowered, topology, devices, bool(twins))
    send_info = _send_table(lowered, devices, costs, shared_pairs)
    mailbox: dict[tuple, object] = {}
    events: list[TraceEvent] = []
    record = events.append
    tp_seconds = plan.tp_seconds if plan is not None else {}
    tp_records: list[tuple] = []
    finished = [False] * lowered.pp
    position = [0] * lowered.pp

    def rank_process(rank: int, program: Sequence[Action]):
        clock = 0.0
        if twins:
            def transfer(src, dst, num_bytes, now):
                return links.transfer_with_twins(src, dst, num_bytes, now, twins)
        else:
            transfer = links.transfer
        source = devices[rank]
        compute_kinds, send_kinds = COMPUTE_KINDS, SEND_KINDS
        for index, action in enumerate(program):
            stage, kind, microbatch = action
            if kind in compute_kinds:
                end = clock + durations[stage, kind]
                record(TraceEvent(rank, f"{stage}{kind}{microbatch}", kind, stage, microbatch, clock, end, "compute"))
                clock = end
                if tp_seconds:
                    collectives = tp_seconds.get((stage, kind))
                    if collectives:
                        tp_records.append((rank, action, clock, clock + collectives))
                        clock += collectives
            elif kind in send_kinds:
                clock += comm_overhead
                receiver_stage, receiver_kind, destination, num_bytes, shared = send_info[stage, kind]
                if shared and clock > env.now:
                    position[rank] = index
                    yield env.timeout(clock - env.now)
                # the event starts when the data is ready (posted), as the executor records it:
                # bubble vs exposed communication is read from that moment (schedules.accounting)
                _, _, arrival = transfer(source, destination, num_bytes, clock)
                record(TraceEvent(rank, f"{stage}{kind}{microbatch}", kind, stage, microbatch, clock, arrival, "send"))
                # plain tuples hash and compare equal to the RECV's Action
                receiver = (receiver_stage, receiver_kind, microbatch)
                waiting = mailbox.pop(receiver, None)
                if waiting is None:
                    mailbox[receiver] = arrival
                else:
                    waiting.succeed(arrival)
            elif kind in RECV_KINDS:
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
                record(TraceEvent(rank, f"{stage}{kind}{microbatch}", kind, stage, microbatch, start, clock, "recv"))
            else:
                raise SimulationError(f"rank {rank}: cannot simulate action {action} (unknown kind {kind!r})")
        finished[rank] = True

    for rank, program in enumerate(lowered.programs):
        env.process(rank_process(rank, program))
    env.run()
    if not all(finished):
        stuck = [
            f"rank {rank} at {lowered.programs[rank][position[rank]]}"
            for rank in range(lowered.pp)
            if not finished[rank]
        ]
        raise SimulationError("deadlock: ranks wait forever: " + "; ".join(stuck))
    if tp_records:
        events += [
            TraceEvent(rank, f"{TP_KIND}({action})", TP_KIND, action[0], action[2], start, end, "tp")
            for rank, action, start, end in tp_records
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
    }
    return Trace(events, meta)


def _send_table(
    schedule: Schedule, devices: Sequence[str], costs: Costs, shared_pairs: set[tuple[int, int]]
) -> dict[tuple[int, str], tuple[int, str, str, float, bool]]:
    """For every (stage, SEND kind): the receiving stage and kind, the receiver's device,
    the bytes moved and whether the route shares links with other senders. Looked up
    once per send instead of recomputed."""
    table = {}
    for stage, rank in enumerate(schedule.placement):
        for kind in SEND_KINDS:
            receiver = Action(stage, kind, 0).matching()
            if not 0 <= receiver.stage < schedule.num_stages:
                continue
            peer = schedule.placement[receiver.stage]
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
    placement = schedule.placement
    pairs = set()
    for stage in range(schedule.num_stages - 1):
        left, right = placement[stage], placement[stage + 1]
        if left != right:
            pairs.update(((left, right), (right, left)))
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
