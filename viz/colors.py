"""Colours shared by every pipesim chart.

One place so that a forward is the same blue in a Gantt chart and in any other
view, and a schedule keeps its colour from one sweep chart to the next.
"""

from __future__ import annotations

import zlib

# Compute kinds: forward cool, backward warm; the zero-bubble split (I, W) gets its
# own two colours so a split backward is never mistaken for a full one.
KIND_COLORS: dict[str, str] = {
    "F": "#4C78A8",  # forward: blue
    "B": "#54A24B",  # full backward: green
    "I": "#F58518",  # input-gradient backward: orange
    "W": "#B279A2",  # weight-gradient backward: purple
}
UNKNOWN_KIND_COLOR = "#9D9D9D"

# Communication: sends are quiet (they overlap compute, so usually harmless); the part
# of a receive wait with data in flight is loud red, because that is communication the
# rank could not hide; the part before the producer had the data is a pale grey
# bubble, a cost of the schedule that no faster network would remove.
SEND_COLOR = "#5C5C5C"
RECV_WAIT_COLOR = "#D62728"
BUBBLE_COLOR = "#B0B0B0"

# Step-level parts that occupy the rank itself, drawn in its compute lane:
# stream -> (legend label, colour, bar pattern). Order is the drawing order.
STEP_STREAM_STYLES: dict[str, tuple[str, str, str]] = {
    "dp": ("dp gradient all-reduce (shows where compute does not hide it)", "#8C564B", ""),
    "idle": ("idle (rank done, step not)", "#9ECAE1", "."),  # pale blue: not the grey bubble
    "tp": ("tp collective (inside compute)", "#17BECF", ""),
    "ep": ("ep all-to-all (expert dispatch and combine)", "#BCBD22", ""),
    "cp": ("cp K/V exchange the attention did not hide", "#E377C2", ""),
    "step": ("optimizer step, closing all-reduces (loss, tied embeddings, grad norm)", "#7F7F7F", ""),
}

# Chunks of an interleaved or V schedule: chunk 0 in the kind's colour, later chunks
# darker (white labels stay legible) and textured, so they differ in shade *and* in
# texture (the texture survives greyscale printing; the shade survives WebGL).
CHUNK_PATTERNS = ("", "x", ".", "+", "-", "|")
_CHUNK_DARKEN = 0.32  # fraction towards black per chunk, capped

# Streams beyond these (an unknown stream a measurement may add).
_EXTRA_STREAM_COLORS = ("#17BECF", "#BCBD22", "#8C564B", "#E377C2", "#7F7F7F")

# Every generator keeps a fixed colour of its own and a marker of its own (a chart that
# mixes twelve schedules tells each apart by both, in colour and in greyscale); an unknown
# name (a schedule file) hashes into a palette. NO_PIPELINE: a layout of pp 1, whichever
# schedule name it was searched under.
NO_PIPELINE = "no pipeline (pp 1)"
SCHEDULE_COLORS: dict[str, str] = {
    "gpipe": "#4C78A8",
    "1f1b": "#F58518",
    "interleaved-1f1b": "#54A24B",
    "interleaved-auto": "#1F77B4",
    "zb-h1": "#E45756",
    "zb-h2": "#B279A2",
    "zbv": "#72B7B2",
    "zbv-auto": "#EECA3B",
    "zb-auto": "#9D755D",
    "interleaved-zb": "#FF9DA6",
    "dualpipev": "#2F4B7C",
    "looped-bfs": "#BAB0AC",
    NO_PIPELINE: "#222222",
}
SCHEDULE_SYMBOLS: dict[str, str] = {
    "gpipe": "circle", "1f1b": "square", "interleaved-1f1b": "diamond", "interleaved-auto": "diamond-wide",
    "zb-h1": "triangle-up",
    "zb-h2": "triangle-down", "zbv": "pentagon", "zbv-auto": "hexagon", "zb-auto": "triangle-left",
    "interleaved-zb": "cross", "dualpipev": "star-triangle-up", "looped-bfs": "x", NO_PIPELINE: "star",
}
_SYMBOL_PALETTE = ("circle-open", "square-open", "diamond-open", "triangle-up-open", "hexagram", "bowtie")
_SCHEDULE_PALETTE = ("#FF9DA6", "#9D755D", "#EECA3B", "#BAB0AC", "#1F77B4", "#2CA02C", "#9467BD", "#8C564B")


def stable_pick(name: str, palette: tuple[str, ...]) -> str:
    """A palette entry chosen by a stable hash, so a name keeps its colour across runs
    (Python's ``hash`` of a string changes per process)."""
    return palette[zlib.crc32(name.encode()) % len(palette)]


def kind_color(kind: str) -> str:
    """Colour of a compute action of ``kind``."""
    return KIND_COLORS.get(kind, UNKNOWN_KIND_COLOR)


def stream_color(stream: str) -> str:
    """Colour of an event on a non-compute ``stream``."""
    if stream == "send":
        return SEND_COLOR
    if stream == "recv":
        return RECV_WAIT_COLOR
    return stable_pick(stream, _EXTRA_STREAM_COLORS)


def _mix(color: str, target: tuple[int, int, int], amount: float) -> str:
    channels = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    mixed = [round(c + (t - c) * amount) for c, t in zip(channels, target, strict=True)]
    return "#" + "".join(f"{c:02X}" for c in mixed)


def chunk_color(kind: str, chunk: int) -> str:
    """Colour of ``kind`` on model chunk ``chunk``: chunk 0 is the kind's own colour,
    each later chunk a step darker."""
    return _mix(kind_color(kind), (0, 0, 0), min(_CHUNK_DARKEN * chunk, 0.75))


def chunk_pattern(chunk: int) -> str:
    """Bar texture of model chunk ``chunk`` ('' = solid for chunk 0)."""
    return CHUNK_PATTERNS[chunk % len(CHUNK_PATTERNS)]


def schedule_color(schedule: str) -> str:
    """Colour of a schedule's line in sweep charts."""
    return SCHEDULE_COLORS.get(schedule.lower(), stable_pick(schedule.lower(), _SCHEDULE_PALETTE))


def schedule_symbol(schedule: str) -> str:
    """Marker of a schedule's points: its own for every generator."""
    return SCHEDULE_SYMBOLS.get(schedule.lower(), stable_pick(schedule.lower(), _SYMBOL_PALETTE))
