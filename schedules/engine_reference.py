"""The engine's rules as SimPy processes: the readable specification of a step's timing.

``schedules.engine`` states the rules and runs them compiled; this module runs the same
rules the way one would first write them down. Each rank is a process that walks its
program in true time; under rendezvous each rank's P2P stream is a process of its own;
a buffered or free transfer is a process that leaves at its moment; each rank's
data-parallel channel (``schedules.dp_channel``) is a process that takes the collectives
its rank issues one after another. Links are a calendar (``LinkCalendar``): a transfer
takes every link of its route from the moment all are free, for its occupancy, and
arrives its latency later; a collective takes every link its ring crosses the same way,
for its seconds.

It serves three purposes:

- the oracle the compiled engine is tested against (``tests/test_engine_reference.py``:
  the same moments on random schedules, costs, clusters, placements, tp/dp plans and
  every semantics);
- the fallback where nothing was compiled (``schedules.engine.run`` calls
  ``run_reference``): slower, the same numbers;
- the place to extend a simulation: subclass ``SimpyStep`` to change a rule (a rank that
  straggles, ``compute_seconds``), or add a process to its ``env`` before ``run`` (a
  link that fails for a while, ``LinkCalendar.block``). ``docs/simulator.md`` shows both.

Moments that tie are taken as the compiled engine takes them: a group start or a
departure at the same time as another goes in rank order, then in the order it was
posted (a SimPy priority per rank and group, after SimPy's own urgent and normal events:
a rank's groups are numbered in the order it posts them; departures, created as they are
posted, keep SimPy's order of creation). A group's number, not the moment its stream
takes it up, decides: under torch's runtime a rank's group can wait for its stream while
a later one, on another stream, starts at once. A collective's start comes after every
P2P moment of the same time (a priority above all of theirs), then in rank order.
"""

from __future__ import annotations

from collections.abc import Sequence
from heapq import heappush

import numpy as np
import simpy
from simpy.core import NORMAL

from schedules.action import SEND_KINDS, Action
from schedules.dp_channel import AT_ACTION, AT_FRACTION, AT_STEP_END, AT_STEP_START, ChannelArrays, no_channel
from schedules.engine import (
    BUFFERED,
    FREE,
    RENDEZVOUS,
    EngineProgram,
    StepRun,
    StepTiming,
    WireArrays,
    compile_program,
    empty_run,
    step_inputs,
)
from schedules.p2p import TORCH_RUNTIME
from schedules.schedule import Schedule

FIRST_RANK_PRIORITY = 2  # after SimPy's URGENT (0) and NORMAL (1) events of the same moment


class Environment(simpy.Environment):
    """SimPy's environment, able to schedule an event at an exact moment: a timeout of
    ``moment - now`` lands on ``now + (moment - now)``, which can differ from ``moment`` in
    its last bit, and moments that tie must tie here as they do in the compiled engine."""

    def at(self, moment: float, priority: int = NORMAL) -> simpy.Event:
        event = simpy.Event(self)
        event._ok, event._value = True, None
        heappush(self._queue, (moment, priority, next(self._eid), event))
        return event


class LinkCalendar:
    """When each link is next free. ``reserve`` is the one rule: a route's transfer
    starts once all its links are free and holds them all for its occupancy."""

    def __init__(self, count: int) -> None:
        self.free_at = [0.0] * count

    def reserve(self, links: Sequence[int], occupancy: float, latency: float, now: float) -> float:
        """Reserve ``links`` from ``now``; the arrival. A route with no links arrives at once."""
        if not links:
            return now
        begin = self.free_from(links, now)
        self.occupy(links, begin + occupancy)
        return begin + occupancy + latency

    def free_from(self, links: Sequence[int], now: float) -> float:
        """The moment, ``now`` or later, from which every one of ``links`` is free."""
        return max([now] + [self.free_at[link] for link in links])

    def occupy(self, links: Sequence[int], until: float) -> None:
        """Hold ``links`` until ``until``."""
        for link in links:
            self.free_at[link] = until

    def block(self, link: int, until: float) -> None:
        """Take ``link`` out of service until ``until`` (a failing link): transfers that
        reserve it later wait."""
        self.free_at[link] = max(self.free_at[link], until)


class SimpyStep:
    """One step of ``program`` as SimPy processes; ``run()`` returns its ``StepRun``.

    The extension point: ``SimpyStep.of(schedule, timing, semantics)`` builds the step
    the engine would time; subclass it to change a rule (``compute_seconds``), or add
    processes to its ``env`` (a link out of service: ``links.block``) before ``run()``."""

    @classmethod
    def of(cls, schedule: Schedule, timing: StepTiming, semantics: str) -> SimpyStep:
        """The step of ``schedule`` under ``timing`` and ``semantics``, handed the same
        inputs as the compiled walk (``schedules.engine.step_inputs``)."""
        program = compile_program(schedule, semantics)
        inputs = step_inputs(program, timing)
        return cls(program, inputs.seconds, inputs.hold, inputs.wires, inputs.comm_overhead, inputs.channels)

    def __init__(self, program: EngineProgram, seconds: np.ndarray, hold: np.ndarray, wires: WireArrays,
                 comm_overhead: float, channels: ChannelArrays | None = None) -> None:
        self.program, self.seconds, self.hold, self.wires = program, seconds, hold, wires
        self.comm_overhead = comm_overhead
        self.channels = channels if channels is not None else no_channel(program)
        self.schedule = program.arrays.schedule
        self.env = Environment()
        self.links = LinkCalendar(max(wires.link_count, self.channels.link_count))
        self.result = empty_run(program, self.channels)
        # a collective's issue: an event per collective, its value the moment it is issued for;
        # and its end, known (the value) once its last bucket has taken its links
        self.issued = [self.env.event() for _ in range(self.channels.count)]
        self.scheduled = [self.env.event() for _ in range(self.channels.count)]
        arrays = program.arrays
        # what the moments are recorded against: compute actions by their row, transfers by key
        self.compute_of_row = {int(row): index for index, row in enumerate(program.compute_row)}
        self.first_row = [int(row) for row in arrays.rank_start[:-1]]
        self.microbatches = arrays.microbatches
        self.arrived: dict[int, simpy.Event] = {}  # transfer key -> its arrival (the value)
        self.group_done: dict[tuple[int, int], simpy.Event] = {}  # (rank, group number) -> completion
        self.offers: dict[int, tuple[int, simpy.Event]] = {}  # rendezvous: transfer key -> (rank, paired event)
        self.streams: dict[int, simpy.Store] = {}
        flat = [action for rank_program in self.schedule.programs for action in rank_program]
        self.transfer_of = {flat[row]: key for row, key in zip(program.endpoint_row.tolist(),
                                                                program.endpoint_transfer.tolist(), strict=True)}
        self.first_group = np.searchsorted(program.group_rank, np.arange(self.schedule.pp)).tolist()

    # -- the rules ----------------------------------------------------------------------

    def compute_seconds(self, rank: int, action: Action, seconds: float) -> float:
        """How long ``action`` runs on ``rank`` (override to make a rank straggle)."""
        return seconds

    def transfer(self, key: int, now: float) -> float:
        """Put transfer ``key`` on its wire at ``now``; its arrival (the latest route's)."""
        wires = self.wires
        wire = int(self.program.transfer_wire[key])
        arrival = now
        for route in range(wires.route_start[wire], wires.route_start[wire + 1]):
            links = wires.links[wires.link_start[route]:wires.link_start[route + 1]].tolist()
            arrival = max(arrival, self.links.reserve(links, wires.occupancy[route], wires.latency[route], now))
        return arrival

    def in_rank_order(self, moment: float, rank: int, group: int = -1) -> simpy.Event:
        """An event at ``moment`` taken after everything else of that moment, in rank order,
        then by ``group``, the number of the group starting (-1: a departure)."""
        return self.env.at(moment, FIRST_RANK_PRIORITY + rank * (self.program.groups + 1) + group + 1)

    def until(self, moment: float) -> simpy.Event:
        """Wait until ``moment`` (at once if it has passed)."""
        return self.env.at(max(moment, self.env.now))

    # -- the processes ------------------------------------------------------------------

    def rank_process(self, rank: int):
        """Walk ``rank``'s program in true time (see ``schedules.engine`` for the rules)."""
        semantics = self.program.semantics
        env, result = self.env, self.result
        groups_posted = 0
        for row, item in self.walk(rank):
            if type(item) is not tuple:  # a compute action
                index = self.compute_of_row[row]
                result.ready[index] = env.now
                if self.program.compute_blocked[index]:
                    yield env.event()  # its same-rank input comes later: it never runs
                partner = int(self.program.compute_pair[index])
                # an overlapped pair's forward waits for both halves' inputs
                for waiter in (index, partner) if partner > index else (index,):
                    needed = int(self.program.compute_need[waiter])
                    if needed >= 0:
                        waited = (self.group_done[rank, needed] if semantics in (RENDEZVOUS, TORCH_RUNTIME)
                                  else self.arrived_event(needed))
                        yield self.until((yield waited))
                duration = self.compute_seconds(rank, item, float(self.seconds[index]))
                start = env.now
                if self.channels.gate_last[index] >= 0:  # an action that waits for its parameter gathers
                    self.issue_gathers(index)
                    start = yield from self.gathered(index, duration)
                result.start[index] = start
                self.issue_released(index, start, start + duration)
                yield self.until(start + duration)
                result.end[index] = env.now
                if self.hold[index]:  # tensor-parallel collectives hold the rank after it
                    yield env.timeout(float(self.hold[index]))
                # a pair's outputs both leave when it ends, its forward's first
                sends = [int(self.program.compute_send[partner])] if 0 <= partner < index else []
                if not partner > index:
                    sends.append(int(self.program.compute_send[index]))
                for send in sends:
                    if send >= 0:
                        env.process(self.departure(rank, send))
                continue
            group = self.group_number(rank, groups_posted)
            groups_posted += 1
            if semantics in (RENDEZVOUS, TORCH_RUNTIME):
                yield env.timeout(self.comm_overhead * len(item))
                result.group_posted[group] = env.now
                self.group_done[rank, group] = env.event()
                self.stream_of(group).put((group, item))
                continue
            for action in item:  # buffered: sends leave as they are posted, then receives are posted
                if action.kind in SEND_KINDS:
                    yield env.timeout(self.comm_overhead)
                    env.process(self.departure(rank, self.key_of(action)))
            for action in item:
                if action.kind not in SEND_KINDS:
                    yield env.timeout(self.comm_overhead)
            result.group_posted[group] = env.now
        result.rank_clock[rank] = env.now
        if groups_posted and semantics in (RENDEZVOUS, TORCH_RUNTIME):  # the step ends with its last transfers
            first = self.group_number(rank, 0)
            last_done = 0.0
            for group in range(first, first + groups_posted):
                last_done = max(last_done, (yield self.group_done[rank, group]))
            yield self.until(last_done)
        result.rank_done[rank] = env.now
        channels = self.channels
        for collective in range(channels.channel_start[rank], channels.channel_start[rank + 1]):
            if channels.mode[collective] == AT_STEP_END:
                self.issued[collective].succeed(env.now)

    def issue_gathers(self, index: int) -> None:
        """ZeRO-3: the rank reached compute row ``index`` with its input there; issue the
        gathers of its layers now (ZeRO-1/2's were issued at the step's start)."""
        channels = self.channels
        first, last = int(channels.gate_first[index]), int(channels.gate_last[index])
        if channels.mode[first] == AT_ACTION:
            for collective in range(first, last + 1):
                self.issued[collective].succeed(self.env.now)

    def gathered(self, index: int, duration: float):
        """When compute row ``index`` (``duration`` seconds) may start, its parameter
        gathers considered (``schedules.dp_channel``): no earlier than its first layer's
        gather ends, and so that it ends no earlier than its last layer's gather's end
        plus one layer's share of it. Known once the last gather has taken its links,
        which can be after that start: nothing of the rank happens before the forward's
        end, which is after it."""
        channels = self.channels
        free = self.env.now  # the rank and the forward's inputs are there
        first, last = int(channels.gate_first[index]), int(channels.gate_last[index])
        last_end = yield self.scheduled[last]
        first_end = self.scheduled[first].value
        layers = last - first + 1
        return max(free, first_end, last_end + duration / layers - duration)

    def issue_released(self, index: int, start: float, end: float) -> None:
        """Compute row ``index`` runs from ``start`` to ``end``: issue the collectives it
        releases, at their fraction of it or at its end."""
        channels = self.channels
        for at in range(channels.row_start[index], channels.row_start[index + 1]):
            collective = int(channels.row_collectives[at])
            fraction = float(channels.fraction[collective])
            ready = start + fraction * (end - start) if channels.mode[collective] == AT_FRACTION else end
            self.issued[collective].succeed(ready)

    def channel_process(self, rank: int):
        """A rank's data-parallel channel: its collectives in channel order, each starting
        once issued, once the one before it ended and once its links are free, then
        holding them one bucket at a time (a transfer that took one in between delays the
        rest of the run)."""
        channels, result, env = self.channels, self.result, self.env
        free_at = 0.0
        for collective in range(channels.channel_start[rank], channels.channel_start[rank + 1]):
            ready = yield self.issued[collective]
            result.collective_ready[collective] = ready
            priority = self.channel_priority(rank, collective)
            yield env.at(max(ready, free_at), priority)
            links = channels.links_of(collective)
            ends = channels.bucket_ends(collective)
            for bucket, end in enumerate(ends):
                begin = self.links.free_from(links, env.now)
                if bucket == 0:
                    base = result.collective_start[collective] = begin
                elif begin > env.now:
                    base += begin - env.now
                free_at = base + end
                self.links.occupy(links, free_at)
                if bucket == len(ends) - 1:
                    self.scheduled[collective].succeed(free_at)
                yield env.at(free_at, priority)
            result.collective_end[collective] = free_at

    def channel_priority(self, rank: int, collective: int) -> int:
        """A collective's start after every P2P moment of its time, then in rank order."""
        p2p = FIRST_RANK_PRIORITY + self.program.ranks * (self.program.groups + 1)
        return p2p + rank * (self.channels.count + 1) + collective

    def stream_of(self, group: int) -> simpy.Store:
        """The P2P stream ``group`` runs on (its rank's; torch's runtime: its rank pair's),
        its process started with its first group."""
        stream = int(self.program.group_stream[group])
        if stream not in self.streams:
            self.streams[stream] = simpy.Store(self.env)
            self.env.process(self.stream_process(int(self.program.group_rank[group]), self.streams[stream]))
        return self.streams[stream]

    def stream_process(self, rank: int, stream: simpy.Store):
        """Rendezvous: a stream's groups one after another, each starting once posted and
        once the one before completed; a transfer leaves when the later of its two groups
        starts; a group completes when all its transfers have arrived."""
        env, result = self.env, self.result
        free_at = 0.0
        while True:
            group, actions = yield stream.get()
            start = max(float(result.group_posted[group]), free_at)
            result.group_start[group] = start
            yield self.in_rank_order(start, rank, group)
            arrivals = []
            waiting = []
            for action in actions:
                key = self.key_of(action)
                peer = self.offers.pop(key, None)
                if peer is None:
                    paired = env.event()
                    self.offers[key] = (group, paired)
                    waiting.append(paired)
                    continue
                peer_group, peer_paired = peer
                arrival = self.transfer(key, start)
                sender = group if action.kind in SEND_KINDS else peer_group
                result.posted[key] = result.group_posted[sender]
                result.departed[key], result.arrival[key] = start, arrival
                peer_paired.succeed(arrival)
                arrivals.append(arrival)
            for paired in waiting:
                arrivals.append((yield paired))
            free_at = max([start, *arrivals])
            result.group_done[group] = free_at
            self.group_done[rank, group].succeed(free_at)

    def departure(self, rank: int, key: int):
        """Buffered or free: transfer ``key`` leaves now (in rank order among the moment's)."""
        self.result.posted[key] = self.env.now
        yield self.in_rank_order(self.env.now, rank)
        arrival = self.transfer(key, self.env.now)
        self.result.departed[key], self.result.arrival[key] = self.env.now, arrival
        self.arrived_event(key).succeed(arrival)

    # -- bookkeeping ----------------------------------------------------------------------

    def walk(self, rank: int):
        """``(row, item)`` of each item ``rank`` walks: its compute actions and P2P groups
        (``free``: its compute actions only), with the program row where each begins."""
        row = self.first_row[rank]
        if self.program.semantics == FREE:
            for action in self.schedule.programs[rank]:
                if action.is_compute:
                    yield row, action
                row += 1
            return
        if self.program.semantics == TORCH_RUNTIME:  # every transfer alone
            for action in self.schedule.programs[rank]:
                yield row, action if action.is_compute else (action,)
                row += 1
            return
        for item in self.schedule.program_items(rank):
            yield row, item
            row += len(item) if type(item) is tuple else 1

    def arrived_event(self, key: int) -> simpy.Event:
        if key not in self.arrived:
            self.arrived[key] = self.env.event()
        return self.arrived[key]

    def key_of(self, action: Action) -> int:
        """The number of the transfer a P2P action is an end of (both ends name the same:
        ``ProgramArrays.transfer_key``, looked up by the action)."""
        return self.transfer_of[action]

    def group_number(self, rank: int, ordinal: int) -> int:
        """The global number of ``rank``'s ``ordinal``-th group."""
        return self.first_group[rank] + ordinal

    def run(self) -> StepRun:
        channels = self.channels
        for collective in np.flatnonzero(channels.mode == AT_STEP_START).tolist():
            self.issued[collective].succeed(0.0)  # the parameter gathers, from the step's start
        for rank in range(self.schedule.pp):
            self.env.process(self.rank_process(rank))
            self.env.process(self.channel_process(rank))
        self.env.run()
        result = self.result
        finished = ~np.isnan(result.rank_done)
        items = np.diff(self.program.rank_item_start)
        result.stuck_item = np.where(finished, -1, self._stuck_items(items)).astype(np.int64)
        return result

    def _stuck_items(self, items: np.ndarray) -> np.ndarray:
        """The item each unfinished rank stands at: the first compute action it never
        started, else its end (it waits for its last transfers)."""
        program = self.program
        where = items.copy()
        for rank in range(program.ranks):
            first, stop = program.rank_item_start[rank], program.rank_item_start[rank + 1]
            for item in range(first, stop):
                if not program.item_is_group[item] and np.isnan(self.result.start[program.item_ref[item]]):
                    where[rank] = item - first
                    break
        return where


def run_reference(program: EngineProgram, seconds: np.ndarray, hold: np.ndarray, wires: WireArrays,
                  comm_overhead: float, channels: ChannelArrays | None = None) -> StepRun:
    """``schedules.engine.run``'s result, computed by the SimPy processes."""
    if program.semantics not in (RENDEZVOUS, BUFFERED, FREE, TORCH_RUNTIME):
        raise ValueError(f"unknown semantics {program.semantics!r}")
    return SimpyStep(program, seconds, hold, wires, comm_overhead, channels).run()
