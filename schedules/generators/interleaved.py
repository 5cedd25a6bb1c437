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

import numpy as np

from schedules.action import KIND_CODES, ActionKind, actions_of
from schedules.generators.common import ScheduleUnavailableError
from schedules.program_arrays import keep_program_arrays
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
    """Megatron's depth-first interleaved schedule with looped placement. Every rank's
    program is computed as arrays at once (a large step has hundreds of thousands of
    actions), and the arrays are kept with the schedule for lowering to read."""
    group = round_size(pp, microbatches)
    rank, backward, step = _program_steps(pp, microbatches * virtual_stages, virtual_stages, group)
    chunk = (step // group) % virtual_stages
    stage = np.where(backward, virtual_stages - 1 - chunk, chunk) * pp + rank
    microbatch = step // (group * virtual_stages) * group + step % group
    kinds = list(map((ActionKind.F, ActionKind.B).__getitem__, backward.tolist()))
    actions = actions_of(stage.tolist(), kinds, microbatch.tolist())
    bounds = np.searchsorted(rank, np.arange(pp + 1)).tolist()
    programs = [actions[begin:end] for begin, end in zip(bounds[:-1], bounds[1:], strict=True)]
    schedule = Schedule(pp, microbatches, looped_placement(pp, virtual_stages), programs, name="interleaved-1f1b")
    codes = np.where(backward, KIND_CODES[ActionKind.B], KIND_CODES[ActionKind.F])
    keep_program_arrays(schedule, rank, stage, codes, microbatch)
    return schedule


def _program_steps(pp: int, total: int, virtual_stages: int, group: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per action of every rank's program, in order: its rank, whether it is a backward
    and its step ``j`` (the j-th forward, or backward, of the rank). Warm-up forwards,
    then F/B pairs, then the remaining backwards; the j-th forward runs chunk
    ``(j // g) % v`` and the j-th backward chunk ``v - 1 - (j // g) % v``, each on that
    chunk's next microbatch: every round of ``g v`` steps gives each chunk ``g`` of them,
    so it is microbatch ``(j // (g v)) g + j % g`` (``m`` is whole rounds)."""
    ranks, backwards, steps = [], [], []
    for rank in range(pp):
        warmup = min((virtual_stages - 1) * group + 2 * (pp - 1 - rank), total)
        steady = np.arange(total - warmup)
        paired = np.stack([warmup + steady, steady], axis=1).ravel()
        steps.append(np.concatenate([np.arange(warmup), paired, np.arange(total - warmup, total)]))
        backwards.append(np.concatenate([np.zeros(warmup, dtype=bool), np.tile([False, True], len(steady)),
                                         np.ones(warmup, dtype=bool)]))
        ranks.append(np.full(2 * total, rank, dtype=np.int64))
    return np.concatenate(ranks), np.concatenate(backwards), np.concatenate(steps)
