"""Memory per rank over a step: what must fit on each device.

    static   parameters + gradients + optimizer state, by bytes per parameter
             (default mixed-precision Adam: 2 bf16 weights + 2 bf16 gradients +
             12 fp32 optimizer: master weights, momentum and variance = 16 bytes);
             with ZeRO-1 (the distributed optimizer) the optimizer bytes, fp32 master
             weights included, are sharded over the dp replicas: / dp (over dp x cp
             with context parallelism, and a stage's routed experts over their expert
             data-parallel group, dp x cp / ep, with expert parallelism)
    buffers  2 x the boundary activation per P2P peer (one for the activation, one for
             its gradient) and one DDP bucket when data parallel
    stash    each stage's ``stash_bytes`` for every microbatch whose forward has started
             and whose last backward piece (B, or W when split) has not ended:
             ``schedules.metrics.stash_changes``, read from the Trace

The parameter count of a stage is its ``params`` when the costs know it (a model spec),
else its ``param_bytes`` over the weights' bytes per parameter (flags and costs files
give bytes in the weights' dtype). The timeline is a list of ``(time, bytes)`` points
at every change. Costs that say nothing about memory (``Costs.memory_known`` false) get
no report: the memory columns read n/a rather than a made-up 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipesim.model.costs import Costs
from schedules.collector import without_collector
from schedules.metrics import running_totals, stash_changes
from schedules.trace import Trace


class OutOfMemoryError(RuntimeError):
    """A plan whose peak memory exceeds a device's capacity (raised on request only)."""


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs: weights (the dtype ``param_bytes`` is counted in),
    gradients and optimizer state."""

    weights: float = 2.0
    grads: float = 2.0
    optimizer: float = 12.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def parse_bytes_per_param(text: str) -> BytesPerParam:
    """``"2,2,12"`` (weights, gradients, optimizer) -> ``BytesPerParam``."""
    try:
        parts = [float(part) for part in text.split(",")]
    except ValueError as error:
        raise ValueError(f"--bytes-per-param {text!r}: expected three numbers WEIGHTS,GRADS,OPTIMIZER") from error
    if not all(math.isfinite(part) for part in parts):
        raise ValueError(f"--bytes-per-param {text!r}: every part must be a finite number")
    if len(parts) != 3 or parts[0] <= 0 or min(parts) < 0:
        raise ValueError(f"--bytes-per-param {text!r}: expected WEIGHTS,GRADS,OPTIMIZER with WEIGHTS > 0, e.g. 2,2,12")
    return BytesPerParam(*parts)


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory: the parts, the peak and the timeline, against its capacity."""

    rank: int
    device: str
    capacity_bytes: float
    static_bytes: float
    buffer_bytes: float
    peak_stash_bytes: float
    peak_bytes: float
    timeline: tuple[tuple[float, float], ...]

    @property
    def oom(self) -> bool:
        return self.peak_bytes > self.capacity_bytes


@without_collector
def memory_report(
    trace: Trace,
    costs: Costs,
    placement: Sequence[int],
    devices: Sequence[str],
    capacities: Sequence[float],
    bytes_per_param: BytesPerParam = BytesPerParam(),
    dp: int = 1,
    bucket_bytes: float = 0.0,
    zero: int = 0,
    expert_dp: int | None = None,
) -> list[RankMemory]:
    """Memory of every rank of the simulated pipeline, from its Trace; ``zero=1`` shards
    the optimizer state over the ``dp`` ranks that hold each parameter (the routed
    experts' over ``expert_dp``, default ``dp``). Empty when the costs say nothing about
    memory."""
    if not costs.memory_known:
        return []
    if zero not in (0, 1):
        raise ValueError(f"--zero {zero}: pipesim models ZeRO stage 0 (none) or 1 (sharded optimizer state)")
    last_stage = costs.num_stages - 1
    num_ranks = trace.num_ranks
    static = [0.0] * num_ranks
    buffers = [0.0] * num_ranks
    per_param = static_bytes_per_param(bytes_per_param, dp, zero)
    per_expert_param = static_bytes_per_param(bytes_per_param, dp if expert_dp is None else expert_dp, zero)
    for stage, cost in enumerate(costs.stages):
        rank = placement[stage]
        params = stage_params(cost.params, cost.param_bytes, bytes_per_param)
        static[rank] += (params - cost.expert_params) * per_param + cost.expert_params * per_expert_param
        if stage > 0 and placement[stage - 1] != rank:
            buffers[rank] += 2 * costs.stages[stage - 1].act_bytes
        if stage < last_stage and placement[stage + 1] != rank:
            buffers[rank] += 2 * cost.act_bytes
    if dp > 1:
        buffers = [value + bucket_bytes for value in buffers]
    bases = [static[rank] + buffers[rank] for rank in range(num_ranks)]
    timelines = stash_timelines(trace, costs, bases)
    return [
        RankMemory(rank=rank, device=devices[rank], capacity_bytes=capacities[rank], static_bytes=static[rank],
                   buffer_bytes=buffers[rank], peak_stash_bytes=peak_stash, peak_bytes=bases[rank] + peak_stash,
                   timeline=timeline)
        for rank, (peak_stash, timeline) in enumerate(timelines)
    ]


def stash_timelines(trace: Trace, costs: Costs, bases: list[float]) -> list[tuple[float, tuple]]:
    """Per rank: its peak stash bytes and its memory timeline, ``(0.0, base)`` then a
    point at every stash change (changes at one moment merged into the last)."""
    stash = np.array([stage.stash_bytes for stage in costs.stages])
    rank, time, change = stash_changes(trace.columns, lambda stages: stash[stages])
    held = running_totals(rank, change)
    ranks = len(bases)
    peaks = np.zeros(ranks)
    if len(held):
        np.maximum.at(peaks, rank, held)
    # the last change of each moment of a rank stands for the moment
    last_of_moment = np.r_[(rank[1:] != rank[:-1]) | (time[1:] != time[:-1]), True] if len(rank) else rank
    bounds = np.searchsorted(rank[last_of_moment], np.arange(ranks + 1))
    times, totals = time[last_of_moment].tolist(), held[last_of_moment].tolist()
    timelines = []
    for owner in range(ranks):
        base = bases[owner]
        points = [(0.0, base)] + [(moment, base + total) for moment, total in
                                  zip(times[bounds[owner]:bounds[owner + 1]], totals[bounds[owner]:bounds[owner + 1]],
                                      strict=True)]
        if len(points) > 1 and points[1][0] == 0.0:  # a change at 0 replaces the starting point
            points.pop(0)
        timelines.append((float(peaks[owner]), tuple(points)))
    return timelines


def stage_params(params: float, param_bytes: float, bytes_per_param: BytesPerParam) -> float:
    """Parameters of a stage on one device: its count if known, else its weight bytes over
    the weights' bytes per parameter."""
    return params if params > 0 else param_bytes / bytes_per_param.weights


def static_bytes_per_param(bytes_per_param: BytesPerParam, dp: int = 1, zero: int = 0) -> float:
    """Bytes each parameter holds on a device: weights + gradients + optimizer state,
    the optimizer's share / dp under ZeRO-1 (Rajbhandari et al. 2020, P_os)."""
    optimizer = bytes_per_param.optimizer / dp if zero >= 1 else bytes_per_param.optimizer
    return bytes_per_param.weights + bytes_per_param.grads + optimizer


def check_memory(report: list[RankMemory]) -> None:
    """Raise ``OutOfMemoryError`` naming the first rank that does not fit."""
    for rank in report:
        if rank.oom:
            raise OutOfMemoryError(
                f"out of memory: rank {rank.rank} on {rank.device} peaks at {rank.peak_bytes / 1e9:.2f} GB "
                f"(static {rank.static_bytes / 1e9:.2f} GB params+grads+optimizer, "
                f"stash {rank.peak_stash_bytes / 1e9:.2f} GB, buffers {rank.buffer_bytes / 1e9:.2f} GB) "
                f"but the device holds {rank.capacity_bytes / 1e9:.2f} GB; "
                "add pipeline/tensor ranks, fewer microbatches in flight (1F1B), or sequence parallelism"
            )
