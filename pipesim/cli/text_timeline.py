"""A timeline drawn in characters, for terminals and logs: one row per rank, each
compute action a run of characters labelled with its kind and microbatch, idle time
as dots, the time axis in its unit. Coarse by nature; the HTML Gantt chart is the
precise view.

Chunks of an interleaved or V schedule are told apart by the letter's case: chunk 0
upper case (``F3``), chunk 1 lower case (``f3``), later chunks primed (``F3'``, ``f3'``),
so a rank's two chunks of one microbatch never read as one. An action too short for its
label keeps its letter and fills the rest with ``·``, so neighbours stay apart."""

from __future__ import annotations

from schedules.trace import Trace
from schedules.units import duration, time_unit


def chunk_label(kind: str, microbatch: int, chunk: int) -> str:
    """``F3`` on chunk 0, ``f3`` on chunk 1, ``F3'`` on chunk 2, ``f3'`` on chunk 3 ..."""
    letter = kind.lower() if chunk % 2 else kind
    return f"{letter}{microbatch}" + "'" * (chunk // 2)


def text_timeline(trace: Trace, width: int = 160) -> str:
    """Render ``trace``'s compute events into rows ``width`` characters wide, with a
    legend of the chunks' letters where there are several and the axis in its unit."""
    events = [event for event in trace.events if event.stream == "compute"]
    if not events:
        return "(no compute events)"
    origin = min(event.start for event in events)
    span = max(event.end for event in events) - origin
    ranks = trace.num_ranks
    chunks = max(int(trace.meta.get("virtual_stages") or 1), max(event.stage for event in events) // ranks + 1)
    label_width = len(f"rank {ranks - 1}: ")
    columns = max(10, width - label_width)
    scale = columns / span if span > 0 else 1.0
    rows = [["."] * columns for _ in range(ranks)]
    for event in events:
        first = min(columns - 1, int(round((event.start - origin) * scale)))
        last = max(first + 1, min(columns, int(round((event.end - origin) * scale))))
        chunk = event.stage // ranks if chunks > 1 else 0
        label = chunk_label(event.kind, event.microbatch, chunk)
        cells = last - first
        if cells > len(label):
            text = label + " " * (cells - len(label))
        elif cells == len(label):
            text = label
        else:
            text = label[0] + "·" * (cells - 1)
        rows[event.rank][first:last] = list(text)
    lines = [f"rank {rank}: ".rjust(label_width) + "".join(row) for rank, row in enumerate(rows)]
    if trace.meta.get("time_unit") == "units":
        end = duration(span, "units")
    else:
        end = duration(span, time_unit(span)[0])
    lines.append(f"{'':>{label_width}}0{end:>{columns - 1}}")
    if chunks > 1:
        names = ", ".join(f"chunk {chunk} {chunk_label('F', 3, chunk)}" for chunk in range(chunks))
        lines.append(f"{'':>{label_width}}(microbatch 3's forward on {names}; '·': an action too short for its label)")
    return "\n".join(lines)
