"""Where each transfer of a compute-only order is posted, and with which others.

Lowering (``schedules.lowering``) reads the compute-only order timed by the engine with
free-flowing transfers: each transfer is *ready* when its producer ends and *needed* when
its consumer starts, and its *flight* is the time its data takes on the wire. A
placement gives every transfer one **departure moment** in ``[ready, needed]``, the
moment both ends should post it, and from that moment alone each rank derives where:

- an end goes at the rank's last compute boundary at or before the moment (after every
  compute action that has ended by then), on both ranks;
- the ends a rank posts at one boundary go in (moment, sending stage, direction,
  microbatch) order, cut into P2P groups where a group's data would otherwise hold a
  later transfer up (``group_breaks``).

Why this is deadlock-free under rendezvous, whatever the moments: every rank posts its
ends in the order of one global key (moment, sending stage, direction, microbatch), since
"the last boundary at or before the moment" never decreases as the moment grows. So each
rank pair's sends and receives are posted in the same order, and a group never waits for
a group of a larger key: a group waits only for its peers' groups of the same
transfers, for earlier groups on its stream (smaller keys) and for compute actions
before it, whose inputs came in earlier groups (smaller keys again). By induction on the
key every transfer departs, as long as a send is posted after its producer and a receive
before its consumer, which the moments guarantee when every planned compute action takes
some time (zero durations are planned as a tiny one).

Which moments, and which groups, decide how close the step comes to free-flowing
transfers; ``schedules.placement_search`` chooses among them with the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np

from schedules import engine
from schedules.action import KINDS, actions_of
from schedules.dataflow import (
    DIRECTION_KIND_CODES,
    RECV_OF_CODES,
    SEND_OF_CODES,
    WIRES_PER_STAGE,
    receiving_stage,
    transfer_parts,
    transfer_wire,
)
from schedules.hop import wire_flight
from schedules.program_arrays import ProgramArrays, keep_program_arrays, program_arrays_of_rows
from schedules.schedule import Schedule

# Planning durations below this are raised to it, so that every compute action has an
# inside and "at or before the moment" separates a producer from its consumer.
MIN_PLANNED_SECONDS = 1e-9


@dataclass(frozen=True)
class Transfers:
    """Every cross-rank transfer of a compute-only order, as arrays in one order, with
    the free-flowing timing of that order (``step``, the engine's ``free`` run)."""

    step: engine.StepRun
    key: np.ndarray  # the engine's transfer number
    producer: np.ndarray  # compute index (into the step's compute rows) of the producer
    consumer: np.ndarray
    sender: np.ndarray
    receiver: np.ndarray
    ready: np.ndarray
    needed: np.ndarray
    flight: np.ndarray

    @property
    def count(self) -> int:
        return len(self.key)

    @cached_property
    def first_compute(self) -> np.ndarray:
        """Per rank (and one past the last) the index of its first compute action."""
        program = self.step.program
        return np.r_[np.searchsorted(program.compute_rank, np.arange(program.ranks)), len(program.compute_rank)]

    @cached_property
    def _parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return transfer_parts(self.key, self.step.program.arrays.microbatches)

    @property
    def sending_stage(self) -> np.ndarray:
        return self._parts[0]

    @property
    def direction(self) -> np.ndarray:
        return self._parts[1]

    @property
    def microbatch(self) -> np.ndarray:
        return self._parts[2]

    @cached_property
    def latest(self) -> np.ndarray:
        """The last departure that still arrives when its consumer starts."""
        return np.maximum(self.needed - self.flight, self.ready)


def transfers_of(step: engine.StepRun, timing: engine.StepTiming) -> Transfers:
    """The transfers of ``step`` (an engine run of a compute-only order under ``free``)."""
    program = step.program
    arrays = program.arrays
    producer = np.flatnonzero(program.compute_send >= 0)
    key = program.compute_send[producer]
    consumer_of = np.full(arrays.transfers, -1, dtype=np.int64)
    consumers = np.flatnonzero(program.compute_need >= 0)
    consumer_of[program.compute_need[consumers]] = consumers
    consumer = consumer_of[key]
    flight = _wire_flight(timing, arrays.schedule.num_stages)[transfer_wire(key, arrays.microbatches)]
    return Transfers(step, key, producer, consumer, program.compute_rank[producer], program.compute_rank[consumer],
                     step.end[producer], step.start[consumer], flight)


def _wire_flight(timing: engine.StepTiming, num_stages: int) -> np.ndarray:
    """Per wire (``schedules.dataflow.wire_of``): the seconds from departure to arrival
    when its links are free (its slowest route)."""
    flight = np.zeros(WIRES_PER_STAGE * num_stages)
    for wire, routes in enumerate(timing.wires or ()):
        flight[wire] = wire_flight(routes)
    return flight


def crossing_moments(transfers: Transfers) -> np.ndarray:
    """Every transfer departs the moment it is ready (the receiver posts it at its last
    boundary before, the sender right after the producer), except where that holds up
    the receiver's own sends more than it gains: see ``_yielding_moments``. Costs are
    departure delays, so this keeps every transfer as close to free-flowing as it can
    (orders with no slack to spare: interleaved-zb)."""
    return _yielding_moments(transfers, by_lateness=False)


def slack_moments(transfers: Transfers) -> np.ndarray:
    """As ``crossing_moments``, with costs counted as lateness at the consumers, so that
    a receive with slack yields to the sends it would hold up, and one that arrives in
    time anyway is posted after the compute action it becomes ready in (the V's turn,
    where a rank's chunks send to both neighbours while receiving from both)."""
    return _yielding_moments(transfers, by_lateness=True)


def _yielding_moments(transfers: Transfers, by_lateness: bool) -> np.ndarray:
    """Ready moments, but a receive that becomes ready inside a compute action X of its
    receiver and would still be in flight when X ends departs when X ends instead, if
    that costs less than keeping it.

    Why: the receiver posts a receive at its last boundary before the moment, so one
    ready inside X is posted before X and holds the receiver's stream until it arrives;
    the sends X produces (the gradient X returns to the neighbour whose forward is
    arriving, where F and B traffic cross) then wait behind it, as a rank's groups run
    one after another. Departing at X's end posts the receive with those sends at X's
    boundary, in one group that leaves at once. Costs: keeping it delays X's sends until
    it arrives, moving it delays it until X ends; counted as departure delays, or with
    ``by_lateness`` as how late each then arrives for its consumer (a receive that is
    not late for its consumer either way is then moved: it frees the stream). The moment
    stays in ``[ready, needed]``: the consumer comes after X on the receiver."""
    step, first = transfers.step, transfers.first_compute
    ready, flight, needed = transfers.ready, transfers.flight, transfers.needed
    moment = ready.copy()
    if not len(moment):
        return moment
    inside_of = _rank_search(step.end, first, transfers.receiver, ready)  # X: the first action ending after ready
    exists = inside_of < first[transfers.receiver + 1]
    inside_of = np.minimum(inside_of, len(step.end) - 1)
    ends = step.end[inside_of]
    inside = exists & (step.start[inside_of] < ready) & (ready + flight > ends)
    # per compute action, the send it produces that suffers most from leaving late
    worst = np.full(len(step.end), -np.inf)
    np.maximum.at(worst, transfers.producer, (flight - needed) if by_lateness else 0.0)
    held = worst[inside_of]
    sends = np.isfinite(held)
    if by_lateness:
        keep_cost = np.where(sends, np.maximum(0.0, ready + flight + held), 0.0)
        move_cost = np.maximum(0.0, ends + flight - needed)
    else:
        keep_cost = np.where(sends, ready + flight - ends, 0.0)
        move_cost = ends - ready
    move = np.flatnonzero(inside & ((move_cost < keep_cost) | (move_cost <= 0.0)))
    moment[move] = np.minimum(ends[move], needed[move])
    return moment


def meeting_moments(transfers: Transfers) -> np.ndarray:
    """Every transfer departs at the earliest moment from ``ready`` at which neither rank
    is inside a compute action, so that neither posts a group early and holds its stream
    waiting; if that comes too late for the consumer, at the moment of least waiting."""
    step = transfers.step
    first = transfers.first_compute
    moment = transfers.ready.copy()
    if not len(moment):
        return moment
    ranks = step.program.ranks
    pair = transfers.sender * ranks + transfers.receiver
    order = np.argsort(pair, kind="stable")
    cuts = np.flatnonzero(np.r_[True, pair[order][1:] != pair[order][:-1], True])
    for begin, stop in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        members = order[begin:stop]
        busy = [(step.start[first[rank]:first[rank + 1]], step.end[first[rank]:first[rank + 1]])
                for rank in (int(transfers.sender[members[0]]), int(transfers.receiver[members[0]]))]
        starts, ends = _busy_union(*busy)
        at = np.searchsorted(starts, moment[members], side="left") - 1
        inside = (at >= 0) & (moment[members] < ends[np.maximum(at, 0)])
        moment[members[inside]] = ends[at[inside]]
    too_late = np.flatnonzero(moment > transfers.latest)
    if len(too_late):
        moment[too_late] = _least_waiting(transfers, too_late)
    return moment


def _least_waiting(transfers: Transfers, which: np.ndarray) -> np.ndarray:
    """For transfers whose two ranks are never both between compute actions in time: the
    moment in ``[ready, latest]`` (when ready, or a boundary of either rank) at which the
    two ranks together wait least for the compute action they are inside, each having
    posted the group at its boundary before (the earliest such moment on a tie).

    All candidates of all transfers are scored at once: a large step has tens of
    thousands of such transfers."""
    step, first = transfers.step, transfers.first_compute
    ready, latest = transfers.ready[which], transfers.latest[which]
    sides = (transfers.sender[which], transfers.receiver[which])
    # candidates: (position in ``which``, moment); first every ready moment, then the
    # boundaries of either rank in (ready, latest]
    owner, moment = [np.arange(len(which))], [ready]
    for rank_of in sides:
        low = _rank_search(step.end, first, rank_of, ready)
        high = _rank_search(step.end, first, rank_of, latest)
        counts = high - low
        positions = np.repeat(np.arange(len(which)), counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        owner.append(positions)
        moment.append(step.end[np.repeat(low, counts) + offsets])
    owner, moment = np.concatenate(owner), np.concatenate(moment)
    waiting = sum(_waiting(step, first, rank_of[owner], moment) for rank_of in sides)
    least = np.full(len(which), np.inf)
    np.minimum.at(least, owner, waiting)
    best = np.flatnonzero(waiting == least[owner])
    chosen = np.full(len(which), np.inf)
    np.minimum.at(chosen, owner[best], moment[best])  # the earliest of the best moments
    return chosen


def _rank_search(end: np.ndarray, first: np.ndarray, rank: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """Per query, the global index of the first compute action of ``rank`` that ends
    after ``moment`` (one past the rank's last if none)."""
    found = np.empty(len(rank), dtype=np.int64)
    by_rank = _by_rank(rank)
    cuts = np.searchsorted(rank[by_rank], np.arange(len(first)))
    for owner in range(len(first) - 1):
        members = by_rank[cuts[owner]:cuts[owner + 1]]
        if len(members):
            found[members] = first[owner] + np.searchsorted(end[first[owner]:first[owner + 1]], moment[members],
                                                            side="right")
    return found


def _by_rank(rank: np.ndarray) -> np.ndarray:
    """The indices of ``rank`` grouped by rank, in order within each: a stable sort of
    small numbers (a radix sort, where they fit 16 bits)."""
    small = len(rank) > 0 and 0 <= rank.min() and rank.max() < 2**15
    return np.argsort(rank.astype(np.int16) if small else rank, kind="stable")


def _waiting(step: engine.StepRun, first: np.ndarray, rank: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """Per query, how long ``rank`` has waited at ``moment`` for the compute action it is
    inside, having posted at the boundary before it (zero between actions)."""
    at = _rank_search(step.end, first, rank, moment)
    inside = at < first[rank + 1]
    inside[inside] = step.start[at[inside]] < moment[inside]
    before = np.where(at > first[rank], step.end[np.maximum(at - 1, 0)], 0.0)
    return np.where(inside, moment - before, 0.0)


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


@dataclass(frozen=True)
class Ends:
    """Both ends of every transfer (sends first, then receives, each in transfer order),
    placed: per end its rank, its slot (how many of the rank's compute actions come
    before it) and its position in the rank's posting order (``order``)."""

    rank: np.ndarray
    slot: np.ndarray
    is_send: np.ndarray
    order: np.ndarray  # the ends by (rank, slot, key)
    moment: np.ndarray
    arrival: np.ndarray
    needed: np.ndarray


def place_ends(transfers: Transfers, moment: np.ndarray, shift: np.ndarray | None = None) -> Ends | None:
    """Each end at its rank's last boundary at or before the transfer's moment, moved by
    ``shift`` boundaries (per end: a receive posted earlier, a send later). None if a
    shift breaks the rules: a send before its producer, a receive after its consumer,
    or a rank whose ends are no longer in key order."""
    step = transfers.step
    first = transfers.first_compute
    count = transfers.count
    rank = np.concatenate([transfers.sender, transfers.receiver])
    both = np.concatenate([moment, moment])
    slot = _rank_search(step.end, first, rank, both) - first[rank]
    # by rank and key; the slots of a rank's ends never decrease in that order (a later
    # moment's boundary is never an earlier one, and a shift that breaks it is refused
    # below), so it is also their order by (rank, slot, key): each rank's posting order
    order = _key_order(rank, moment, transfers.key)
    if shift is not None and shift.any():
        slot = slot + shift
        within = np.arange(len(step.program.compute_rank)) - first[step.program.compute_rank]
        producer_slot, consumer_slot = within[transfers.producer] + 1, within[transfers.consumer]
        if (slot[:count] < producer_slot).any() or (slot[count:] > consumer_slot).any():
            return None
        same_rank = rank[order][1:] == rank[order][:-1]
        if (same_rank & (slot[order][1:] < slot[order][:-1])).any():
            return None
    arrival = both + np.concatenate([transfers.flight, transfers.flight])
    is_send = np.r_[np.ones(count, dtype=bool), np.zeros(count, dtype=bool)]
    return Ends(rank, slot, is_send, order, both, arrival, np.concatenate([transfers.needed, transfers.needed]))


def _key_order(rank: np.ndarray, moment: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The ends (``rank`` of each: the transfers' senders, then their receivers) by rank,
    then by the module's global key (moment, sending stage, direction, microbatch: the
    transfer's ``key`` orders the last three). The transfers are sorted by the key once and
    their ends then grouped by rank, a stable sort of small numbers."""
    count = len(key)
    by_key = np.lexsort((key, moment))
    ends = np.stack([by_key, by_key + count], axis=1).ravel()
    return ends[_by_rank(rank[ends])]


def group_starts(ends: Ends, mind_the_consumer: bool, breaks: np.ndarray | None = None,
                 joins: np.ndarray | None = None) -> np.ndarray:
    """Per end (in ``ends.order``): whether it starts a new P2P group.

    Ends at one boundary of one rank share a group while their flights overlap: a
    rank's groups run one after another, so a transfer in a later group would wait for
    the whole earlier group to arrive. Transfers that take no time join the group before
    them unless a receive there would then wait for them. With ``mind_the_consumer`` an overlapping end
    still starts a group of its own when joining would make the group's receives arrive
    later for their consumers than it makes this end late on its own. ``breaks`` and
    ``joins`` (per end, by end index) force the choice (``placement_search``'s repairs)."""
    order = ends.order
    if not len(order):
        return np.zeros(0, dtype=bool)
    rank, slot = ends.rank[order], ends.slot[order]
    starts = np.r_[True, (rank[1:] != rank[:-1]) | (slot[1:] != slot[:-1])]
    if breaks is not None:
        starts |= breaks[order]
    # The choice runs along each run of ends that share a boundary (a new group resets
    # what the next end joins); runs are short, so all runs take their k-th step at once.
    first = np.flatnonzero(starts)
    length = np.diff(np.r_[first, len(order)])
    moment, arrival = ends.moment[order], ends.arrival[order]
    own_need = ends.needed[order]
    receives = ~ends.is_send[order]
    need = np.where(receives, own_need, np.inf)
    forced_join = joins[order] if joins is not None else None
    complete, first_need = arrival[first], need[first]
    decided = starts.copy()
    for step in range(1, int(length.max())):
        live = np.flatnonzero(length > step)
        index = first[live] + step
        was_complete, was_need = complete[live], first_need[live]
        here, arrives = moment[index], arrival[index]
        joined = np.maximum(was_complete, arrives)
        # the group before has arrived by the time this one leaves; with nothing on the
        # wire, joining it costs no time, so what falls between two compute actions is
        # posted as one batch (Megatron's pairing) unless a receive of the group would wait
        after = (arrives > here) | (joined > was_need)
        if mind_the_consumer:
            late_joined = np.maximum(np.maximum(0.0, joined - was_need),
                                     np.where(receives[index], joined - own_need[index], 0.0))
            late_alone = np.maximum(0.0, was_complete + arrives - here - own_need[index])
            overlapping = late_alone < late_joined
        else:
            overlapping = np.zeros(len(index), dtype=bool)
        new = np.where(here >= was_complete, after, overlapping)
        if forced_join is not None:
            new &= ~forced_join[index]
        decided[index] = new
        complete[live] = np.where(new, arrives, joined)
        first_need[live] = np.where(new, need[index], np.minimum(was_need, need[index]))
    return decided




@dataclass(frozen=True)
class LoweredRows:
    """A placement's lowered programs as rows (compute actions and transfer ends in
    program order, rank after rank): what the engine times, without the ``Action``
    tuples of a ``Schedule``, which only the placement kept needs (``lowered_schedule``)."""

    count: int  # compute actions: rows below it in ``order`` are compute actions, the rest ends
    order: np.ndarray  # per row, its compute action (< count) or end (count + its place in ``posted``)
    rank: np.ndarray
    stage: np.ndarray
    kind: np.ndarray  # ``KIND_CODES``
    microbatch: np.ndarray
    joined: np.ndarray  # per row: posted in the group of the row before
    end_stage: np.ndarray  # per end in posting order: its action's stage, kind (``KIND_CODES``)
    end_kind: np.ndarray
    end_microbatch: np.ndarray

    def arrays(self, schedule: Schedule) -> ProgramArrays:
        """The rows as ``ProgramArrays`` of the compute-only ``schedule`` they lower (its
        placement, stages and microbatches are theirs), for timing them without
        building their ``Schedule``."""
        arrays = program_arrays_of_rows(schedule, self.rank, self.stage, self.kind, self.microbatch)
        arrays.__dict__["joined"] = self.joined  # what ``joined`` reads off a lowered schedule's joins
        return arrays


def lowered_rows(transfers: Transfers, ends: Ends, starts: np.ndarray) -> LoweredRows:
    """The lowered programs' rows: each rank's compute actions in their order, each end
    at its slot (before the compute action of that index), ends of one slot in
    ``ends.order``, grouped where ``starts`` (per end in that order) does not open a group."""
    program = transfers.step.program
    count = len(program.compute_row)
    first = transfers.first_compute
    compute_rank = program.compute_rank
    within = np.arange(count) - first[compute_rank]
    posted = ends.order  # the ends in posting order; ``starts`` follows it
    end_rank, end_slot = ends.rank[posted], ends.slot[posted]
    # rows: the compute actions, then the ends in posting order; each rank's rows by slot,
    # an end before the compute action of its slot (a stable sort keeps the rest in order)
    # (a repair may shift a receive before the rank's first boundary: slots below 0 sort first)
    low = int(min(0, end_slot.min(initial=0)))
    slots = int(max(within.max(initial=0), end_slot.max(initial=0))) + 1 - low
    place = np.concatenate([(compute_rank * slots + within - low) * 2 + 1, (end_rank * slots + end_slot - low) * 2])
    order = np.argsort(place, kind="stable")
    is_transfer = order >= count
    is_send = ends.is_send[posted]
    transfer_of = np.where(is_send, posted, posted - transfers.count)  # ends: the sends, then the receives
    direction = transfers.direction[transfer_of]
    sending = transfers.sending_stage[transfer_of]
    stage = np.where(is_send, sending, receiving_stage(sending, direction))
    carried = DIRECTION_KIND_CODES[direction]  # the compute kind whose output it carries
    kind = np.where(is_send, SEND_OF_CODES[carried], RECV_OF_CODES[carried])
    microbatch = transfers.microbatch[transfer_of]
    rank = np.concatenate([compute_rank, end_rank])[order]
    opens = np.concatenate([np.ones(count, dtype=bool), starts])[order]
    joined = np.zeros(len(order), dtype=bool)
    joined[1:] = is_transfer[1:] & is_transfer[:-1] & (rank[1:] == rank[:-1]) & ~opens[1:]
    arrays = program.arrays
    rows = [np.concatenate([compute_part, end_part])[order] for compute_part, end_part in (
        (arrays.stage[program.compute_row], stage),
        (arrays.kind[program.compute_row], kind.astype(np.int8)),
        (arrays.microbatch[program.compute_row], microbatch))]
    return LoweredRows(count, order, rank, *rows, joined, stage, kind, microbatch)


def lowered_schedule(schedule: Schedule, transfers: Transfers, rows: LoweredRows) -> Schedule:
    """The lowered programs of ``rows`` (``lowered_rows``) as a schedule, with its arrays kept."""
    program = transfers.step.program
    # the actions: compute ones as the schedule has them, each end built from its transfer
    # (held in object arrays: reordering hundreds of thousands of them is then one gather)
    originals = np.fromiter(chain.from_iterable(schedule.programs), dtype=object, count=program.arrays.size)
    transfer = actions_of(rows.end_stage.tolist(), np.array(KINDS, dtype=object)[rows.end_kind].tolist(),
                          rows.end_microbatch.tolist())
    actions = np.concatenate([originals[program.compute_row], np.fromiter(transfer, dtype=object, count=len(transfer))])
    rank_start = np.searchsorted(rows.rank, np.arange(schedule.pp + 1))
    sequence = actions[rows.order]
    joined_at = np.flatnonzero(rows.joined)
    programs, joins = [], []
    for rank in range(schedule.pp):
        begin, stop = int(rank_start[rank]), int(rank_start[rank + 1])
        programs.append(sequence[begin:stop].tolist())
        inside = joined_at[(joined_at > begin) & (joined_at < stop)] - begin
        joins.append(frozenset(inside.tolist()))
    lowered = schedule.with_programs(programs, joins, fused=())  # re-paired by ``keep_pairs_together``
    keep_program_arrays(lowered, rows.rank, rows.stage, rows.kind, rows.microbatch)
    return lowered
