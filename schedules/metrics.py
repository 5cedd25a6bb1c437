"""Metrics of a step, computed from its Trace alone.

Because they never look inside the simulator or the executor, the same functions
score a prediction and a measurement, and the two can be compared number for number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from schedules.accounting import PARTS, RankTime, part_seconds, time_accounting
from schedules.action import KIND_CODES, Action
from schedules.trace import Trace, TraceColumns


@dataclass(frozen=True)
class RankMetrics:
    """What one rank did during the step.

    ``busy``: seconds of compute. ``idle``: makespan minus busy. ``comm``: seconds its
    outgoing transfers spent between being posted and arriving. The rest of the
    makespan is split as ``schedules.accounting`` says, so that
    ``busy + bubble + exposed_comm + tp + ep + cp + dp + optimizer + overhead =
    makespan``: ``bubble``: waiting for data its producer had not finished yet, or for the
    pipeline to fill and drain; ``exposed_comm``: blocked on a receive whose data was
    ready but still in flight; ``tp``, ``ep``, ``cp``, ``dp``, ``optimizer``:
    tensor-parallel collectives, expert-parallel all-to-alls, context-parallel K/V
    exchanges (what the attention did not hide), the part of the gradient reduction
    nothing hid, the optimizer step;
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
    ep: float = 0.0
    cp: float = 0.0

    def time(self) -> RankTime:
        """The makespan's split, as ``schedules.accounting`` returns it."""
        return RankTime(self.busy, self.bubble, self.exposed_comm, self.tp, self.dp, self.optimizer, self.overhead,
                        self.ep, self.cp)


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
    columns = trace.columns
    if not len(columns):
        return 0.0
    return float(columns.end.max() - columns.start.min())


def peak_inflight(trace: Trace, rank: int, chunks_per_rank: int = 1) -> float:
    """Most forward stashes held at once on ``rank`` (see ``stash_changes``)."""
    return float(peak_stashes(trace.columns, trace.num_ranks)[rank]) / chunks_per_rank


def stash_changes(columns: TraceColumns, size: Callable[[np.ndarray], np.ndarray] | None = None,
                  kept: Callable[[np.ndarray], np.ndarray] | None = None,
                  weight: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rank, time, change)`` of every forward stash taken (+size) and released (-size),
    sorted by rank then time: a stash of ``size(stage)`` (default 1) is taken when a
    forward starts and released when the last backward piece of that stage and
    microbatch (B, or W when the backward is split) ends. With ``kept(stage)``, the
    share of a stash that a split backward still needs between its I and its W (the
    matrix products' inputs and output gradients), an I releases all but that share
    and its W the rest. At equal times releases come first, as memory freed by a
    backward is reused by the next forward. With ``weight(stage, microbatch)`` each
    microbatch's stash is scaled by it (microbatches of unequal sizes: a batch the
    microbatches do not divide). The in-flight count and the memory model both read
    stashes this way."""
    compute = columns.on_stream("compute")
    kind, stage, microbatch = columns.kind[compute], columns.stage[compute], columns.microbatch[compute]
    forward = kind == columns.kind_code("F")
    backward = (kind == columns.kind_code("B")) | (kind == columns.kind_code("I"))
    shares = None if kept is None else np.asarray(kept(stage), dtype=float) * np.ones(len(stage))
    taken, amount = stash_moves(forward, backward, kind == columns.kind_code("W"), stage, microbatch, shares)
    if size is not None:
        amount = amount * np.asarray(size(stage), dtype=float) * np.ones(len(stage))
    if weight is not None:
        amount = amount * np.asarray(weight(stage, microbatch), dtype=float) * np.ones(len(stage))
    change = amount[taken]
    time = np.where(forward, columns.start[compute], columns.end[compute])[taken]
    rank = columns.rank[compute][taken]
    order = np.lexsort((change, time, rank))
    return rank[order], time[order], change[order]


def stash_moves(forward: np.ndarray, backward: np.ndarray, weight: np.ndarray, stage: np.ndarray,
                microbatch: np.ndarray, kept: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The one rule of counting stashes, over compute actions given as masks (an ``F``, a
    backward piece ``B`` or ``I``, a ``W``) with their stage and microbatch: which
    actions move a stash, and by +1 (taken: the forward) or -1 (released: the last
    backward piece of that stage and microbatch, ``B``, or ``W`` when the backward is
    split). What a ``W`` keeps after its ``I`` is a stash until the ``W``: all of it, or
    with ``kept`` (per action, the share of its stash a split backward still needs
    between its I and its W: the matrix products' inputs and output gradients) that
    share, the I releasing the rest."""
    key = stage * (int(microbatch.max()) + 1 if len(microbatch) else 1) + microbatch
    split = _members(key, key[weight])
    release = weight | (backward & ~split)
    move = np.where(forward, 1.0, -1.0)
    if kept is None:
        return forward | release, move
    partial = backward & split  # an I before its W: releases all but the kept share
    move = move * np.where(weight, kept, np.where(partial, 1.0 - kept, 1.0))
    return forward | release | partial, move


def order_peak_stashes(program: Sequence[Action], kept: float | None = None,
                       sizes: Sequence[float] | None = None) -> float:
    """The most stashes a rank's order holds at once (``stash_moves``), counted in program
    order: a rank runs its order one action at a time, so its order is its time order.
    With ``kept``, the share of a stash held between a split backward's I and its W, as
    ``stash_moves`` counts it (the count is then a fraction); with ``sizes`` (one per
    stage, in any unit) each stage's stash counts at its size."""
    if not program:
        return 0
    kind = np.fromiter((KIND_CODES[action.kind] for action in program), np.int64, len(program))
    stage = np.fromiter((action.stage for action in program), np.int64, len(program))
    microbatch = np.fromiter((action.microbatch for action in program), np.int64, len(program))
    shares = None if kept is None else np.full(len(program), float(kept))
    taken, sign = stash_moves(kind == KIND_CODES["F"], (kind == KIND_CODES["B"]) | (kind == KIND_CODES["I"]),
                              kind == KIND_CODES["W"], stage, microbatch, shares)
    if sizes is not None:
        sign = sign * np.asarray(sizes, dtype=float)[stage]
    peak = max(float(np.cumsum(sign[taken]).max(initial=0.0)), 0.0)
    return int(peak) if kept is None and sizes is None else peak


def _members(values: np.ndarray, among: np.ndarray) -> np.ndarray:
    """``np.isin(values, among)`` for integers, by a table over their range: a
    step's (stage, microbatch) keys are few and dense, and ``isin`` sorts both."""
    if not len(values) or not len(among):
        return np.zeros(len(values), dtype=bool)
    low = int(values.min())
    table = np.zeros(int(values.max()) - low + 1, dtype=bool)
    table[among - low] = True
    return table[values - low]


def peak_stashes(columns: TraceColumns, ranks: int, size: Callable[[np.ndarray], np.ndarray] | None = None,
                 kept: Callable[[np.ndarray], np.ndarray] | None = None,
                 weight: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Per rank, the most stash held at once (``stash_changes``)."""
    rank, _, change = stash_changes(columns, size, kept, weight)
    peaks = np.zeros(ranks)
    if len(change):
        held = running_totals(rank, change)
        np.maximum.at(peaks, rank, held)
    return peaks


def running_totals(rank: np.ndarray, change: np.ndarray) -> np.ndarray:
    """The running total of ``change`` within each rank (rows sorted by rank)."""
    running = np.cumsum(change)
    first = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    before = np.r_[0.0, running][first]  # the total before each rank's first row
    return running - np.repeat(before, np.diff(np.r_[first, len(rank)]))


def step_metrics(trace: Trace, chunks_per_rank: int | None = None) -> StepMetrics:
    """All metrics of a step. ``chunks_per_rank`` defaults to ``meta["virtual_stages"]``."""
    chunks = chunks_per_rank or int(trace.meta.get("virtual_stages", 1))
    columns = trace.columns
    ranks = trace.num_ranks
    span = makespan(trace)
    parts = part_seconds(trace)
    duration = columns.end - columns.start
    comm = np.bincount(columns.rank, weights=np.where(columns.on_stream("send"), duration, 0.0), minlength=ranks)
    peaks = peak_stashes(columns, ranks) / chunks
    busy = parts[:, PARTS.index("busy")]
    idle = 1.0 - busy.sum() / (ranks * span) if span > 0 else 0.0
    bubble = parts[:, PARTS.index("bubble")].sum() / (ranks * span) if span > 0 else 0.0
    per_rank = tuple(
        RankMetrics(rank=rank, busy=float(busy[rank]), idle=span - float(busy[rank]), comm=float(comm[rank]),
                    **{part: float(parts[rank, PARTS.index(part)]) for part in PARTS if part != "busy"},
                    peak_inflight_microbatches=float(peaks[rank]))
        for rank in range(ranks)
    )
    return StepMetrics(makespan=span, bubble_fraction=bubble, ranks=per_rank, idle_fraction=idle)


COMM_KINDS_BY_STREAM = {"send": "p2p", "tp": "tp", "ep": "ep", "cp": "cp", "dp": "dp"}


def comm_by_kind(trace: Trace, accounting: list[RankTime] | None = None) -> list[dict[str, dict[str, float]]]:
    """Per rank, communication seconds by kind: ``{"p2p"|"dp"|"tp": {"total", "exposed"}}``.

    p2p: total is the time outgoing transfers were in flight, from posting to arrival (a
    send waiting for its peer's receive included), exposed the time the rank sat blocked
    on receives whose data was already sent (``exposed_comm``; waiting for the producer is
    bubble, not communication); where the trace knows them (a simulated one's meta),
    ``wire``: the seconds the rank's sends spent on the links, and ``bytes`` they carried.
    tp, ep, cp: collectives on the compute's critical path (what holds the rank after it:
    for cp, the part of the K/V exchange the attention did not hide), so all of it is
    exposed; ep and cp appear only where the trace has them. dp: gradient reduction time, exposed where
    nothing holding the rank (compute, tp, a receive wait) runs beside it.
    ``accounting`` (from ``time_accounting``) saves computing it again."""
    accounting = accounting if accounting is not None else time_accounting(trace)
    columns = trace.columns
    duration = columns.end - columns.start
    totals = {kind: np.bincount(columns.rank, weights=np.where(columns.on_stream(stream), duration, 0.0),
                                minlength=len(accounting))
              for stream, kind in COMM_KINDS_BY_STREAM.items()}
    wire, sent = trace.meta.get("p2p_wire_seconds"), trace.meta.get("p2p_bytes")
    held = [kind for kind in ("ep", "cp") if totals[kind].any()]
    return [{"p2p": {"total": float(totals["p2p"][rank]), "exposed": parts.exposed_comm,
                     "wire": wire[rank] if wire else None, "bytes": sent[rank] if sent else None},
             "dp": {"total": float(totals["dp"][rank]), "exposed": parts.dp},
             "tp": {"total": float(totals["tp"][rank]), "exposed": float(totals["tp"][rank])},
             **{kind: {"total": float(totals[kind][rank]), "exposed": float(totals[kind][rank])} for kind in held}}
            for rank, parts in enumerate(accounting)]
