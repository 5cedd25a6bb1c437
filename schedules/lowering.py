"""Lowering: add the SEND/RECV actions that a compute-only schedule implies, grouped
into the P2P batches that are posted together.

Every dependency that crosses ranks (a forward output going to the next stage, an
input gradient going back to the previous one) becomes a SEND on the producer's rank
and a RECV on the consumer's. Where they go, and which of them are posted together as
one ``batch_isend_irecv``, decides whether the step can hang on NCCL: NCCL matches the
P2P operations of a rank pair in posting order, and a send may wait until its receive
is posted (rendezvous). gloo, which matches by tag and buffers sends, forgives orders
that NCCL does not.

Where they go is decided with the step's costs (``lower(schedule, timing)``; nominal
durations and free transfers when none are given). The engine times the compute-only
order with free-flowing transfers; every transfer gets a departure moment between its
producer's end and its consumer's start, both ends post it at their last compute
boundary before that moment, and what a rank posts at one boundary is cut into groups
(``schedules.transfer_placement``: why every such placement is deadlock-free under
rendezvous). Which moments and cuts is chosen by timing whole lowered steps on the engine
(``schedules.placement_search``). ``docs/schedules.md`` has the argument and the
numbers; the validator checks any schedule.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from schedules import dataflow, engine
from schedules.action import RECV_OF, SEND_OF, Action, ActionKind
from schedules.collector import without_collector
from schedules.placement_search import DEFAULT_RULE, Search
from schedules.program_arrays import program_arrays
from schedules.schedule import Schedule
from schedules.transfer_placement import MIN_PLANNED_SECONDS, transfers_of

_F, _B, _I = ActionKind.F, ActionKind.B, ActionKind.I
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B

# The durations lowering plans with when it is given none: a backward about twice a
# forward, split in two equal halves by zero-bubble schedules.
NOMINAL_SECONDS = {ActionKind.F: 1.0, ActionKind.B: 2.0, ActionKind.I: 1.0, ActionKind.W: 1.0}


def nominal_timing(schedule: Schedule) -> engine.StepTiming:
    """``NOMINAL_SECONDS`` on every stage, transfers free."""
    row = [NOMINAL_SECONDS[kind] for kind in engine.COMPUTE_KINDS]
    return engine.StepTiming(np.tile(np.array(row), (schedule.num_stages, 1)))


@without_collector
def lower(schedule: Schedule, timing: engine.StepTiming | None = None, repair_runs: int | None = None,
          rule: int | None = None) -> Schedule:
    """The schedule with communication actions inserted and grouped; already-lowered
    schedules (for instance a CSV written by hand with its own SEND/RECV order) come back
    as they are. ``timing`` is what the step's actions and transfers cost, to place the
    transfers for (default: ``NOMINAL_SECONDS``, free transfers); the result depends on
    nothing else, so whoever lowers with the same timing posts the same groups.
    ``repair_runs`` bounds the engine runs spent on it (default: ``repair_budget``).
    ``rule`` places the transfers by that one rule of ``placement_search.RULES``, untimed
    and unrepaired: a step the best rule's or longer, found with no engine run (what a
    planner screens layouts with, ``SCREEN_RULE``).

    A compute-only schedule that cannot run at all (a cycle between ranks, a missing
    producer) is lowered naively, each RECV right before its consumer, so that
    ``validate`` reports the problem in the user's terms instead of lowering failing."""
    try:
        arrays = program_arrays(schedule)
    except (ValueError, TypeError):  # an action that is no action: validation names it
        return _lower_naively(schedule)
    if not arrays.is_compute.all():
        return schedule
    timing = timing or nominal_timing(schedule)
    planned = _timed(schedule, planning_timing(timing))
    if planned is None:
        return _lower_naively(schedule)
    step, free_start = planned
    search = Search(schedule, transfers_of(step, timing), timing, free_start)
    if rule is not None:
        return search.placed(rule)
    if arrays.size > CHOICE_ACTIONS and not repair_runs:
        return search.placed(DEFAULT_RULE)
    best = search.best_rule()
    budget = repair_budget(arrays.size) if repair_runs is None else repair_runs
    if budget > search.runs:
        best = search.repair(best, budget)
    return best.lowered


def repair_budget(actions: int) -> int:
    """Engine runs lowering may spend on a schedule of ``actions`` compute actions:
    ``REPAIR_RUNS`` on small steps, where the repair wins what it wins (the ratio table of
    ``benchmarks/bench_zero_bubble.py``), fewer as the step grows so that the runs time at
    most ``REPAIR_WORK`` actions in all, and none beyond ``REPAIR_ACTIONS`` (a run there
    costs more than it is likely to win). Measured: on steps of thousands of actions the
    repair changed no step of a 70B plan's top 10, at 0.3 s per lowering with 120 runs."""
    if actions > REPAIR_ACTIONS:
        return 0
    return max(8, min(REPAIR_RUNS, REPAIR_WORK // max(actions, 1)))


REPAIR_RUNS = 120
REPAIR_WORK = 60_000
REPAIR_ACTIONS = 20_000
# Above this many compute actions one rule is placed without timing the others: each
# candidate costs a lowering and an engine run of the whole step.
CHOICE_ACTIONS = 100_000


def planning_timing(timing: engine.StepTiming) -> engine.StepTiming:
    """``timing`` with every compute action lasting at least ``MIN_PLANNED_SECONDS``, so
    that each has an inside (``schedules.transfer_placement``)."""
    seconds = np.maximum(np.asarray(timing.seconds, dtype=float), MIN_PLANNED_SECONDS)
    pairs = {key: max(value, MIN_PLANNED_SECONDS) for key, value in timing.pair_seconds.items()}
    return dataclasses.replace(timing, seconds=seconds, pair_seconds=pairs)


def _timed(schedule: Schedule, timing: engine.StepTiming) -> tuple[engine.StepRun, np.ndarray] | None:
    """The engine's timing of the compute-only order with free-flowing transfers, and its
    compute start moments; in the timing, overlapped pairs span their whole pair (both
    inputs needed when it starts, both outputs there when it ends). None if the order
    cannot finish."""
    try:
        step = engine.run(schedule, timing, engine.FREE)
    except (ValueError, IndexError):  # an action outside the schedule's stages: validation names it
        return None
    if step.stuck or np.isnan(step.start).any():
        return None
    free_start = step.start.copy()
    if any(schedule.fused):
        program = step.program
        row_of = {int(row): index for index, row in enumerate(program.compute_row)}
        for rank in range(schedule.pp):
            for position in schedule.fused[rank]:
                backward = row_of[int(program.arrays.rank_start[rank] + position)]
                forward = row_of[int(program.arrays.rank_start[rank] + position - 1)]
                step.end[forward] = step.end[backward]
                step.start[backward] = step.start[forward]
    return step, free_start


def _lower_naively(schedule: Schedule) -> Schedule:
    """Each SEND right after its producer and each RECV right before its consumer, every
    transfer a group of its own: the order validation can explain when the compute order
    itself is broken."""
    placement = schedule.placement
    lowered = []
    for rank, program in enumerate(schedule.programs):
        actions: list[Action] = []
        append = actions.append
        for action in program:
            stage, kind, microbatch = action
            if kind in RECV_OF:  # F, B or I: it reads a neighbour's output and hands its own on
                if dataflow.receives(placement, stage, kind, rank, schedule.copies):
                    append(Action(stage, RECV_OF[kind], microbatch))
                append(action)
                if dataflow.sends(placement, stage, kind, rank, schedule.copies):
                    append(Action(stage, SEND_OF[kind], microbatch))
            else:
                append(action)
        lowered.append(actions)
    # transfers now stand between an overlapped pair's halves: ``keep_pairs_together`` pairs them again
    return schedule.with_programs(lowered, fused=())
