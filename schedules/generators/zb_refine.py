"""zb-auto's optimising pass: a constraint model of the zero-bubble paper's problem,
solved by OR-Tools' CP-SAT from the best heuristic order (Qi et al., ICLR 2024,
Section 3.2 refines its heuristics with an integer program; a scheduling solver with
interval variables states the same problem more directly and finds good orders sooner).

Every pass of every stage is an interval of its (scaled, integer) duration on its
stage's timeline, none overlapping; a forward starts ``comm`` after the previous
stage's forward of the microbatch ends, an input gradient ``comm`` after the next
stage's, a weight pass after its own input gradient, and each kind runs its
microbatches in order. Memory per stage stays within the limit: a forward holds one
microbatch's activations until its ``I``, and ``weight_memory`` of them until its ``W``.
The first forward of stage ``s`` starts at ``s (F + comm)``, the earliest any order
allows, so minimising the longest stage span (first ``F`` to last ``W``, the paper's
cost) never rewards an order for starting late; the order the engine then times as
soon as possible is at least as good.

The solver runs on one worker with a deterministic time limit, so the same inputs give
the same order. When the budget runs out it returns the best order found, the starting
heuristic at worst; ``None`` when OR-Tools is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from schedules import engine
from schedules.action import Action
from schedules.dataflow import input_stage
from schedules.schedule import Schedule, looped_placement

_KINDS = "FIW"
RESOLUTION = 2000  # the longest pass lasts this many time units in the model


def refine(pp: int, microbatches: int, forward: Sequence[float], backward_input: Sequence[float],
           backward_weight: Sequence[float], comm: float, memory_limit: float | Sequence[float],
           weight_memory: float, start: Sequence[Sequence[Action]], budget: float) -> list[list[Action]] | None:
    """An order at least as good as ``start`` (each rank's order) for the paper's cost,
    found within ``budget`` deterministic seconds, at most ``memory_limit`` stashes on a
    rank (one number for every rank, or one each); None without OR-Tools or when the
    solver returns nothing."""
    try:
        from ortools.sat.python import cp_model  # noqa: PLC0415 - optional, and slow to import
    except ImportError:  # pragma: no cover - depends on the install
        return None
    scale = RESOLUTION / max(max(forward), max(backward_input), max(backward_weight), 1e-12)
    costs = {kind: [max(1, round(value * scale)) for value in values]
             for kind, values in zip(_KINDS, (forward, backward_input, backward_weight), strict=True)}
    hop = round(comm * scale)
    horizon = 4 * sum(microbatches * (costs["F"][s] + costs["I"][s] + costs["W"][s]) for s in range(pp)) + \
        2 * pp * (max(costs["F"]) + max(costs["I"]) + hop)
    model = cp_model.CpModel()
    starts, ends, intervals = {}, {}, {}
    for stage in range(pp):
        for kind in _KINDS:
            for microbatch in range(microbatches):
                key = (kind, stage, microbatch)
                starts[key] = model.NewIntVar(0, horizon, "")
                ends[key] = model.NewIntVar(0, horizon, "")
                intervals[key] = model.NewIntervalVar(starts[key], costs[kind][stage], ends[key], "")
    held = round(weight_memory * 100)
    limits = [memory_limit] * pp if isinstance(memory_limit, (int, float)) else list(memory_limit)
    span = model.NewIntVar(0, horizon, "span")
    first_start = 0
    for stage in range(pp):
        model.AddNoOverlap([intervals[kind, stage, mb] for kind in _KINDS for mb in range(microbatches)])
        stashes, demands = [], []
        for mb in range(microbatches):
            for kind in ("F", "I"):  # the neighbour's pass of the same kind feeds it, a hop later
                source = input_stage(stage, kind)
                if 0 <= source < pp:
                    model.Add(starts[kind, stage, mb] >= ends[kind, source, mb] + hop)
            if stage == pp - 1:  # the last stage's I follows its own F (elsewhere it follows through the stages after)
                model.Add(starts["I", stage, mb] >= ends["F", stage, mb])
            model.Add(starts["W", stage, mb] >= ends["I", stage, mb])
            if mb:
                for kind in _KINDS:
                    model.Add(starts[kind, stage, mb] >= ends[kind, stage, mb - 1])
            for until, demand in (("I", 100 - held), ("W", held)):
                if demand:
                    size = model.NewIntVar(0, horizon, "")
                    stashes.append(model.NewIntervalVar(starts["F", stage, mb], size, ends[until, stage, mb], ""))
                    demands.append(demand)
        model.AddCumulative(stashes, demands, int(limits[stage] * 100 + 1e-9))
        model.Add(starts["F", stage, 0] == first_start)
        model.Add(span >= ends["W", stage, microbatches - 1] - first_start)
        first_start += costs["F"][stage] + hop
    model.Minimize(span)
    for action, moment in _timed(pp, microbatches, start, costs, hop).items():
        model.AddHint(starts[action.kind, action.stage, action.microbatch], moment)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = budget
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    orders = []
    for stage in range(pp):
        passes = sorted((solver.Value(starts[kind, stage, mb]), _KINDS.index(kind), mb)
                        for kind in _KINDS for mb in range(microbatches))
        orders.append([Action(stage, _KINDS[kind], mb) for _moment, kind, mb in passes])
    return orders


def _timed(pp: int, microbatches: int, orders: Sequence[Sequence[Action]], costs: dict[str, list[int]],
           hop: int) -> dict[Action, int]:
    """The start of every pass of ``orders`` as soon as possible in the model's integer
    units (the engine's free timing), a hint the model's constraints hold exactly."""
    seconds = np.array([[costs["F"][s], costs["I"][s] + costs["W"][s], costs["I"][s], costs["W"][s]]
                        for s in range(pp)], dtype=float)
    schedule = Schedule(pp, microbatches, looped_placement(pp, 1), orders)
    step = engine.run(schedule, engine.StepTiming(seconds, wires=engine.hop_wires(pp, float(hop))), engine.FREE)
    program = step.program
    flat = [action for order in orders for action in order]
    return {flat[row]: round(moment) for row, moment in zip(program.compute_row.tolist(), step.start.tolist(),
                                                           strict=True)}
