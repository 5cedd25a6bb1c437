"""Metrics of a step, computed from its Trace alone.

Because they never look inside the simulator or the executor, the same functions
score a prediction and a measurement, and the two can be compared number for number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from schedules.action import ActionKind
from schedules.trace import Trace, TraceEvent


@dataclass(frozen=True)
class RankMetrics:
    """What one rank did during the step.

    ``busy``: seconds of compute. ``idle``: makespan minus busy. ``comm``: seconds its
    outgoing transfers spent between leaving and arriving. ``exposed_comm``: seconds the
    rank sat blocked on a receive (communication it could not hide).
    ``peak_inflight_microbatches``: most forward activation stashes held at once, in
    units of one microbatch on the rank's whole share of the model (a chunk of an
    interleaved rank counts ``1/v``)."""

    rank: int
    busy: float
    idle: float
    comm: float
    exposed_comm: float
    peak_inflight_microbatches: float


@dataclass(frozen=True)
class StepMetrics:
    """Whole-step numbers: ``makespan`` (step time, seconds) and ``bubble_fraction``
    ``1 - sum(compute) / (ranks * makespan)``, plus one ``RankMetrics`` per rank."""

    makespan: float
    bubble_fraction: float
    ranks: tuple[RankMetrics, ...]

    def to_dict(self) -> dict:
        return {
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "ranks": [asdict(rank) for rank in self.ranks],
        }


def makespan(trace: Trace) -> float:
    """Seconds from the first event's start to the last event's end."""
    if not trace.events:
        return 0.0
    return max(event.end for event in trace.events) - min(event.start for event in trace.events)


def peak_inflight(trace: Trace, rank: int, chunks_per_rank: int = 1) -> float:
    """Most forward stashes held at once on ``rank`` (see ``peak_inflight_of_events``)."""
    return peak_inflight_of_events(trace.of_rank(rank), chunks_per_rank)


def peak_inflight_of_events(rank_events: list[TraceEvent], chunks_per_rank: int = 1) -> float:
    """Most stashes held at once by one rank's events (the rule of ``stash_changes``)."""
    held = peak = 0
    for _, change in stash_changes(rank_events):
        held += change
        if held > peak:
            peak = held
    return peak / chunks_per_rank


def stash_changes(
    rank_events: list[TraceEvent], size: Callable[[int], float] = lambda stage: 1
) -> list[tuple[float, float]]:
    """``(time, +size / -size)`` of one rank's forward stashes, sorted: a stash of
    ``size(stage)`` is taken when a forward starts and released when the last backward
    piece of that stage and microbatch (B, or W when the backward is split) ends. At
    equal times releases sort first, as memory freed by a backward is reused by the next
    forward. The in-flight count and the memory model both read stashes this way."""
    events = [e for e in rank_events if e.stream == "compute"]
    has_weight_pass = {(e.stage, e.microbatch) for e in events if e.kind == ActionKind.W}
    changes = []
    for event in events:
        if event.kind == ActionKind.F:
            changes.append((event.start, size(event.stage)))
        elif event.kind == ActionKind.W or (
            event.kind in (ActionKind.B, ActionKind.I) and (event.stage, event.microbatch) not in has_weight_pass
        ):
            changes.append((event.end, -size(event.stage)))
    changes.sort()
    return changes


def step_metrics(trace: Trace, chunks_per_rank: int | None = None) -> StepMetrics:
    """All metrics of a step, in one pass over each rank's events.
    ``chunks_per_rank`` defaults to ``meta["virtual_stages"]``."""
    chunks = chunks_per_rank or int(trace.meta.get("virtual_stages", 1))
    groups = trace.by_rank()
    first_start, last_end = float("inf"), float("-inf")
    sums = []
    for rank_events in groups:
        busy = comm = exposed = 0.0
        for event in rank_events:
            if event.start < first_start:
                first_start = event.start
            if event.end > last_end:
                last_end = event.end
            stream = event.stream
            if stream == "compute":
                busy += event.end - event.start
            elif stream == "send":
                comm += event.end - event.start
            elif stream == "recv":
                exposed += event.end - event.start
        sums.append((busy, comm, exposed))
    span = last_end - first_start if trace.events else 0.0
    total_busy = sum(busy for busy, _, _ in sums)
    bubble = 1.0 - total_busy / (len(groups) * span) if span > 0 else 0.0
    per_rank = tuple(
        RankMetrics(
            rank=rank,
            busy=busy,
            idle=span - busy,
            comm=comm,
            exposed_comm=exposed,
            peak_inflight_microbatches=peak_inflight_of_events(groups[rank], chunks),
        )
        for rank, (busy, comm, exposed) in enumerate(sums)
    )
    return StepMetrics(makespan=span, bubble_fraction=bubble, ranks=per_rank)


COMM_KINDS_BY_STREAM = {"send": "p2p", "tp": "tp", "dp": "dp"}


def comm_by_kind(trace: Trace) -> list[dict[str, dict[str, float]]]:
    """Per rank, communication seconds by kind: ``{"p2p"|"dp"|"tp": {"total", "exposed"}}``.

    p2p: total is the time outgoing transfers were in flight, exposed the time the rank
    sat blocked on receives. tp: collectives on the compute's critical path, so all of
    it is exposed. dp: gradient all-reduce time, exposed where no compute or tp
    collective of the rank runs beside it (the part overlap could not hide)."""
    result = []
    for rank_events in trace.by_rank():
        totals = {kind: {"total": 0.0, "exposed": 0.0} for kind in ("p2p", "dp", "tp")}
        working = []
        reducing = []
        for event in rank_events:
            stream = event.stream
            if stream == "recv":
                totals["p2p"]["exposed"] += event.duration
            elif stream in COMM_KINDS_BY_STREAM:
                totals[COMM_KINDS_BY_STREAM[stream]]["total"] += event.duration
            if stream in ("compute", "tp"):
                working.append((event.start, event.end))
            elif stream == "dp":
                reducing.append((event.start, event.end))
        totals["tp"]["exposed"] = totals["tp"]["total"]
        totals["dp"]["exposed"] = totals["dp"]["total"] - _overlap(sorted(reducing), sorted(working))
        result.append(totals)
    return result


def _overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Seconds where an interval of ``first`` meets one of ``second`` (each list sorted
    and without overlaps of its own)."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        start = max(first[i][0], second[j][0])
        end = min(first[i][1], second[j][1])
        if end > start:
            total += end - start
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total
