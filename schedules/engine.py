"""The timing engine: every rank walks its program, and the step's moments follow.

One engine answers every timing question pipesim asks: a simulated step's Trace
(``pipesim.sim.engine`` hands it a cluster's links and collectives), lowering's planned
times, the timing of zero-bubble candidate orders, and whether a schedule can finish at
all (a rank left stuck is the validator's deadlock verdict). It knows nothing of clusters
or models: it is given each compute action's seconds, what holds a rank after it (tensor
parallel collectives), and each transfer's *wire*: the links it crosses, how long its
bytes occupy them and the latency on top.

The rules, under the P2P semantics named in ``schedules.p2p``:

- a rank runs its items in program order. A compute action starts once the rank is free
  and its input is there (below), runs for its seconds, then holds the rank for its hold;
- an overlapped pair (``Schedule.fused``: DualPipe's ``OVERLAP_F_B``, a forward and the
  backward right after it) is one step: its forward starts once both halves' inputs are
  there, and both halves' outputs exist when its backward ends (under ``free``, both leave
  then; lowered programs post the sends after the pair). ``torch-runtime`` runs the two
  halves one after the other, each waiting for its own input, as torch's runtime does;
- ``rendezvous`` (NCCL): posting a group costs ``comm_overhead`` per operation and never
  blocks; a rank's groups run one after another on its stream, a group starting once
  posted and once the previous one completed; a transfer leaves when the later of its two
  groups starts; a group completes when all of its transfers have arrived. A compute
  action whose input comes from another rank waits for the group holding that receive to
  complete, and a rank's step ends once its last group has completed;
- ``buffered`` (gloo): a group's sends leave as they are posted (``comm_overhead`` each,
  then its receives are posted); a compute action waits for its input's arrival, where
  it needs it (as ``irecv`` and a wait right before the consumer);
- ``free`` (compute-only programs): each output leaves when its producer ends and the
  consumer waits for its arrival: the step as if transfers flowed freely;
- ``torch-runtime``: rendezvous with every transfer posted alone, a rank's transfers to
  each peer on a stream of their own (torch's runtime on NCCL, ``schedules.p2p``).

A transfer reserves every link of its route first come, first served: it starts when
all of them are free, holds them for its occupancy, and arrives its latency later.
Transfers that leave at the same moment reserve in rank order, then in posting order: a
rank's groups in the order it posted them, whichever stream each runs on and whenever
that stream took it up.
A route with no links (the ideal cluster, one device) arrives at once.

Each rank's data-parallel channel (``schedules.dp_channel``): a backward that releases
gradients issues its stage's reductions as the rank runs it (at their fraction of it, at
its end, or at the rank's step end), and the channel serves them in issue order, each
once issued, once the one before it ended and once every link it crosses is free,
holding those links a bucket at a time; a channel's moment is taken after every P2P
moment of the same time, then in rank order. Nothing in a rank's walk waits for its
channel.

The walk is compiled (``schedules/_engine.c``, built by setup.py) and is the only product
copy of these rules; it reads the programs as arrays (``schedules.program_arrays``).
Where no C compiler was available, the SimPy model of the same rules
(``schedules.engine_reference``, the specification the compiled walk is tested against)
runs instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from schedules import dataflow
from schedules.action import COMPUTE_KINDS, KIND_CODES  # COMPUTE_KINDS: the columns of ``StepTiming.seconds``
from schedules.dp_channel import ChannelArrays, Reductions, channel_arrays, empty_channels, no_channel
from schedules.p2p import BUFFERED, RENDEZVOUS, TORCH_RUNTIME
from schedules.program_arrays import (
    B_CODE,
    F_CODE,
    I_CODE,
    ProgramArrays,
    program_arrays,
)
from schedules.schedule import Schedule

try:  # built by setup.py where a C compiler is found
    from schedules import _engine as _compiled
except ImportError:  # pragma: no cover - depends on the install
    _compiled = None

FREE = "free"  # compute-only programs: every output flows to its consumer as soon as it exists
# the walk's rules; torch's runtime is rendezvous on other streams (``EngineProgram.group_stream``)
SEMANTICS_CODES = {RENDEZVOUS: 0, BUFFERED: 1, FREE: 2, TORCH_RUNTIME: 0}

# One route of a wire: the link numbers it crosses, seconds its bytes occupy them, latency.
Route = tuple[tuple[int, ...], float, float]


@dataclass(frozen=True)
class StepTiming:
    """What a step's actions cost, as the engine reads it.

    ``seconds[stage, k]`` is the duration of compute kind ``COMPUTE_KINDS[k]`` on
    ``stage``; ``hold[stage, k]`` what holds the rank right after it (tensor-parallel
    collectives, expert-parallel all-to-alls; None: nothing). ``pair_seconds`` and
    ``pair_hold``, keyed ``(stage, kind, microbatch)``, override single actions (the two
    halves of an overlapped pair, whose communication can hide under each other's
    compute). ``wires[dataflow.wire_of(stage, direction)]`` are the routes of the transfer that leaves
    ``stage`` forward (direction 0) or backward (1): one route, or several when the same
    send of other pipelines shares links with it (the data counts as arrived when every
    route's has); empty or None: it arrives at once. ``reductions``: the gradient
    reductions each rank's data-parallel channel runs (``schedules.dp_channel``), None:
    none."""

    seconds: np.ndarray
    hold: np.ndarray | None = None
    pair_seconds: Mapping[tuple, float] = field(default_factory=dict)
    pair_hold: Mapping[tuple, float] = field(default_factory=dict)
    wires: Sequence[Sequence[Route] | None] = ()
    comm_overhead: float = 0.0
    reductions: Reductions | None = None

    @classmethod
    def uniform(cls, num_stages: int, fwd: float, bwd: float, wgrad: float = 0.0, hop: float = 0.0) -> StepTiming:
        """Every stage alike (``I = bwd - wgrad``, ``W = wgrad``), every transfer ``hop``
        seconds of latency on a link of its own."""
        seconds = np.tile(np.array([fwd, bwd, bwd - wgrad, wgrad], dtype=float), (num_stages, 1))
        return cls(seconds, wires=hop_wires(num_stages, hop))


def hop_wires(num_stages: int, hop: float | Sequence[float]) -> list[list[Route]]:
    """Wires of ``hop`` seconds of latency each (one number, or one per stage boundary:
    ``hop[s]`` between stages ``s`` and ``s + 1``), each on a link of its own so that
    transfers never queue: the zero-bubble paper's ``T_comm`` model."""
    hops = [float(hop)] * max(num_stages - 1, 0) if isinstance(hop, (int, float)) else [float(h) for h in hop]
    wires: list[list[Route]] = []
    for stage in range(num_stages):  # hops[s] lies between stages s and s + 1: the lower of the two ends
        wires += [[((dataflow.wire_of(stage, direction),), 0.0, hops[min(stage, target)])]
                  if 0 <= (target := dataflow.receiving_stage(stage, direction)) < num_stages else []
                  for direction in (dataflow.FORWARD, dataflow.BACKWARD)]
    return wires


class EngineError(RuntimeError):
    """The engine was handed something it cannot time (not a validation problem: the
    caller passed inconsistent inputs)."""


@dataclass
class StepRun:
    """What the engine computed for one step: per compute row (in program order, rank
    after rank) the moment its rank reached it (``ready``), its ``start`` and ``end``
    (its ``hold`` follows); per transfer key when its SEND was posted, left and arrived; per
    P2P group when it was posted, started and completed (rendezvous); per rank the host's
    clock at the end of its program and when its step is done (its last transfers
    included); per collective of the ranks' data-parallel channels (``channels``, in
    channel order) when it was issued, started and ended. Moments never reached are NaN.
    ``stuck_item[r]`` is the item rank ``r`` stopped at, -1 if it finished."""

    program: EngineProgram
    ready: np.ndarray
    start: np.ndarray
    end: np.ndarray
    posted: np.ndarray
    departed: np.ndarray
    arrival: np.ndarray
    group_posted: np.ndarray
    group_start: np.ndarray
    group_done: np.ndarray
    rank_clock: np.ndarray
    rank_done: np.ndarray
    stuck_item: np.ndarray
    collective_ready: np.ndarray = field(default_factory=lambda: np.zeros(0))
    collective_start: np.ndarray = field(default_factory=lambda: np.zeros(0))
    collective_end: np.ndarray = field(default_factory=lambda: np.zeros(0))
    channels: ChannelArrays | None = None
    hold: np.ndarray | None = None  # per compute row: the seconds that held its rank after it
    # the schedule run, held for readers of ``program.arrays.schedule`` (the arrays point to it weakly)
    schedule: Schedule | None = None

    @property
    def stuck(self) -> list[int]:
        """The ranks that can never finish their program (empty unless it deadlocks)."""
        return [int(rank) for rank in np.flatnonzero(self.stuck_item >= 0)]

    @property
    def makespan(self) -> float:
        """From the first moment (0) to the last rank's end."""
        return float(self.rank_done.max()) if len(self.rank_done) else 0.0

    def rank_spans(self) -> np.ndarray:
        """Per rank, its first compute action's start to its last one's end (the
        zero-bubble paper's measure of a stage's time)."""
        program = self.program
        spans = np.zeros(program.ranks)
        if len(self.start):
            first = np.full(program.ranks, np.inf)
            last = np.zeros(program.ranks)
            np.minimum.at(first, program.compute_rank, self.start)
            np.maximum.at(last, program.compute_rank, self.end)
            spans = np.where(np.isfinite(first), last - first, 0.0)
        return spans


@dataclass
class EngineProgram:
    """A schedule compiled for one semantics: the items each rank walks, with everything
    that follows from the schedule alone (which receive or transfer each compute action
    waits for, which transfer it sends in ``free`` mode, which group holds each P2P
    operation). Kept with the schedule per semantics (``Schedule.derived``)."""

    arrays: ProgramArrays
    semantics: str
    ranks: int
    rank_item_start: np.ndarray
    item_is_group: np.ndarray
    item_ref: np.ndarray
    compute_row: np.ndarray  # the program row of each compute action
    compute_rank: np.ndarray
    compute_need: np.ndarray  # the group (rendezvous) or transfer (else) each waits for, -1 none
    compute_send: np.ndarray  # free mode: the transfer each compute action sends, -1 none
    compute_blocked: np.ndarray  # its same-rank input comes later in the program: never runs
    compute_pair: np.ndarray  # an overlapped pair's other half (its forward's, its backward's), -1 none
    group_endpoint_start: np.ndarray
    group_rank: np.ndarray
    group_stream: np.ndarray  # the P2P stream each group runs on: its rank's, or (torch) its rank pair's
    stream_group_start: np.ndarray  # stream s runs groups stream_groups[stream_group_start[s]:...] in order
    stream_groups: np.ndarray
    endpoint_row: np.ndarray
    endpoint_transfer: np.ndarray
    endpoint_is_send: np.ndarray
    transfer_wire: np.ndarray

    @property
    def computes(self) -> int:
        return len(self.compute_row)

    @cached_property
    def no_collectives(self) -> ChannelArrays:
        """Data-parallel channels with no collective, shaped for this program
        (``schedules.dp_channel.no_channel``)."""
        return empty_channels(self.ranks, self.computes, self.arrays.schedule.num_stages)

    @property
    def groups(self) -> int:
        return len(self.group_rank)

    @cached_property
    def compute_stage(self) -> np.ndarray:
        return self.arrays.stage[self.compute_row]

    @cached_property
    def compute_kind(self) -> np.ndarray:
        return self.arrays.kind[self.compute_row]

    @cached_property
    def compute_microbatch(self) -> np.ndarray:
        return self.arrays.microbatch[self.compute_row]


def compile_program(schedule: Schedule, semantics: str) -> EngineProgram:
    """The schedule's programs as the engine walks them under ``semantics`` (kept with
    the schedule). ``free`` reads only the compute actions; the others need a lowered
    schedule."""
    _require_semantics(semantics)
    return schedule.derived(f"engine_program:{semantics}", lambda owner: _compile(program_arrays(owner), semantics))


def _compile(arrays: ProgramArrays, semantics: str) -> EngineProgram:
    schedule = arrays.schedule
    placement = np.asarray(schedule.placement, dtype=np.int64)
    num_stages, microbatches = schedule.num_stages, arrays.microbatches
    free = semantics == FREE
    is_compute = arrays.is_compute
    # items: each compute row, and the first row of each P2P group (free: compute rows only)
    if free:
        item_first = np.flatnonzero(is_compute)
    elif semantics == TORCH_RUNTIME:  # every transfer posted alone, whatever groups the file has
        item_first = np.arange(arrays.size)
    else:
        item_first = np.flatnonzero(is_compute | ~arrays.joined)
    item_is_group = ~is_compute[item_first]
    compute_row = item_first[~item_is_group]
    item_ref = np.empty(len(item_first), dtype=np.int64)
    item_ref[~item_is_group] = np.arange(len(compute_row))
    group_first = item_first[item_is_group]
    item_ref[item_is_group] = np.arange(len(group_first))
    per_rank = np.bincount(arrays.rank[item_first], minlength=schedule.pp)
    rank_item_start = np.zeros(schedule.pp + 1, dtype=np.int64)
    np.cumsum(per_rank, out=rank_item_start[1:])
    # P2P operations (endpoints) and the group each belongs to
    if free:
        endpoint_row = np.zeros(0, dtype=np.int64)
        endpoint_group = endpoint_row
    else:
        endpoint_row = np.flatnonzero(~is_compute)
        group_of_item = np.cumsum(item_is_group) - 1
        item_of_row = np.searchsorted(item_first, endpoint_row, side="right") - 1
        endpoint_group = group_of_item[item_of_row]
    group_endpoint_start = np.searchsorted(endpoint_group, np.arange(len(group_first) + 1)).astype(np.int64)
    endpoint_transfer = arrays.transfer_key(arrays.stage[endpoint_row], arrays.kind[endpoint_row],
                                            arrays.microbatch[endpoint_row])
    endpoint_is_send = arrays.is_send[endpoint_row]
    # what each compute action waits for from another rank, and sends to one
    stage, kind, microbatch = (arrays.stage[compute_row], arrays.kind[compute_row],
                               arrays.microbatch[compute_row])
    rank = arrays.rank[compute_row]
    source, has_input = dataflow.input_stages(stage, kind, num_stages, schedule.copies)
    source_rank = placement[np.clip(source, 0, num_stages - 1)]
    crosses = has_input & (source_rank != rank)
    direction = dataflow.DIRECTION_CODES[kind]
    input_key = np.where(crosses, dataflow.transfer_key(source, direction, microbatch, microbatches), -1)
    if semantics in (RENDEZVOUS, TORCH_RUNTIME):
        receives = np.flatnonzero(~endpoint_is_send)
        group_holding = np.full(arrays.transfers, -1, dtype=np.int64)
        group_holding[endpoint_transfer[receives]] = endpoint_group[receives]
        need = np.where(crosses, group_holding[np.maximum(input_key, 0)], -1)
    else:
        need = input_key
    if free:
        target, has_output = dataflow.output_stages(stage, kind, num_stages, schedule.copies)
        sends = has_output & (placement[np.clip(target, 0, num_stages - 1)] != rank)
        compute_send = np.where(sends, dataflow.transfer_key(stage, direction, microbatch, microbatches), -1)
    else:
        compute_send = np.full(len(compute_row), -1, dtype=np.int64)
    blocked = _later_same_rank_input(arrays, compute_row, has_input & ~crosses, source)
    pair = _overlapped_pairs(arrays, compute_row) if semantics != TORCH_RUNTIME else np.full(len(compute_row), -1)
    group_rank = arrays.rank[group_first]
    group_stream = group_rank
    if semantics == TORCH_RUNTIME:  # one stream per rank pair: the peer of the group's one transfer
        first_endpoint = endpoint_row[group_endpoint_start[:-1]]
        group_stream = group_rank * schedule.pp + _peer_rank(arrays, placement, first_endpoint)
    stream_count = schedule.pp * (schedule.pp if semantics == TORCH_RUNTIME else 1)
    stream_groups = np.argsort(group_stream, kind="stable")
    stream_group_start = np.searchsorted(group_stream[stream_groups], np.arange(stream_count + 1)).astype(np.int64)
    return EngineProgram(
        arrays=arrays, semantics=semantics, ranks=schedule.pp, rank_item_start=rank_item_start,
        item_is_group=item_is_group.astype(np.int8), item_ref=item_ref, compute_row=compute_row, compute_rank=rank,
        compute_need=need, compute_send=compute_send, compute_blocked=blocked.astype(np.int8),
        compute_pair=pair.astype(np.int64),
        group_endpoint_start=group_endpoint_start, group_rank=group_rank, group_stream=group_stream,
        stream_group_start=stream_group_start, stream_groups=stream_groups, endpoint_row=endpoint_row,
        endpoint_transfer=endpoint_transfer, endpoint_is_send=endpoint_is_send.astype(np.int8),
        transfer_wire=dataflow.transfer_wire(np.arange(arrays.transfers, dtype=np.int64), microbatches),
    )


def _overlapped_pairs(arrays: ProgramArrays, compute_row: np.ndarray) -> np.ndarray:
    """Per compute action, the other half of its overlapped pair (``Schedule.fused``:
    the backward at a listed position, the forward just before it), -1 if it has none."""
    pair = np.full(len(compute_row), -1, dtype=np.int64)
    schedule = arrays.schedule
    if not any(schedule.fused):
        return pair
    backward_rows = np.array([int(arrays.rank_start[rank]) + position for rank in range(schedule.pp)
                              for position in sorted(schedule.fused[rank])], dtype=np.int64)
    backward = np.searchsorted(compute_row, backward_rows)
    forward = np.searchsorted(compute_row, backward_rows - 1)
    pair[forward], pair[backward] = backward, forward
    return pair


def _peer_rank(arrays: ProgramArrays, placement: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rank on the other end of each communication row."""
    return placement[arrays.stage[rows] + dataflow.PEER_OFFSET_CODES[arrays.kind[rows]]]


def _later_same_rank_input(arrays: ProgramArrays, compute_row: np.ndarray, local: np.ndarray,
                           source: np.ndarray) -> np.ndarray:
    """Compute actions whose input comes from a stage on the same rank (a V-shaped
    placement) but whose producer comes later in the program, or not at all: they can
    never run."""
    blocked = np.zeros(len(compute_row), dtype=bool)
    if not local.any():
        return blocked
    microbatches = arrays.microbatches
    kind = arrays.kind[compute_row]
    position = arrays.position[compute_row]
    key = arrays.stage[compute_row] * microbatches + arrays.microbatch[compute_row]
    size = arrays.schedule.num_stages * microbatches
    forward_at = np.full(size, np.iinfo(np.int64).max)
    backward_at = np.full(size, np.iinfo(np.int64).max)
    is_forward = kind == F_CODE
    is_backward = (kind == B_CODE) | (kind == I_CODE)
    forward_at[key[is_forward]] = position[is_forward]
    backward_at[key[is_backward]] = position[is_backward]
    wanted = local.nonzero()[0]
    producer_key = source[wanted] * microbatches + arrays.microbatch[compute_row][wanted]
    producer_at = np.where(is_forward[wanted], forward_at[producer_key], backward_at[producer_key])
    blocked[wanted] = producer_at > position[wanted]
    return blocked


def run(schedule: Schedule, timing: StepTiming, semantics: str) -> StepRun:
    """Time one step of ``schedule`` under ``semantics`` (see the module)."""
    return run_program(compile_program(schedule, semantics), timing)


def compile_arrays(arrays: ProgramArrays, semantics: str) -> EngineProgram:
    """``arrays`` compiled for ``semantics``, not kept: lowering's candidate placements,
    timed as rows (``schedules.transfer_placement.LoweredRows``) before the one kept is
    built as a schedule. Overlapped pairs are read off the owning schedule's positions,
    so its rows must be that schedule's when it has any."""
    _require_semantics(semantics)
    return _compile(arrays, semantics)


def _require_semantics(semantics: str) -> None:
    if semantics not in SEMANTICS_CODES:
        raise ValueError(f"unknown P2P semantics {semantics!r}: use one of {', '.join(SEMANTICS_CODES)}")


def run_program(program: EngineProgram, timing: StepTiming) -> StepRun:
    """Time one step of a compiled program (``run``)."""
    return run_inputs(program, step_inputs(program, timing))


def run_inputs(program: EngineProgram, inputs: StepInputs) -> StepRun:
    """Time one step of ``program`` on ``inputs``: ``step_inputs``, or its arrays perturbed
    (a caller that times many variants of one step, sampled jitter or stragglers, prices
    it once and scales the arrays; ``program.transfer_wire[key]`` is transfer ``key``'s
    wire)."""
    inputs = inputs._replace(seconds=np.ascontiguousarray(inputs.seconds, dtype=float),
                             hold=np.ascontiguousarray(inputs.hold, dtype=float),
                             channels=inputs.channels if inputs.channels is not None else no_channel(program))
    if _compiled is None:  # pragma: no cover - an install without a C compiler
        from schedules.engine_reference import run_reference

        step = run_reference(program, inputs.seconds, inputs.hold, inputs.wires, inputs.comm_overhead,
                             inputs.channels)
    else:
        step = _run_compiled(program, inputs)
    step.hold = inputs.hold
    return step


class StepInputs(NamedTuple):
    """A compiled program's costs under one ``StepTiming``, as both walks read them: each
    compute action's seconds and hold (in compute row order), the wires as flat arrays,
    the posting overhead, the ranks' data-parallel channels (None: none). ``step_inputs``
    builds them; the compiled walk and the SimPy specification
    (``schedules.engine_reference.SimpyStep``) are handed the same."""

    seconds: np.ndarray
    hold: np.ndarray
    wires: WireArrays
    comm_overhead: float
    channels: ChannelArrays | None = None


def step_inputs(program: EngineProgram, timing: StepTiming) -> StepInputs:
    """``program``'s ``StepInputs`` under ``timing`` (a NamedTuple: built on every run)."""
    seconds, hold = compute_costs(program, timing)
    wires = wire_arrays(timing.wires, program.arrays)
    return StepInputs(seconds, hold, wires, float(timing.comm_overhead),
                      channel_arrays(program, timing.reductions, wires.links))


def compute_costs(program: EngineProgram, timing: StepTiming) -> tuple[np.ndarray, np.ndarray]:
    """Seconds and hold of each compute action, looked up by (stage, kind)."""
    stage, kind = program.compute_stage, program.compute_kind
    table = np.asarray(timing.seconds, dtype=float)
    if table.shape != (program.arrays.schedule.num_stages, len(COMPUTE_KINDS)):
        raise EngineError(f"timing gives seconds for {table.shape[0]} stages; the schedule has "
                          f"{program.arrays.schedule.num_stages}")
    seconds = table[stage, kind]
    hold = np.zeros(len(seconds)) if timing.hold is None else np.asarray(timing.hold, dtype=float)[stage, kind]
    for overrides, values in ((timing.pair_seconds, seconds), (timing.pair_hold, hold)):
        if overrides:
            rows = action_rows(program, list(overrides))
            values[rows[rows >= 0]] = np.fromiter(overrides.values(), float, len(overrides))[rows >= 0]
    return np.ascontiguousarray(seconds), np.ascontiguousarray(hold)


def action_rows(program: EngineProgram, actions: Sequence[tuple]) -> np.ndarray:
    """The compute row of ``program`` that runs each ``(stage, kind, microbatch)``, -1 where
    none does (a compute action appears once in a valid schedule)."""
    microbatches = program.arrays.microbatches
    key = (program.compute_stage * len(COMPUTE_KINDS) + program.compute_kind) * microbatches \
        + program.compute_microbatch
    order = np.argsort(key, kind="stable")
    wanted = np.array([(stage * len(COMPUTE_KINDS) + KIND_CODES[kind]) * microbatches + microbatch
                       for stage, kind, microbatch in actions], dtype=np.int64)
    at = np.clip(np.searchsorted(key[order], wanted), 0, max(len(key) - 1, 0))
    found = (len(key) > 0) & (key[order][at] == wanted) if len(key) else np.zeros(len(wanted), dtype=bool)
    return np.where(found, order[at] if len(key) else -1, -1)


@dataclass(frozen=True)
class WireArrays:
    """``StepTiming.wires`` flattened: per wire its routes, per route its links,
    occupancy and latency."""

    route_start: np.ndarray
    link_start: np.ndarray
    links: np.ndarray
    occupancy: np.ndarray
    latency: np.ndarray
    link_count: int


def wire_arrays(wires: Sequence[Sequence[Route] | None], arrays: ProgramArrays) -> WireArrays:
    """``StepTiming.wires`` of the schedule of ``arrays`` flattened (``WireArrays``)."""
    count = arrays.schedule.num_stages * 2
    if wires and len(wires) != count:
        raise EngineError(f"timing gives {len(wires)} wires; the schedule has {count} (two per stage)")
    route_start, link_start, links, occupancy, latency = [0], [0], [], [], []
    for wire in (wires or [None] * count):
        for route_links, seconds, route_latency in (wire or ()):
            links += route_links
            link_start.append(len(links))
            occupancy.append(seconds)
            latency.append(route_latency)
        route_start.append(len(occupancy))
    links_array = np.array(links, dtype=np.int64)
    return WireArrays(np.array(route_start, dtype=np.int64), np.array(link_start, dtype=np.int64), links_array,
                      np.array(occupancy, dtype=float), np.array(latency, dtype=float),
                      int(links_array.max()) + 1 if len(links_array) else 0)


def empty_run(program: EngineProgram, channels: ChannelArrays | None = None) -> StepRun:
    """A ``StepRun`` of NaN moments, the shape of ``program``'s outputs (and of
    ``channels``' collectives)."""
    computes, transfers, groups = program.computes, program.arrays.transfers, program.groups
    collectives = channels.count if channels is not None else 0

    def nan(size: int) -> np.ndarray:
        return np.full(size, np.nan)

    return StepRun(program, nan(computes), nan(computes), nan(computes), nan(transfers), nan(transfers),
                   nan(transfers), nan(groups), nan(groups), nan(groups), nan(program.ranks), nan(program.ranks),
                   np.full(program.ranks, -1, dtype=np.int64), nan(collectives), nan(collectives), nan(collectives),
                   channels=channels, schedule=program.arrays.schedule)


class EngineInputs(NamedTuple):
    """The arrays the compiled walk reads, by name (``schedules/_engine.c``'s ``INPUT_NAMES``,
    whose order is checked when the module loads): a tuple, so the C side takes them by
    position at no cost, built here by name so that no position is matched by hand."""

    rank_item_start: np.ndarray
    item_is_group: np.ndarray
    item_ref: np.ndarray
    seconds: np.ndarray
    hold: np.ndarray
    need: np.ndarray
    send: np.ndarray
    blocked: np.ndarray
    pair: np.ndarray
    group_endpoint_start: np.ndarray
    group_rank: np.ndarray
    group_stream: np.ndarray
    stream_group_start: np.ndarray
    stream_groups: np.ndarray
    endpoint_transfer: np.ndarray
    endpoint_is_send: np.ndarray
    transfer_wire: np.ndarray
    route_start: np.ndarray
    link_start: np.ndarray
    links: np.ndarray
    occupancy: np.ndarray
    latency: np.ndarray
    channel_start: np.ndarray
    collective_mode: np.ndarray
    collective_fraction: np.ndarray
    collective_run: np.ndarray
    run_offset_start: np.ndarray
    run_offsets: np.ndarray
    collective_stage: np.ndarray
    stage_link_start: np.ndarray
    stage_links: np.ndarray
    row_collective_start: np.ndarray
    row_collectives: np.ndarray
    gate_first: np.ndarray
    gate_last: np.ndarray


# The compiled walk's outputs are these ``StepRun`` fields, in this order (``OUTPUT_NAMES``).
ENGINE_OUTPUTS = ("ready", "start", "end", "posted", "departed", "arrival", "group_posted", "group_start",
                  "group_done", "rank_clock", "rank_done", "stuck_item", "collective_ready", "collective_start",
                  "collective_end")


def engine_inputs(program: EngineProgram, inputs: StepInputs) -> EngineInputs:
    """What the compiled walk reads for ``program`` under ``inputs``."""
    wires, channels = inputs.wires, inputs.channels
    return EngineInputs(
        rank_item_start=program.rank_item_start, item_is_group=program.item_is_group, item_ref=program.item_ref,
        seconds=inputs.seconds, hold=inputs.hold, need=program.compute_need, send=program.compute_send,
        blocked=program.compute_blocked, pair=program.compute_pair, group_endpoint_start=program.group_endpoint_start,
        group_rank=program.group_rank, group_stream=program.group_stream,
        stream_group_start=program.stream_group_start, stream_groups=program.stream_groups,
        endpoint_transfer=program.endpoint_transfer, endpoint_is_send=program.endpoint_is_send,
        transfer_wire=program.transfer_wire, route_start=wires.route_start, link_start=wires.link_start,
        links=wires.links, occupancy=wires.occupancy, latency=wires.latency, channel_start=channels.channel_start,
        collective_mode=channels.mode, collective_fraction=channels.fraction, collective_run=channels.table_row,
        run_offset_start=channels.offset_start, run_offsets=channels.offsets,
        collective_stage=channels.stage, stage_link_start=channels.stage_link_start,
        stage_links=channels.stage_links, row_collective_start=channels.row_start,
        row_collectives=channels.row_collectives, gate_first=channels.gate_first, gate_last=channels.gate_last)


def _run_compiled(program: EngineProgram, inputs: StepInputs) -> StepRun:
    if inputs.channels is None:
        inputs = inputs._replace(channels=no_channel(program))
    result = empty_run(program, inputs.channels)
    _compiled.run(SEMANTICS_CODES[program.semantics], inputs.comm_overhead, engine_inputs(program, inputs),
                  max(inputs.wires.link_count, inputs.channels.link_count),
                  tuple(getattr(result, name) for name in ENGINE_OUTPUTS))
    return result


def _check_compiled_names() -> None:
    """A compiled walk built from another ``_engine.c`` than this module's names would read
    its arrays in the wrong places: refuse it, saying how to rebuild."""
    for kind, expected, built in (("inputs", EngineInputs._fields, getattr(_compiled, "INPUTS", None)),
                                  ("outputs", ENGINE_OUTPUTS, getattr(_compiled, "OUTPUTS", None))):
        if built is not None and tuple(built) != tuple(expected):
            raise ImportError(f"schedules/_engine.c's {kind} {built} are not schedules.engine's {expected}: "
                              f"rebuild the walk (python setup.py build_ext --inplace)")


if _compiled is not None:
    _check_compiled_names()


def transfer_sender(program: EngineProgram) -> np.ndarray:
    """The rank that sends each transfer key (the rank of its sending stage)."""
    arrays = program.arrays
    placement = np.asarray(arrays.schedule.placement, dtype=np.int64)
    return placement[dataflow.transfer_parts(np.arange(arrays.transfers), arrays.microbatches)[0]]

