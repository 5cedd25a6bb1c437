"""Argument checks shared by the generators, so every generator refuses bad sizes
with the same words."""

from __future__ import annotations


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
