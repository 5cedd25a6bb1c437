"""Where each rank's step time went: compute, pipeline bubble, exposed communication.

A rank blocked on a receive is waiting for one of two things. Before the producer has
finished the data there is nothing to send yet: that wait is the schedule's *bubble*,
and no faster network would shorten it. Once the data exists, the rest of the wait is
the transfer itself (and any queue in front of it on the links): *exposed
communication*, the part a faster network or better overlap would remove.

The split is read from the Trace alone. A receive is matched with the send of the same
transfer (the SEND that ``Action.matching`` names); the send event's ``start`` is the
moment the producer posted it, i.e. the moment the data was ready. Both the simulator
(``pipesim.engine``) and the executor (``executor.runtime``) record sends that way, so a
prediction and a measurement are split by the same rule.

Every second of a rank's step, from the step's first event to its last, goes to exactly
one part, so ``busy + bubble + exposed_comm + tp + dp + optimizer + overhead =
makespan`` by construction. Where events overlap, the part that holds the rank wins:
compute (``busy``), then tensor-parallel collectives (``tp``), the optimizer step
(``optimizer``), receive waits (``bubble`` before the data was ready, then
``exposed_comm``), and last the gradient reduction (``dp``: only the part no compute or
wait hides). Time before a rank's first event or after its last is ``bubble`` (the
pipeline filling and draining); gaps between its own events are ``overhead`` (posting
communication, host work between actions).
"""

from __future__ import annotations

from dataclasses import dataclass

from schedules.action import RECV_KINDS, Action
from schedules.trace import Trace, TraceEvent

# Parts in the order they claim a moment where several events overlap.
HOLDING_STREAMS = {"compute": "busy", "tp": "tp", "step": "optimizer"}
PARTS = ("busy", "tp", "optimizer", "bubble", "exposed_comm", "dp", "overhead")
_PRIORITY = {part: index for index, part in enumerate(PARTS)}


@dataclass(frozen=True)
class RankTime:
    """Seconds of one rank's step by what the rank was doing; they sum to the makespan."""

    busy: float = 0.0
    bubble: float = 0.0
    exposed_comm: float = 0.0
    tp: float = 0.0
    dp: float = 0.0
    optimizer: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return self.busy + self.bubble + self.exposed_comm + self.tp + self.dp + self.optimizer + self.overhead


def data_ready_times(trace: Trace) -> dict[tuple[int, str, int], float]:
    """``(stage, SEND kind, microbatch) -> `` the start of that send (when its data was ready)."""
    return {(event.stage, event.kind, event.microbatch): event.start
            for event in trace.events if event.stream == "send"}


def receive_ready(event: TraceEvent, ready: dict[tuple[int, str, int], float]) -> float:
    """When the data a receive event waits for was ready: its send's start. A receive
    whose send is not in the trace (a trace of one rank only) counts as ready at once,
    so all its wait is communication, as nothing shows a producer to wait for."""
    step, send_kind = _SENDER[event.kind]
    return ready.get((event.stage + step, send_kind, event.microbatch), event.start)


# RECV kind -> (the sending stage's offset, its SEND kind), as ``Action.matching`` says
_SENDER = {kind: (Action(0, kind, 0).matching().stage, Action(0, kind, 0).matching().kind) for kind in RECV_KINDS}


def split_receive(event: TraceEvent, ready_at: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """``(bubble, exposed)`` intervals of one receive wait: before ``ready_at``, after it."""
    cut = min(max(ready_at, event.start), event.end)
    return (event.start, cut), (cut, event.end)


def time_accounting(trace: Trace, groups: list[list[TraceEvent]] | None = None,
                    bounds: tuple[float, float] | None = None) -> list[RankTime]:
    """Per rank, the step's time split into the parts of ``RankTime`` (see the module).
    ``groups`` (``trace.by_rank()``) and ``bounds`` (the step's first start and last
    end) save computing them again."""
    if not trace.events:
        return [RankTime() for _ in range(trace.num_ranks)]
    first, last = bounds or (min(event.start for event in trace.events), max(event.end for event in trace.events))
    ready = data_ready_times(trace)
    return [_rank_time(rank_events, ready, first, last) for rank_events in groups or trace.by_rank()]


def _rank_time(rank_events: list[TraceEvent], ready: dict, first: float, last: float) -> RankTime:
    seconds = [0.0] * len(PARTS)
    holding: list[tuple[float, float]] = []  # what holds the rank: compute, tp, optimizer, receive waits
    pieces: list[tuple[float, float, int]] = []  # the same, with its part, for the general case
    reducing: list[tuple[float, float]] = []
    sender = _SENDER
    for event in rank_events:
        stream = event.stream
        start, end = event.start, event.end
        if end <= start and stream != "recv":
            continue
        if stream == "compute":
            seconds[0] += end - start
            holding.append((start, end))
            pieces.append((start, end, 0))
        elif stream == "recv":  # split_receive, inlined: a large step has ~100k waits
            step, send_kind = sender[event.kind]
            cut = ready.get((event.stage + step, send_kind, event.microbatch), start)
            cut = start if cut < start else end if cut > end else cut
            if end > start:
                seconds[_BUBBLE] += cut - start
                seconds[_EXPOSED] += end - cut
                holding.append((start, end))
                pieces.append((start, cut, _BUBBLE))
                pieces.append((cut, end, _EXPOSED))
        elif stream in HOLDING_STREAMS:
            part = _PRIORITY[HOLDING_STREAMS[stream]]
            seconds[part] += end - start
            holding.append((start, end))
            pieces.append((start, end, part))
        elif stream == "dp":
            reducing.append((start, end))
    if not holding and not reducing:
        seconds[_BUBBLE] = last - first
        return RankTime(*_in_field_order(seconds))
    holding.sort()
    reducing.sort()
    if _disjoint(holding):
        seconds[_PRIORITY["dp"]] = _measure(reducing) - _overlap(reducing, holding)
        own_first = min(holding[0][0] if holding else last, reducing[0][0] if reducing else last)
        own_last = max(holding[-1][1] if holding else first, max((end for _, end in reducing), default=first))
        seconds[_PRIORITY["overhead"]] = max(0.0, (own_last - own_first) - sum(seconds))
    else:
        seconds = [0.0] * len(PARTS)
        pieces = [piece for piece in pieces if piece[1] > piece[0]]
        own_first, own_last = _sweep(pieces + [(start, end, _PRIORITY["dp"]) for start, end in reducing], seconds)
    seconds[_BUBBLE] += (own_first - first) + (last - own_last)
    return RankTime(*_in_field_order(seconds))


_BUBBLE = _PRIORITY["bubble"]
_EXPOSED = _PRIORITY["exposed_comm"]


def _in_field_order(seconds: list[float]) -> list[float]:
    """``seconds`` (indexed like ``PARTS``) in ``RankTime``'s field order."""
    return [seconds[_PRIORITY[name]] for name in RankTime.__dataclass_fields__]


def _disjoint(spans: list[tuple[float, float]]) -> bool:
    """Whether sorted spans never overlap (the usual case: one rank does one thing at a
    time; batched receives waited on together are the exception)."""
    return all(spans[index][0] >= spans[index - 1][1] for index in range(1, len(spans)))


def _measure(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of sorted intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Length of (union of ``first``) meeting (union of ``second``); both sorted by start,
    ``second`` without overlaps of its own."""
    total, j, reach = 0.0, 0, float("-inf")
    for start, end in first:
        start = max(start, reach)  # what an earlier interval of ``first`` already covered
        if end <= start:
            continue
        reach = end
        while j < len(second) and second[j][1] <= start:
            j += 1
        k = j
        while k < len(second) and second[k][0] < end:
            total += max(0.0, min(end, second[k][1]) - max(start, second[k][0]))
            k += 1
    return total


def _sweep(pieces: list[tuple[float, float, int]], seconds: list[float]) -> tuple[float, float]:
    """Give each stretch of time to the highest-priority part open then (the general
    case, overlapping pieces); return the first and last moment covered."""
    boundaries = sorted([(start, 1, part) for start, _, part in pieces] + [(end, -1, part) for _, end, part in pieces])
    open_count = [0] * len(PARTS)
    previous = boundaries[0][0]
    for moment, change, part in boundaries:
        if moment > previous:
            owner = next((index for index, count in enumerate(open_count) if count), None)
            seconds[owner if owner is not None else _PRIORITY["overhead"]] += moment - previous
            previous = moment
        open_count[part] += change
    return boundaries[0][0], boundaries[-1][0]
