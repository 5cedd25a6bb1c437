"""Metrics of a step, computed from its Trace alone.

Because they never look inside the simulator or the executor, the same functions
score a prediction and a measurement, and the two can be compared number for number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from schedules import accounting as accounting_module
from schedules.accounting import RankTime, _in_field_order, holds_on_sends, time_accounting
from schedules.action import ActionKind
from schedules.collector import without_collector
from schedules.trace import Trace, TraceEvent


@dataclass(frozen=True)
class RankMetrics:
    """What one rank did during the step.

    ``busy``: seconds of compute. ``idle``: makespan minus busy. ``comm``: seconds its
    outgoing transfers spent between being posted and arriving. The rest of the
    makespan is split as ``schedules.accounting`` says, so that
    ``busy + bubble + exposed_comm + tp + dp + optimizer + overhead = makespan``:
    ``bubble``: waiting for data its producer had not finished yet, or for the
    pipeline to fill and drain; ``exposed_comm``: blocked on a receive whose data was
    ready but still in flight; ``tp``, ``dp``, ``optimizer``: tensor-parallel
    collectives, the part of the gradient reduction nothing hid, the optimizer step;
    ``overhead``: gaps between the rank's own events.
    ``peak_inflight_microbatches``: most forward activation stashes held at once, in
    units of one microbatch on the rank's whole share of the model (a chunk of an
    interleaved rank counts ``1/v``)."""

    rank: int
    busy: float
    idle: float
    comm: float
    bubble: float
    exposed_comm: float
    tp: float
    dp: float
    optimizer: float
    overhead: float
    peak_inflight_microbatches: float

    def time(self) -> RankTime:
        """The makespan's split, as ``schedules.accounting`` returns it."""
        return RankTime(self.busy, self.bubble, self.exposed_comm, self.tp, self.dp, self.optimizer, self.overhead)


@dataclass(frozen=True)
class StepMetrics:
    """Whole-step numbers: ``makespan`` (step time, seconds); ``bubble_fraction``, the
    ranks' pipeline bubble (waiting for a peer's data, fill and drain; see
    ``schedules.accounting``) over ``ranks * makespan``; ``idle_fraction``,
    ``1 - sum(compute) / (ranks * makespan)``: every moment not computing, so the bubble
    plus exposed P2P, tp and dp communication, the optimizer step and overhead. The two
    are equal when nothing but the pipeline's own dependencies keeps a rank waiting; they
    are told apart because a zero-bubble schedule on tp=4 is not 22% bubble when 7% of
    its step is tensor-parallel all-reduces. Plus one ``RankMetrics`` per rank."""

    makespan: float
    bubble_fraction: float
    ranks: tuple[RankMetrics, ...]
    idle_fraction: float = 0.0

    def to_dict(self) -> dict:
        return {
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "idle_fraction": self.idle_fraction,
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


@without_collector
def step_metrics(trace: Trace, chunks_per_rank: int | None = None) -> StepMetrics:
    """All metrics of a step. ``chunks_per_rank`` defaults to ``meta["virtual_stages"]``."""
    chunks = chunks_per_rank or int(trace.meta.get("virtual_stages", 1))
    native = _native_summary(trace)
    if native is not None:  # one pass in C: the same numbers (tests/test_accounting_native.py)
        first, span, rows = native
        if any(seconds is None for seconds, _, _ in rows):  # a rank for the general sweep
            python = time_accounting(trace, trace.by_rank(), (first, first + span))
            accounting = [RankTime(*_in_field_order(seconds)) if seconds is not None else python[rank]
                          for rank, (seconds, _, _) in enumerate(rows)]
        else:
            accounting = [RankTime(*_in_field_order(seconds)) for seconds, _, _ in rows]
        comm = [row[1] for row in rows]
        peaks = [row[2] / chunks for row in rows]
    else:
        groups = trace.by_rank()
        first = min((event.start for event in trace.events), default=0.0)
        span = max((event.end for event in trace.events), default=0.0) - first
        accounting = time_accounting(trace, groups, (first, first + span))
        comm = [_plain_sum(event.end - event.start for event in rank_events if event.stream == "send")
                for rank_events in groups]
        peaks = [peak_inflight_of_events(rank_events, chunks) for rank_events in groups]
    ranks = len(accounting)
    total_busy = sum(part.busy for part in accounting)
    idle = 1.0 - total_busy / (ranks * span) if span > 0 else 0.0
    bubble = sum(part.bubble for part in accounting) / (ranks * span) if span > 0 else 0.0
    per_rank = tuple(
        RankMetrics(
            rank=rank,
            busy=part.busy,
            idle=span - part.busy,
            comm=comm[rank],
            bubble=part.bubble,
            exposed_comm=part.exposed_comm,
            tp=part.tp,
            dp=part.dp,
            optimizer=part.optimizer,
            overhead=part.overhead,
            peak_inflight_microbatches=peaks[rank],
        )
        for rank, part in enumerate(accounting)
    )
    return StepMetrics(makespan=span, bubble_fraction=bubble, ranks=per_rank, idle_fraction=idle)


def _native_summary(trace: Trace) -> tuple[float, float, list] | None:
    """``schedules._accounting.summary`` of the trace, or None where it is not built,
    switched off, or hands the trace back (no events, a rank number out of range)."""
    if not accounting_module.ACCELERATED or not trace.events:
        return None
    kinds = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)
    return accounting_module._native.summary(trace.event_list(), trace.num_ranks, holds_on_sends(trace), kinds)


def _plain_sum(values) -> float:
    """Left to right from 0.0, as the C summary adds (Python 3.12's sum() compensates)."""
    total = 0.0
    for value in values:
        total += value
    return total


COMM_KINDS_BY_STREAM = {"send": "p2p", "tp": "tp", "dp": "dp"}


def comm_by_kind(trace: Trace, accounting: list[RankTime] | None = None) -> list[dict[str, dict[str, float]]]:
    """Per rank, communication seconds by kind: ``{"p2p"|"dp"|"tp": {"total", "exposed"}}``.

    p2p: total is the time outgoing transfers were in flight, exposed the time the rank
    sat blocked on receives whose data was already sent (``exposed_comm``; waiting for
    the producer is bubble, not communication). tp: collectives on the compute's
    critical path, so all of it is exposed. dp: gradient reduction time, exposed where
    nothing holding the rank (compute, tp, a receive wait) runs beside it.
    ``accounting`` (from ``time_accounting``) saves computing it again."""
    accounting = accounting if accounting is not None else time_accounting(trace)
    result = []
    for rank_events, parts in zip(trace.by_rank(), accounting, strict=True):
        totals = {kind: {"total": 0.0, "exposed": 0.0} for kind in ("p2p", "dp", "tp")}
        for event in rank_events:
            kind = COMM_KINDS_BY_STREAM.get(event.stream)
            if kind is not None:
                totals[kind]["total"] += event.duration
        totals["p2p"]["exposed"] = parts.exposed_comm
        totals["tp"]["exposed"] = totals["tp"]["total"]
        totals["dp"]["exposed"] = parts.dp
        result.append(totals)
    return result
