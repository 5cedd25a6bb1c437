"""Combined 1F1B: Megatron-Core's ``--overlap-moe-expert-parallel-comm``.

In the steady state of 1F1B every rank runs one forward, then one backward of an
earlier microbatch. Megatron-Core's combined 1F1B merges each such forward and backward
into one step whose layers' pieces are interleaved, so that the expert-parallel
all-to-alls of one (dispatch and combine) run while the other computes; its
documentation states the aim as hiding the all-to-alls of a mixture of experts behind
the other microbatch's attention and MLP. For the two halves never to depend on each
other, every rank runs one more warm-up forward first (``schedules.py``:
``num_warmup_microbatches + 1`` "to ensure the forward and backward computations are
independent in all 1f1b steps").

Here that is the schedule's order with one more warm-up forward and each steady-state
backward marked as overlapped with the forward just before it (``Schedule.fused``, the
pairs DualPipe overlaps too); the simulator prices a pair as ``pipesim.sim.overlap``
says. Megatron-Core runs it for the interleaved schedule, and without pipelining (pp 1)
for 1F1B; a non-interleaved 1F1B over several ranks is refused, as Megatron-Core refuses it.
"""

from __future__ import annotations

import dataclasses

from schedules.action import ActionKind
from schedules.generators.common import ScheduleUnavailableError
from schedules.generators.interleaved import interleaved_1f1b, round_size, warmup_forwards
from schedules.generators.one_f_one_b import one_f_one_b
from schedules.schedule import Schedule

COMBINABLE = ("1f1b", "interleaved-1f1b")


def combined_problem(name: str, pp: int, ep: int = 2, recompute: str = "none") -> str:
    """Why Megatron-Core would not run schedule ``name`` over ``pp`` ranks as combined
    1F1B with ``ep`` expert-parallel ranks and ``recompute`` ('' when it would): the one
    rule ``simulate``, ``sweep`` and ``run`` refuse ``--ep-overlap`` by."""
    if ep < 2:
        return ("--ep-overlap needs --ep above 1: it hides expert parallelism's all-to-alls (Megatron-Core requires "
                "expert parallelism for it); give --ep or drop --ep-overlap")
    if name not in COMBINABLE:
        return (f"--ep-overlap conflicts with --schedule {name}: combined 1F1B overlaps the steady state of "
                f"{' or '.join(COMBINABLE)} (Megatron-Core's), and {name} is not one of them; use one of them or drop "
                f"--ep-overlap")
    if name == "1f1b" and pp != 1:
        return (f"--ep-overlap with --schedule 1f1b over --pp {pp}: combined 1F1B over several ranks needs the "
                f"interleaved schedule (Megatron-Core runs it for interleaved-1f1b, and for 1f1b only without "
                f"pipelining, pp 1); use --schedule interleaved-1f1b")
    if recompute == "full":
        return ("--ep-overlap conflicts with --recompute full: Megatron-Core refuses full recomputation under "
                "combined 1F1B; use another --recompute or drop --ep-overlap")
    return ""


def combined_1f1b(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
                  microbatch_group: int | None = None) -> Schedule:
    """Schedule ``name`` (1f1b at pp 1, or interleaved-1f1b) run as combined 1F1B: one
    more warm-up forward per rank and every steady-state (forward, backward) pair fused."""
    problem = combined_problem(name, pp)
    if problem:
        raise ScheduleUnavailableError(problem)
    if name == "interleaved-1f1b":
        schedule = interleaved_1f1b(pp, microbatches, virtual_stages, microbatch_group, extra_warmup=1)
        group = microbatch_group or round_size(pp, microbatches)
        warmups = [warmup_forwards(pp, rank, microbatches, virtual_stages, group, extra=1) for rank in range(pp)]
    else:  # 1f1b without pipelining
        schedule = one_f_one_b(pp, microbatches, extra_warmup=1)
        warmups = [min(1, microbatches)]
    return fuse_steady_pairs(schedule, warmups)


def fuse_steady_pairs(schedule: Schedule, warmups: list[int]) -> Schedule:
    """``schedule`` (warm-up forwards, then forward-backward pairs, then the drain's
    backwards on every rank) with each steady-state pair marked as overlapped: rank
    ``r``'s ``warmups[r]`` warm-up forwards are followed by ``n - warmups[r]`` pairs, ``n``
    its forwards; a rank whose forwards are all warm-up has none."""
    fused = []
    for program, warmup in zip(schedule.programs, warmups, strict=True):
        forwards = sum(1 for action in program if action.kind == ActionKind.F)
        fused.append(frozenset(warmup + 2 * pair + 1 for pair in range(forwards - warmup)))
    return dataclasses.replace(schedule, fused=tuple(fused), meta={**schedule.meta, "combined_1f1b": True})
