"""Trace: the one timeline format, shared by predicted and measured runs.

``{"meta": {...}, "events": [{"rank", "action", "kind", "stage", "microbatch",
"start", "end", "stream"}]}`` with times in seconds. Metrics, charts and comparisons
read Traces only, so the simulator and the executor are interchangeable sources.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import NamedTuple

from schedules.action import Action
from schedules.textfile import read_text

STREAMS = ("compute", "send", "recv")


class TraceEvent(NamedTuple):
    """One timed action on one rank. ``stream`` says which engine it occupied:
    ``compute`` for F/B/I/W, ``send`` for a transfer leaving the rank (start to
    arrival), ``recv`` for time the rank spent blocked waiting for data.

    A NamedTuple because a large simulated step records ~400k of them and tuples are
    the cheapest Python object to build."""

    rank: int
    action: str
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
    stream: str

    @property
    def duration(self) -> float:
        return self.end - self.start

    @classmethod
    def of(cls, rank: int, action: Action, start: float, end: float, stream: str) -> TraceEvent:
        """An event for ``action``, filling the derived text fields."""
        return cls(rank, str(action), action.kind, action.stage, action.microbatch, start, end, stream)


@dataclass
class Trace:
    """A timeline of one pipeline step. ``meta`` holds at least ``pp`` (ranks) and
    ``source`` (``simulated`` or ``measured``)."""

    events: list[TraceEvent]
    meta: dict = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        """Ranks the step ran on, including any that recorded no event."""
        recorded = max(map(itemgetter(0), self.events), default=-1) + 1  # itemgetter: ~400k events at scale
        return max(int(self.meta.get("pp", 0)), recorded)

    def event_list(self) -> list[TraceEvent]:
        """``events`` as a list, itself when it is one (the C passes over a Trace read a
        list; copying ~400k events for each of them would be work done for nothing)."""
        return self.events if type(self.events) is list else list(self.events)

    def of_rank(self, rank: int) -> list[TraceEvent]:
        return [event for event in self.events if event.rank == rank]

    def by_rank(self) -> list[list[TraceEvent]]:
        """Events grouped by rank in one pass (``of_rank`` in a loop would be O(n * ranks))."""
        groups: list[list[TraceEvent]] = [[] for _ in range(self.num_ranks)]
        append_to = [group.append for group in groups]
        for event in self.events:
            append_to[event[0]](event)  # event.rank, without the attribute lookup
        return groups

    def to_dict(self) -> dict:
        return {"meta": self.meta, "events": [event._asdict() for event in self.events]}

    @classmethod
    def from_dict(cls, data: dict) -> Trace:
        try:
            events = [TraceEvent(**event) for event in data["events"]]
        except (KeyError, TypeError) as error:
            fields = ", ".join(TraceEvent._fields)
            raise ValueError(f"not a pipesim Trace (each event needs {fields}): {error}") from error
        return cls(events, dict(data.get("meta", {})))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        text = read_text(path, "trace (pipesim Trace JSON)")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a pipesim Trace (expected a mapping with 'meta' and 'events')")
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    @classmethod
    def merge(cls, parts: Iterable[Trace], meta: dict | None = None) -> Trace:
        """One trace from the traces each rank recorded."""
        events: list[TraceEvent] = []
        for part in parts:
            events.extend(part.events)
        events.sort(key=lambda event: (event.start, event.rank))
        return cls(events, dict(meta or {}))
