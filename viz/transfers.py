"""Measured sends as transfers: from posting to the moment the receiver had the data.

The executor stamps a send's end when it next polls the send's handle, and sends still
pending at the end of the step are stamped when the step drains them, so a measured
send can stretch across most of the step although its data arrived long before. The
receiver's own stamp is the better witness: its receive returns once the data is there.
So a measured send is drawn ending at the end of the matching receive on the peer rank
(``{s}SEND_F{m}`` feeds ``{s+1}RECV_F{m}``, ``{s}SEND_B{m}`` feeds ``{s-1}RECV_B{m}``),
when that receive ended before the send's own stamp. Ranks read their own clocks, which
the step's barrier aligns only to within a fraction of a millisecond; a receive that
ended *before* its send was posted on the other clock means the data moved at once,
and the send is drawn as an instant (nothing is invented to fill it). Where a rank
stayed in the step past its last action only to see its sends complete, that time is
drawn as the end-of-step ``wait``, so the step keeps its measured length.
Predicted traces are left alone: the simulator stamps arrival already.
"""

from __future__ import annotations

from schedules.trace import Trace, TraceEvent

_RECEIVER = {"SEND_F": ("RECV_F", 1), "SEND_B": ("RECV_B", -1)}


def as_transfers(trace: Trace) -> Trace:
    """``trace`` with each measured send ending when its receiver had the data (see the
    module docstring); the same object when nothing changes."""
    if trace.meta.get("source") != "measured":
        return trace
    receive_end = {
        (event.kind, event.stage, event.microbatch): event.end for event in trace.events if event.stream == "recv"
    }
    events: list[TraceEvent] = []
    held: dict[int, TraceEvent] = {}  # rank -> its latest-stamped send that was cut short
    for event in trace.events:
        receiver = _RECEIVER.get(event.kind) if event.stream == "send" else None
        if receiver is not None:
            kind, step = receiver
            arrival = receive_end.get((kind, event.stage + step, event.microbatch))
            if arrival is not None and arrival < event.end:
                if event.rank not in held or event.end > held[event.rank].end:
                    held[event.rank] = event
                event = event._replace(end=max(arrival, event.start))
        events.append(event)
    if not held:
        return trace
    last_end = {}
    for event in events:
        if event.stream != "send" and event.end > last_end.get(event.rank, float("-inf")):
            last_end[event.rank] = event.end
    for rank, send in held.items():
        # The rank itself stayed in the step until it saw its sends complete: that
        # time is the end-of-step wait, drawn as such so the step keeps its length.
        since = max(last_end.get(rank, send.start), send.start)
        if send.end > since:
            events.append(send._replace(start=since, stream="wait"))
    return Trace(events, trace.meta)
