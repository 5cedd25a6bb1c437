"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024; also
Section 6 of "Zero Bubble Pipeline Parallelism"): two chunks per rank in a V.

Rank ``r`` holds stage ``r`` (chunk 0, going down) and stage ``2p - 1 - r`` (chunk 1,
coming back up), so the first and last stages share rank 0 and the loss turns around
without a hop. Rank ``r`` warms up with ``2(p - r) - 1`` chunk-0 forwards, then ``r``
pairs of chunk-1 and chunk-0 forwards, then ``p - r`` rounds of chunk-1 ``F I W``;
the steady state alternates ``F I W`` on chunk 0 and chunk 1, and the drain runs the
remaining ``I`` then ``W`` passes. With F = I = W per chunk and ``m >= 2p`` every rank
computes without a gap from its first action to its last (zero bubble in the paper's
sense), holding at most ``2p`` chunk stashes, i.e. ``p`` microbatches of the rank's
whole share of the model: 1F1B's memory. Each microbatch crosses ``2(p - 1)`` links
each way, twice 1F1B's traffic. The order is torch.distributed.pipelining's
ScheduleZBVZeroBubble, which pads the microbatch count to ``2p - 1`` and drops the
padding; so do we.
"""

from __future__ import annotations

from schedules.action import Action, ActionKind
from schedules.generators.common import ScheduleUnavailableError
from schedules.schedule import Schedule, v_shape_placement

_F, _I, _W = ActionKind.F, ActionKind.I, ActionKind.W


def zbv(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """The ZB-V order on the V placement (stage ``s`` and ``2p - 1 - s`` on one rank)."""
    if virtual_stages != 2:
        raise ScheduleUnavailableError(f"zbv places exactly 2 stages per rank in a V; virtual stages={virtual_stages}")
    padded = max(2 * pp - 1, microbatches)
    programs = []
    for rank in range(pp):
        program = _rank_program(rank, pp, padded)
        programs.append([action for action in program if action.microbatch < microbatches])
    return Schedule(pp, microbatches, v_shape_placement(pp, 2), programs, name="zbv",
                    meta={"memory_microbatches": pp})


def _rank_program(rank: int, pp: int, microbatches: int) -> list[Action]:
    down, up = rank, 2 * pp - 1 - rank
    count = {(stage, kind): 0 for stage in (down, up) for kind in (_F, _I, _W)}
    program: list[Action] = []

    def emit(stage: int, kind: str, key: str | None = None) -> None:
        microbatch = count[stage, key or kind]
        count[stage, key or kind] += 1
        program.append(Action(stage, kind, microbatch))

    for _ in range(2 * (pp - rank) - 1):  # chunk-0 forwards until chunk 1 can start
        emit(down, _F)
    for _ in range(rank):
        emit(up, _F)
        emit(down, _F)
    for _ in range(pp - rank):  # chunk 1 turns around: F I W
        emit(up, _F)
        emit(up, _I)
        emit(up, _W)
    while count[up, _F] < count[down, _F] or count[down, _F] < microbatches:  # steady state
        if count[down, _F] < microbatches:
            emit(down, _F)
        emit(down, _I)
        emit(down, _W)
        emit(up, _F)
        emit(up, _I)
        emit(up, _W)
    for _ in range(rank):  # drain: input gradients first, weights after
        emit(down, _I)
        emit(up, _I)
    for _ in range(pp - rank):
        emit(down, _I)
        emit(down, _W)
    while count[up, _W] < count[up, _I]:
        emit(up, _W)
    while count[down, _W] < count[down, _I]:
        emit(down, _W)
    return program
