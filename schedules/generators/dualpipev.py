"""DualPipeV (DeepSeek-V3 technical report, 2024; the V-shaped "cut-in-half" DualPipe of
github.com/deepseek-ai/DualPipe; torch.distributed.pipelining's ScheduleDualPipeV).

V placement like ZB-V (rank ``r`` holds stages ``r`` and ``2p - 1 - r``). The steady
state runs a forward of one chunk *overlapped* with the full backward of the other
chunk: the two are independent, so their compute and their communication (in DeepSeek's
case, MoE all-to-all) hide each other. An overlapped pair is kept in the program as its
two actions, ``F`` then ``B`` adjacent, with the ``B``'s position listed in
``Schedule.fused``; the simulator charges the pair its own cost (``overlap_fb`` in the
costs, otherwise ``F + B``) and the CSV writes it as torch's
``(F;B)OVERLAP_F_B`` cell.

Phases on rank ``r`` (torch's order; stage ``s0 = r``, ``s1 = 2p - 1 - r``):
``2(p - r - 1)`` forwards of s0; ``r + 1`` pairs ``F s0, F s1``; ``p - r - 1`` rounds of
``I s1, W, F s1``; ``m - 2p + r + 1`` rounds of overlapped ``(F s0; B s1)`` and
``(F s1; B s0)``; ``p - r - 1`` rounds of ``B s1, (F s1; B s0)``; ``r + 1`` rounds of
``B|I s1, B|I s0`` switching to split backward half way; ``p - r - 1`` rounds of
``W, B|I s0``; and the ``W`` passes still owed. It needs ``m >= 2p``.
Peak memory: up to ``2p + 1`` chunk stashes on rank 0, about ``p`` microbatches of the
rank's share (1F1B's), against DualPipe's ``2p`` for keeping two model copies.
"""

from __future__ import annotations

from collections import deque

from schedules.action import Action, ActionKind
from schedules.generators.common import ScheduleUnavailableError
from schedules.schedule import Schedule, v_shape_placement

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def dualpipev(pp: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """DualPipeV's order with its overlapped forward-backward pairs marked as fused."""
    if virtual_stages != 2:
        raise ScheduleUnavailableError(
            f"dualpipev places exactly 2 stages per rank in a V; virtual stages={virtual_stages}"
        )
    if microbatches < 2 * pp:
        raise ScheduleUnavailableError(
            f"dualpipev needs at least as many microbatches as stages: {microbatches} microbatches for "
            f"{2 * pp} stages (pp={pp}); use m >= {2 * pp}"
        )
    programs, fused = overlapped_programs(pp, lambda rank: _RankProgram(rank, pp, microbatches).build())
    return Schedule(pp, microbatches, v_shape_placement(pp, 2), programs, name="dualpipev",
                    meta={"memory_microbatches": pp + 0.5}, fused=fused)


def overlapped_programs(pp: int, build) -> tuple[list, tuple[frozenset[int], ...]]:
    """Each rank's program and the positions of its overlapped pairs' backwards, from
    ``build(rank)`` (DualPipeV's and DualPipe's rank programs return both)."""
    programs, fused = [], []
    for rank in range(pp):
        program, overlapped = build(rank)
        programs.append(program)
        fused.append(frozenset(overlapped))
    return programs, tuple(fused)


class _RankProgram:
    """One rank's program, built phase by phase with per-stage microbatch counters."""

    def __init__(self, rank: int, pp: int, microbatches: int) -> None:
        self.rank, self.pp, self.microbatches = rank, pp, microbatches
        self.down, self.up = rank, 2 * pp - 1 - rank
        self.forwards = {self.down: 0, self.up: 0}
        self.backwards = {self.down: 0, self.up: 0}  # B and I share the count
        self.owed_weights: deque[Action] = deque()
        self.program: list[Action] = []
        self.overlapped: list[int] = []

    def forward(self, stage: int) -> None:
        self.program.append(Action(stage, _F, self.forwards[stage]))
        self.forwards[stage] += 1

    def backward(self, stage: int, split: bool = False) -> None:
        action = Action(stage, _I if split else _B, self.backwards[stage])
        self.program.append(action)
        self.backwards[stage] += 1
        if split:
            self.owed_weights.append(Action(stage, _W, action.microbatch))

    def weight(self) -> None:
        if self.owed_weights:
            self.program.append(self.owed_weights.popleft())

    def overlap(self, forward_stage: int, backward_stage: int) -> None:
        self.forward(forward_stage)
        self.overlapped.append(len(self.program))
        self.backward(backward_stage)

    def build(self) -> tuple[list[Action], list[int]]:
        rank, pp, down, up = self.rank, self.pp, self.down, self.up
        for _ in range(2 * (pp - rank - 1)):
            self.forward(down)
        for _ in range(rank + 1):
            self.forward(down)
            self.forward(up)
        for _ in range(pp - rank - 1):
            self.backward(up, split=True)
            self.weight()
            self.forward(up)
        for step in range(self.microbatches - 2 * pp + rank + 1):
            if step == 0 and rank == pp - 1:
                # the turn of the V: run these two apart, which shortens the bubble
                self.forward(down)
                self.backward(up)
            else:
                self.overlap(down, up)
            self.overlap(up, down)
        for _ in range(pp - rank - 1):
            self.backward(up)
            self.overlap(up, down)
        split = False
        drain = rank + 1
        for step in range(drain):
            if step == drain // 2 and rank % 2 == 1:
                split = True
            self.backward(up, split)
            if step == drain // 2 and rank % 2 == 0:
                split = True
            self.backward(down, split)
        for _ in range(pp - rank - 1):
            self.weight()
            self.backward(down, split)
        while self.owed_weights:
            self.weight()
        return self.program, self.overlapped
