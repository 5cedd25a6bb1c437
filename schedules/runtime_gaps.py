"""The gaps between a rank's compute actions in a measured step: what the runtime spends
of its own between them (its loop, hooks and P2P posts, and, where each receive's wait
is marked, what a wait costs beyond being blocked). Read by the costs of a run's own
calibration steps (``executor.run_costs.overhead_fit``) and by ``pipesim compare``'s
runtime line (``pipesim.sim.comparison.runtime_per_rank``), so both count a gap alike.
Pure functions of a Schedule and a Trace.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from schedules.action import COMM_KINDS, RECV_KINDS, RECV_OF, ActionKind
from schedules.schedule import Schedule
from schedules.trace import Trace

# (seconds, P2P actions posted in the gap, whether the action after it waits for another rank's data)
Gap = tuple[float, int, bool]


def covered_seconds(intervals: Sequence[tuple[float, float]], begin: float, end: float) -> float:
    """Seconds of ``[begin, end]`` that ``intervals`` (``(start, end)`` pairs, disjoint, as
    one rank's waits are) cover: what a rank spent blocked inside a gap between two of its
    actions."""
    return sum(min(stop, end) - max(start, begin) for start, stop in intervals if start < end and stop > begin)


def gaps_by_rank(schedule: Schedule, trace: Trace, waits_timed: bool = False) -> list[list[Gap]]:
    """Per rank, per compute action after the rank's first: (seconds since the rank's
    previous compute action ended, P2P actions the program posts between the two,
    whether the action waits for data from another rank). Only the rank's loop, its hooks and its posts
    fill a gap that waits for nothing.

    With ``waits_timed`` (buffered P2P, where the runtime marks each receive's wait as an
    event of its own, ``recv`` stream, right before the action that needs the data), the
    seconds the rank was blocked in those waits are taken out of the gap: what is left is
    the runtime's own time, a waiting gap's included (the wait's bookkeeping, handing the
    data on), which ``overhead_fit`` then reads off every gap."""
    by_rank: dict[int, dict[str, tuple[float, float]]] = defaultdict(dict)
    blocked: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in trace.events:
        if event.stream == "compute":
            by_rank[event.rank][event.action] = (event.start, event.end)
        elif waits_timed and event.stream == "recv":
            blocked[event.rank].append((event.start, event.end))
    per_rank: list[list[Gap]] = []
    for rank in range(schedule.pp):
        samples: list[Gap] = []
        received = {(action.kind, action.stage, action.microbatch)
                    for action in schedule.programs[rank] if action.kind in RECV_KINDS}
        paired = dict(schedule.fused_pairs(rank))  # an overlapped pair's forward waits for both inputs
        timed = by_rank.get(rank, {})
        previous_end, posts = None, 0
        for action in schedule.programs[rank]:
            if action.kind in COMM_KINDS:
                posts += 1
                continue
            if str(action) not in timed:
                continue
            start, end = timed[str(action)]
            needs = [action, *([paired[action]] if action in paired else [])]
            waits = any((RECV_OF.get(a.kind, ActionKind.RECV_B), a.stage, a.microbatch) in received for a in needs)
            if previous_end is not None:
                held = covered_seconds(blocked.get(rank, ()), previous_end, start)
                samples.append((start - previous_end - held, posts, waits))
            previous_end, posts = end, 0
        per_rank.append(samples)
    return per_rank


def gaps(schedule: Schedule, trace: Trace, waits_timed: bool = False) -> list[Gap]:
    """Every rank's gaps (``gaps_by_rank``) in one list."""
    return [gap for samples in gaps_by_rank(schedule, trace, waits_timed) for gap in samples]
