"""1F1B (PipeDream-Flush / Megatron): warm up, alternate one forward and one backward,
drain.

Same makespan as GPipe, but rank ``r`` holds at most ``pp - r`` microbatches'
activations instead of ``m``.
"""

from __future__ import annotations

from schedules.action import B, F
from schedules.generators.common import require_single_chunk
from schedules.schedule import Schedule, looped_placement


def one_f_one_b(pp: int, microbatches: int, virtual_stages: int = 1, extra_warmup: int = 0) -> Schedule:
    """Rank ``r`` runs ``min(pp - r - 1 + extra_warmup, m)`` warm-up forwards, then F/B
    pairs, then the remaining backwards (``extra_warmup``: combined 1F1B's one more,
    ``schedules.generators.combined``)."""
    require_single_chunk("1f1b", virtual_stages)
    programs = []
    for rank in range(pp):
        warmup = min(pp - rank - 1 + extra_warmup, microbatches)
        program = [F(rank, microbatch) for microbatch in range(warmup)]
        for step in range(microbatches - warmup):
            program.append(F(rank, warmup + step))
            program.append(B(rank, step))
        program.extend(B(rank, microbatch) for microbatch in range(microbatches - warmup, microbatches))
        programs.append(program)
    return Schedule(pp, microbatches, looped_placement(pp, 1), programs, name="1f1b")
