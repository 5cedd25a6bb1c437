"""Schedule generators, by the names users type on the command line.

A generator computes each rank's compute-only order and returns a ``Schedule``; it
does no lowering, validation or timing (those are passes that treat every schedule
alike)."""

from __future__ import annotations

from collections.abc import Callable

from schedules.generators.common import ScheduleUnavailableError, require_positive
from schedules.generators.dualpipev import dualpipev
from schedules.generators.gpipe import gpipe
from schedules.generators.interleaved import interleaved_1f1b
from schedules.generators.interleaved_zb import interleaved_zb
from schedules.generators.looped_bfs import looped_bfs
from schedules.generators.one_f_one_b import one_f_one_b
from schedules.generators.zb_auto import zb_auto
from schedules.generators.zb_h1 import zb_h1
from schedules.generators.zb_h2 import zb_h2
from schedules.generators.zbv import zbv
from schedules.schedule import Schedule

Generator = Callable[[int, int, int], Schedule]

GENERATORS: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "interleaved-zb": interleaved_zb,
    "looped-bfs": looped_bfs,
    "dualpipev": dualpipev,
}

# Schedules that place several stages on a rank and therefore use ``virtual_stages``.
MULTI_CHUNK = frozenset({"interleaved-1f1b", "zbv", "interleaved-zb", "looped-bfs", "dualpipev"})

# Schedules whose order depends on the stage costs and a memory limit: they cannot be
# built from sizes alone, so they have their own signature (see ``zb_auto``) and the
# command line builds them from the costs it already has (``build_cost_aware``).
COST_AWARE = frozenset({"zb-auto"})

SCHEDULE_NAMES = (*GENERATORS, *sorted(COST_AWARE))


class UnknownScheduleError(ValueError):
    """The schedule name is not one this tool can generate."""


def generate(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build the named schedule; errors name the bad value and list what is valid."""
    generator = GENERATORS.get(name)
    if name in COST_AWARE:
        raise UnknownScheduleError(
            f"{name} builds its order from stage costs and a memory limit; call "
            f"schedules.generators.zb_auto(pp, m, forward, backward_input, backward_weight, comm, memory_limit)"
        )
    if generator is None:
        raise UnknownScheduleError(
            f"unknown schedule {name!r}; available: {', '.join(sorted(SCHEDULE_NAMES))}"
        )
    require_positive(name, pp, microbatches, virtual_stages)
    return generator(pp, microbatches, virtual_stages)


__all__ = [
    "COST_AWARE",
    "GENERATORS",
    "MULTI_CHUNK",
    "SCHEDULE_NAMES",
    "ScheduleUnavailableError",
    "UnknownScheduleError",
    "dualpipev",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zb",
    "looped_bfs",
    "one_f_one_b",
    "zb_auto",
    "zb_h1",
    "zb_h2",
    "zbv",
]
