"""Split a Trace into the layers a Gantt chart draws, one per colour.

Each layer becomes one plotly trace holding arrays for all its events. Drawing a
trace per event would make a 400k-event step unusable, and grouping by colour is also
what gives the legend one entry per kind.

A wait (``recv``, or the end-of-step ``wait`` a rank spends until its last sends are
matched) is drawn in pieces by the rule of ``schedules.accounting``: *bubble* while the
rank waits for a peer (data not yet sent, or a send of its own not yet matched),
*exposed communication* while the data is in flight, so the chart never calls waiting
for upstream compute communication.

Within a rank's row the layers sit in lanes: compute (and receive waits, which can
only happen while compute is stalled) in the wide middle lane, outgoing transfers in
a thin lane below, any unknown stream in a thin lane above. Whatever occupies the rank
itself shares the middle lane, so no time the rank spent reads as a white gap: tensor-
parallel collectives (issued inside a compute action), the optimizer step, waits, and
the gradient all-reduce (drawn *under* compute, so what shows of it is the part compute
did not hide). After a rank's last event the lane is filled to the step's end as
"idle", so a rank that finished early is seen to wait. What is left — a stretch of the
rank's lane no event covers — is labelled by the rule of ``schedules.accounting``:
before the rank's first event it is bubble (the pipeline filling), between its own
events ``overhead`` (posting communication, host work between actions: a profile's
modelled overhead, a measured executor's gaps). So every moment of a rank's row from
the step's start to its end carries a label (``lane_gaps``).

Chunks: on a schedule with ``v > 1`` model chunks per rank, compute layers are split by
chunk (``stage // pp``, which is right for looped and V placements alike), each chunk
a darker shade of its kind's colour with its own texture and legend entry.

A blocked-time kind (bubble, exposed communication) is one ``Layer`` built in
``layers_of``; a new kind is one more ``Layer`` placed in the drawing order there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schedules.accounting import WAITING_STREAMS, split_waits
from schedules.trace import Trace, TraceEvent
from viz.colors import BUBBLE_COLOR, STEP_STREAM_STYLES, chunk_color, chunk_pattern, kind_color, stream_color

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
IDLE_STREAM = "idle"  # drawn only: a rank's time from its last event to the step's end
OVERHEAD_STREAM = "overhead"  # drawn only: gaps between a rank's own events
OVERHEAD_LABEL = "overhead (between actions: posting communication, host work)"
OVERHEAD_COLOR = "#FDD0A2"  # pale orange: time the rank spent on neither compute nor a wait
# streams drawn in the rank's own lane (a send leaving, in the lane below, does not hold it)
LANE_STREAMS = frozenset({"compute", *WAITING_STREAMS, *STEP_STREAM_STYLES})
_COMPUTE_ORDER = ("F", "B", "I", "W")
UNDER_COMPUTE = ("dp", IDLE_STREAM)  # step-level layers drawn beneath the compute bars


@dataclass
class Layer:
    """Events drawn alike: one colour, one lane, one legend entry. ``pattern`` is a
    plotly bar pattern shape ('' for solid); ``hatched`` is the receive-wait hatch."""

    label: str
    color: str
    lane: tuple[float, float]
    is_compute: bool = False
    hatched: bool = False
    events: list[TraceEvent] = field(default_factory=list)
    pattern: str = ""
    pattern_color: str = ""

    @property
    def textured(self) -> bool:
        return self.hatched or bool(self.pattern)


def chunk_of(event: TraceEvent, ranks: int) -> int:
    """The model chunk a stage belongs to on its rank: stage ``s`` is chunk ``s // pp``
    under both looped (``s % pp``) and V-shaped placements."""
    return event.stage // ranks if ranks > 0 and event.stage >= 0 else 0


def chunks_in(trace: Trace) -> int:
    """Model chunks per rank, from ``meta`` or, failing that, from the stages seen."""
    declared = int(trace.meta.get("virtual_stages") or 0)
    if declared:
        return declared
    stages = [event.stage for event in trace.events if event.stream == "compute"]
    return max(stages, default=0) // max(trace.num_ranks, 1) + 1


def _compute_layer(kind: str, chunk: int, chunks: int) -> Layer:
    label = KIND_LABELS.get(kind, kind)
    if chunks <= 1:
        return Layer(label, kind_color(kind), COMPUTE_LANE, is_compute=True)
    return Layer(f"{label} · chunk {chunk}", chunk_color(kind, chunk), COMPUTE_LANE, is_compute=True,
                 pattern=chunk_pattern(chunk), pattern_color=kind_color(kind))


# dp events by kind (pipesim.sim.parallel writes them): what the dp lane is called
DP_LABELS = (
    ("ALLGATHER_PARAMS", "dp reduce-scatter + parameter all-gather (ZeRO; shows where compute does not hide it)"),
    ("REDUCE_SCATTER_DP", "dp gradient reduce-scatter (ZeRO; shows where compute does not hide it)"),
)


HELD_DP_LABEL = "dp: ZeRO-3 gathers and reduce-scatters the rank was held in, inside its actions"
HELD_DP_PATTERN = "x"


def held_inside_actions(event: TraceEvent, meta: dict) -> bool:
    """Whether ``event`` (on the dp stream) held its rank inside the action it serves, so
    that it is drawn over the compute bar as tp's collectives are, not beneath it where
    the bar would hide it: a collective that serves an action (ZeRO-3's, named
    ``0ALLGATHER_PARAMS[L1](0F2)`` by the simulator and the executor alike) in a trace
    whose run says its ZeRO-3 collectives held the rank (``dp_held_inside_actions``: the
    executor's FSDP2 on CPU, where they are synchronous). The simulator's are prefetched
    and overlapped beside the compute, and stay beneath it."""
    return bool(meta.get("dp_held_inside_actions")) and event.action.endswith(")")


def dp_label(kinds: set[str]) -> str:
    """The dp lane's name for the collectives it holds: an all-reduce, or ZeRO's
    reduce-scatter, with ZeRO-3's parameter gathers named as such."""
    for kind, label in DP_LABELS:
        if kind in kinds:
            return label
    return STEP_STREAM_STYLES["dp"][0]


def _step_layer(stream: str) -> Layer:
    label, color, pattern = STEP_STREAM_STYLES[stream]
    return Layer(label, color, COMPUTE_LANE, pattern=pattern)


def idle_tails(trace: Trace) -> list[TraceEvent]:
    """One event per rank from its last event's end to the step's end (none for the
    ranks that end the step)."""
    if not trace.events:
        return []
    step_start = min(event.start for event in trace.events)
    step_end = max(event.end for event in trace.events)
    tails = []
    for rank, rank_events in enumerate(trace.by_rank()):
        last = max((event.end for event in rank_events), default=step_start)
        if step_end - last > 1e-12 * max(abs(step_end), 1.0):
            tails.append(TraceEvent(rank, "idle (rank done)", IDLE_STREAM, -1, -1, last, step_end, IDLE_STREAM))
    return tails


def lane_gaps(trace: Trace) -> list[TraceEvent]:
    """The stretches of each rank's own lane that no event nor its idle tail covers (a
    rank's tail starts after its last send, which is not in its lane),
    as events: before its first event a ``bubble`` wait (the fill), between its events
    ``overhead`` (the part ``schedules.accounting`` gives the name)."""
    if not trace.events:
        return []
    step_start = min(event.start for event in trace.events)
    scale = max(abs(max(event.end for event in trace.events)), 1.0)
    spans: dict[int, list[tuple[float, float]]] = {}
    for event in [*trace.events, *idle_tails(trace)]:
        if event.stream in LANE_STREAMS:
            spans.setdefault(event.rank, []).append((event.start, event.end))
    gaps = []
    for rank in range(trace.num_ranks):
        moment, first = step_start, True
        for start, end in sorted(spans.get(rank, ())):
            if start - moment > 1e-12 * scale:
                stream, label = ("bubble", "fill (waiting for the pipeline)") if first else \
                    (OVERHEAD_STREAM, "overhead")
                gaps.append(TraceEvent(rank, label, stream, -1, -1, moment, start, stream))
            moment, first = max(moment, end), False
    return gaps


def layers_of(trace: Trace) -> list[Layer]:
    """The layers of ``trace`` in drawing order: waits first (underneath; the bubble
    part, then the exposed-communication part), the gradient all-reduce and the idle
    tail, compute kinds in F, B, I, W order (by chunk),
    the dp collectives that held the rank inside its actions (``held_inside_actions``),
    the other in-lane step parts (tp, optimizer), sends, then any
    unknown stream by name."""
    chunks = chunks_in(trace)
    ranks = max(trace.num_ranks, 1)
    compute: dict[tuple[str, int], Layer] = {}
    bubble = Layer(STREAM_LABELS["bubble"], BUBBLE_COLOR, COMPUTE_LANE, hatched=True)
    recv = Layer(STREAM_LABELS["recv"], stream_color("recv"), COMPUTE_LANE)
    send = Layer(STREAM_LABELS["send"], stream_color("send"), SEND_LANE)
    steps: dict[str, Layer] = {}
    others: dict[str, Layer] = {}
    overhead = Layer(OVERHEAD_LABEL, OVERHEAD_COLOR, COMPUTE_LANE)
    held = Layer(HELD_DP_LABEL, STEP_STREAM_STYLES["dp"][1], COMPUTE_LANE, pattern=HELD_DP_PATTERN)
    for event in [*trace.events, *idle_tails(trace), *lane_gaps(trace)]:
        stream = event.stream
        if stream == "bubble":  # the fill before a rank's first event
            bubble.events.append(event)
        elif stream == OVERHEAD_STREAM:
            overhead.events.append(event)
        elif stream == "compute":
            chunk = chunk_of(event, ranks) if chunks > 1 else 0
            layer = compute.get((event.kind, chunk))
            if layer is None:
                layer = compute[event.kind, chunk] = _compute_layer(event.kind, chunk, chunks)
            layer.events.append(event)
        elif stream in WAITING_STREAMS:
            continue  # drawn below, cut into their bubble and exposed pieces
        elif stream == "send":
            send.events.append(event)
        elif stream == "dp" and held_inside_actions(event, trace.meta):
            held.events.append(event)
        elif stream in STEP_STREAM_STYLES:
            layer = steps.get(stream)
            if layer is None:
                layer = steps[stream] = _step_layer(stream)
            layer.events.append(event)
        else:
            layer = others.get(stream)
            if layer is None:
                layer = others[stream] = Layer(stream, stream_color(stream), OTHER_LANE)
            layer.events.append(event)
    for event, pieces in split_waits(trace):
        for start, end, part in pieces:
            (bubble if part == "bubble" else recv).events.append(event._replace(start=start, end=end))
    ordered = sorted(compute, key=lambda key: (_COMPUTE_ORDER.index(key[0]) if key[0] in _COMPUTE_ORDER else 99,
                                               key[0], key[1]))
    if "dp" in steps:
        steps["dp"].label = dp_label({event.kind for event in steps["dp"].events})
    under = [steps[name] for name in UNDER_COMPUTE if name in steps]
    over = [steps[name] for name in STEP_STREAM_STYLES if name in steps and name not in UNDER_COMPUTE]
    layers = [bubble, recv, overhead, *under, *(compute[key] for key in ordered), held, *over, send,
              *(others[name] for name in sorted(others))]
    return [layer for layer in layers if layer.events]
