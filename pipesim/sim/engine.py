"""One simulated step on a modelled cluster: the engine's inputs from costs and links,
its moments turned into a Trace.

The timing rules themselves live once, in ``schedules.engine`` (compiled, with the SimPy
model ``schedules.engine_reference`` as their specification). This module says what the
cluster and the model make of them: each compute action's seconds (``Costs``), the
tensor-parallel collectives that hold a rank after it (``CommPlan``), and each
transfer's wire: the links of its route between the two ranks' devices, the seconds its
bytes occupy them and the latency on top (``Route.wire``), plus the routes of the same
send of the pipelines not simulated where they share links (``pipesim.cluster.twins``),
and the collectives each rank's dp channel runs in the same walk (the gradient
reductions; under ZeRO-1 and 2 with ``--overlap-param-gather``, the parameter gathers
the step's first forwards wait for; under ZeRO-3, every forward's and backward's
per-layer gathers), holding the links their rings cross in the
same numbering (``pipesim.sim.parallel.gradient_reductions``). After the pipeline come
each rank's optimizer step and, without that overlap, the parameter gathers after it
(``pipesim.sim.parallel.step_tail_columns``).

Events are recorded as the executor records them. A send's runs from the moment its
group was posted (its data was ready) to its arrival, however long it then waited for
its receive or for busy links; a receive's from the moment the rank reached the action
that needs its data to the moment that action can start. A rank whose program ends while
its last transfers are still in flight waits for them (a ``wait`` event). Bubble and
exposed communication are told apart from those moments (``schedules.accounting``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from pipesim.cluster.topology import Topology
from pipesim.model.costs import Costs
from pipesim.sim.context_parallel import CP_KIND
from pipesim.sim.expert_parallel import EP_KIND
from pipesim.sim.overlap import HOLD_PARTS, overlapped_pairs
from pipesim.sim.parallel import (
    PARAM_GATHER_KIND,
    TP_KIND,
    CommPlan,
    embedding_sum_seconds,
    gradient_reductions,
    reduction_columns,
    step_tail_columns,
)
from schedules import dataflow, engine
from schedules.action import KINDS, format_group
from schedules.lowering import lower
from schedules.p2p import RENDEZVOUS, TORCH_RUNTIME, require_semantics
from schedules.schedule import Schedule
from schedules.trace import LazyNames, Trace, TraceColumns

COMPUTE, SEND, RECV, WAIT, TP, EP, CP, DP = "compute", "send", "recv", "wait", "tp", "ep", "cp", "dp"
_STREAMS = (COMPUTE, SEND, RECV, WAIT, TP, EP, CP, DP)
_KINDS = (*KINDS, TP_KIND, EP_KIND, CP_KIND, PARAM_GATHER_KIND)
# part (= its stream) -> event kind
_HOLD_KINDS = dict(zip(HOLD_PARTS, (TP_KIND, EP_KIND, CP_KIND), strict=True))


class SimulationError(RuntimeError):
    """The programs could not run to completion (a deadlock the validator did not see)."""


def simulate(
    schedule: Schedule,
    costs: Costs,
    topology: Topology,
    rank_devices: Sequence[str] | None = None,
    plan: CommPlan | None = None,
    p2p: str = RENDEZVOUS,
) -> Trace:
    """Simulate one step of ``schedule`` (lowered here if it is not) and return its Trace.

    ``rank_devices[r]`` is the device pipeline rank ``r`` runs on; by default the
    topology's first ``pp`` devices in order. ``plan`` adds tp and dp collectives.
    ``p2p`` is the point-to-point semantics of the backend predicted
    (``schedules.p2p``). A schedule that can never finish raises ``SimulationError``
    naming where its ranks wait (``schedules.validate`` explains such a schedule in full)."""
    step, priced = _run_priced(schedule, costs, topology, rank_devices, plan, p2p)
    if step.stuck:
        raise SimulationError(f"deadlock under {p2p} semantics: ranks wait forever: " + stuck_places(step))
    return step_trace(step, costs, topology, rank_devices_of(step.program.arrays.schedule, topology, rank_devices),
                      plan, p2p, priced)


def run_step(schedule: Schedule, costs: Costs, topology: Topology, rank_devices: Sequence[str] | None = None,
             plan: CommPlan | None = None, p2p: str = RENDEZVOUS, priced: PricedStep | None = None) -> engine.StepRun:
    """The engine's moments of one step (``simulate`` without the Trace); ``priced`` is
    the step's ``price_step`` where the caller has it already."""
    return _run_priced(schedule, costs, topology, rank_devices, plan, p2p, priced)[0]


def _run_priced(schedule: Schedule, costs: Costs, topology: Topology, rank_devices: Sequence[str] | None,
                plan: CommPlan | None, p2p: str, priced: PricedStep | None = None
                ) -> tuple[engine.StepRun, PricedStep]:
    """The step run and its prices, each priced once: lowering reads the step's timing
    without the collectives' plan, which is the step's own timing when there is none (a
    compute-only schedule and its lowering cost the same per stage, kind and pair)."""
    require_semantics(p2p)
    if costs.num_stages != schedule.num_stages:
        raise ValueError(f"costs describe {costs.num_stages} stages but the schedule has {schedule.num_stages}")
    devices = rank_devices_of(schedule, topology, rank_devices)
    lowered = schedule
    if not schedule.is_lowered:
        unplanned = price_step(schedule, costs, topology, devices)
        lowered = lower_for(schedule, costs, topology, rank_devices, timing=unplanned.timing)
        if plan is None and priced is None:
            priced = unplanned
    priced = priced or price_step(lowered, costs, topology, devices, plan)
    return engine.run(lowered, priced.timing, p2p), priced


def lower_for(schedule: Schedule, costs: Costs, topology: Topology,
              rank_devices: Sequence[str] | None = None, repair_runs: int | None = None,
              rule: int | None = None, timing: engine.StepTiming | None = None) -> Schedule:
    """``schedule`` lowered for the step it will be simulated as: its transfers placed
    and grouped with these stage costs and these links (``schedules.lowering.lower``
    with the step's timing). Lowering depends on nothing else, so the executor gets the
    same programs by lowering with the same ``StepTiming``. Already-lowered schedules
    come back as they are. ``repair_runs`` and ``rule`` as in ``lower`` (default: its own
    budget, every rule; a planner screening thousands of layouts passes one rule and
    lowers its finalists again). ``timing`` is the step's ``step_timing`` without a plan
    where the caller has it already."""
    if schedule.is_lowered:
        return schedule
    if timing is None:
        timing = step_timing(schedule, costs, topology, rank_devices_of(schedule, topology, rank_devices))
    return lower(schedule, timing, repair_runs, rule)


def step_timing(schedule: Schedule, costs: Costs, topology: Topology, devices: Sequence[str],
                plan: CommPlan | None = None) -> engine.StepTiming:
    """What the engine needs of the costs and the cluster (see the module)."""
    return price_step(schedule, costs, topology, devices, plan).timing


@dataclass(frozen=True)
class PricedStep:
    """A step priced once: the engine's timing, and the parts its holds are made of (per
    part of ``HOLD_PARTS``, stage and kind: ``hold_tables``; per overlapped pair and part),
    which the Trace splits each hold into."""

    timing: engine.StepTiming
    hold_parts: np.ndarray | None
    pair_parts: dict


def price_step(schedule: Schedule, costs: Costs, topology: Topology, devices: Sequence[str],
               plan: CommPlan | None = None) -> PricedStep:
    """``step_timing`` with the parts of its holds (``PricedStep``)."""
    durations = costs.durations()
    kinds = engine.COMPUTE_KINDS
    seconds = np.array([[durations[stage, kind] for kind in kinds] for stage in range(schedule.num_stages)])
    parts = hold_tables(schedule, plan)
    hold = parts.sum(axis=0) if parts is not None else None
    pair_seconds, pair_parts = overlapped_pairs(schedule, costs, durations, holds_of(plan), pair_slowdown(plan))
    twins = plan.twin_transfers if plan is not None else {}
    link_numbers: dict[tuple[str, str], int] = {}
    wires = transfer_wires(schedule, costs, topology, devices, twins, link_numbers)
    timing = engine.StepTiming(seconds, hold, pair_seconds,
                               {action: sum(held) for action, held in pair_parts.items()},
                               wires, costs.comm_overhead, gradient_reductions(plan, link_numbers))
    return PricedStep(timing, parts, pair_parts)


def holds_of(plan: CommPlan | None) -> dict[str, dict[tuple[int, str], float]]:
    """Per part of ``HOLD_PARTS``, the seconds that hold a rank after each (stage, kind)."""
    if plan is None:
        return {}
    return {"tp": plan.tp_seconds, "ep": plan.ep_seconds, "cp": plan.cp_seconds}


def pair_slowdown(plan: CommPlan | None) -> float:
    """What an all-to-all beside the other half of an overlapped pair costs its compute
    (``CommPlan.overlap_slowdown``; 0 without a plan: nothing runs beside it)."""
    return plan.overlap_slowdown if plan is not None else 0.0


def hold_tables(schedule: Schedule, plan: CommPlan | None) -> np.ndarray | None:
    """``[part, stage, kind]``: what holds a rank after each compute action, by part
    (tp collectives, ep all-to-alls, cp K/V exchanges); None when nothing does."""
    holds = holds_of(plan)
    if not any(holds.values()):
        return None
    return np.array([[[holds[part].get((stage, kind), 0.0) for kind in engine.COMPUTE_KINDS]
                      for stage in range(schedule.num_stages)] for part in HOLD_PARTS])


def transfer_wires(schedule: Schedule, costs: Costs, topology: Topology, devices: Sequence[str],
                   twins: dict | None = None, numbers: dict[tuple[str, str], int] | None = None
                   ) -> list[list[engine.Route]]:
    """Per (stage, direction) the routes its transfer takes: its own between the two
    ranks' devices, then its twins' (``pipesim.cluster.twins``), links numbered 0, 1, ...
    in ``numbers`` (filled here: the numbering other users of the links extend)."""
    numbers = {} if numbers is None else numbers
    wires: list[list[engine.Route]] = []
    placement = schedule.placement
    for stage in range(schedule.num_stages):
        for kind in dataflow.DIRECTION_KINDS:  # its forward wire, then its backward one (``dataflow.wire_of``)
            target = dataflow.output_to(placement, stage, kind)
            if (target is None or placement[target] == placement[stage]
                    or not schedule.same_copy(stage, target)):  # no transfer: same rank, or a seam between copies
                wires.append([])
                continue
            num_bytes = transfer_bytes(costs, stage, target)
            source, destination = devices[placement[stage]], devices[placement[target]]
            routes = []
            for src, dst in [(source, destination), *(twins or {}).get((source, destination), ())]:
                route = topology.route(src, dst)
                occupancy, latency = route.wire(num_bytes)
                routes.append((tuple(numbers.setdefault(link, len(numbers)) for link in route.links), occupancy,
                               latency))
            wires.append(routes)
    return wires


def transfer_bytes(costs: Costs, stage: int, target: int) -> float:
    """Bytes a transfer from ``stage`` to its neighbour ``target`` moves: the lower
    stage's output activation, forward, or its gradient (the same size) back."""
    return costs.stages[min(stage, target)].act_bytes


def stuck_places(step: engine.StepRun) -> str:
    """Where each stuck rank stands, for a one-line message."""
    schedule = step.program.arrays.schedule
    places = []
    for rank in step.stuck:
        items = schedule.program_items(rank)
        at = min(int(step.stuck_item[rank]), len(items) - 1)
        item = items[at]
        places.append(f"rank {rank} at {format_group(item) if type(item) is tuple else item}")
    return "; ".join(places)


def step_trace(step: engine.StepRun, costs: Costs, topology: Topology, devices: Sequence[str],
               plan: CommPlan | None, p2p: str, priced: PricedStep | None = None) -> Trace:
    """The Trace of a step the engine ran to its end: pipeline events, the gradient
    reductions of the ranks' dp channels, then each rank's step-level tail (optimizer,
    parameter gathers). ``priced``: the step's prices, where
    the caller has them (else priced again)."""
    schedule = step.program.arrays.schedule
    if priced is None:
        priced = price_step(schedule, costs, topology, devices, plan)
    pipeline = pipeline_columns(step, held_parts(step, priced))
    tail = step_tail_columns(pipeline, schedule.pp, plan, costs.step_overhead, reduction_columns(step, plan),
                             embedding_sum_seconds(schedule, costs, topology, devices), costs.grad_norm_overhead)
    wire, sent_bytes = p2p_wire_and_bytes(step, costs)
    meta = {
        "source": "simulated",
        "schedule": schedule.name,
        "pp": schedule.pp,
        "microbatches": schedule.microbatches,
        "virtual_stages": schedule.virtual_stages,
        "topology": topology.name,
        "devices": list(devices),
        "p2p": p2p,
        "p2p_wire_seconds": wire,
        "p2p_bytes": sent_bytes,
    }
    return Trace(columns=TraceColumns.concatenate([pipeline, tail]) if tail is not None else pipeline, meta=meta)


def p2p_wire_and_bytes(step: engine.StepRun, costs: Costs) -> tuple[list[float], list[float]]:
    """Per rank, the seconds its sends spent on the wire (from leaving, when the peer had
    posted its receive under rendezvous, to arriving: queueing behind other transfers on
    the links included, waiting for the peer not) and the bytes they carried: what a
    faster link or a smaller activation would change, apart from the time a send waits
    for its peer (which the Trace's send events include)."""
    arrays = step.program.arrays
    sent = np.flatnonzero(~np.isnan(step.arrival) & ~np.isnan(step.departed))
    stage, direction, _microbatch = dataflow.transfer_parts(sent, arrays.microbatches)
    sender = np.asarray(arrays.schedule.placement)[stage]
    act_bytes = np.array([cost.act_bytes for cost in costs.stages])  # a boundary carries its lower stage's output
    carried = act_bytes[np.minimum(stage, dataflow.receiving_stage(stage, direction))] if len(sent) else np.zeros(0)
    ranks = arrays.schedule.pp
    wire = np.bincount(sender, weights=step.arrival[sent] - step.departed[sent], minlength=ranks)
    return wire.tolist(), np.bincount(sender, weights=carried, minlength=ranks).tolist()


def held_parts(step: engine.StepRun, priced: PricedStep) -> np.ndarray | None:
    """``[row, part]``: the seconds of each part of ``HOLD_PARTS`` that held the rank after
    each compute row (they add up to the engine's hold); None when nothing held any."""
    program = step.program
    tables = priced.hold_parts
    if tables is None:
        return None
    # compute kinds' codes are the columns of the tables (F, B, I, W first in KINDS, as the engine reads them)
    parts = tables[:, program.compute_stage, program.compute_kind].T.copy()
    pair_parts = priced.pair_parts
    if pair_parts:
        rows = engine.action_rows(program, list(pair_parts))
        for row, held in zip(rows.tolist(), pair_parts.values(), strict=True):
            if row >= 0:
                parts[row] = held
    return parts


def pipeline_columns(step: engine.StepRun, held: np.ndarray | None = None) -> TraceColumns:
    """The pipeline's events as Trace columns: compute actions, what holds the rank after
    them (``held[row, part]``: tp collectives, ep all-to-alls, cp K/V exchanges, one
    event each, one after the other; without it the whole hold as tp), receives waited
    for, sends from posting to arrival, and end-of-step waits (the parameter gathers an
    action waited for are the dp channel's events: ``reduction_columns``)."""
    program = step.program
    arrays = program.arrays
    parts: list[tuple] = []  # (rank, kind, stage, microbatch, start, end, stream)
    rank, stage, kind, microbatch = (program.compute_rank, program.compute_stage, program.compute_kind,
                                     program.compute_microbatch)
    parts.append((rank, kind, stage, microbatch, step.start, step.end, _STREAMS.index(COMPUTE)))
    # per part, its events' count and, for holds, what names them (made only if read: ``LazyNames``)
    names: list[tuple] = [(len(rank),)]
    named = False  # whether any event has a name of its own (else the Trace keeps none)
    if held is None:
        held = np.zeros((len(rank), len(HOLD_PARTS)))
        held[:, 0] = step.hold if step.hold is not None else 0.0
    # each part ends at the compute's end plus the parts so far, added as the engine adds the
    # hold: the last one ends exactly where the engine lets the rank go on
    ends = step.end[:, None] + np.cumsum(held, axis=1)
    for index, part in enumerate(HOLD_PARTS):
        start, end = (step.end if index == 0 else ends[:, index - 1]), ends[:, index]
        rows = np.flatnonzero(held[:, index] > 0)
        if len(rows):
            hold_kind = _HOLD_KINDS[part]
            parts.append((rank[rows], np.full(len(rows), _KINDS.index(hold_kind)), stage[rows], microbatch[rows],
                          start[rows], end[rows], _STREAMS.index(part)))
            names.append((len(rows), hold_kind, stage[rows], kind[rows], microbatch[rows]))
            named = True
    if program.semantics != engine.FREE:
        waited = np.flatnonzero(program.compute_need >= 0)
        receive = dataflow.RECV_OF_CODES[kind[waited]]
        parts.append((rank[waited], receive, stage[waited], microbatch[waited], step.ready[waited],
                      received(step, waited), _STREAMS.index(RECV)))
        names.append((len(waited),))
        # an overlapped pair starts once both halves' inputs are there: a forward that needs no
        # transfer of its own (the first stage's) waits for its backward's, drawn as that receive
        other = program.compute_pair
        pair_forwards = np.flatnonzero((other >= 0) & (program.compute_need < 0) & (other > np.arange(len(other)))
                                       & (step.start > step.ready))
        if len(pair_forwards):
            backward = other[pair_forwards]
            parts.append((rank[pair_forwards], dataflow.RECV_OF_CODES[kind[backward]], stage[backward],
                          microbatch[backward], step.ready[pair_forwards], step.start[pair_forwards],
                          _STREAMS.index(RECV)))
            names.append((len(pair_forwards),))
    sent = np.flatnonzero(~np.isnan(step.arrival) & ~np.isnan(step.posted))
    if len(sent):
        microbatches = arrays.microbatches
        send_stage, direction, sent_microbatch = dataflow.transfer_parts(sent, microbatches)
        send_kind = dataflow.SEND_OF_CODES[dataflow.DIRECTION_KIND_CODES[direction]]
        sender = np.asarray(arrays.schedule.placement)[send_stage]
        parts.append((sender, send_kind, send_stage, sent_microbatch, step.posted[sent], step.arrival[sent],
                      _STREAMS.index(SEND)))
        names.append((len(sent),))
    waiting = np.flatnonzero(step.rank_done > step.rank_clock)
    if len(waiting):
        last_rows = arrays.rank_start[waiting + 1] - 1  # the wait is named after the rank's last action
        parts.append((waiting, arrays.kind[last_rows], arrays.stage[last_rows], arrays.microbatch[last_rows],
                      step.rank_clock[waiting], step.rank_done[waiting], _STREAMS.index(WAIT)))
        names.append((len(waiting),))
    columns = [np.concatenate([np.broadcast_to(part[index], part[0].shape) for part in parts])
               for index in range(7)]
    return TraceColumns(columns[0].astype(np.int64), columns[1].astype(np.int64), columns[2].astype(np.int64),
                        columns[3].astype(np.int64), columns[4].astype(float), columns[5].astype(float),
                        columns[6].astype(np.int64), _KINDS, _STREAMS,
                        LazyNames(sum(part[0] for part in names), partial(_hold_names, names)) if named else None)


def received(step: engine.StepRun, rows: np.ndarray) -> np.ndarray:
    """When each compute row of ``rows`` (each waiting for a transfer) stopped waiting for
    it: its start, or for an action held by its parameter gathers
    (``schedules.dp_channel``) the moment its input was there, so that the rest of its
    wait shows as the gathers' (the ``dp`` events beside it), not as communication."""
    ends = step.start[rows].copy()
    channels = step.channels
    if channels is None or not len(channels.gate_last):
        return ends
    held = np.flatnonzero(channels.gate_last[rows] >= 0)
    if len(held):
        program = step.program
        needed = program.compute_need[rows[held]]
        there = step.group_done[needed] if program.semantics in (RENDEZVOUS, TORCH_RUNTIME) else step.arrival[needed]
        ends[held] = np.minimum(ends[held], np.maximum(step.ready[rows[held]], there))
    return ends


def _hold_names(parts: list[tuple]) -> list[str | None]:
    """``pipeline_columns``' event names: ``TP(3F5)`` for what holds a rank after ``3F5``,
    None for the events named by their stage, kind and microbatch."""
    names: list[str | None] = []
    for count, *held in parts:
        if not held:
            names += [None] * count
            continue
        hold_kind, stage, kind, microbatch = held
        names += [f"{hold_kind}({s}{KINDS[k]}{m})"
                  for s, k, m in zip(stage.tolist(), kind.tolist(), microbatch.tolist(), strict=True)]
    return names


def rank_devices_of(schedule: Schedule, topology: Topology, rank_devices: Sequence[str] | None) -> list[str]:
    """The device of each pipeline rank: as given, or the topology's first ``pp``."""
    if rank_devices is not None:
        devices = list(rank_devices)
        if len(devices) != schedule.pp:
            raise ValueError(f"{len(devices)} devices given for {schedule.pp} pipeline ranks")
        return devices
    if topology.ideal:
        return [f"gpu{rank}" for rank in range(schedule.pp)]
    topology.require_devices(schedule.pp, "pipeline ranks")
    return topology.devices[: schedule.pp]

