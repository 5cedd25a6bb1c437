"""Looped breadth-first pipeline (Lamy-Poirier, "Breadth-First Pipeline Parallelism",
2022; torch.distributed.pipelining's ScheduleLoopedBFS).

``v`` looped chunks per rank (stages ``r, r + p, ...``). A rank runs every microbatch's
forward through its first chunk, then its second, ...; then the backwards chunk by
chunk from the last, each chunk's microbatches in reverse order (the last forward's
activations are the freshest). Like GPipe it holds every microbatch's activations
(``m`` on each chunk), in exchange for long runs of one chunk, which suit data-parallel
sharding that gathers a chunk's weights once per pass.
"""

from __future__ import annotations

from schedules.action import B, F
from schedules.schedule import Schedule, looped_placement


def looped_bfs(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """All forwards chunk by chunk, then all backwards chunk by chunk in reverse."""
    programs = []
    for rank in range(pp):
        stages = range(rank, pp * virtual_stages, pp)
        program = [F(stage, microbatch) for stage in stages for microbatch in range(microbatches)]
        program += [B(stage, microbatch) for stage in reversed(stages) for microbatch in reversed(range(microbatches))]
        programs.append(program)
    return Schedule(pp, microbatches, looped_placement(pp, virtual_stages), programs, name="looped-bfs",
                    meta={"memory_microbatches": microbatches})
