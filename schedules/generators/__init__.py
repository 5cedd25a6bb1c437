"""Schedule generators, by the names users type on the command line.

A generator computes each rank's compute-only order and returns a ``Schedule``; it
does no lowering, validation or timing (those are passes that treat every schedule
alike)."""

from __future__ import annotations

from collections.abc import Callable

from schedules.generators.common import ScheduleUnavailableError, require_positive
from schedules.generators.gpipe import gpipe
from schedules.generators.interleaved import interleaved_1f1b
from schedules.generators.one_f_one_b import one_f_one_b
from schedules.schedule import Schedule

Generator = Callable[[int, int, int], Schedule]

GENERATORS: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
}

# Schedules that place several stages on a rank and therefore use ``virtual_stages``.
MULTI_CHUNK = frozenset({"interleaved-1f1b"})


class UnknownScheduleError(ValueError):
    """The schedule name is not one this tool can generate."""


def generate(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build the named schedule; errors name the bad value and list what is valid."""
    generator = GENERATORS.get(name)
    if generator is None:
        raise UnknownScheduleError(
            f"unknown schedule {name!r}; available: {', '.join(sorted(GENERATORS))}"
        )
    require_positive(name, pp, microbatches, virtual_stages)
    return generator(pp, microbatches, virtual_stages)


__all__ = [
    "GENERATORS",
    "MULTI_CHUNK",
    "ScheduleUnavailableError",
    "UnknownScheduleError",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
]
