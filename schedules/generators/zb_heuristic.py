"""The zero-bubble paper's list-scheduling heuristic (Qi et al., ICLR 2024, Section 3.1;
its scheduler in github.com/sail-sg/zero-bubble-pipeline-parallelism), written for one
stage per rank.

Microbatch by microbatch, every stage places its passes at the earliest moment their
inputs allow, keeping its own clock:

- warm-up: each stage runs as many forwards before its first input gradient ``I`` as
  keep it busy until that gradient can arrive (never more than memory allows, never
  more than the stage before it), then the first ``I`` runs from the last stage back;
- steady state: for each microbatch every stage that still has forwards runs one ``F``
  (with ``prioritize_inputs``, a stage two or more forwards ahead of the next one skips
  it when it would delay the next stage's ``I``), and then every stage runs its ``I``
  from the last stage back. Before each ``F`` or ``I``, pending ``W`` passes go first while
  memory is over the limit, then while one fits before the input arrives, and one more
  when the remaining gap is small against the largest bubble so far (always, or only
  with ``fill_gaps``);
- the remaining ``W`` passes close every stage.

Memory is counted as the paper does: a forward takes one microbatch's activations, its
``I`` frees all but ``weight_memory`` of them, its ``W`` the rest. The paper tries the
eight combinations of its three switches and keeps the best; so does ``zb_auto``.

Every pass is placed at the earliest moment its stage and its input allow, so the times
are the engine's free timing of the order, and a run can stop once its order cannot be
chosen (``schedules.generators.common.Cutoff``). Not where a pass takes no time: the
order lists a stage's passes by their end, and passes that end together may then be
listed otherwise than they were placed, so the times are not the order's.
"""

from __future__ import annotations

from collections.abc import Sequence

from schedules.action import INPUT_OFFSET, Action, ActionKind
from schedules.generators.common import Cutoff

_F, _I, _W = 0, 1, 2
# the dataflow rule, in this module's kind numbers
_INPUT_OFFSET = {_F: INPUT_OFFSET[ActionKind.F], _I: INPUT_OFFSET[ActionKind.I]}
_KINDS = "FIW"


class _Placer:
    """One run of the heuristic: per stage its clock, counts, memory and bubble."""

    def __init__(self, pp: int, microbatches: int, costs: Sequence[Sequence[float]], comm: float,
                 memory: Sequence[float], limit: float | Sequence[float], cutoff: Cutoff, cutoff_comm: float) -> None:
        self.pp, self.microbatches, self.costs, self.comm = pp, microbatches, costs, comm
        # each stage's (= rank's) most stashes: one number for every stage, or one each
        self.memory, self.limits = memory, [limit] * pp if isinstance(limit, (int, float)) else list(limit)
        self.clock = [0.0] * pp
        self.count = [[0, 0, 0] for _ in range(pp)]
        self.held = [0.0] * pp
        self.bubble = [0.0] * pp
        self.end: dict[tuple[int, int, int], float] = {}
        # each stage's seconds of passes not yet placed, and what its last pass may not end
        # after (the step's cutoff, and from its first pass the span's too)
        self.remaining = [microbatches * (forward + backward_input + backward_weight)
                          for forward, backward_input, backward_weight in zip(*costs, strict=True)]
        self.step_cutoff, self.span_cutoff = cutoff.with_margin()
        self.bound = [self.step_cutoff] * pp
        # the cutoff's own clock where its hop is shorter than the run's: the same order, each
        # pass at the earliest that hop allows (``heuristic_orders``)
        self.cutoff_comm = cutoff_comm
        self.shadow = cutoff_comm != comm
        self.low_clock = [0.0] * pp
        self.low_end: dict[tuple[int, int, int], float] = {}

    def put(self, stage: int, kind: int) -> None:
        microbatch = self.count[stage][kind]
        cost = self.costs[kind][stage]
        end = self.clock[stage] + cost
        source = self.source(stage, kind)
        if source is not None:
            end = max(end, self.end[kind, source, microbatch] + self.comm + cost)
        low = end
        if self.shadow:
            low = self.low_clock[stage] + cost
            if source is not None:
                low = max(low, self.low_end[kind, source, microbatch] + self.cutoff_comm + cost)
            self.low_clock[stage] = self.low_end[kind, stage, microbatch] = low
        if self.count[stage][_F]:
            self.bubble[stage] += end - (self.clock[stage] + cost)
        elif kind == _F and microbatch == 0:  # the stage's first pass: its span starts here
            self.bound[stage] = min(self.step_cutoff, low - cost + self.span_cutoff)
        self.remaining[stage] -= cost
        if low + self.remaining[stage] > self.bound[stage]:
            raise _PastCutoffError
        self.clock[stage] = self.end[kind, stage, microbatch] = end
        self.held[stage] += self.memory[kind]
        self.count[stage][kind] += 1

    def source(self, stage: int, kind: int) -> int | None:
        """The stage whose pass of the same kind feeds ``kind`` on ``stage`` (the dataflow
        rule: F from the stage before, I from the stage after), None at the pipeline's ends
        and for W."""
        offset = _INPUT_OFFSET.get(kind)
        if offset is None or not 0 <= stage + offset < self.pp:
            return None
        return stage + offset

    def input_arrival(self, stage: int, kind: int, microbatch: int) -> float:
        """When the input of ``kind``'s ``microbatch`` on ``stage`` arrives from its source."""
        return self.end[kind, self.source(stage, kind), microbatch] + self.comm

    def weights_before(self, stage: int, arrival: float, fill_gaps: bool) -> None:
        """``W`` passes before a pass whose input arrives at ``arrival``: those that fit,
        then one more where it shortens a gap the stage can afford less than others."""
        counts, cost = self.count[stage], self.costs[_W][stage]
        while counts[_W] < counts[_I] and self.clock[stage] + cost <= arrival:
            self.put(stage, _W)
        if counts[_W] < counts[_I] and self.clock[stage] < arrival:
            if arrival - self.clock[stage] > max(self.bubble) - self.bubble[stage] or fill_gaps:
                self.put(stage, _W)

    def make_room(self, stage: int, kind: int) -> None:
        while self.held[stage] + self.memory[kind] > self.limits[stage] + 1e-9:
            if self.count[stage][_W] >= self.count[stage][_I]:
                raise ValueError("memory limit too small for one more pass")
            self.put(stage, _W)


class _PastCutoffError(Exception):
    """A run stopped at its cutoff."""


def heuristic_orders(pp: int, microbatches: int, forward: Sequence[float], backward_input: Sequence[float],
                     backward_weight: Sequence[float], comm: float, memory_limit: float | Sequence[float],
                     weight_memory: float,
                     bubble_before_first_input: bool, prioritize_inputs: bool, fill_gaps: bool,
                     cutoff: Cutoff | None = None, cutoff_comm: float | None = None) -> list[list[Action]] | None:
    """Each rank's order under one setting of the three switches; None if the memory
    limit cannot be kept, or once the order cannot beat ``cutoff``. ``cutoff`` is on the
    order's timing with every hop ``cutoff_comm`` (default ``comm``): where the order will
    be timed on hops of their own (a cluster's), the least of them, so that the run's
    bound is below that timing however the hops differ (each pass is then also placed on
    a clock of that hop, beside the run's own)."""
    costs = (forward, backward_input, backward_weight)
    if cutoff is not None and min(min(values) for values in costs) <= 0:
        cutoff = None  # passes of no time: the order is not listed as placed (the module)
    cutoff_comm = comm if cutoff is None or cutoff_comm is None else cutoff_comm
    if not 0 <= cutoff_comm <= comm:
        raise ValueError(f"the cutoff's hop must be between 0 and the run's {comm}, got {cutoff_comm}")
    placer = _Placer(pp, microbatches, costs, comm, (1.0, -(1.0 - weight_memory), -weight_memory), memory_limit,
                     cutoff or Cutoff(), cutoff_comm)
    try:
        _warm_up(placer, bubble_before_first_input)
        for microbatch in range(1, microbatches):
            _steady_round(placer, microbatch, prioritize_inputs, fill_gaps)
        for stage in range(pp):
            while placer.count[stage][_W] < microbatches:
                placer.put(stage, _W)
    except (ValueError, KeyError, _PastCutoffError):  # the limit cannot be kept, a stage runs out of forwards to wait
        return None  # for, or the order cannot beat the cutoff
    orders = []
    for stage in range(pp):
        passes = sorted((placer.end[kind, stage, microbatch], kind, microbatch)
                        for kind in (_F, _I, _W) for microbatch in range(microbatches))
        orders.append([Action(stage, _KINDS[kind], microbatch) for _end, kind, microbatch in passes])
    return orders


def _warm_up(placer: _Placer, bubble_before_first_input: bool) -> None:
    pp, costs = placer.pp, placer.costs
    for stage in range(pp):
        placer.put(stage, _F)
    extra = [0] * pp
    gradient_ready = 0.0
    for stage in range(pp - 1, -1, -1):
        if stage == pp - 1:
            gradient_ready = placer.end[_F, stage, 0] + costs[_I][stage]
            continue
        held, clock, limit = placer.held[stage], placer.clock[stage], placer.limits[stage]
        while placer.count[stage][_F] + extra[stage] < placer.microbatches and held + 1.0 <= limit + 1e-9:
            arrival = gradient_ready + placer.comm
            if (clock + costs[_F][stage] > arrival) if bubble_before_first_input else (clock >= arrival):
                break
            held += 1.0
            clock += costs[_F][stage]
            extra[stage] += 1
        gradient_ready = max(clock, gradient_ready + placer.comm) + costs[_I][stage]
    for stage in range(1, pp):  # a stage never runs more warm-up forwards than the one before
        while (extra[stage] > 0 and extra[stage] >= extra[stage - 1]
               and placer.count[stage][_F] + extra[stage] < placer.microbatches):
            extra[stage] -= 1
    for stage in range(pp):
        for _ in range(extra[stage]):
            placer.put(stage, _F)
    for stage in range(pp - 1, -1, -1):
        placer.put(stage, _I)


def _steady_round(placer: _Placer, microbatch: int, prioritize_inputs: bool, fill_gaps: bool) -> None:
    pp, costs, count = placer.pp, placer.costs, placer.count
    wanted = [0] * pp
    for stage in range(pp):
        if count[stage][_F] >= placer.microbatches:
            continue
        if prioritize_inputs and stage + 1 < pp and count[stage][_F] >= count[stage + 1][_F] + 2:
            following = placer.clock[stage + 1] + costs[_F][stage + 1] + costs[_I][stage + 1] + placer.comm
            if placer.clock[stage] >= following:
                continue
            room_cost, held, pending = 0.0, placer.held[stage] + 1.0, count[stage][_W]
            while held > placer.limits[stage] + 1e-9 and pending < count[stage][_I]:
                room_cost += costs[_W][stage]
                held += placer.memory[_W]
                pending += 1
            if placer.clock[stage] + costs[_F][stage] + room_cost <= following:
                wanted[stage] = 1
                continue
            if following - placer.clock[stage] <= max(placer.bubble) - placer.bubble[stage]:
                continue
        wanted[stage] = 1
    for stage in range(pp - 2, -1, -1):
        wanted[stage] = min(wanted[stage], wanted[stage + 1])
    for stage in range(pp):
        if not wanted[stage]:
            continue
        placer.make_room(stage, _F)
        if placer.source(stage, _F) is not None:
            placer.weights_before(stage, placer.input_arrival(stage, _F, count[stage][_F]), fill_gaps)
        placer.put(stage, _F)
    for stage in range(pp - 1, -1, -1):
        placer.make_room(stage, _I)
        if placer.source(stage, _I) is not None:
            placer.weights_before(stage, placer.input_arrival(stage, _I, microbatch), fill_gaps)
        if stage == 0 and count[stage][_F] == placer.microbatches:
            while count[stage][_W] < count[stage][_I]:
                placer.put(stage, _W)
        placer.put(stage, _I)
