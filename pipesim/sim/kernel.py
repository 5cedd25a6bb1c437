"""A small discrete-event kernel with SimPy's scheduling rules, for the engine's hot path.

The engine (``pipesim.sim.engine``) needs only a few of SimPy's pieces: processes that
yield events, plain events, timeouts and an unbounded FIFO store. This module
re-implements exactly those, with SimPy's ordering: events are processed by (time,
priority, insertion order); a process starts with an urgent event when it is created;
a store's put and get trigger each other through callbacks as SimPy's ``Store`` does.
Because the order of every step is the same, a run here takes the same decisions in
the same order as under SimPy (``tests/test_engine_fast.py`` compares the Traces of
both on random schedules, costs, clusters and placements, event for event).

What it leaves out is what makes SimPy general and slow for this use: failure and
interruption handling, condition events, resource bookkeeping, active-process
tracking, and the event object of a finished process (nothing waits for it here).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from heapq import heappop, heappush
from typing import Any

URGENT = 0
NORMAL = 1

_PENDING = object()


class Event:
    """Something that happens at one moment; processes wait on it with ``yield``."""

    __slots__ = ("env", "callbacks", "_value")

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.callbacks: list | None = []
        self._value: Any = _PENDING

    @property
    def triggered(self) -> bool:
        return self._value is not _PENDING

    @property
    def processed(self) -> bool:
        return self.callbacks is None

    @property
    def value(self) -> Any:
        return self._value

    def succeed(self, value: Any = None) -> Event:
        if self._value is not _PENDING:
            raise RuntimeError(f"{self} has already been triggered")
        self._value = value
        env = self.env
        env._eid += 1
        heappush(env._queue, (env.now, NORMAL, env._eid, self))
        return self


class Environment:
    """The clock and the queue of scheduled events."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list = []
        self._eid = 0

    def event(self) -> Event:
        return Event(self)

    def timeout(self, delay: float, value: Any = None, priority: int = NORMAL) -> Event:
        """An event ``delay`` from now; among the events of its moment it comes after every
        event of a lower ``priority`` (SimPy: ``Environment.schedule(event, priority, delay)``;
        SimPy's own timeouts are NORMAL)."""
        if delay < 0:
            raise ValueError(f"Negative delay {delay}")
        event = Event(self)
        event._value = value
        self._eid += 1
        heappush(self._queue, (self.now + delay, priority, self._eid, event))
        return event

    def process(self, generator: Generator) -> None:
        """Start ``generator`` as a process (at the current time, before other events)."""
        Process(self, generator)

    def run(self) -> None:
        """Process events until none is left."""
        queue = self._queue
        while queue:
            self.now, _, _, event = heappop(queue)
            callbacks, event.callbacks = event.callbacks, None
            for callback in callbacks:
                callback(event)


class Process:
    """A generator driven by the events it yields."""

    __slots__ = ("env", "_generator", "_resume")

    def __init__(self, env: Environment, generator: Generator) -> None:
        self.env = env
        self._generator = generator
        self._resume = self._make_resume()
        start = Event(env)
        start._value = None
        start.callbacks.append(self._resume)
        env._eid += 1
        heappush(env._queue, (env.now, URGENT, env._eid, start))

    def _make_resume(self):
        send = self._generator.send

        def resume(event: Event) -> None:
            while True:
                try:
                    event = send(event._value)
                except StopIteration:
                    return
                if event.callbacks is not None:
                    event.callbacks.append(resume)
                    return
                # already processed: carry on at once with its value, as SimPy does

        return resume


class Store:
    """An unbounded FIFO of items: ``put`` never waits, ``get`` waits for an item.

    As SimPy's ``Store``: a put succeeds at once (its event scheduled now) and, when that
    event is processed, hands the first item to the first waiting get; a get made while
    items wait succeeds at once with the first. Since an unbounded store accepts every
    put as it is made, no put ever waits, and SimPy's re-check of waiting puts after
    each get finds none: it is left out."""

    __slots__ = ("env", "items", "get_queue", "_serve_getter")

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.items: deque = deque()
        self.get_queue: deque = deque()
        self._serve_getter = self._trigger_get  # one bound method for every put's callback

    def put(self, item: Any) -> Event:
        env = self.env
        event = Event(env)
        event.callbacks.append(self._serve_getter)
        self.items.append(item)
        event._value = None
        env._eid += 1
        heappush(env._queue, (env.now, NORMAL, env._eid, event))
        return event

    def get(self) -> Event:
        event = Event(self.env)
        self.get_queue.append(event)
        self._trigger_get(None)
        return event

    def _trigger_get(self, _event: Event | None) -> None:
        # SimPy serves the first waiting get if an item is there
        if self.get_queue and self.items:
            self.get_queue.popleft().succeed(self.items.popleft())
