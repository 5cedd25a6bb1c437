"""DualPipe (DeepSeek-V3 technical report, 2024; github.com/deepseek-ai/DualPipe): two
copies of the model along one pipeline, microbatches fed from both ends.

Copy 0 runs the forward direction (its stage ``s`` on rank ``s``), copy 1 the reverse
direction (its stage ``s`` on rank ``pp - 1 - s``); half of the ``m`` microbatches go each
way. As a ``Schedule`` the copies are stages ``0 .. pp-1`` and ``pp .. 2pp-1`` with
``copies=2`` (no data crosses the seam), which puts stage ``2pp - 1 - r`` on rank ``r``:
the V placement of DualPipeV, each stage holding ``1/pp`` of the model (not ``1/2pp``). A
rank therefore keeps two stages' parameters, gradients and optimizer state, twice
1F1B's, and each stage's gradient is all-reduced with its other copy's (rank ``r`` with
rank ``pp - 1 - r``) before the optimizer step. ``Schedule.microbatches`` counts one
direction's microbatches, ``m / 2``.

Rank ``r``'s program is DualPipeV's on the half pipeline (``pp / 2`` ranks, ``m / 2``
microbatches) at the half rank ``h = min(r, pp - 1 - r)``: DeepSeek's step order is the
same eight phases (warm-up forwards, forward pairs, zero-bubble ``I, W, F``, the
overlapped ``(F; B)`` steady state, the drain switching to split backward half way,
the ``W`` passes owed). Its "phase 0" chunk is the direction fed from its own end (copy
0 on the first half of the ranks, copy 1 on the second), "phase 1" the other. It needs
``pp`` even and ``m`` even with ``m >= 2 pp``.

Bubble (DeepSeek's table): ``(pp/2 - 1)(F&B + B - 3W)`` against 1F1B's ``(pp - 1)(F + B)``;
activations of ``pp + 1`` microbatches of a stage's share at most, with twice the
parameters.
"""

from __future__ import annotations

from schedules.generators.common import ScheduleUnavailableError
from schedules.generators.dualpipev import _RankProgram, overlapped_programs
from schedules.schedule import Schedule, v_shape_placement

ENDS = 2  # the pipeline's two ends, each feeding half of the microbatches


def dualpipe(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipe over ``pp`` ranks for ``microbatches`` microbatches in all (half each way),
    its overlapped forward-backward pairs marked as fused."""
    if virtual_stages != 2:
        raise ScheduleUnavailableError(
            f"dualpipe places two stages per rank (one of each copy of the model); virtual stages={virtual_stages}"
        )
    if pp < 2 or pp % 2:
        raise ScheduleUnavailableError(f"dualpipe needs an even number of pipeline ranks, got pp={pp}")
    if microbatches % ENDS or microbatches < ENDS * pp:
        raise ScheduleUnavailableError(
            f"dualpipe feeds half of the microbatches from each end: it needs an even count of at least "
            f"2 x pp = {2 * pp}, got {microbatches} microbatches"
        )
    per_direction = microbatches // ENDS
    programs, fused = overlapped_programs(pp, lambda rank: _HalfRankProgram(rank, pp, per_direction).build())
    return Schedule(pp, per_direction, v_shape_placement(pp, 2), programs, name="dualpipe",
                    meta={"memory_microbatches": (pp + 1) / 2},  # pp + 1 stage stashes: (pp + 1) / 2 rank shares
                    fused=fused, copies=2)


class _HalfRankProgram(_RankProgram):
    """DualPipeV's rank program at the half rank, on this rank's two copies' stages."""

    def __init__(self, rank: int, pp: int, per_direction: int) -> None:
        half_rank = min(rank, pp - 1 - rank)
        super().__init__(half_rank, pp // 2, per_direction)
        forward_copy, reverse_copy = rank, 2 * pp - 1 - rank
        # phase 0 is the direction fed from this rank's own end of the pipeline
        self.down, self.up = (forward_copy, reverse_copy) if rank < pp // 2 else (reverse_copy, forward_copy)
        self.forwards = {self.down: 0, self.up: 0}
        self.backwards = {self.down: 0, self.up: 0}
