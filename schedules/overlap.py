"""Overlapped forward-and-backward pairs (DualPipe's ``OVERLAP_F_B``) through lowering.

A pair runs as one step: both of its inputs must be there before it starts and both of
its outputs leave after it ends (torch.distributed.pipelining lowers its
``OVERLAP_F_B`` actions the same way). Lowering places transfers for single actions, so
it may put a transfer between the pair's forward and backward; this pass moves the
receives of such a P2P group to just before the forward and its sends to just after the
backward, each part one group in its original order, so the pair stays adjacent and
``Schedule.fused`` can mark it in the lowered programs too.
"""

from __future__ import annotations

from schedules.action import SEND_KINDS, Action
from schedules.schedule import Schedule


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
    return lowered.with_programs(programs, joins).with_fused_from(source)


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
        receives = tuple(action for action in between if action.kind not in SEND_KINDS)
        sends = tuple(action for action in between if action.kind in SEND_KINDS)
        result += ([receives] if receives else []) + [item, backward] + ([sends] if sends else [])
        index = end + 1
    return result


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
