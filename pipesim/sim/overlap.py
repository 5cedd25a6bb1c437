"""What an overlapped forward-and-backward pair costs (DualPipe's ``OVERLAP_F_B``).

DeepSeek-V3 (technical report, 2024, section 3.2.1) runs the forward of one chunk and
the backward of another together, their pieces rearranged so that the all-to-all of
one half (expert parallelism's dispatch and combine) runs while the other half
computes: its stated aim is to hide the all-to-all entirely. With each half's compute
(``C_F``, ``C_B``: the actions' own seconds) and all-to-all (``A_F``, ``A_B``: the ep
seconds that would hold the rank after each alone), a pair costs

    C_F + C_B + max(0, A_F - C_B) + max(0, A_B - C_F)

both halves' compute, then whatever of each half's all-to-all the other half's compute
does not cover; with the slowdown a collective costs the compute beside it
(``pipesim.sim.comm_overlap``), each ``max(0, A - C)`` is ``exposed_seconds(C, A)``.
The compute keeps its own time, so the Trace keeps each half's compute action as it is
and the uncovered all-to-all holds the rank after the pair (``ep``);
tensor-parallel collectives and the context-parallel K/V exchange stay where they are,
after their half. DeepSeek gives the communication 20 of the H800's 132 SMs, which slows
the compute beside it: the slowdown above stands for that (a measured pair, given as
``overlap_fb``, has it in it).

A pair whose cost is given (``overlap_fb`` in the costs) costs that, shared between its
halves in proportion to their own seconds; its all-to-alls are taken to be inside it.

Where the executor runs a pair's halves one after the other (on a CPU: costs with
``pairs_overlap`` false, as ``pipesim compare`` sets them from the run), nothing is
hidden: each half costs what it costs alone, and what holds the rank after it is its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipesim.sim.comm_overlap import exposed_seconds
from schedules.action import ActionKind
from schedules.schedule import Schedule

# what holds a rank after a compute action, in the order the Trace shows it (ZeRO-3's
# parameter gathers hold none: they run on the dp channel in the engine's walk)
HOLD_PARTS = ("tp", "ep", "cp")


def overlapped_pairs(schedule: Schedule, costs, durations: Mapping,
                     holds: Mapping[str, Mapping[tuple[int, str], float]], slowdown: float = 0.0
                     ) -> tuple[dict[tuple, float], dict[tuple, tuple[float, ...]]]:
    """For the actions of every overlapped pair, keyed ``(stage, kind, microbatch)``: its
    seconds (where they differ from the action alone) and what holds the rank after it,
    by part of ``HOLD_PARTS`` (where it differs from the action alone: its ep hidden,
    each all-to-all beside the other half's compute slowing it by ``slowdown``)."""
    seconds: dict[tuple, float] = {}
    hold: dict[tuple, tuple[float, ...]] = {}
    if not costs.pairs_overlap:  # one half after the other: each as it is alone
        return seconds, hold
    ep = holds.get("ep", {})
    for rank in range(schedule.pp):
        for forward, backward in schedule.fused_pairs(rank):
            alone_f, alone_b = durations[forward[0], forward[1]], durations[backward[0], backward[1]]
            given = costs.stages[forward.stage].overlap_fb
            if given or not ep:
                pair = costs.overlap_seconds(forward.stage, backward.stage, backward.kind)
                share = alone_f / (alone_f + alone_b) if alone_f + alone_b > 0 else 0.5
                seconds[tuple(forward)], seconds[tuple(backward)] = pair * share, pair * (1 - share)
                uncovered = 0.0
            else:
                all_to_all_f = ep.get((forward.stage, ActionKind.F), 0.0)
                all_to_all_b = ep.get((backward.stage, backward.kind), 0.0)
                uncovered = (exposed_seconds(alone_b, all_to_all_f, slowdown)
                             + exposed_seconds(alone_f, all_to_all_b, slowdown))
            if ep:
                hold[tuple(forward)] = _parts(holds, forward.stage, forward.kind, 0.0)
                hold[tuple(backward)] = _parts(holds, backward.stage, backward.kind, uncovered)
    return seconds, hold


def _parts(holds: Mapping[str, Mapping[tuple[int, str], float]], stage: int, kind: str,
           all_to_all: float) -> tuple[float, ...]:
    """The hold of an action in a pair, by part: its own tp and cp, ``all_to_all`` for ep."""
    return tuple(all_to_all if part == "ep" else holds.get(part, {}).get((stage, kind), 0.0) for part in HOLD_PARTS)
