"""GPipe (Huang et al., 2019): every forward, then every backward.

Simple and memory-hungry: each rank holds all ``m`` microbatches' activations at once.
"""

from __future__ import annotations

from schedules.action import B, F
from schedules.generators.common import require_single_chunk
from schedules.schedule import Schedule, looped_placement


def gpipe(pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """All forwards in microbatch order, then all backwards in the same order."""
    require_single_chunk("gpipe", virtual_stages)
    programs = []
    for rank in range(pp):
        forwards = [F(rank, microbatch) for microbatch in range(microbatches)]
        backwards = [B(rank, microbatch) for microbatch in range(microbatches)]
        programs.append(forwards + backwards)
    return Schedule(pp, microbatches, looped_placement(pp, 1), programs, name="gpipe")
