"""Split a Trace into the layers a Gantt chart draws, one per colour.

Each layer becomes one plotly trace holding arrays for all its events. Drawing a
trace per event would make a 400k-event step unusable, and grouping by colour is also
what gives the legend one entry per kind.

A wait (``recv``, or the end-of-step ``wait``) is drawn in pieces by the rule of
``schedules.accounting``: *bubble* while the rank waits for a peer (data not yet
sent, or a send of its own not yet matched), *exposed communication* while the data
is in flight, so the chart never calls waiting for upstream compute communication.

Within a rank's row the layers sit in lanes: compute (and receive waits, which can
only happen while compute is stalled) in the wide middle lane, outgoing transfers in
a thin lane below, any other stream (collectives, later) in a thin lane above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schedules.accounting import WAITING_STREAMS, split_waits
from schedules.trace import Trace, TraceEvent
from viz.colors import BUBBLE_COLOR, kind_color, stream_color

COMPUTE_LANE = (0.0, 0.56)  # (centre offset from the rank's row, thickness), row pitch 1
SEND_LANE = (0.37, 0.14)  # below the compute bar (the y axis runs top to bottom)
OTHER_LANE = (-0.37, 0.14)  # above it

KIND_LABELS = {
    "F": "F forward",
    "B": "B backward",
    "I": "I input-grad backward",
    "W": "W weight-grad backward",
}
STREAM_LABELS = {
    "send": "send (posted to arrival)",
    "recv": "exposed comm (wait, data in flight)",
    "bubble": "bubble (wait for a peer)",
}
_COMPUTE_ORDER = ("F", "B", "I", "W")


@dataclass
class Layer:
    """Events drawn alike: one colour, one lane, one legend entry."""

    label: str
    color: str
    lane: tuple[float, float]
    is_compute: bool = False
    hatched: bool = False
    events: list[TraceEvent] = field(default_factory=list)


def layers_of(trace: Trace) -> list[Layer]:
    """The layers of ``trace`` in drawing order: receive waits first (underneath; the
    bubble part, then the exposed-communication part), compute kinds in F, B, I, W
    order, then sends, then any other stream by name."""
    compute: dict[str, Layer] = {}
    bubble = Layer(STREAM_LABELS["bubble"], BUBBLE_COLOR, COMPUTE_LANE, hatched=True)
    recv = Layer(STREAM_LABELS["recv"], stream_color("recv"), COMPUTE_LANE)
    send = Layer(STREAM_LABELS["send"], stream_color("send"), SEND_LANE)
    others: dict[str, Layer] = {}
    for event in trace.events:
        if event.stream == "compute":
            layer = compute.get(event.kind)
            if layer is None:
                label = KIND_LABELS.get(event.kind, event.kind)
                layer = compute[event.kind] = Layer(label, kind_color(event.kind), COMPUTE_LANE, is_compute=True)
            layer.events.append(event)
        elif event.stream in WAITING_STREAMS:
            continue  # drawn below, cut into their bubble and exposed pieces
        elif event.stream == "send":
            send.events.append(event)
        else:
            layer = others.get(event.stream)
            if layer is None:
                layer = others[event.stream] = Layer(event.stream, stream_color(event.stream), OTHER_LANE)
            layer.events.append(event)
    for event, pieces in split_waits(trace):
        for start, end, part in pieces:
            (bubble if part == "bubble" else recv).events.append(event._replace(start=start, end=end))
    ordered_kinds = sorted(
        compute, key=lambda kind: (_COMPUTE_ORDER.index(kind) if kind in _COMPUTE_ORDER else 99, kind)
    )
    layers = [bubble, recv, *(compute[kind] for kind in ordered_kinds), send,
              *(others[name] for name in sorted(others))]
    return [layer for layer in layers if layer.events]
