"""Interleaved 1F1B (Narayanan et al., 2021; Megatron-LM's virtual pipeline).

Each rank holds ``v`` model chunks (stages ``r, r + pp, r + 2pp, ...``). Microbatches
move through the chunks in rounds of ``g`` microbatches: the rank runs chunk 0 for a
round, then chunk 1 for the same round, and so on, which cuts the warm-up and drain
bubble by ``v``: makespan ``m(F+B) + (p-1)(F+B)/v`` when chunks cost ``F/v``, ``B/v``.

When ``m`` is not a multiple of ``pp`` the rounds follow ``torch.distributed.pipelining``
(``rounds = max(1, m // pp)``, ``g = m / rounds``), so the two tools accept and refuse
the same microbatch counts.
"""

from __future__ import annotations

from schedules.action import Action, ActionKind
from schedules.generators.common import ScheduleUnavailableError
from schedules.schedule import Schedule, looped_placement


def round_size(pp: int, microbatches: int) -> int:
    """Microbatches per round; raises where no equal split into rounds exists."""
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        nearby = sorted(
            {count for count in range(max(1, microbatches - pp), microbatches + pp + 1)
             if count % max(1, count // pp) == 0} - {microbatches}
        )
        raise ScheduleUnavailableError(
            f"interleaved-1f1b: {microbatches} microbatches on pp={pp} do not split into "
            f"{rounds} equal rounds (rounds = max(1, m // pp) must divide m); "
            f"nearby counts that work: {', '.join(map(str, nearby[:6]))}"
        )
    return microbatches // rounds


def interleaved_1f1b(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's depth-first interleaved schedule with looped placement."""
    group = round_size(pp, microbatches)
    programs = [_rank_program(rank, pp, microbatches, virtual_stages, group) for rank in range(pp)]
    placement = looped_placement(pp, virtual_stages)
    return Schedule(pp, microbatches, placement, programs, name="interleaved-1f1b")


def _rank_program(rank: int, pp: int, microbatches: int, virtual_stages: int, group: int) -> list[Action]:
    """Warm-up forwards, then F/B pairs, then the remaining backwards; the j-th forward
    runs chunk ``(j // g) % v`` and the j-th backward chunk ``v - 1 - (j // g) % v``,
    each on that chunk's next microbatch: every round of ``g v`` steps gives each chunk
    ``g`` of them, so it is microbatch ``(j // (g v)) g + j % g`` (``m`` is whole rounds)."""
    total = microbatches * virtual_stages
    warmup = min((virtual_stages - 1) * group + 2 * (pp - 1 - rank), total)
    span = group * virtual_stages
    forward_kind, backward_kind = ActionKind.F, ActionKind.B

    def forward(step: int) -> Action:
        return Action((step // group) % virtual_stages * pp + rank, forward_kind, step // span * group + step % group)

    def backward(step: int) -> Action:
        chunk = virtual_stages - 1 - (step // group) % virtual_stages
        return Action(chunk * pp + rank, backward_kind, step // span * group + step % group)

    program = [forward(step) for step in range(warmup)]
    for step in range(total - warmup):
        program.append(forward(warmup + step))
        program.append(backward(step))
    program.extend(backward(step) for step in range(total - warmup, total))
    return program
