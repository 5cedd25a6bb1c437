"""Choosing where transfers go, by timing the candidates on the engine.

Every placement of ``schedules.transfer_placement`` is deadlock-free under rendezvous;
they differ in how long the step takes, and no single rule is best for every order and
every cost: posting a receive at the compute boundary before its data is ready holds
the rank's communication stream until the data arrives (a send that becomes ready
meanwhile waits behind it), posting it later delays the data. So lowering tries a few
rules and keeps the fastest under rendezvous (``RULES``), then repairs it where a
compute action still starts later than with free-flowing transfers: at the first such
action it tries moving the departures of the transfers that hold it up and cutting or
merging their groups, keeps the change that shortens the step most (then the one that
delays compute least in total) and looks again, for at most ``repair_runs`` engine runs.
Everything is decided by the engine's timing of whole steps, so the choice is
deterministic for a given schedule and timing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from schedules import engine
from schedules.overlap import keep_pairs_together
from schedules.p2p import RENDEZVOUS
from schedules.schedule import Schedule
from schedules.transfer_placement import (
    Transfers,
    crossing_moments,
    group_starts,
    lowered_rows,
    lowered_schedule,
    meeting_moments,
    place_ends,
    slack_moments,
)

# (departure moments, whether a group is cut for its receives' consumers)
RULES: tuple[tuple[Callable[[Transfers], np.ndarray], bool], ...] = (
    (crossing_moments, True), (slack_moments, True), (meeting_moments, False), (meeting_moments, True))
DEFAULT_RULE = 2  # meeting points, placed untimed on huge steps (``lowering.CHOICE_ACTIONS``)
# The rule a planner screens layouts with, untimed: crossing moments won 75 of the 78
# lowerings of the 70B plan's screen (docs/plan.md) and was never 0.05% behind the best;
# its finalists are lowered again with every rule and the repair.
SCREEN_RULE = 0


@dataclass
class Attempt:
    """One placement and the engine's verdict on it. Its lowered schedule is built when
    first asked for (``build``, once): of the dozens of placements a lowering times, it keeps one."""

    moment: np.ndarray
    mind_the_consumer: bool
    shift: np.ndarray  # per end: boundaries away from its moment's
    breaks: np.ndarray  # per end: forced to open a group
    joins: np.ndarray  # per end: forced to join the group before
    build: Callable[[], Schedule]
    score: tuple[float, float]  # (makespan, total delay of compute against free-flowing transfers)
    run: engine.StepRun | None

    @property
    def lowered(self) -> Schedule:
        return self.build()


class Search:
    """The candidates of one schedule and timing, scored by the engine under rendezvous."""

    def __init__(self, schedule: Schedule, transfers: Transfers, timing: engine.StepTiming,
                 free_start: np.ndarray) -> None:
        self.schedule, self.transfers, self.timing = schedule, transfers, timing
        self.free_start = free_start  # each compute action's start with free-flowing transfers
        self.runs = 0
        scale = float(np.nanmax(transfers.step.end)) if len(transfers.step.end) else 1.0
        self.tolerance = 1e-9 * max(scale, 1e-30)

    def attempt(self, moment: np.ndarray, mind_the_consumer: bool, shift: np.ndarray | None = None,
                breaks: np.ndarray | None = None, joins: np.ndarray | None = None) -> Attempt | None:
        """The placement timed under rendezvous; None if ``shift`` breaks its rules."""
        count = 2 * self.transfers.count
        shift = np.zeros(count, dtype=np.int64) if shift is None else shift
        breaks = np.zeros(count, dtype=bool) if breaks is None else breaks
        joins = np.zeros(count, dtype=bool) if joins is None else joins
        ends = place_ends(self.transfers, moment, shift)
        if ends is None:
            return None
        starts = group_starts(ends, mind_the_consumer, breaks, joins)
        rows = lowered_rows(self.transfers, ends, starts)

        @functools.cache
        def build() -> Schedule:
            return keep_pairs_together(lowered_schedule(self.schedule, self.transfers, rows), self.schedule)

        self.runs += 1
        if any(self.schedule.fused):
            # timed as lowering returns it: an overlapped pair's transfers moved out of the pair
            run = engine.run(build(), self.timing, RENDEZVOUS)
        else:  # the rows are what lowering returns: timed without building their Actions
            run = engine.run_program(engine.compile_arrays(rows.arrays(self.schedule), RENDEZVOUS), self.timing)
        if run.stuck or np.isnan(run.start).any():  # pragma: no cover - excluded by construction
            return Attempt(moment, mind_the_consumer, shift, breaks, joins, build, (np.inf, np.inf), None)
        delay = float(np.sum(np.maximum(run.start - self.free_start, 0.0)))
        return Attempt(moment, mind_the_consumer, shift, breaks, joins, build, (run.makespan, delay), run)

    def placed(self, index: int) -> Schedule:
        """``RULES[index]``'s placement, not timed: for steps too large to time several,
        and for a planner's screen."""
        rule, mind_the_consumer = RULES[index]
        ends = place_ends(self.transfers, rule(self.transfers))
        starts = group_starts(ends, mind_the_consumer)
        rows = lowered_rows(self.transfers, ends, starts)
        return keep_pairs_together(lowered_schedule(self.schedule, self.transfers, rows), self.schedule)

    def best_rule(self) -> Attempt:
        attempts = [self.attempt(rule(self.transfers), mind) for rule, mind in RULES]
        return min(attempts, key=lambda attempt: attempt.score)

    def repair(self, current: Attempt, repair_runs: int) -> Attempt:
        """Improve ``current`` at its first late compute action, as long as runs are left."""
        while self.runs < repair_runs and current.run is not None:
            late = np.flatnonzero(current.run.start > self.free_start + self.tolerance)
            if not len(late):
                break
            improved = None
            for action in late[np.argsort(self.free_start[late], kind="stable")][:3].tolist():
                for candidate in self.moves(current, action):
                    if self.runs >= repair_runs:
                        break
                    tried = self.attempt(*candidate)
                    if tried is not None and tried.score < (improved or current).score:
                        improved = tried
                if improved is not None or self.runs >= repair_runs:
                    break
            if improved is None:
                break
            current = improved
        return current

    def moves(self, current: Attempt, action: int):
        """Changes worth trying for a compute action that starts late: for the transfers
        that bring its input or share a group with it on either rank, other departure
        moments (when ready, the boundaries next to the current one) and cutting or
        joining their groups."""
        transfers = self.transfers
        suspects = self.suspects(current, action)
        count = transfers.count
        for transfer in suspects:
            for moment in self.other_moments(current, transfer):
                changed = current.moment.copy()
                changed[transfer] = moment
                yield changed, current.mind_the_consumer, current.shift, current.breaks, current.joins
            for end in (transfer, transfer + count):
                for step in (-1, 1):
                    shifted = current.shift.copy()
                    shifted[end] += step
                    yield current.moment, current.mind_the_consumer, shifted, current.breaks, current.joins
                for forced, other in ((current.breaks, current.joins), (current.joins, current.breaks)):
                    if forced[end]:
                        continue
                    flipped, cleared = forced.copy(), other.copy()
                    flipped[end], cleared[end] = True, False
                    pair = (flipped, cleared) if forced is current.breaks else (cleared, flipped)
                    yield current.moment, current.mind_the_consumer, current.shift, *pair
        yield current.moment, not current.mind_the_consumer, current.shift, current.breaks, current.joins

    def suspects(self, current: Attempt, action: int) -> list[int]:
        """The transfer feeding ``action`` and the transfers posted around it on both ranks
        (by departure moment, the few before and after it)."""
        transfers = self.transfers
        feeding = np.flatnonzero(transfers.consumer == action)
        if not len(feeding):
            return []
        transfer = int(feeding[0])
        moment = current.moment[transfer]
        near = set()
        for rank in (int(transfers.sender[transfer]), int(transfers.receiver[transfer])):
            mine = np.flatnonzero((transfers.sender == rank) | (transfers.receiver == rank))
            order = mine[np.argsort(current.moment[mine], kind="stable")]
            at = int(np.searchsorted(current.moment[order], moment, side="left"))
            near.update(order[max(at - 3, 0):at + 3].tolist())
        near.discard(transfer)
        return [transfer, *sorted(near, key=lambda other: (current.moment[other], other))]

    def other_moments(self, current: Attempt, transfer: int) -> list[float]:
        """The transfer's ready moment and the compute boundaries of its two ranks just
        before and just after its current moment, within its window."""
        transfers, step = self.transfers, self.transfers.step
        first = transfers.first_compute
        ready, latest = float(transfers.ready[transfer]), float(transfers.needed[transfer])
        moment = float(current.moment[transfer])
        options = {ready}
        for rank in (int(transfers.sender[transfer]), int(transfers.receiver[transfer])):
            boundaries = step.end[first[rank]:first[rank + 1]]
            at = int(np.searchsorted(boundaries, moment, side="left"))
            for index in (at - 1, at, at + 1):
                if 0 <= index < len(boundaries) and ready <= boundaries[index] <= latest:
                    options.add(float(boundaries[index]))
        options.discard(moment)
        return sorted(options)
