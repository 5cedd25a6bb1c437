"""The one cache of a layout evaluator: what its costs, floors, bounds and orders derive,
kept for the evaluator's own job and dropped with it.

A plan asks the same questions of thousands of layouts that share their stages, their
placement or their order (the costs of a placement, the bound terms of a mapping), so
each answer is kept under what it depends on. Keeping them in one object owned by the
evaluator, instead of a cache per function at module level, means a second evaluator
for another job starts empty and nothing has to be cleared by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

Method = TypeVar("Method", bound=Callable[..., Any])


class Tables(dict):
    """Rule name -> its table of answers, a table made empty on first use."""

    def __missing__(self, name: str) -> dict:
        table = self[name] = {}
        return table


class LayoutCache:
    """One table per kept rule (named by the rule's method), each mapping the rule's
    arguments to its answer. Rules whose answers are large (schedules, lowered
    programs) keep at most ``limit`` of them, the oldest dropped first."""

    def __init__(self) -> None:
        self.tables = Tables()

    def table(self, name: str) -> dict:
        """The answers of rule ``name``."""
        return self.tables[name]

    def __len__(self) -> int:
        return sum(map(len, self.tables.values()))


def kept(limit: int | None = None) -> Callable[[Method], Method]:
    """Keep a method's answers in its object's cache (``tables``: a ``LayoutCache``'s),
    under its positional arguments (all hashable); at most ``limit`` of them where given.
    A lookup is one call and two dictionary reads: the bounds of a plan make a few hundred
    thousand of them."""

    def decorate(method: Method) -> Method:
        name = method.__qualname__

        @functools.wraps(method)
        def keep(self, *arguments):
            table = self.tables[name]
            answer = table.get(arguments, table)  # the table itself: no answer yet (None is one)
            if answer is table:
                answer = method(self, *arguments)
                if limit is not None and len(table) >= limit:
                    del table[next(iter(table))]
                table[arguments] = answer
            return answer

        return keep  # type: ignore[return-value]

    return decorate
