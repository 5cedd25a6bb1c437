"""As-soon-as-possible timing of fixed per-rank orders, for the generators that choose
between orders by their cost (``zb-auto``).

This is not the simulator: it knows no links, no memory and no step-level work, only
that an action starts when its rank is free and its inputs have arrived, ``comm``
seconds after their producer ended on another rank. That is the model the zero-bubble
paper's scheduler reasons in (Qi et al., ICLR 2024, Section 3), and it lets a generator
compare candidate orders without importing the simulator (``schedules`` sits below it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from schedules.action import Action, ActionKind

try:  # ``step_and_rank_span`` in C, built by setup.py where a compiler is found
    from schedules import _timing as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
_KINDS = (_F, _B, _I, _W)  # in the order the C version reads them
# Whether ``step_and_rank_span`` asks the C version first (PIPESIM_PURE_PYTHON=1: Python only).
ACCELERATED = _native is not None and os.environ.get("PIPESIM_PURE_PYTHON", "") in ("", "0")


def order_end_times(
    programs: Sequence[Sequence[Action]],
    placement: Sequence[int],
    seconds: Callable[[Action], float],
    comm: float = 0.0,
) -> dict[Action, float]:
    """End time of every action when each rank runs its program in order, each action
    as soon as its rank and its inputs allow. Raises ``ValueError`` if the orders
    deadlock (an action waits for one that can never run). Linear in the number of
    actions: a rank that must wait parks on the producer it needs and is woken by it."""
    last_stage = len(placement) - 1
    backward_of = {(action[0], action[2]): action for program in programs for action in program
                   if action[1] in (_B, _I)}
    ends: dict[Action, float] = {}
    clocks = [0.0] * len(programs)
    cursor = [0] * len(programs)
    waiting: dict[Action, list[int]] = {}
    runnable = list(range(len(programs)))
    while runnable:
        rank = runnable.pop()
        program = programs[rank]
        while cursor[rank] < len(program):
            action = program[cursor[rank]]
            ready = _ready_time(action, ends, placement, last_stage, comm, backward_of)
            if type(ready) is tuple:  # the producer it waits for
                waiting.setdefault(ready, []).append(rank)
                break
            start = max(clocks[rank], ready)
            clocks[rank] = ends[action] = start + seconds(action)
            cursor[rank] += 1
            runnable.extend(waiting.pop(action, ()))
    stuck = [str(program[cursor[rank]]) for rank, program in enumerate(programs) if cursor[rank] < len(program)]
    if stuck:
        raise ValueError(f"orders deadlock: no rank can run its next action ({', '.join(stuck)})")
    return ends


def _ready_time(action: Action, ends: dict[Action, float], placement: Sequence[int], last_stage: int,
                comm: float, backward_of: dict[tuple[int, int], Action]) -> float | tuple:
    """When ``action``'s inputs are there, or the producer it still waits for (as a plain
    ``(stage, kind, microbatch)`` tuple: it hashes and compares as the Action does, and
    zb-auto times hundreds of thousands of them)."""
    stage, kind, microbatch = action
    inputs: list[tuple[tuple, float]] = []
    if kind == _F:
        if stage > 0:
            inputs.append(((stage - 1, _F, microbatch), _hop(placement, stage - 1, stage, comm)))
    elif kind in (_B, _I):
        inputs.append(((stage, _F, microbatch), 0.0))
        if stage < last_stage:
            above = backward_of.get((stage + 1, microbatch), (stage + 1, _B, microbatch))
            inputs.append((tuple(above), _hop(placement, stage + 1, stage, comm)))
    elif kind == _W:
        inputs.append(((stage, _I, microbatch), 0.0))
    ready = 0.0
    for producer, delay in inputs:
        end = ends.get(producer)
        if end is None:
            return producer
        ready = max(ready, end + delay)
    return ready


def _hop(placement: Sequence[int], source: int, target: int, comm: float) -> float:
    return comm if placement[source] != placement[target] else 0.0


def step_and_rank_span(programs: Sequence[Sequence[Action]], placement: Sequence[int],
                       seconds: Callable[[Action], float], comm: float = 0.0,
                       per_stage: tuple[Sequence[float], Sequence[float], Sequence[float]] | None = None,
                       ) -> tuple[float, float]:
    """The step's makespan and the longest time one rank spends from its first action's
    start to its last action's end (the zero-bubble paper's measure, which counts what
    a next step overlapping this one could not use). ``per_stage``: the F, I and W
    seconds of each stage when ``seconds`` reads them there, which lets the C version
    (``schedules/_timing.c``, the same arithmetic) time the orders."""
    if per_stage is not None and ACCELERATED:
        timed = _native.step_and_rank_span(programs, placement, *per_stage, comm, _KINDS)
        if timed is not None:  # None: an action it does not time (Python decides)
            return timed
    ends = order_end_times(programs, placement, seconds, comm)
    spans = [ends[program[-1]] - (ends[program[0]] - seconds(program[0])) for program in programs if program]
    return max(ends.values(), default=0.0), max(spans, default=0.0)
