"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2.1): 1F1B
with the backward split into ``I`` (input gradient) and ``W`` (weight gradient).

Rank ``r`` warms up with ``p - 1 - r`` forwards like 1F1B, then alternates ``F`` and
``I``; its ``W`` passes start ``r`` steps late and fill the drain at the end. Every rank
holds at most ``p`` stashes, 1F1B's peak on rank 0, and the bubble shrinks from
``(p-1)(F+I+W)`` to ``(p-1)(F+I-W)``: a third of 1F1B's when F = I = W.
The order is torch.distributed.pipelining's ZB1P (ScheduleInterleavedZeroBubble with
one stage per rank).
"""

from __future__ import annotations

from schedules.action import F, I, W
from schedules.generators.common import require_single_chunk
from schedules.schedule import Schedule, looped_placement


def zb_h1(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Warm-up forwards, then ``F I`` pairs with ``W`` lagging ``r`` steps, then the rest."""
    require_single_chunk("zb-h1", virtual_stages)
    programs = []
    for rank in range(pp):
        warmup = min(pp - 1 - rank, microbatches)
        program = [F(rank, microbatch) for microbatch in range(warmup)]
        weights = 0
        for step in range(microbatches):
            if warmup + step < microbatches:
                program.append(F(rank, warmup + step))
            program.append(I(rank, step))
            if step >= rank:
                program.append(W(rank, weights))
                weights += 1
        program.extend(W(rank, microbatch) for microbatch in range(weights, microbatches))
        programs.append(program)
    return Schedule(pp, microbatches, looped_placement(pp, 1), programs, name="zb-h1",
                    meta={"memory_microbatches": pp})
