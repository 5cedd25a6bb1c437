"""torch.distributed.pipelining's own orders for a schedule class, as our ``Schedule``.

torch computes a schedule's order in the constructor of its schedule class, from the
pipeline stages it is given; only their sizes and rank are read, so stand-in stages
without a model give the order without building anything. Shared by the tests and
benchmarks/bench_zero_bubble.py (which compare our generated orders against these).
"""

from __future__ import annotations

from torch.distributed.pipelining import schedules as torch_schedules

from schedules.action import parse_action
from schedules.schedule import Schedule

# our name -> (torch class, placement style, stages per rank)
TORCH_CLASSES = {
    "zb-h1": ("ScheduleInterleavedZeroBubble", "loop", 1),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop", 2),
    "zbv": ("ScheduleZBVZeroBubble", "v", 2),
    "looped-bfs": ("ScheduleLoopedBFS", "loop", 2),
    "dualpipev": ("ScheduleDualPipeV", "v", 2),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop", 2),
}


class StandInStage:
    """What a torch schedule constructor reads from a pipeline stage, and nothing else."""

    def __init__(self, stage_index: int, num_stages: int, pp: int, rank: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = pp
        self.group_rank = rank
        self.submod = None
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1


def torch_schedule(name: str, pp: int, microbatches: int, chunks: int | None = None) -> Schedule:
    """torch's compute-only order for the schedule class matching ``name``, every rank,
    with torch's placement. Idle steps (None) are dropped; an overlapped pair
    ``(F;B)OVERLAP_F_B`` becomes our F then B, marked fused."""
    class_name, style, default_chunks = TORCH_CLASSES[name]
    chunks = chunks or default_chunks
    cls = getattr(torch_schedules, class_name)
    num_stages = pp * chunks
    if style == "v":
        stages = [StandInStage(stage, num_stages, pp, 0) for stage in (0, num_stages - 1)]
    else:
        stages = [StandInStage(chunk * pp, num_stages, pp, 0) for chunk in range(chunks)]
    schedule = cls(stages, microbatches)
    placement = _placement(schedule, num_stages, pp, style)
    programs, fused = [], []
    for rank in range(pp):
        program, overlapped = [], set()
        for action in schedule.pipeline_order[rank]:
            if action is None or not action.is_compute_op:  # idle steps, REDUCE_GRAD
                continue
            if action.sub_actions is not None:
                forward, backward = action.sub_actions
                program.append(parse_action(str(forward)))
                overlapped.add(len(program))
                program.append(parse_action(str(backward)))
            else:
                program.append(parse_action(str(action)))
        programs.append(program)
        fused.append(frozenset(overlapped))
    extra = {"fused": tuple(fused)} if any(fused) else {}
    return Schedule(pp, microbatches, placement, programs, name=f"torch {class_name}", **extra)


def torch_lowered_schedule(name: str, pp: int, microbatches: int) -> Schedule:
    """torch's own lowered order (its ``_add_send_recv`` over the class's compute order)
    for the class matching ``name``, as our ``Schedule``; the step-level actions
    (REDUCE_GRAD, UNSHARD, RESHARD) move no data and are left out, an overlapped pair
    becomes our F then B, marked fused."""
    class_name, style, chunks = TORCH_CLASSES[name]
    num_stages = pp * chunks
    stages = ([StandInStage(stage, num_stages, pp, 0) for stage in (0, num_stages - 1)] if style == "v"
              else [StandInStage(chunk * pp, num_stages, pp, 0) for chunk in range(chunks)])
    schedule = getattr(torch_schedules, class_name)(stages, microbatches)
    programs, fused = [], []
    for rank in range(pp):
        program, overlapped = [], set()
        for action in schedule.pipeline_order_with_comms[rank]:
            if action.sub_actions is not None:
                forward, backward = action.sub_actions
                program.append(parse_action(str(forward)))
                overlapped.add(len(program))
                program.append(parse_action(str(backward)))
            elif action.computation_type.value not in ("REDUCE_GRAD", "UNSHARD", "RESHARD"):
                program.append(parse_action(str(action)))
        programs.append(program)
        fused.append(frozenset(overlapped))
    extra = {"fused": tuple(fused)} if any(fused) else {}
    return Schedule(pp, microbatches, _placement(schedule, num_stages, pp, style), programs,
                    name=f"torch {class_name} lowered", **extra)


def _placement(schedule, num_stages: int, pp: int, style: str) -> tuple[int, ...]:
    mapping = getattr(schedule, "stage_index_to_group_rank", None)
    if mapping:
        return tuple(mapping[stage] for stage in range(num_stages))
    if style == "v":  # pragma: no cover - torch always sets it for V schedules
        raise AssertionError("torch gave no stage mapping for a V schedule")
    return tuple(stage % pp for stage in range(num_stages))
