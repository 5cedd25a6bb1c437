"""Measured sends as transfers: from posting to the moment the receiver had the data.

The executor stamps a send's end when it next polls the send's handle, and sends still
pending at the end of the step are stamped when the step drains them, so a measured
send can stretch across most of the step although its data arrived long before. The
receiver's own stamp is the better witness: its receive returns once the data is there.
So a measured send is drawn ending at the end of the matching receive on the peer rank
(``{s}SEND_F{m}`` feeds ``{s+1}RECV_F{m}``, ``{s}SEND_B{m}`` feeds ``{s-1}RECV_B{m}``),
when that receive ended after the send was posted and before the send's own stamp.
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
    changed = False
    for event in trace.events:
        receiver = _RECEIVER.get(event.kind) if event.stream == "send" else None
        if receiver is not None:
            kind, step = receiver
            arrival = receive_end.get((kind, event.stage + step, event.microbatch))
            if arrival is not None and event.start <= arrival < event.end:
                event = event._replace(end=arrival)
                changed = True
        events.append(event)
    return Trace(events, trace.meta) if changed else trace
