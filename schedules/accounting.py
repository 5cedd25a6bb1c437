"""Where each rank's step time went: compute, pipeline bubble, exposed communication.

A rank blocked on a receive is waiting for one of two things. Before the producer has
finished the data there is nothing to send yet: that wait is the schedule's *bubble*,
and no faster network would shorten it. Once the data exists, the rest of the wait is
communication — posting it, queueing on the links or the sender's stream, the
transfer itself: *exposed communication*, the part a faster network or better
overlap would remove.

The split is read from the Trace alone, so a prediction and a measurement are split by
the same rule. A receive is matched with the send of the same transfer (the SEND
``Action.matching`` names), and the send event's ``start`` is the moment the producer
posted it — its data was ready and handed over. Both the simulator and the executor
record sends from that moment. Under rendezvous semantics (NCCL; ``meta["p2p"]``, or any
backend but gloo) a rank can also be held by its own send, whose transfer cannot leave
before the peer posts the matching receive: while a send the rank has posted waits for a
receive not yet posted, the rank's wait is bubble too (the peer is still busy with
earlier work). Buffered sends (gloo) never hold the rank.

Every second of a rank's step, from the step's first event to its last, goes to exactly
one part, so ``busy + bubble + exposed_comm + tp + ep + cp + dp + optimizer + overhead
= makespan`` by construction. Where events overlap, the part that holds the rank wins:
compute (``busy``), then tensor-parallel collectives (``tp``), expert-parallel
all-to-alls (``ep``), context-parallel K/V exchanges (``cp``), the optimizer step
(``optimizer``), waits (``recv`` and end-of-step ``wait`` events: ``bubble`` while some
data the rank needs is not sent yet or some send of the rank is not yet matched, or
while the rank waits for the others to join a collective over every rank, which is the
pipeline draining; ``exposed_comm`` otherwise), and last the gradient reduction (``dp``: only the part
nothing else hides). Time before a rank's first event or after its last is ``bubble``
(the pipeline filling and draining); gaps between its own events are ``overhead``
(posting communication, host work between actions).

The rule is applied to every rank at once, as one sweep over the sorted moments at which
an event begins or ends (``_sweep``): between two moments, the parts open decide who
owns the time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schedules.action import COMPUTE_KINDS, KIND_CODES
from schedules.dataflow import end_transfer_key
from schedules.trace import Trace, TraceColumns, TraceEvent

# Parts in the order they claim a moment where several events overlap.
HOLDING_STREAMS = {"compute": "busy", "tp": "tp", "ep": "ep", "cp": "cp", "step": "optimizer"}
WAITING_STREAMS = frozenset({"recv", "wait"})
GRAD_NORM_ALLREDUCE = "GRAD_NORM_ALLREDUCE"  # gradient clipping's norm: the squares summed over every rank
# a ``wait`` event of these kinds is a rank waiting for the others to join a collective
# over every rank (the simulator draws it before the collective itself): waiting for peers
JOINING_KINDS = frozenset({GRAD_NORM_ALLREDUCE})
PARTS = ("busy", "tp", "ep", "cp", "optimizer", "bubble", "exposed_comm", "dp", "overhead")
_PART = {part: index for index, part in enumerate(PARTS)}
# what an event contributes to the sweep: the parts that hold, a wait, dp, and "peer"
# (something the rank waits for is not ready on the other side)
_BUSY, _TP, _EP, _CP, _OPTIMIZER, _WAITING, _DP, _PEER = range(8)
_SWEEP_STREAMS = {"compute": _BUSY, "tp": _TP, "ep": _EP, "cp": _CP, "step": _OPTIMIZER, "recv": _WAITING,
                  "wait": _WAITING, "dp": _DP}
# who owns a stretch of a rank's time: the first rule all of whose kinds are open then
# (overhead where none is)
_SWEEP_RULES = (((_BUSY,), "busy"), ((_TP,), "tp"), ((_EP,), "ep"), ((_CP,), "cp"), ((_OPTIMIZER,), "optimizer"),
                ((_WAITING, _PEER), "bubble"), ((_WAITING,), "exposed_comm"), ((_DP,), "dp"))
_ROUNDING = 1e-12  # of the step: below it, a wait is float rounding, not time


def _owners_of_open() -> np.ndarray:
    """``[bits]``: the part that owns a stretch in which the kinds whose bits are set are
    open (bit ``k`` for kind ``k``): the first of ``_SWEEP_RULES`` all of whose kinds are,
    overhead where none is."""
    owners = np.full(1 << (_PEER + 1), _PART["overhead"])
    for bits in range(len(owners)):
        for needs, part in _SWEEP_RULES:
            if all(bits >> kind & 1 for kind in needs):
                owners[bits] = _PART[part]
                break
    return owners


_OWNER_OF_OPEN = _owners_of_open()


@dataclass(frozen=True)
class RankTime:
    """Seconds of one rank's step by what the rank was doing; they sum to the makespan."""

    busy: float = 0.0
    bubble: float = 0.0
    exposed_comm: float = 0.0
    tp: float = 0.0
    dp: float = 0.0
    optimizer: float = 0.0
    overhead: float = 0.0
    ep: float = 0.0
    cp: float = 0.0

    @property
    def total(self) -> float:
        return (self.busy + self.bubble + self.exposed_comm + self.tp + self.ep + self.cp + self.dp + self.optimizer
                + self.overhead)


def holds_on_sends(trace: Trace) -> bool:
    """Whether a rank's own sends can hold it (rendezvous semantics)."""
    p2p = trace.meta.get("p2p")
    if p2p is None:
        p2p = "buffered" if trace.meta.get("backend") == "gloo" else "rendezvous"
    return p2p != "buffered"


def transfer_keys(columns: TraceColumns) -> tuple[np.ndarray, np.ndarray]:
    """For every event, the number of the transfer it is an end of (both ends of a
    transfer get the same number: that of its SEND), and whether it is one."""
    # the trace's own kind numbers as the schedule's (``KIND_CODES``); kinds of no action -1
    codes = np.array([KIND_CODES.get(name, -1) for name in columns.kinds], dtype=np.int64)[columns.kind]
    is_transfer = codes >= len(COMPUTE_KINDS)
    microbatches = int(columns.microbatch.max()) + 1 if len(columns) else 1
    key = end_transfer_key(columns.stage, np.where(is_transfer, codes, 0), columns.microbatch, microbatches)
    return np.where(is_transfer, key, -1), is_transfer


def peer_intervals(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rank, start, end)`` of every stretch in which a rank waits for its peer: a
    receive before its data was sent (the matching send's start), under rendezvous a
    send of the rank before its receive was posted (the matching receive's start), and
    a ``wait`` for the others to join a collective (``JOINING_KINDS``), whole. A
    receive whose send is not in the trace (a trace of one rank) counts as ready at once."""
    columns = trace.columns
    joining = columns.on_stream("wait") & np.array([name in JOINING_KINDS for name in columns.kinds] or [False],
                                                   dtype=bool)[columns.kind]
    key, is_transfer = transfer_keys(columns)
    recv = columns.on_stream("recv") & is_transfer
    send = columns.on_stream("send") & is_transfer
    size = int(key.max()) + 1 if len(key) and key.max() >= 0 else 0
    sent_at = np.full(size, np.nan)
    sent_at[key[send]] = columns.start[send]
    ranks, starts, ends = [], [], []
    ready = sent_at[key[recv]]
    late = ready > columns.start[recv]  # NaN (no send in the trace) compares false
    ranks.append(columns.rank[recv][late])
    starts.append(columns.start[recv][late])
    ends.append(np.minimum(ready[late], columns.end[recv][late]))
    if holds_on_sends(trace):
        received_at = np.full(size, np.nan)
        received_at[key[recv]] = columns.start[recv]
        accepted = received_at[key[send]]
        late = accepted > columns.start[send]
        ranks.append(columns.rank[send][late])
        starts.append(columns.start[send][late])
        ends.append(np.minimum(accepted[late], columns.end[send][late]))
    ranks.append(columns.rank[joining])
    starts.append(columns.start[joining])
    ends.append(columns.end[joining])
    return np.concatenate(ranks), np.concatenate(starts), np.concatenate(ends)


def time_accounting(trace: Trace) -> list[RankTime]:
    """Per rank, the step's time split into the parts of ``RankTime`` (see the module)."""
    seconds = part_seconds(trace)
    return [RankTime(**{part: float(seconds[rank, _PART[part]]) for part in PARTS}) for rank in range(len(seconds))]


def part_seconds(trace: Trace) -> np.ndarray:
    """(ranks, parts) seconds: the sweep of every rank at once."""
    columns = trace.columns
    ranks = trace.num_ranks
    seconds = np.zeros((ranks, len(PARTS)))
    if not len(columns):
        return seconds
    first, last = float(columns.start.min()), float(columns.end.max())
    category = np.full(len(columns), -1)
    for stream, part in _SWEEP_STREAMS.items():
        category[columns.on_stream(stream)] = part
    peer_rank, peer_start, peer_end = peer_intervals(trace)
    rank = np.concatenate([columns.rank, peer_rank])
    start = np.concatenate([columns.start, peer_start])
    end = np.concatenate([columns.end, peer_end])
    category = np.concatenate([category, np.full(len(peer_rank), _PEER)])
    keep = (category >= 0) & (end > start)
    rank, start, end, category = rank[keep], start[keep], end[keep], category[keep]
    # each rank's own span: from its first event to its last (what it waits for on a peer aside)
    own = category != _PEER
    own_first = np.full(ranks, np.inf)
    own_last = np.full(ranks, -np.inf)
    np.minimum.at(own_first, rank[own], start[own])
    np.maximum.at(own_last, rank[own], end[own])
    seconds[:, :] = _sweep(rank, start, end, category, own_first, own_last, ranks)
    active = np.isfinite(own_first)
    seconds[:, _PART["bubble"]] += np.where(active, (own_first - first) + (last - own_last), last - first)
    # a difference of equal sums is not a wait: exposed dust below the rounding goes to the bubble
    dust = seconds[:, _PART["exposed_comm"]] < _ROUNDING * (last - first)
    seconds[dust, _PART["bubble"]] += seconds[dust, _PART["exposed_comm"]]
    seconds[dust, _PART["exposed_comm"]] = 0.0
    return seconds


def _sweep(rank: np.ndarray, start: np.ndarray, end: np.ndarray, category: np.ndarray, own_first: np.ndarray,
           own_last: np.ndarray, ranks: int) -> np.ndarray:
    """Give each stretch between consecutive moments of a rank to the part that holds
    the rank then, within the rank's own span."""
    moments = np.concatenate([start, end])
    change = np.concatenate([np.ones(len(start), dtype=np.int64), -np.ones(len(end), dtype=np.int64)])
    owner_rank = np.concatenate([rank, rank])
    kinds = np.concatenate([category, category])
    # by rank, then by moment; moments that tie bound empty stretches, so their order does not
    # matter: a quick sort of the moments, then a stable (radix) sort of the small rank numbers
    by_moment = np.argsort(moments)
    order = by_moment[np.argsort(owner_rank[by_moment].astype(np.int16 if ranks < 2**15 else np.int64), kind="stable")]
    moments, change, owner_rank, kinds = moments[order], change[order], owner_rank[order], kinds[order]
    # whether pieces of each kind are open after each moment (a rank's pieces all close
    # within its moments); the first rule whose kinds are all open owns the stretch, and
    # a rule with a kind the step does not have never does
    # (as a bit per kind, read through ``_OWNER_OF_OPEN``)
    present = np.bincount(kinds, minlength=_PEER + 1) > 0
    open_kinds = np.zeros(len(moments), dtype=np.int64)
    for kind in np.flatnonzero(present).tolist():
        open_kinds |= (np.cumsum(np.where(kinds == kind, change, 0)) > 0).astype(np.int64) << kind
    owner = _OWNER_OF_OPEN[open_kinds[:-1]]
    same_rank = owner_rank[1:] == owner_rank[:-1]
    segment_rank = owner_rank[:-1]
    low, high = own_first[segment_rank], own_last[segment_rank]
    length = np.clip(moments[1:], low, high) - np.clip(moments[:-1], low, high)
    length = np.where(same_rank, length, 0.0)
    return np.bincount(segment_rank * len(PARTS) + owner, weights=length,
                       minlength=ranks * len(PARTS)).reshape(ranks, len(PARTS))


def split_waits(trace: Trace) -> list[tuple[TraceEvent, list[tuple[float, float, str]]]]:
    """Every wait (``recv``, ``wait``) event with its pieces ``(start, end, part)``,
    ``part`` being ``bubble`` or ``exposed_comm`` by the rule of ``time_accounting``
    (for charts that draw the two apart)."""
    peer_rank, peer_start, peer_end = peer_intervals(trace)
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for rank, start, end in zip(peer_rank.tolist(), peer_start.tolist(), peer_end.tolist(), strict=True):
        by_rank.setdefault(rank, []).append((start, end))
    merged = {rank: _union(sorted(intervals)) for rank, intervals in by_rank.items()}
    return [(event, _cut(event.start, event.end, merged.get(event.rank, [])))
            for event in trace.events if event.stream in WAITING_STREAMS]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted intervals merged where they touch or overlap."""
    merged: list[tuple[float, float]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _cut(start: float, end: float, bubbles: list[tuple[float, float]]) -> list[tuple[float, float, str]]:
    """``[start, end]`` cut into bubble pieces (inside ``bubbles``) and exposed ones."""
    pieces, moment = [], start
    for low, high in bubbles:
        low, high = max(low, start), min(high, end)
        if high <= low:
            continue
        if low > moment:
            pieces.append((moment, low, "exposed_comm"))
        pieces.append((low, high, "bubble"))
        moment = high
    if end > moment or not pieces:
        pieces.append((moment, end, "exposed_comm"))
    return pieces
