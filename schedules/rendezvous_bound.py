"""How fast any rendezvous-safe lowering of a compute order can be: a lower bound by
integer programming (OR-Tools CP-SAT), to hold ``schedules.lowering`` against.

Whatever SEND/RECV order and P2P groups a lowered program has, under NCCL's rule
(``schedules.p2p``, the engine's ``rendezvous``) with transfers that never queue (each
wire its own link, ``engine.hop_wires``), its moments satisfy:

- each rank runs its compute actions in program order, each for its seconds then its
  hold; an overlapped pair is one step (both inputs before it, both outputs after it);
- a transfer ``t`` departs at ``d_t`` no earlier than its producer's end, and its
  consumer starts no earlier than ``d_t + flight_t``;
- the transfers a rank takes part in (sending or receiving) are in P2P groups that its
  stream runs one after another. For two of them, ``t1`` and ``t2``, either their groups
  on that rank differ, and then one arrives before the other departs
  (``d_2 >= d_1 + flight_1`` or the reverse: the later group starts after the earlier
  one completed); or they share a group, which starts after every send in it has been
  produced (so each departs no earlier than the other's producer's end, where the other is
  a send of this rank), completes when both have arrived (so a receive's consumer waits
  for both), and is posted after those producers and before those consumers (so each
  receive's consumer starts no earlier than each send's producer ends);
- the step lasts until every compute action has ended and every transfer has arrived.

The model minimises the step under these constraints alone. Every lowered program
meets them, so its optimum is at most the best rendezvous-safe program's step; with the
pairwise choices only for transfers whose free-flowing windows come close
(``horizon``), it is still a lower bound (fewer constraints). Without the group
constraints the optimum is the free-flowing step. So ``bound / free`` above 1 is a gap
NCCL's rule forces on the order, and a lowering whose step comes within x % of the bound
comes within x % of the best program.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schedules import dataflow, engine
from schedules.lowering import planning_timing
from schedules.schedule import Schedule
from schedules.transfer_placement import transfers_of


@dataclass(frozen=True)
class Bound:
    """The CP-SAT result: ``bound`` (seconds) is proven; ``step`` is the best assignment
    found (equal to ``bound`` when ``optimal``)."""

    bound: float
    step: float
    optimal: bool
    free: float  # the free-flowing step of the same order
    departures: np.ndarray  # per transfer (``transfers_of``'s order): its departure in the best assignment


def rendezvous_bound(schedule: Schedule, timing: engine.StepTiming, horizon: float | None = None,
                     seconds: float = 30.0, resolution: float | None = None, workers: int = 2) -> Bound:
    """A lower bound on the step of every rendezvous-safe lowering of ``schedule`` (a
    compute-only order) under ``timing`` (see the module). ``horizon``: pairs of
    transfers whose free-flowing windows are further apart than this get no choice
    (default: four times the longest compute action). ``resolution``: the time unit the
    model counts in (default: the coarsest power of ten that counts every duration
    exactly, at most 1e-6 of the free-flowing step); times are rounded down to it, so
    the bound stays a bound."""
    from ortools.sat.python import cp_model  # noqa: PLC0415 - optional, and slow to import

    free_run = engine.run(schedule, timing, engine.FREE)
    free = free_run.makespan
    transfers = transfers_of(engine.run(schedule, planning_timing(timing), engine.FREE), timing)
    program = free_run.program
    seconds_of, hold_of = engine.compute_costs(program, timing)
    unit = resolution or _resolution(np.concatenate([seconds_of, hold_of, transfers.flight]), free)

    def ticks(value: float) -> int:
        return int(np.floor(value / unit + 1e-9))

    count = program.computes
    pair = program.compute_pair
    limit = ticks(free) * 4 + ticks(float(seconds_of.sum() + hold_of.sum())) + 10
    model = cp_model.CpModel()
    start = [model.NewIntVar(0, limit, f"s{index}") for index in range(count)]
    end = [start[index] + ticks(float(seconds_of[index])) for index in range(count)]
    after = [end[index] + ticks(float(hold_of[index])) for index in range(count)]
    makespan = model.NewIntVar(0, limit, "makespan")
    for index in range(count):
        model.Add(makespan >= end[index])
        if index + 1 < count and program.compute_rank[index + 1] == program.compute_rank[index]:
            model.Add(start[index + 1] >= after[index])
    # same-rank data (a V's turn): the engine runs them in program order already; the
    # producer's end before the consumer's start
    _local_edges(model, program, start, end)

    def output_ready(index: int):  # a pair's outputs exist when it ends
        partner = int(pair[index])
        return end[partner] if partner > index else end[index]

    def input_needed(index: int):  # a pair's inputs are needed when it starts
        partner = int(pair[index])
        return start[partner] if 0 <= partner < index else start[index]

    producer, consumer = transfers.producer.tolist(), transfers.consumer.tolist()
    flight = [ticks(float(value)) for value in transfers.flight]
    departs = [model.NewIntVar(0, limit, f"d{t}") for t in range(transfers.count)]
    for t in range(transfers.count):
        model.Add(departs[t] >= output_ready(producer[t]))
        model.Add(input_needed(consumer[t]) >= departs[t] + flight[t])
        model.Add(makespan >= departs[t] + flight[t])
    horizon = horizon if horizon is not None else 4.0 * float(seconds_of.max(initial=0.0))
    ready, needed = transfers.ready, transfers.needed
    for rank in range(program.ranks):
        mine = np.flatnonzero((transfers.sender == rank) | (transfers.receiver == rank)).tolist()
        for a_at, first in enumerate(mine):
            for second in mine[a_at + 1:]:
                if ready[second] > needed[first] + horizon or ready[first] > needed[second] + horizon:
                    continue
                before = model.NewBoolVar("")
                behind = model.NewBoolVar("")
                together = model.NewBoolVar("")
                model.AddExactlyOne(before, behind, together)
                model.Add(departs[second] >= departs[first] + flight[first]).OnlyEnforceIf(before)
                model.Add(departs[first] >= departs[second] + flight[second]).OnlyEnforceIf(behind)
                for one, other in ((first, second), (second, first)):
                    if transfers.sender[other] == rank:  # the group starts after the other's producer
                        model.Add(departs[one] >= output_ready(producer[other])).OnlyEnforceIf(together)
                    if transfers.receiver[one] == rank:  # one's consumer waits for the whole group
                        model.Add(input_needed(consumer[one]) >= departs[other] + flight[other]
                                  ).OnlyEnforceIf(together)
                        if transfers.sender[other] == rank:  # posted between producer and consumer
                            model.Add(input_needed(consumer[one]) >= output_ready(producer[other])
                                      ).OnlyEnforceIf(together)
    model.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"CP-SAT found no assignment ({solver.StatusName(status)})")
    found = np.array([solver.Value(variable) for variable in departs], dtype=float) * unit
    return Bound(solver.BestObjectiveBound() * unit, solver.ObjectiveValue() * unit, status == cp_model.OPTIMAL,
                 free, found)


def _resolution(values: np.ndarray, free: float) -> float:
    """The coarsest power of ten of which every one of ``values`` is a whole multiple
    (to 1e-9 of it), no finer than ``free`` * 1e-6."""
    finest = max(free, 1e-30) * 1e-6
    unit = 10.0 ** np.ceil(np.log10(max(float(np.max(values, initial=0.0)), finest)))
    while unit > finest:
        scaled = values / unit
        if np.all(np.abs(scaled - np.round(scaled)) < 1e-6):
            return unit
        unit /= 10.0
    return finest


def _local_edges(model, program: engine.EngineProgram, start: list, end: list) -> None:
    """Producer before consumer for data that stays on one rank (V-shaped placements)."""
    arrays = program.arrays
    placement = np.asarray(arrays.schedule.placement)
    index_of = {}
    stage, kind, microbatch = program.compute_stage, program.compute_kind, program.compute_microbatch
    for index in range(program.computes):
        index_of[int(stage[index]), int(kind[index]), int(microbatch[index])] = index
    from schedules.program_arrays import B_CODE, F_CODE, I_CODE  # noqa: PLC0415

    schedule = arrays.schedule
    sources, reads = dataflow.input_stages(stage, kind, schedule.num_stages, schedule.copies)
    for index in np.flatnonzero(reads).tolist():
        s, source_stage, mb = int(stage[index]), int(sources[index]), int(microbatch[index])
        if placement[source_stage] != placement[s]:  # across ranks: the transfer's own constraints
            continue
        producers = (F_CODE,) if int(kind[index]) == F_CODE else (B_CODE, I_CODE)  # dataflow.FED_BY
        source = next((index_of[key] for key in ((source_stage, code, mb) for code in producers) if key in index_of),
                      None)
        if source is not None:
            model.Add(start[index] >= end[source])
