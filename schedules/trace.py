"""Trace: the one timeline format, shared by predicted and measured runs.

``{"meta": {...}, "events": [{"rank", "action", "kind", "stage", "microbatch",
"start", "end", "stream"}]}`` with times in seconds. Metrics, charts and comparisons
read Traces only, so the simulator and the executor are interchangeable sources.

A Trace holds its events in one of two forms and makes the other on first use: a list
of ``TraceEvent`` (what the executor records and charts draw) or ``TraceColumns``, one
array per field (what the engine produces and the metrics read: a large simulated step
has ~400k events, and whole-array arithmetic over them costs a few milliseconds where a
Python pass costs a second).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import NamedTuple

import numpy as np

from schedules.action import Action
from schedules.textfile import read_text, write_text_whole

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


class LazyNames(Sequence):
    """Events' names (``TraceColumns.names``) made by ``make`` when first read: a
    simulated step names thousands of collective events that its metrics never read (a
    planner simulates hundreds of steps and draws none). Reads, compares and pickles as
    the list it stands for."""

    __slots__ = ("_length", "_make", "_names")

    def __init__(self, length: int, make: Callable[[], list[str | None]]) -> None:
        self._length = length
        self._make: Callable[[], list[str | None]] | None = make
        self._names: list[str | None] | None = None

    def listed(self) -> list[str | None]:
        """The names, made now if they were not yet."""
        if self._names is None:
            assert self._make is not None
            self._names, self._make = self._make(), None
            if len(self._names) != self._length:
                raise AssertionError(f"{len(self._names)} names made for {self._length} events")
        return self._names

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        return self.listed()[index]

    def __iter__(self) -> Iterator[str | None]:
        return iter(self.listed())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, LazyNames)) and self.listed() == list(other)

    __hash__ = None  # a sequence that compares equal to a list is no more hashable than one

    def __reduce__(self):
        return list, (self.listed(),)

    def __repr__(self) -> str:
        return repr(self.listed())


@dataclass(frozen=True)
class TraceColumns:
    """A Trace's events as arrays, one per field: ``kind`` and ``stream`` are codes into
    the ``kinds`` and ``streams`` names. ``names[i]`` is event ``i``'s action text where it
    is not ``{stage}{kind}{microbatch}`` (a collective's, the optimizer's), else None."""

    rank: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    start: np.ndarray
    end: np.ndarray
    stream: np.ndarray
    kinds: tuple[str, ...]
    streams: tuple[str, ...]
    names: Sequence[str | None] | None = None

    def __len__(self) -> int:
        return len(self.start)

    def stream_code(self, name: str) -> int:
        """The code of stream ``name`` (-1 when no event is on it)."""
        return self.streams.index(name) if name in self.streams else -1

    def kind_code(self, name: str) -> int:
        return self.kinds.index(name) if name in self.kinds else -1

    def on_stream(self, name: str) -> np.ndarray:
        """Which events are on stream ``name``."""
        return self.stream == self.stream_code(name)

    @classmethod
    def concatenate(cls, parts: list[TraceColumns]) -> TraceColumns:
        """One set of columns from several (their codes re-numbered into shared names)."""
        kinds = tuple(dict.fromkeys(kind for part in parts for kind in part.kinds))
        streams = tuple(dict.fromkeys(stream for part in parts for stream in part.streams))

        def recode(codes: np.ndarray, names: tuple[str, ...], into: tuple[str, ...]) -> np.ndarray:
            table = np.array([into.index(name) for name in names] or [0], dtype=np.int64)
            return table[codes] if len(codes) else codes.astype(np.int64)

        names: Sequence | None = None
        if any(part.names is not None for part in parts):
            named = [(part.names, len(part)) for part in parts]
            names = LazyNames(sum(length for _, length in named), partial(_joined_names, named))
        return cls(
            np.concatenate([part.rank for part in parts]),
            np.concatenate([recode(part.kind, part.kinds, kinds) for part in parts]),
            np.concatenate([part.stage for part in parts]),
            np.concatenate([part.microbatch for part in parts]),
            np.concatenate([part.start for part in parts]),
            np.concatenate([part.end for part in parts]),
            np.concatenate([recode(part.stream, part.streams, streams) for part in parts]),
            kinds, streams, names,
        )

    @classmethod
    def from_events(cls, events: list[TraceEvent]) -> TraceColumns:
        kinds = tuple(dict.fromkeys(event[2] for event in events))
        streams = tuple(dict.fromkeys(event[7] for event in events))
        kind_code = {kind: code for code, kind in enumerate(kinds)}
        stream_code = {stream: code for code, stream in enumerate(streams)}
        count = len(events)
        names = [None if event[1] == f"{event[3]}{event[2]}{event[4]}" else event[1] for event in events]

        def column(index: int, dtype) -> np.ndarray:
            return np.fromiter(map(itemgetter(index), events), dtype, count)

        return cls(column(0, np.int64), np.fromiter((kind_code[event[2]] for event in events), np.int64, count),
                   column(3, np.int64), column(4, np.int64), column(5, float), column(6, float),
                   np.fromiter((stream_code[event[7]] for event in events), np.int64, count), kinds, streams,
                   names if any(name is not None for name in names) else None)

    def events(self) -> list[TraceEvent]:
        """The events as ``TraceEvent`` tuples, in column order."""
        kinds = [self.kinds[code] for code in self.kind.tolist()]
        streams = [self.streams[code] for code in self.stream.tolist()]
        stages, microbatches = self.stage.tolist(), self.microbatch.tolist()
        names = self.names or [None] * len(self)
        new = tuple.__new__
        return [new(TraceEvent, (rank, name if name is not None else f"{stage}{kind}{microbatch}", kind, stage,
                                 microbatch, start, end, stream))
                for rank, name, kind, stage, microbatch, start, end, stream in zip(
                    self.rank.tolist(), names, kinds, stages, microbatches, self.start.tolist(), self.end.tolist(),
                    streams, strict=True)]


def _joined_names(named: list[tuple[Sequence[str | None] | None, int]]) -> list[str | None]:
    """The names of parts' events one after the other (None for each of a part without)."""
    names: list[str | None] = []
    for part, length in named:
        names += part if part is not None else [None] * length
    return names


class Trace:
    """A timeline of one pipeline step: ``events`` (a list of ``TraceEvent``) or the same
    as ``columns``, whichever it was made with, the other made on first use. ``meta``
    holds at least ``pp`` (ranks) and ``source`` (``simulated`` or ``measured``)."""

    def __init__(self, events: list[TraceEvent] | None = None, meta: dict | None = None, *,
                 columns: TraceColumns | None = None) -> None:
        if (events is None) == (columns is None):
            raise ValueError("a Trace is made from events or from columns, one of them")
        self._events = list(events) if events is not None else None
        self._columns = columns
        self.meta = meta if meta is not None else {}

    def __repr__(self) -> str:
        return f"Trace({len(self)} events, meta={self.meta!r})"

    def __len__(self) -> int:
        return len(self._events) if self._events is not None else len(self._columns)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Trace) and self.events == other.events and self.meta == other.meta

    @property
    def events(self) -> list[TraceEvent]:
        if self._events is None:
            self._events = self._columns.events()
        return self._events

    @events.setter
    def events(self, events: list[TraceEvent]) -> None:
        self._events, self._columns = list(events), None

    @property
    def columns(self) -> TraceColumns:
        if self._columns is None:
            self._columns = TraceColumns.from_events(self._events)
        return self._columns

    @property
    def num_ranks(self) -> int:
        """Ranks the step ran on, including any that recorded no event."""
        if self._columns is not None:
            recorded = int(self._columns.rank.max()) + 1 if len(self._columns) else 0
        else:
            recorded = max(map(itemgetter(0), self._events), default=-1) + 1
        return max(int(self.meta.get("pp", 0)), recorded)

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
        write_text_whole(path, json.dumps(self.to_dict()))

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
