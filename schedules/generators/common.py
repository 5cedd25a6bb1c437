"""Argument checks shared by the generators, so every generator refuses bad sizes
with the same words, and what the searching ones share."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import NamedTuple, TypeVar

from schedules.action import Action

T = TypeVar("T")
K = TypeVar("K")


class ScheduleUnavailableError(ValueError):
    """No schedule of this family exists for the sizes asked for."""


def require_positive(name: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    """Reject sizes that describe no pipeline at all."""
    for flag, value in (("pp", pp), ("microbatches", microbatches), ("virtual stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleUnavailableError(f"{name}: {flag} must be a whole number >= 1, got {value!r}")


def per_rank_limits(name: str, pp: int, memory_limit, unit: str) -> list[float]:
    """``memory_limit`` as one finite number per rank (one number for every rank, or a list
    or tuple of ``pp``); a one-line error naming ``unit`` otherwise."""
    limits = list(memory_limit) if isinstance(memory_limit, (list, tuple)) else [memory_limit] * pp
    if len(limits) != pp or any(isinstance(value, bool) or not isinstance(value, (int, float))
                                or not math.isfinite(value) for value in limits):
        raise ScheduleUnavailableError(
            f"{name}: --memory-limit must be a number of {unit} per rank (or one per rank of pp={pp}), "
            f"got {memory_limit!r}")
    return limits


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


class Cutoff(NamedTuple):
    """When a list scheduler's run can stop, in a search that keeps the fastest of several
    (``greedy_zero_bubble``, ``zb_heuristic``): once its step must exceed ``step``, or a
    rank's span (its first pass's start to its last pass's end) must exceed ``span``
    (seconds; infinity: never). The run's times are the engine's free timing of its order,
    so a rank that ends a pass at ``e`` with ``r`` seconds of passes left cannot end before
    ``e + r``: past the cutoff, the run's order could not be chosen."""

    step: float = math.inf
    span: float = math.inf

    def with_margin(self) -> tuple[float, float]:
        """(step, span) raised by ``CUTOFF_MARGIN``: what a run's bounds are compared with."""
        return self.step * (1.0 + CUTOFF_MARGIN), self.span * (1.0 + CUTOFF_MARGIN)


# A run stops only where its bound exceeds the cutoff by this share: the bound sums a rank's
# remaining seconds in another order than the engine sums the same passes, which can differ in
# the last bits.
CUTOFF_MARGIN = 1e-9


def fastest(candidates: Callable[[Callable[[], Cutoff]], Iterable[T | None]], key: Callable[[T], K],
            cutoff_of: Callable[[K], Cutoff]) -> T | None:
    """The first candidate of the least ``key`` (None if there is none). ``candidates`` is
    given the search's current cutoff, to read as each run starts: ``cutoff_of`` the best
    key so far (``Cutoff()`` until there is one); a run stopped at it yields None."""
    best, best_key, current = None, None, Cutoff()

    def cutoff() -> Cutoff:
        return current  # the best so far when the next run starts

    for candidate in candidates(cutoff):
        if candidate is None:
            continue
        candidate_key = key(candidate)
        if best_key is None or candidate_key < best_key:
            best, best_key, current = candidate, candidate_key, cutoff_of(candidate_key)
    return best
