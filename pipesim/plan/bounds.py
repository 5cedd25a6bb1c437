"""What a layout provably cannot beat, before it is simulated: a lower bound on its step
time, and the least memory any schedule of it holds. The search simulates layouts best
bound first and stops once no bound left can reach the top; layouts whose floor exceeds
the device are rejected without a simulation (``tests/test_plan.py`` holds both to the
simulation of every schedule, with tp, dp and ZeRO).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipesim.model.costs import Costs


def step_lower_bound(costs: Costs, placement: Sequence[int], microbatches: int, split_backward: bool,
                     holds: dict[tuple[int, str], float], gather_seconds: dict[int, float],
                     hop: Callable[[int, int], float], overlapped_pairs: bool = False) -> float:
    """A step time no order of a schedule with this ``placement`` can beat.

    For each pipeline rank r (whose lowest stage is stage r under both the looped and the
    V placement):
    - it cannot start before microbatch 0's forward has crossed stages 0..r-1: their
      forwards, what holds a rank after each (``holds[stage, kind]``: tensor-parallel
      collectives, ZeRO-3's unhidden parameter gathers) and the unloaded transfer of each
      boundary (``hop(source, target)``);
    - it then runs all its work: every microbatch's forward and backward of its stages,
      each with its holds (a split backward's are the full backward's or more: its input
      gradient hides less of the gathers and ends with the same tp collectives);
    - without a split backward its last action is a backward of stage r (any later
      backward of a higher stage would feed one of stage r after it), which then still
      has to cross stages r-1..0; with a split backward the weight gradients may come
      last, so nothing is added;
    - then the optimizer step and, under ZeRO-1 and 2, the parameter all-gathers
      (``gather_seconds``) of the rank that ends the step.
    With overlapped forward-backward pairs of a given cost (``overlap_fb``) the pair may
    undercut F + B: only the step's tail is certain."""
    stages = costs.stages
    if overlapped_pairs:
        return costs.step_overhead
    pp = max(placement) + 1
    forward = [stage.fwd + holds.get((index, "F"), 0.0) for index, stage in enumerate(stages)]
    backward = [stage.bwd + holds.get((index, "B"), 0.0) for index, stage in enumerate(stages)]
    work = [0.0] * pp  # each rank's forwards and backwards of one microbatch, its stages in order
    tail = [0.0] * pp
    for stage, rank in enumerate(placement):
        work[rank] += forward[stage] + backward[stage]
        tail[rank] += gather_seconds.get(stage, 0.0)
    tail = [costs.step_overhead + seconds for seconds in tail]
    best = fill = drain = 0.0  # fill and drain: across stages 0..rank-1, running sums
    for rank in range(pp):
        if rank > 0:
            fill += forward[rank - 1] + hop(rank - 1, rank)
            drain += backward[rank - 1] + hop(rank, rank - 1)
        busy = microbatches * work[rank]
        best = max(best, fill + busy + tail[rank])
        if not split_backward and rank > 0:
            best = max(best, fill + busy + drain + tail[0])
    return best


def memory_floor(costs: Costs, placement: Sequence[int], static_bytes: Callable[[int], float]) -> list[float]:
    """Per rank, the least memory any schedule holds: its stages' parameters, gradients
    and optimizer state (``static_bytes(stage)``) and one microbatch's stash of its
    largest stage."""
    ranks = max(placement) + 1
    static, stash = [0.0] * ranks, [0.0] * ranks
    for stage, rank in enumerate(placement):  # a rank's stages in order, as a sum over them would add
        static[rank] += static_bytes(stage)
        stash[rank] = max(stash[rank], costs.stages[stage].stash_bytes)
    return [static[rank] + stash[rank] for rank in range(ranks)]
