"""Export a Trace as Chrome Trace Event JSON, for ui.perfetto.dev and chrome://tracing.

Those viewers zoom smoothly through millions of events and let a user measure between
any two of them, which no HTML chart matches. The mapping: one process per rank
("rank N"), one thread per stream (compute, send, recv, then any other), one complete
("X") event per action, times in microseconds as the format requires.
"""

from __future__ import annotations

import json
from pathlib import Path

from schedules.trace import STREAMS, Trace

STREAM_ORDER = STREAMS  # thread ids 0, 1, 2; other streams follow


def _thread_ids(trace: Trace) -> dict[str, int]:
    """Stable thread ids: the known streams first, then unknown ones by name."""
    extra = sorted({event.stream for event in trace.events} - set(STREAM_ORDER))
    return {stream: tid for tid, stream in enumerate((*STREAM_ORDER, *extra))}


def _metadata(trace: Trace, tids: dict[str, int]) -> list[dict]:
    """Name and order every rank and stream, so viewers list rank 0 first and label
    threads by stream rather than by number."""
    events: list[dict] = []
    used = {(event.rank, event.stream) for event in trace.events}
    for rank in range(trace.num_ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for stream, tid in tids.items():
            if stream != "compute" and (rank, stream) not in used:
                continue
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": stream}})
            events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}}
            )
    return events


def to_chrome_trace(trace: Trace) -> dict:
    """The trace as a Chrome Trace Event JSON object (``traceEvents`` plus metadata).

    Times keep the trace's own origin (seconds × 1e6), so an exported measurement
    can be lined up against other profiler output of the same run.
    """
    tids = _thread_ids(trace)
    events = _metadata(trace, tids)
    for event in trace.events:
        events.append(
            {
                "name": event.action,
                "cat": f"{event.stream},{event.kind}",
                "ph": "X",
                "ts": event.start * 1e6,
                "dur": (event.end - event.start) * 1e6,
                "pid": event.rank,
                "tid": tids[event.stream],
                "args": {"stage": event.stage, "microbatch": event.microbatch, "kind": event.kind},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {str(key): _json_safe(value) for key, value in trace.meta.items()},
    }


def _json_safe(value: object) -> object:
    """Meta values as JSON can hold them; anything exotic becomes its text."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    return str(value)


def write_chrome_trace(trace: Trace, path: str | Path) -> Path:
    """Write the trace as Chrome Trace Event JSON; open it in ui.perfetto.dev."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(trace), separators=(",", ":")), encoding="utf-8")
    return path
