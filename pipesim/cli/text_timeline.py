"""A timeline drawn in characters, for terminals and logs: one row per rank, each
compute action a run of characters labelled with its kind and microbatch, idle time
as dots. Coarse by nature; the HTML Gantt chart is the precise view."""

from __future__ import annotations

from schedules.trace import Trace


def text_timeline(trace: Trace, width: int = 160) -> str:
    """Render ``trace``'s compute events into rows ``width`` characters wide."""
    events = [event for event in trace.events if event.stream == "compute"]
    if not events:
        return "(no compute events)"
    origin = min(event.start for event in events)
    span = max(event.end for event in events) - origin
    ranks = trace.num_ranks
    label_width = len(f"rank {ranks - 1}: ")
    columns = max(10, width - label_width)
    scale = columns / span if span > 0 else 1.0
    rows = [["."] * columns for _ in range(ranks)]
    for event in events:
        first = min(columns - 1, int(round((event.start - origin) * scale)))
        last = max(first + 1, min(columns, int(round((event.end - origin) * scale))))
        label = f"{event.kind}{event.microbatch}"
        cells = last - first
        text = (label + " " * cells)[:cells] if cells > len(label) else event.kind * cells
        rows[event.rank][first:last] = list(text)
    lines = [f"rank {rank}: ".rjust(label_width) + "".join(row) for rank, row in enumerate(rows)]
    lines.append(f"{'':>{label_width}}0{'':>{columns - 12}}{span:>11.4g}")
    return "\n".join(lines)
