"""Interleaved zero bubble (torch.distributed.pipelining's ScheduleInterleavedZeroBubble,
the ZB1P schedule of Qi et al., ICLR 2024, with Megatron's virtual stages).

Interleaved 1F1B's chunk order with the backward split: rank ``r`` runs
``(v - 1)·g + (p - 1 - r)`` warm-up forwards (``g`` microbatches per round), then ``F I``
pairs, the ``j``-th forward on chunk ``(j // g) % v`` and the ``k``-th input gradient on
chunk ``v - 1 - (k // g) % v``; each ``W`` follows its ``I`` ``r`` steps later, and the
ones still owed fill the drain. With one chunk per rank this is ``zb-h1``.
Rounds follow torch: ``max(1, m // p)`` rounds must divide ``m``.
"""

from __future__ import annotations

from schedules.action import Action, ActionKind
from schedules.generators.common import ScheduleUnavailableError, chunk_visitor
from schedules.generators.interleaved import round_size
from schedules.schedule import Schedule, looped_placement


def interleaved_zb(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """ZB1P over ``v`` looped chunks per rank."""
    try:
        group = round_size(pp, microbatches)
    except ScheduleUnavailableError as error:
        raise ScheduleUnavailableError(str(error).replace("interleaved-1f1b", "interleaved-zb")) from None
    programs = [_rank_program(rank, pp, microbatches, virtual_stages, group) for rank in range(pp)]
    # chunk stashes peak at the warm-up plus the r steps W lags: (v - 1)g + p of them
    peak_chunks = min((virtual_stages - 1) * group + pp, microbatches * virtual_stages)
    return Schedule(pp, microbatches, looped_placement(pp, virtual_stages), programs, name="interleaved-zb",
                    meta={"memory_microbatches": peak_chunks / virtual_stages})


def _rank_program(rank: int, pp: int, microbatches: int, virtual_stages: int, group: int) -> list[Action]:
    total = microbatches * virtual_stages
    warmup = min((virtual_stages - 1) * group + pp - 1 - rank, total)
    visit = chunk_visitor(pp, rank)

    def backward_chunk(step: int) -> int:
        return virtual_stages - 1 - (step // group) % virtual_stages

    program = [visit(ActionKind.F, (step // group) % virtual_stages) for step in range(warmup)]
    weights = 0
    for step in range(total):
        if warmup + step < total:
            program.append(visit(ActionKind.F, ((warmup + step) // group) % virtual_stages))
        program.append(visit(ActionKind.I, backward_chunk(step)))
        if step >= rank:
            program.append(visit(ActionKind.W, backward_chunk(weights)))
            weights += 1
    program.extend(visit(ActionKind.W, backward_chunk(step)) for step in range(weights, total))
    return program
