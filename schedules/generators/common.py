"""Argument checks shared by the generators, so every generator refuses bad sizes
with the same words."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from schedules.action import Action


class ScheduleUnavailableError(ValueError):
    """No schedule of this family exists for the sizes asked for."""


def require_positive(name: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    """Reject sizes that describe no pipeline at all."""
    for flag, value in (("pp", pp), ("microbatches", microbatches), ("virtual stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleUnavailableError(f"{name}: {flag} must be a whole number >= 1, got {value!r}")


def require_single_chunk(name: str, virtual_stages: int) -> None:
    """Schedules that place one stage per rank say so instead of ignoring ``v``."""
    if virtual_stages != 1:
        raise ScheduleUnavailableError(
            f"{name} places one stage per rank; virtual stages={virtual_stages} needs "
            f"a multi-chunk schedule ('interleaved-1f1b', 'interleaved-zb', 'looped-bfs', 'zbv')"
        )


def chunk_visitor(pp: int, rank: int) -> Callable[[str, int], Action]:
    """``visit(kind, chunk)``: the next microbatch's ``kind`` action on ``rank``'s chunk
    ``chunk`` (stage ``chunk * pp + rank``), counting microbatches per kind and stage —
    how looped multi-chunk schedules walk their chunks."""
    next_microbatch: dict[tuple[str, int], int] = defaultdict(int)

    def visit(kind: str, chunk: int) -> Action:
        stage = chunk * pp + rank
        microbatch = next_microbatch[kind, stage]
        next_microbatch[kind, stage] = microbatch + 1
        return Action(stage, kind, microbatch)

    return visit
