"""Overlapped forward-and-backward pairs (DualPipe's ``OVERLAP_F_B``) through lowering.

A pair runs as one step: both of its inputs must be there before it starts and both of
its outputs leave after it ends (torch.distributed.pipelining lowers its
``OVERLAP_F_B`` actions the same way). Lowering places transfers for single actions, so
it may put a transfer between the pair's forward and backward. This pass moves each
such transfer out of the pair, to the side where it does not delay anything: the
pair's own inputs (receives for its backward) and the sends of earlier actions' outputs
before the forward; the pair's own outputs (the forward's send) and receives for later
actions after the backward. Each side keeps its transfers' order as one P2P group, so
the pair stays adjacent and ``Schedule.fused`` marks it in the lowered programs too.
"""

from __future__ import annotations

from schedules.action import SEND_KINDS, Action
from schedules.schedule import Schedule


def pair_times(times: dict[Action, tuple[float, float]] | None, schedule: Schedule):
    """Lowering's planned (start, end) of each action, with both actions of an
    overlapped pair spanning the whole pair: its inputs are needed when the pair starts
    and its outputs exist when it ends, so transfers are placed around the pair."""
    if times is None or not any(schedule.fused):
        return times
    times = dict(times)
    for rank in range(schedule.pp):
        for forward, backward in schedule.fused_pairs(rank):
            span = (times[forward][0], times[backward][1])
            times[forward] = times[backward] = span
    return times


def keep_pairs_together(lowered: Schedule, source: Schedule) -> Schedule:
    """``lowered`` with ``source``'s overlapped pairs adjacent again and marked."""
    if not any(source.fused):
        return lowered
    programs, joins = [], []
    for rank in range(lowered.pp):
        pairs = {forward: backward for forward, backward in source.fused_pairs(rank)}
        items = _regroup(lowered.program_items(rank), pairs)
        program, joined = _flatten(items)
        programs.append(program)
        joins.append(joined)
    return lowered.with_programs(programs, joins, fused=()).with_fused_from(source)


def _regroup(items: list, pairs: dict[Action, Action]) -> list:
    """Move the transfers found between a pair's forward and backward out of the pair."""
    result: list = []
    index = 0
    while index < len(items):
        item = items[index]
        backward = pairs.get(item) if isinstance(item, Action) else None
        if backward is None:
            result.append(item)
            index += 1
            continue
        end = index + 1
        while items[end] != backward:
            end += 1
        between = [action for group in items[index + 1:end] for action in group]
        before = tuple(action for action in between if _belongs_before(action, item, backward))
        after = tuple(action for action in between if not _belongs_before(action, item, backward))
        result += ([before] if before else []) + [item, backward] + ([after] if after else [])
        index = end + 1
    return result


def _belongs_before(transfer: Action, forward: Action, backward: Action) -> bool:
    """Whether a transfer found inside the pair goes before it: everything but the
    forward's own output and receives meant for later actions."""
    if transfer.kind in SEND_KINDS:
        return (transfer.stage, transfer.microbatch) != (forward.stage, forward.microbatch)
    return (transfer.stage, transfer.microbatch) == (backward.stage, backward.microbatch)


def _flatten(items: list) -> tuple[list[Action], frozenset[int]]:
    program: list[Action] = []
    joined: set[int] = set()
    for item in items:
        if isinstance(item, Action):
            program.append(item)
        else:
            joined.update(range(len(program) + 1, len(program) + len(item)))
            program.extend(item)
    return program, frozenset(joined)
