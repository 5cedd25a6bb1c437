"""What an overlapped forward-backward pair (DualPipeV's ``OVERLAP_F_B``) costs, timed
the way the executor runs it: ``pipesim profile``'s ``overlap_fb``.

The simulator charges a pair ``overlap_fb`` seconds where the costs give it
(``pipesim.model.costs.Costs.overlap_seconds``), else ``F + B``. What overlapping saves
is a property of the model and the machine, so it is measured, not assumed: for each
(forward stage, backward stage) pair a rank's program runs, the forward half on one
lane and the full backward of the other chunk on the other, with the executor's own
lanes (``executor.pair_streams``: two CUDA streams on a GPU, the backward on the stream
its forward ran on; on a CPU one half after the other, as the runtime runs them), from
before the lanes fork to after they join. The pair's seconds over the same profile's
``F + B`` is its factor: about 1 on a CPU (nothing overlaps), below 1 where the
streams overlap.
"""

from __future__ import annotations

import statistics

import torch

from executor.pair_streams import COMPUTE_LANE, PairLanes
from schedules.schedule import Schedule

PAIR_LANES = (1 - COMPUTE_LANE, COMPUTE_LANE)  # (forward, backward): autograd runs the backward where its forward ran


def stage_pairs(schedule: Schedule, rank: int) -> list[tuple[int, int]]:
    """The (forward stage, backward stage) pairs ``rank``'s program overlaps, each once,
    in stage order (DualPipeV: the rank's two chunks, each way round)."""
    return sorted({(forward.stage, backward.stage) for forward, backward in schedule.fused_pairs(rank)})


def time_pair(forward_probe, backward_probe, device: torch.device, now, warmup: int, repeats: int) -> float:
    """Mean seconds of one pair: ``forward_probe``'s forward beside ``backward_probe``'s
    full backward (its forward run untimed before the pair, on the compute stream, as
    the pipeline ran it earlier), timed by ``now`` (``executor.profile.clock_for_compute``)
    over ``repeats`` pairs after ``warmup`` untimed ones."""
    lanes = PairLanes(device)
    forward_lane, backward_lane = PAIR_LANES
    samples = []
    for index in range(warmup + repeats):
        output = backward_probe.forward(backward_probe.input())
        x = forward_probe.input()
        start = now()
        lanes.fork()
        lanes.hand_over([x], forward_lane)
        with lanes.on(forward_lane):
            made = forward_probe.forward(x)
        with lanes.on(backward_lane):
            torch.autograd.backward(output, backward_probe.output_grad)
        lanes.join()
        end = now()
        del made
        if index >= warmup:
            samples.append(end - start)
    return statistics.fmean(samples)


def time_pairs(probes: dict, pairs: list[tuple[int, int]], device: torch.device, now, warmup: int,
               repeats: int) -> dict[int, float]:
    """Seconds of each pair the rank runs, keyed by its forward stage (the stage whose
    ``overlap_fb`` it is)."""
    return {forward: time_pair(probes[forward], probes[backward], device, now, warmup, repeats)
            for forward, backward in pairs}


def pair_factor(pair_seconds: float, forward_seconds: float, backward_seconds: float) -> float:
    """A pair's seconds over its halves' own ``F + B``: 1 when nothing overlaps."""
    alone = forward_seconds + backward_seconds
    return pair_seconds / alone if alone > 0 else 1.0
