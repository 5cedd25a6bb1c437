"""torch's step-level actions, placed where torch's own lowering places them.

When ``torch.distributed.pipelining`` lowers a compute-only schedule itself
(``_PipelineScheduleRuntime._prepare_schedule_with_comms``) it adds, per rank, three
actions that carry no microbatch:

- ``{stage}REDUCE_GRAD`` right after the stage's last backward (``B`` or ``W``;
  ``_add_reduce_grad``). Its runtime handler is where the gradients are divided by the
  microbatch count under ``scale_grads=True`` and where FSDP's gradient reduction runs.
  A lowered file without it runs, and its gradients come out ``m`` times too large.
- ``{stage}UNSHARD`` / ``{stage}RESHARD`` around the compute of FSDP-sharded stages
  (``_add_unshard_reshard``): all-gather a stage's parameters ahead of its next compute,
  keeping at most three stages gathered. Without them a sharded stage refuses to compute.

A lowered file that torch loads as it is (``format="compute_comms"``) gets none of that,
so pipesim writes them itself: ``torch_cells`` gives one rank's row of such a file, the
step-level actions exactly where torch's lowering of the same compute order puts them
relative to the compute actions (tested against torch's own functions), and pipesim's
transfers between the compute actions as lowering placed them.

Pure data, no torch: the two placement rules below mirror torch's, set iteration order
included (the order torch evicts stages in is the order of a Python ``set``, so the same
operations on a ``set`` give the same order).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from schedules.action import COMM_KINDS, WEIGHT_GRAD_DONE_KINDS, Action, format_overlap
from schedules.schedule import Schedule

REDUCE_GRAD, UNSHARD, RESHARD = "REDUCE_GRAD", "UNSHARD", "RESHARD"
STEP_KINDS = (REDUCE_GRAD, UNSHARD, RESHARD)
# torch keeps this many stages gathered at once (``_add_unshard_reshard``'s default)
FSDP_ACTIVE_STAGES = 3
# Where ``schedule_from_csv`` keeps the step-level cells of a file it read:
# meta[STEP_CELLS] = per rank, (program position it precedes, cell text) in file order.
STEP_CELLS = "torch_step_cells"

_STEP_TEXT = re.compile(r"^\s*(\d+)(" + "|".join(STEP_KINDS) + r")\s*$")

ComputeItem = tuple[Action, ...]  # one compute action, or an overlapped (F, B) pair


def parse_step_cell(text: str) -> tuple[int, str] | None:
    """``(stage, kind)`` of a step-level cell such as ``3REDUCE_GRAD``; None otherwise."""
    match = _STEP_TEXT.match(text)
    return (int(match.group(1)), match.group(2)) if match else None


def step_cell(stage: int, kind: str) -> str:
    return f"{stage}{kind}"


def compute_items(schedule: Schedule, rank: int) -> tuple[list[ComputeItem], list[list[Action]]]:
    """``rank``'s compute items in program order (an overlapped pair is one item, as in
    torch's ``OVERLAP_F_B``) and the transfers before each of them; the last list holds
    the transfers after the last item."""
    program, fused = schedule.programs[rank], schedule.fused[rank]
    items: list[ComputeItem] = []
    transfers: list[list[Action]] = []
    pending: list[Action] = []
    for position, action in enumerate(program):
        if action.kind in COMM_KINDS:
            pending.append(action)
        elif position in fused:  # the backward of a pair: its forward is the item just made
            items[-1] = (items[-1][0], action)
        else:
            transfers.append(pending)
            pending = []
            items.append((action,))
    transfers.append(pending)
    return items, transfers


def reduce_grad_after(items: Sequence[ComputeItem], microbatches: int) -> list[list[int]]:
    """Per item, the stages whose gradients it completes (torch's ``_add_reduce_grad``:
    the ``microbatches``-th B or W of a stage, counting a pair's sub-actions)."""
    done: dict[int, int] = {}
    after: list[list[int]] = []
    for item in items:
        completed = []
        for action in item:
            if action.kind in WEIGHT_GRAD_DONE_KINDS:
                done[action.stage] = done.get(action.stage, 0) + 1
                if done[action.stage] == microbatches:
                    completed.append(action.stage)
        after.append(completed)
    return after


def _next_stages(count: int, items: Sequence[ComputeItem]) -> list[int]:
    """The next ``count`` distinct stages to compute, as torch's ``next_stage_indices``
    finds them (a pair adds both its stages before the count is checked, so it may
    overshoot)."""
    seen: list[int] = []
    for item in items:
        for action in item:
            if action.stage not in seen:
                seen.append(action.stage)
        if len(item) > 1 and len(seen) >= count:
            break
        if len(item) == 1 and len(seen) == count:
            break
    return seen


StepActions = list[tuple[int, str]]  # (stage, kind) in order


def unshard_reshard(items: Sequence[ComputeItem],
                    active_limit: int = FSDP_ACTIVE_STAGES) -> tuple[list[StepActions], StepActions]:
    """torch's ``_add_unshard_reshard``: per item, the (stage, RESHARD|UNSHARD) actions
    placed before it, and those after the last item (every stage still gathered)."""
    active: set[int] = set()  # a set, as torch's: its iteration order is the eviction order
    before: list[StepActions] = []
    for index in range(len(items)):
        upcoming = _next_stages(active_limit, items[index:])
        fetch = [stage for stage in upcoming if stage not in active]
        evict = [stage for stage in active if stage not in upcoming]
        placed = []
        for stage in evict:
            active.remove(stage)
            placed.append((stage, RESHARD))
        for stage in fetch:
            active.add(stage)
            placed.append((stage, UNSHARD))
        before.append(placed)
    trailing = []
    for stage in list(active):
        active.remove(stage)
        trailing.append((stage, RESHARD))
    return before, trailing


def _item_cell(item: ComputeItem) -> str:
    return format_overlap(*item) if len(item) > 1 else str(item[0])


def torch_cells(schedule: Schedule, rank: int, fsdp: bool = False) -> list[str]:
    """``rank``'s row of the CSV torch's runtime runs as written: one action per cell, an
    overlapped pair as one ``(F;B)OVERLAP_F_B`` cell.

    A compute-only schedule is its compute cells alone: torch lowers it itself and
    refuses anything else in a compute-only file. A lowered schedule also gets
    ``REDUCE_GRAD`` after each stage's last backward and, with ``fsdp``, torch's
    ``UNSHARD``/``RESHARD``: in the order torch's own lowering gives them relative to the
    compute actions, after the transfers lowering placed between two compute actions
    (so those are posted first, as torch posts a compute action's sends right after it).
    """
    items, transfers = compute_items(schedule, rank)
    if not schedule.is_lowered:
        return [_item_cell(item) for item in items]
    reduce_after = reduce_grad_after(items, schedule.microbatches)
    before, trailing = unshard_reshard(items) if fsdp else ([[] for _ in items], [])
    cells: list[str] = []
    for index, item in enumerate(items):
        cells += [str(action) for action in transfers[index]]
        if index:
            cells += [step_cell(stage, REDUCE_GRAD) for stage in reduce_after[index - 1]]
        cells += [step_cell(stage, kind) for stage, kind in before[index]]
        cells.append(_item_cell(item))
    cells += [str(action) for action in transfers[-1]]
    if items:
        cells += [step_cell(stage, REDUCE_GRAD) for stage in reduce_after[-1]]
    cells += [step_cell(stage, kind) for stage, kind in trailing]
    return cells
