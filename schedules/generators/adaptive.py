"""The handcrafted zero-bubble orders, adapted to the costs at hand.

``zb-h1`` and ``zb-h2`` are drawn for F = I = W and free links. With a long ``W``, a
short one, or transfers that take time, the textbook place of ``W`` can open bubbles
that 1F1B does not have (zb-h1 was 4 % slower than 1F1B on the zero-bubble paper's own
first row under NCCL's rules). ``adapt`` keeps the schedule's memory and times, on the
engine with free-flowing transfers, three orders:

- ``textbook``: the order as drawn;
- ``W placed for these costs``: the zero-bubble paper's list scheduler (``zb_heuristic``)
  at the same memory (``p`` stashes for zb-h1, ``2p - 1`` for zb-h2), which puts each
  ``W`` where it fills a gap for these costs;
- ``1F1B order``: every ``W`` right after its ``I``, which is 1F1B itself;

and returns the fastest step, among equal steps the one whose longest rank span is
shortest (the paper's measure; further ties keep the earlier one in that list), saying
which in ``meta["order"]`` (``pipesim show`` prints it). Since 1F1B's order is a candidate, the
result is never slower than 1F1B on these costs.
"""

from __future__ import annotations

import itertools

import numpy as np

from schedules import engine
from schedules.action import Action, ActionKind
from schedules.dataflow import BACKWARD, FORWARD, wire_of
from schedules.generators.common import Cutoff, fastest
from schedules.generators.zb_heuristic import heuristic_orders
from schedules.hop import flights, planning_hop
from schedules.schedule import Schedule

ADAPTABLE = frozenset({"zb-h1", "zb-h2"})


def adapt(schedule: Schedule, timing: engine.StepTiming) -> Schedule:
    """``schedule`` (zb-h1 or zb-h2, one stage per rank) with the order that runs its
    step fastest under ``timing``; other schedules come back as they are."""
    if schedule.name not in ADAPTABLE or schedule.num_stages != schedule.pp:
        return schedule
    pp, microbatches = schedule.pp, schedule.microbatches
    seconds = np.asarray(timing.seconds, dtype=float)
    forward, backward_input, backward_weight = (seconds[:, column].tolist() for column in (0, 2, 3))
    comm = planning_hop(timing)  # the heuristic plans with one hop, the unloaded hop's rule
    # the quickest any transfer arrives: each used wire's quickest route (a wire of no route
    # arrives at once)
    used = [timing.wires[wire_of(stage, FORWARD)] for stage in range(pp - 1)] + [
        timing.wires[wire_of(stage, BACKWARD)] for stage in range(1, pp)] if timing.wires else []
    quickest = min((min(flights(routes), default=0.0) for routes in used), default=0.0)
    limit = schedule.meta.get("memory_microbatches", pp)

    def candidates(cutoff):
        """The candidates in turn; a heuristic run stops once its order's step, on hops of
        the quickest transfer's time and with nothing holding a rank, cannot beat
        ``cutoff()`` (read as it starts): its step under ``timing`` can only be longer."""
        yield "textbook", schedule.programs
        for switches in itertools.product((True, False), repeat=3):
            orders = heuristic_orders(pp, microbatches, forward, backward_input, backward_weight, comm, limit, 1.0,
                                      *switches, cutoff=cutoff(), cutoff_comm=quickest)
            if orders is not None:
                yield "W placed for these costs", orders
        yield "1F1B order", _one_f_one_b_split(pp, microbatches)

    def step_time(candidate) -> tuple[float, float]:
        """The step, to 12 significant digits (orders that tie but for the last bits of a
        sum tie), then the longest rank span: among equal steps the shortest span, the
        zero-bubble paper's measure."""
        step = engine.run(schedule.with_programs(candidate[1]), timing, engine.FREE)
        return float(f"{step.makespan:.12g}"), float(step.rank_spans().max())

    # ties keep the earlier candidate; no cutoff where an overlapped pair may undercut its halves
    label, programs = fastest(candidates, step_time,
                              lambda best: Cutoff() if timing.pair_seconds else Cutoff(step=best[0]))
    adapted = schedule.with_programs(programs)
    adapted.meta["order"] = label
    return adapted


def _one_f_one_b_split(pp: int, microbatches: int) -> list[list[Action]]:
    """1F1B with every backward as ``I`` then ``W`` at once: 1F1B's own timing."""
    programs = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, microbatches)
        program = [Action(rank, ActionKind.F, microbatch) for microbatch in range(warmup)]

        def backward(microbatch: int, rank: int = rank) -> list[Action]:
            return [Action(rank, ActionKind.I, microbatch), Action(rank, ActionKind.W, microbatch)]

        for step in range(microbatches - warmup):
            program.append(Action(rank, ActionKind.F, warmup + step))
            program += backward(step)
        for microbatch in range(microbatches - warmup, microbatches):
            program += backward(microbatch)
        programs.append(program)
    return programs
