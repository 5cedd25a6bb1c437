"""Interleaved 1F1B (Narayanan et al., 2021; Megatron-LM's virtual pipeline).

Each rank holds ``v`` model chunks (stages ``r, r + pp, r + 2pp, ...``). Microbatches
move through the chunks in groups of ``N`` microbatches: the rank runs chunk 0 for a
group, then chunk 1 for the same group, and so on, which cuts the warm-up and drain
bubble by ``v``: makespan ``m(F+B) + (p-1)(F+B)/v`` when chunks cost ``F/v``, ``B/v``.
Rank ``r`` runs ``2(p-r-1) + (v-1)N`` forwards before its first backward, so it holds
at most one more chunk's stash than that: a smaller ``N`` holds less.

``N`` is Megatron-Core's ``--microbatch-group-size-per-virtual-pipeline-stage``, the
flexible ``N`` of Meta's Llama 3 schedule (Dubey et al. 2024, section 3.3.2: ``N = p`` is
depth-first, ``N = m`` breadth-first). Given, the order is Megatron's
``get_schedule_table`` action by action: groups of ``N`` and a last group of ``m mod N``.
Megatron accepts ``p <= N <= m`` with ``m mod N`` zero or at least ``p``, and so does
this: outside that range a chunk's forward comes round before its input has crossed the
``p`` ranks, and the order deadlocks for most sizes (p=3, v=2, N=1: a cycle through
ranks 0 and 2). ``N = m < p`` is the one exception, the single group of the default
order. So ``N = p`` holds the least; a larger ``N`` gives transfers more slack.

Without ``N`` the groups follow ``torch.distributed.pipelining``
(``rounds = max(1, m // pp)``, ``N = m / rounds``; ``N = p`` when ``p`` divides ``m``),
so the two tools accept and refuse the same microbatch counts.
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


def require_microbatch_group(pp: int, microbatches: int, microbatch_group: int) -> None:
    """Megatron-Core's range for ``N`` (``forward_backward_pipelining_with_interleaving``):
    ``p <= N <= m``, and a last group of ``m mod N`` either empty or at least ``p``; one
    group of all ``m < p`` microbatches is the default order and runs too (see the module)."""
    valid = _range_text(valid_microbatch_groups(pp, microbatches))
    if microbatch_group > microbatches:
        raise ScheduleUnavailableError(
            f"interleaved-1f1b: microbatch group {microbatch_group} is more than the {microbatches} microbatches "
            f"of the step; valid: {valid}"
        )
    if microbatch_group < min(pp, microbatches):
        raise ScheduleUnavailableError(
            f"interleaved-1f1b: microbatch group {microbatch_group} must be between pp={pp} and the "
            f"{microbatches} microbatches of the step (Megatron-Core's range: below pp a chunk's input has "
            f"not crossed the pipeline when its turn comes, and the order deadlocks); valid: {valid}"
        )
    last = microbatches % microbatch_group
    if 0 < last < pp:
        raise ScheduleUnavailableError(
            f"interleaved-1f1b: microbatch group {microbatch_group} leaves a last group of {last} microbatches "
            f"({microbatches} mod {microbatch_group}), fewer than pp={pp} (Megatron-Core refuses it: the order "
            f"waits on itself); valid: {valid}"
        )


def valid_microbatch_groups(pp: int, microbatches: int) -> list[int]:
    """Every ``N`` Megatron-Core's range accepts for ``pp`` ranks and ``m`` microbatches,
    smallest (least memory) first."""
    return [group for group in range(min(pp, microbatches), microbatches + 1)
            if microbatches % group == 0 or microbatches % group >= pp]


def _range_text(groups: list[int]) -> str:
    """A list of valid groups, shortened where it is long."""
    shown = ", ".join(map(str, groups[:8]))
    return shown + (f", ... {groups[-1]}" if len(groups) > 8 else "")


def warmup_forwards(pp: int, rank: int, microbatches: int, virtual_stages: int, microbatch_group: int,
                    extra: int = 0) -> int:
    """Forwards rank ``rank`` runs before its first backward: Megatron's
    ``2(p - r - 1) + (v - 1)N`` (plus ``extra``: combined 1F1B's one more,
    ``schedules.generators.combined``), at most every forward of the step."""
    return min(2 * (pp - 1 - rank) + (virtual_stages - 1) * microbatch_group + extra, microbatches * virtual_stages)


def interleaved_1f1b(pp: int, microbatches: int, virtual_stages: int = 2,
                     microbatch_group: int | None = None, extra_warmup: int = 0) -> Schedule:
    """Megatron's depth-first interleaved schedule with looped placement, ``N =
    microbatch_group`` microbatches per chunk visit (None: torch's rounds, see the
    module); ``extra_warmup`` more warm-up forwards on every rank (combined 1F1B's one,
    ``schedules.generators.combined``). Every rank's program is computed as arrays at once (a
    large step has hundreds of thousands of actions), and the arrays are kept with the
    schedule for lowering to read."""
    if microbatch_group is None:
        group = round_size(pp, microbatches)
    else:
        require_microbatch_group(pp, microbatches, microbatch_group)
        group = microbatch_group
    schedule = grouped_order(pp, microbatches, virtual_stages, group, extra_warmup)
    if microbatch_group is not None:
        schedule.meta["microbatch_group"] = microbatch_group
    return schedule


def grouped_order(pp: int, microbatches: int, virtual_stages: int, group: int, extra_warmup: int = 0) -> Schedule:
    """The order for any group size, unchecked: ``interleaved_1f1b`` keeps to the sizes
    that run (the tests build the others here to show that they deadlock)."""
    table_microbatch, table_chunk = schedule_table(microbatches, virtual_stages, group)
    rank, backward, step = _program_steps(pp, microbatches, virtual_stages, group, extra_warmup)
    chunk = table_chunk[step]
    stage = np.where(backward, virtual_stages - 1 - chunk, chunk) * pp + rank
    microbatch = table_microbatch[step]
    kinds = list(map((ActionKind.F, ActionKind.B).__getitem__, backward.tolist()))
    actions = actions_of(stage.tolist(), kinds, microbatch.tolist())
    bounds = np.searchsorted(rank, np.arange(pp + 1)).tolist()
    programs = [actions[begin:end] for begin, end in zip(bounds[:-1], bounds[1:], strict=True)]
    schedule = Schedule(pp, microbatches, looped_placement(pp, virtual_stages), programs, name="interleaved-1f1b")
    codes = np.where(backward, KIND_CODES[ActionKind.B], KIND_CODES[ActionKind.F])
    keep_program_arrays(schedule, rank, stage, codes, microbatch)
    return schedule


def schedule_table(microbatches: int, virtual_stages: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``get_schedule_table``: for the j-th forward of a rank, its microbatch
    and chunk. Groups of ``group`` microbatches (the last one the ``m mod N`` left, if
    any) each visit chunk 0, then chunk 1, ...; the j-th backward runs the same
    microbatch on chunk ``v - 1 - chunk``, as a chunk's stashes leave first in, first out."""
    step = np.arange(microbatches * virtual_stages, dtype=np.int64)
    whole = microbatches // group * group  # microbatches in full groups
    last = max(microbatches - whole, 1)
    in_whole = step < whole * virtual_stages
    within = step % (group * virtual_stages)
    rest = step - whole * virtual_stages
    microbatch = np.where(in_whole, step // (group * virtual_stages) * group + within % group, whole + rest % last)
    chunk = np.where(in_whole, within // group, rest // last)
    return microbatch, chunk


def _program_steps(pp: int, microbatches: int, virtual_stages: int, group: int, extra_warmup: int = 0
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per action of every rank's program, in order: its rank, whether it is a backward
    and its step ``j`` (the j-th forward, or backward, of the rank). Warm-up forwards,
    then F/B pairs (Megatron's steady state runs forward ``warm-up + k`` then backward
    ``k``), then the remaining backwards."""
    total = microbatches * virtual_stages
    ranks, backwards, steps = [], [], []
    for rank in range(pp):
        warmup = warmup_forwards(pp, rank, microbatches, virtual_stages, group, extra_warmup)
        steady = np.arange(total - warmup)
        paired = np.stack([warmup + steady, steady], axis=1).ravel()
        steps.append(np.concatenate([np.arange(warmup), paired, np.arange(total - warmup, total)]))
        backwards.append(np.concatenate([np.zeros(warmup, dtype=bool), np.tile([False, True], len(steady)),
                                         np.ones(warmup, dtype=bool)]))
        ranks.append(np.full(2 * total, rank, dtype=np.int64))
    return np.concatenate(ranks), np.concatenate(backwards), np.concatenate(steps)
