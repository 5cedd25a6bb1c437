"""Where each rank's step time went: compute, pipeline bubble, exposed communication.

A rank blocked on a receive is waiting for one of two things. Before the producer has
finished the data there is nothing to send yet: that wait is the schedule's *bubble*,
and no faster network would shorten it. Once the data exists, the rest of the wait is
communication — posting it, queueing on the links or the sender's stream, the
transfer itself: *exposed communication*, the part a faster network or better
overlap would remove.

The split is read from the Trace alone, so a prediction and a measurement are split by
the same rule. A receive is matched with the send of the same transfer (the SEND
``Action.matching`` names), and the send event's ``start`` is the moment the producer
posted it — its data was ready and handed over. Both the simulator
(``pipesim.sim.engine``) and the executor (``executor.runtime``) record sends from that
moment. Under rendezvous semantics (NCCL; ``meta["p2p"]``, or any backend but gloo) a
rank can also be held by its own send, whose transfer cannot leave before the peer
posts the matching receive: while a send the rank has posted waits for a receive not
yet posted, the rank's wait is bubble too (the peer is still busy with earlier work).
Buffered sends (gloo) never hold the rank.

Every second of a rank's step, from the step's first event to its last, goes to exactly
one part, so ``busy + bubble + exposed_comm + tp + dp + optimizer + overhead =
makespan`` by construction. Where events overlap, the part that holds the rank wins:
compute (``busy``), then tensor-parallel collectives (``tp``), the optimizer step
(``optimizer``), waits (``recv`` and end-of-step ``wait`` events: ``bubble`` while some
data the rank needs is not sent yet or some send of the rank is not yet matched,
``exposed_comm`` otherwise), and last the gradient reduction (``dp``: only the part
nothing else hides). Time before a rank's first event or after its last is ``bubble``
(the pipeline filling and draining); gaps between its own events are ``overhead``
(posting communication, host work between actions).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from schedules.collector import without_collector
from schedules.trace import Trace, TraceEvent

try:  # the usual case of the accounting in C, built by setup.py where a compiler is found
    from schedules import _accounting as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

# Whether ``time_accounting`` asks the C version first (PIPESIM_PURE_PYTHON=1: Python only).
ACCELERATED = _native is not None and os.environ.get("PIPESIM_PURE_PYTHON", "") in ("", "0")

# Parts in the order they claim a moment where several events overlap.
HOLDING_STREAMS = {"compute": "busy", "tp": "tp", "step": "optimizer"}
WAITING_STREAMS = frozenset({"recv", "wait"})
PARTS = ("busy", "tp", "optimizer", "bubble", "exposed_comm", "dp", "overhead")
_PRIORITY = {part: index for index, part in enumerate(PARTS)}
_BUBBLE = _PRIORITY["bubble"]
_EXPOSED = _PRIORITY["exposed_comm"]
_DP = _PRIORITY["dp"]
_OVERHEAD = _PRIORITY["overhead"]
_ROUNDING = 1e-12  # of the step: below it, a difference of two sums is float rounding
_WAITING = len(PARTS)  # sweep-only: a wait, bubble or exposed by what is open beside it
_PEER = len(PARTS) + 1  # sweep-only: something the rank waits for is not ready on the other side


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


def data_ready_times(trace: Trace) -> dict[str, float]:
    """Action text of every SEND -> when it was posted (its event's start)."""
    return {event.action: event.start for event in trace.events if event.stream == "send"}


def data_ready(event: TraceEvent, sent: dict[str, float]) -> float | None:
    """When the data of a RECV was ready: the start of its send, or None if the trace
    does not hold that send."""
    return sent.get(_SENDER_TEXT[event.kind](event))


def receive_split(event: TraceEvent, ready: float | None) -> tuple[float, float]:
    """``(bubble, exposed)`` seconds of one receive wait on its own: before its data was
    ready, and after. A receive whose send is not in the trace (a trace of one rank
    only) counts as ready at once: nothing shows a producer to wait for."""
    cut = event.start if ready is None else min(max(ready, event.start), event.end)
    return cut - event.start, event.end - cut


def holds_on_sends(trace: Trace) -> bool:
    """Whether a rank's own sends can hold it (rendezvous semantics)."""
    p2p = trace.meta.get("p2p")
    if p2p is None:
        p2p = "buffered" if trace.meta.get("backend") == "gloo" else "rendezvous"
    return p2p != "buffered"


def split_waits(trace: Trace) -> list[tuple[TraceEvent, list[tuple[float, float, str]]]]:
    """Every wait (``recv``, ``wait``) event with its pieces ``(start, end, part)``,
    ``part`` being ``bubble`` or ``exposed_comm`` by the rule of ``time_accounting``
    (for charts that draw the two apart)."""
    sent = data_ready_times(trace)
    posted = {event.action: event.start for event in trace.events if event.stream == "recv"} \
        if holds_on_sends(trace) else None
    result = []
    for rank_events in trace.by_rank():
        peer = []
        for event in rank_events:
            if event.stream == "recv":
                bubble, _ = receive_split(event, data_ready(event, sent))
                if bubble > 0:
                    peer.append((event.start, event.start + bubble))
            elif event.stream == "send" and posted is not None:
                accepted = posted.get(_RECEIVER_TEXT[event.kind](event))
                if accepted is not None and accepted > event.start:
                    peer.append((event.start, min(accepted, event.end)))
        peer = _union(sorted(peer))
        for event in rank_events:
            if event.stream in WAITING_STREAMS:
                result.append((event, _cut(event.start, event.end, peer)))
    return result


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted intervals merged where they touch or overlap."""
    merged: list[tuple[float, float]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _cut(start: float, end: float, bubbles: list[tuple[float, float]]) -> list[tuple[float, float, str]]:
    """``[start, end]`` cut into bubble pieces (inside ``bubbles``) and exposed ones."""
    pieces, moment = [], start
    for low, high in bubbles:
        low, high = max(low, start), min(high, end)
        if high <= low:
            continue
        if low > moment:
            pieces.append((moment, low, "exposed_comm"))
        pieces.append((low, high, "bubble"))
        moment = high
    if end > moment or not pieces:
        pieces.append((moment, end, "exposed_comm"))
    return pieces


@without_collector
def time_accounting(trace: Trace, groups: list[list[TraceEvent]] | None = None,
                    bounds: tuple[float, float] | None = None) -> list[RankTime]:
    """Per rank, the step's time split into the parts of ``RankTime`` (see the module).
    ``groups`` (``trace.by_rank()``) and ``bounds`` (the step's first start and last
    end) save computing them again."""
    if not trace.events:
        return [RankTime() for _ in range(trace.num_ranks)]
    first, last = bounds or (min(event.start for event in trace.events), max(event.end for event in trace.events))
    groups = groups or trace.by_rank()
    sends_hold = holds_on_sends(trace)
    # the usual case in C (the same operations; ranks where what holds them overlaps come back None)
    native = _native.accounting(groups, trace.event_list(), sends_hold, first, last) if ACCELERATED \
        else [None] * len(groups)
    if all(seconds is not None for seconds in native):
        return [RankTime(*_in_field_order(seconds)) for seconds in native]
    sent = data_ready_times(trace)
    posted = {event.action: event.start for event in trace.events if event.stream == "recv"} if sends_hold else None
    return [RankTime(*_in_field_order(seconds)) if seconds is not None
            else _rank_time_in_python(rank_events, sent, posted, first, last)
            for rank_events, seconds in zip(groups, native, strict=True)]


def _rank_time_in_python(rank_events: list[TraceEvent], sent: dict[str, float], posted: dict[str, float] | None,
                         first: float, last: float) -> RankTime:
    """One rank's ``RankTime`` (``schedules/_accounting.c`` computes the disjoint case the
    same way, operation for operation)."""
    seconds = [0.0] * len(PARTS)
    spans: list[tuple[float, float]] = []  # what holds the rank: compute, tp, optimizer (waits added below)
    waits: list[tuple[float, float]] = []
    peer: list[tuple[float, float]] = []  # a wait's data not sent yet, or a send of the rank not yet matched
    reducing: list[tuple[float, float]] = []
    holding = HOLDING_STREAMS
    for event in rank_events:
        stream = event.stream
        start, end = event.start, event.end
        if stream == "recv":  # the hot path: inlined, a large step has ~100k of them
            if end > start:
                waits.append((start, end))
                if event.kind == "RECV_F":
                    ready = sent.get(f"{event.stage - 1}SEND_F{event.microbatch}")
                else:
                    ready = sent.get(f"{event.stage + 1}SEND_B{event.microbatch}")
                if ready is not None and ready > start:
                    peer.append((start, ready if ready < end else end))
        elif stream in holding:
            if end > start:
                seconds[_PRIORITY[holding[stream]]] += end - start
                spans.append((start, end))
        elif stream == "wait":
            if end > start:
                waits.append((start, end))
        elif stream == "send":
            if posted is not None:
                accepted = posted.get(_RECEIVER_TEXT[event.kind](event))
                if accepted is not None and accepted > start:
                    peer.append((start, accepted if accepted < end else end))
        elif stream == "dp":
            if end > start:
                reducing.append((start, end))
    if not spans and not waits and not reducing:
        seconds[_BUBBLE] = last - first
        return RankTime(*_in_field_order(seconds))
    # receives of one group are waited on together: their waits are one blocked stretch
    waits = _union(sorted(waits))
    spans += waits
    spans.sort()
    reducing.sort()
    if _disjoint(spans):
        seconds[_BUBBLE] = _overlap(_union(sorted(peer)), waits)
        seconds[_EXPOSED] = _measure(waits) - seconds[_BUBBLE]
        if seconds[_EXPOSED] < _ROUNDING * (last - first):  # a difference of equal sums, not a wait
            seconds[_BUBBLE] += seconds[_EXPOSED]
            seconds[_EXPOSED] = 0.0
        seconds[_DP] = _measure(reducing) - _overlap(reducing, spans)
        own_first = min(spans[0][0] if spans else last, reducing[0][0] if reducing else last)
        own_last = max(spans[-1][1] if spans else first, max((end for _, end in reducing), default=first))
        total = 0.0
        for part_seconds in seconds:  # left to right, as in C (Python 3.12's sum() compensates)
            total += part_seconds
        seconds[_OVERHEAD] = max(0.0, (own_last - own_first) - total)
    else:
        seconds = [0.0] * len(PARTS)
        own_first, own_last = _sweep(_pieces(rank_events, peer), seconds)
    seconds[_BUBBLE] += (own_first - first) + (last - own_last)
    return RankTime(*_in_field_order(seconds))


def _pieces(rank_events: list[TraceEvent], peer: list[tuple[float, float]]) -> list[tuple[float, float, int]]:
    """``(start, end, part)`` of every event of a rank for the sweep, plus the stretches
    where it waits for a peer."""
    pieces = [(start, end, _PEER) for start, end in peer]
    for event in rank_events:
        stream = event.stream
        if stream in HOLDING_STREAMS:
            pieces.append((event.start, event.end, _PRIORITY[HOLDING_STREAMS[stream]]))
        elif stream in WAITING_STREAMS:
            pieces.append((event.start, event.end, _WAITING))
        elif stream == "dp":
            pieces.append((event.start, event.end, _DP))
    return [piece for piece in pieces if piece[1] > piece[0]]


# RECV kind -> the text of the send it is matched with (as ``Action.matching`` says)
_SENDER_TEXT = {
    "RECV_F": lambda event: f"{event.stage - 1}SEND_F{event.microbatch}",
    "RECV_B": lambda event: f"{event.stage + 1}SEND_B{event.microbatch}",
}
# SEND kind -> the text of the receive it is matched with
_RECEIVER_TEXT = {
    "SEND_F": lambda event: f"{event.stage + 1}RECV_F{event.microbatch}",
    "SEND_B": lambda event: f"{event.stage - 1}RECV_B{event.microbatch}",
}


def _in_field_order(seconds: list[float]) -> list[float]:
    """``seconds`` (indexed like ``PARTS``) in ``RankTime``'s field order."""
    return [seconds[_PRIORITY[name]] for name in RankTime.__dataclass_fields__]


def _disjoint(spans: list[tuple[float, float]]) -> bool:
    """Whether sorted spans never overlap (the usual case: one rank does one thing at a
    time; receives batched together and waited on together are the exception)."""
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
    """Give each stretch of time to the part that holds the rank then (the general
    case: overlapping waits, or sends that hold the rank); return the first and last
    moment a part other than a send's wait covers."""
    boundaries = sorted([(start, 1, part) for start, end, part in pieces if end > start]
                        + [(end, -1, part) for start, end, part in pieces if end > start])
    covering = [piece for piece in pieces if piece[2] != _PEER and piece[1] > piece[0]]
    own_first = min(start for start, _, _ in covering)
    own_last = max(end for _, end, _ in covering)
    open_count = [0] * (len(PARTS) + 2)
    previous = boundaries[0][0]
    for moment, change, part in boundaries:
        if moment > previous:
            lo, hi = max(previous, own_first), min(moment, own_last)
            if hi > lo:
                seconds[_owner(open_count)] += hi - lo
            previous = moment
        open_count[part] += change
    return own_first, own_last


def _owner(open_count: list[int]) -> int:
    """The part a moment belongs to, given how many pieces of each kind are open."""
    for part in (0, 1, 2):  # busy, tp, optimizer
        if open_count[part]:
            return part
    if open_count[_WAITING]:
        return _BUBBLE if open_count[_PEER] else _EXPOSED
    if open_count[_DP]:
        return _DP
    return _OVERHEAD
