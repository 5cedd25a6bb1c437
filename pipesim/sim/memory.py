"""Memory per rank over a step: what must fit on each device.

    static   parameters + gradients + optimizer state, by bytes per parameter
             (default mixed-precision Adam: 2 bf16 weights + 2 bf16 gradients +
             12 fp32 optimizer: master weights, momentum and variance = 16 bytes),
             sharded over the ranks that hold each parameter as the ZeRO stage says
             (``pipesim.sim.zero``: stage 1 the optimizer bytes, fp32 master weights
             included; stage 2 the gradients too; stage 3 the weights too): the dp
             replicas (dp x cp with context parallelism), and a stage's routed experts
             over their expert data-parallel group, dp x cp / ep, with expert parallelism
             (under parallel folding tp x cp x dp / (etp x ep): ``ParallelConfig.expert_holders``)
    buffers  2 x the boundary activation per pipeline link, a neighbouring rank in one
             direction (``p2p_links``: receiving activations from a rank, a received
             activation and the gradient sent back; sending to one, the output and the
             gradient coming back), however many stages the rank holds, and, when data
             parallel, one gradient bucket (stages 0-2) or ZeRO-3's gathered working set:
             two layers' parameters (the one computing and the one prefetched) and one
             layer's whole gradient; and the largest ``workspace_bytes`` of its stages,
             what one action holds for a moment (the loss's temporaries on the last
             stage, a fully recomputed layer's rebuilt activations): counted
             throughout, exact where the action runs at the rank's peak (the loss of
             1F1B's and GPipe's last stage, of a one-stage job; every backward under
             full recompute), an upper bound elsewhere
    stash    each stage's ``stash_bytes`` for every microbatch whose forward has started
             and whose last backward piece (B, or W when split) has not ended:
             ``schedules.metrics.stash_changes``, read from the Trace

The parameter count of a stage is its ``params`` when the costs know it (a model spec),
else its ``param_bytes`` over the weights' bytes per parameter (flags and costs files
give bytes in the weights' dtype).

A rank is out of memory when its peak exceeds its device's capacity less the
**headroom** (``--memory-headroom``): what the device holds that is not the model's, by
default the published rule of ``pipesim.sim.headroom`` (the CUDA context, NCCL's buffers
for the communicators the rank joins, the caching allocator's fragmentation), each part
in the per-rank report.

The timeline is a list of ``(time, bytes)`` points at every change. Costs that say
nothing about memory (``Costs.memory_known`` false) get no report: the memory columns
read n/a rather than a made-up 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipesim.model.costs import Costs
from pipesim.sim.headroom import Communicators, Headroom
from pipesim.sim.zero import (
    bytes_per_param_on_device,
    check_zero,
    gather_units,
    gathers_per_layer,
    optimizer_bytes_per_param,
    working_bytes,
)
from schedules import dataflow
from schedules.action import KINDS, ActionKind
from schedules.collector import without_collector
from schedules.metrics import peak_stashes, running_totals, stash_changes
from schedules.trace import Trace, TraceColumns

NO_HEADROOM = Headroom()  # the whole device for the model


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


# AdamW's two moments: bytes per element by --optimizer-moments. FP32 is the default
# (--bytes-per-param's 12 = FP32 master weights + two FP32 moments); DeepSeek-V3 kept them
# in BF16 with FP32 master weights and gradients (report, section 3.3.3)
OPTIMIZER_MOMENTS = {"fp32": 4, "bf16": 2}


def with_optimizer_moments(per_param: BytesPerParam, moments: str) -> BytesPerParam:
    """``per_param`` with AdamW's two moments held as ``moments`` says (``fp32``, as
    ``--bytes-per-param`` counts them, or ``bf16``: 2 bytes each, 4 fewer per parameter);
    a one-line error naming the flags when the optimizer bytes cannot hold two FP32
    moments to narrow."""
    if moments not in OPTIMIZER_MOMENTS:
        raise ValueError(f"--optimizer-moments {moments!r}: use one of {', '.join(OPTIMIZER_MOMENTS)}")
    saved = 2 * (OPTIMIZER_MOMENTS["fp32"] - OPTIMIZER_MOMENTS[moments])
    if saved and per_param.optimizer < 2 * OPTIMIZER_MOMENTS["fp32"]:
        raise ValueError(f"--optimizer-moments {moments} with --bytes-per-param's OPTIMIZER {per_param.optimizer:g}: "
                         "narrowing AdamW's two FP32 moments needs the 8 bytes they take in it (e.g. 2,2,12)")
    return replace(per_param, optimizer=per_param.optimizer - saved)


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
    headroom_bytes: float = 0.0
    headroom_parts: dict | None = None  # pipesim.sim.headroom.Headroom.parts: None when a number overrides the rule
    workspace_bytes: float = 0.0  # of buffer_bytes, what one action holds for a moment (costs' workspace_bytes)

    @property
    def usable_bytes(self) -> float:
        """What the model may use: the capacity less the headroom."""
        return self.capacity_bytes - self.headroom_bytes

    @property
    def oom(self) -> bool:
        return self.peak_bytes > self.usable_bytes

    @property
    def fragmentation_bytes(self) -> float:
        """What the caching allocator holds beyond the peak (the rule's share of it; 0 when
        a number overrides the rule)."""
        return self.peak_bytes * self.headroom_parts["fragmentation_share"] if self.headroom_parts else 0.0

    @property
    def device_bytes(self) -> float | None:
        """What the device holds at the peak by the rule: the peak, the allocator's
        fragmentation, the CUDA context and NCCL's buffers (None when a number overrides it)."""
        if not self.headroom_parts:
            return None
        return (self.peak_bytes + self.fragmentation_bytes + self.headroom_parts["cuda_context_bytes"]
                + sum(self.headroom_parts["nccl_bytes"].values()))


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
    headroom: Headroom = NO_HEADROOM,
    timelines: bool = True,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    pp_net_channels: int = 0,
    microbatch_weight: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
) -> list[RankMemory]:
    """Memory of every rank of the simulated pipeline, from its Trace, sharded as ZeRO
    stage ``zero`` says over the ``dp`` ranks that hold each parameter (the routed
    experts' over ``expert_dp``, default ``dp``), against each device's capacity less
    ``headroom`` for a rank of its communicators (``tp``, the pipeline, ``dp``, ``cp``,
    ``ep``: ``rank_communicators``; ``pp_net_channels``, NCCL's channels per pipeline
    peer when the pipeline spans nodes: ``pipesim.sim.headroom.pipeline_net_channels``);
    without ``timelines`` only the peaks (a planner's verdict); ``microbatch_weight(stage,
    microbatch)`` scales each microbatch's stash (microbatches of unequal sizes, as a run
    cuts a batch they do not divide). Empty when the costs say nothing about memory."""
    if not costs.memory_known:
        return []
    num_ranks = trace.num_ranks
    static, buffers = rank_bases(costs, placement, num_ranks, bytes_per_param, dp, bucket_bytes, zero, expert_dp)
    bases = [static[rank] + buffers[rank] for rank in range(num_ranks)]
    if timelines:
        parts = stash_timelines(trace, costs, bases, microbatch_weight)
    else:
        stash, kept = stash_shares(costs)
        parts = [(float(peak), ()) for peak in peak_stashes(trace.columns, num_ranks, lambda stages: stash[stages],
                                                              lambda stages: kept[stages], microbatch_weight)]
    communicators = rank_communicators(placement, num_ranks, tp, dp, cp, ep, expert_dp, pp_net_channels)
    workspaces = rank_workspaces(costs, placement, num_ranks)  # of the buffers, named in the report
    return [
        RankMemory(rank=rank, device=devices[rank], capacity_bytes=capacities[rank], static_bytes=static[rank],
                   buffer_bytes=buffers[rank], peak_stash_bytes=peak_stash, peak_bytes=bases[rank] + peak_stash,
                   timeline=timeline, headroom_bytes=headroom.of(capacities[rank], communicators[rank]),
                   headroom_parts=headroom.parts(communicators[rank]),
                   workspace_bytes=workspaces[rank])
        for rank, (peak_stash, timeline) in enumerate(parts)
    ]


def rank_bases(costs: Costs, placement: Sequence[int], num_ranks: int, bytes_per_param: BytesPerParam = BytesPerParam(),
               dp: int = 1, bucket_bytes: float = 0.0, zero: int = 0, expert_dp: int | None = None
               ) -> tuple[list[float], list[float]]:
    """Per rank, what it holds whatever the schedule's order: its static bytes (parameters,
    gradients and optimizer state, sharded as ``memory_report`` says) and its buffers (its
    pipeline links' and, when data parallel, its collectives'). The stashes come on top."""
    check_zero(zero)
    static = [0.0] * num_ranks
    for stage, cost in enumerate(costs.stages):
        static[placement[stage]] += static_bytes(cost, bytes_per_param, dp, zero, expert_dp)
    workspaces = rank_workspaces(costs, placement, num_ranks)
    buffers = [p2p_buffer_bytes(costs, placement, rank) + workspaces[rank] for rank in range(num_ranks)]
    if dp > 1:
        buffers = [value + reduction_buffer_bytes(costs, placement, rank, bytes_per_param, bucket_bytes, zero)
                   for rank, value in enumerate(buffers)]
    return static, buffers


def rank_communicators(placement: Sequence[int], num_ranks: int, tp: int = 1, dp: int = 1, cp: int = 1,
                       ep: int = 1, expert_dp: int | None = None, pp_net_channels: int = 0) -> list[Communicators]:
    """Per pipeline rank, the NCCL communicators it joins (``pipesim.sim.headroom``): the
    job's tp, gradient-reduction (``dp``: the ranks that hold each parameter, dp x cp),
    cp and ep groups, the experts' data-parallel group, and the other ranks its stages
    exchange activations with (``schedules.dataflow``'s forward neighbours)."""
    neighbours = [{peer for peer, _ in p2p_links(placement, rank)} for rank in range(num_ranks)]
    return [Communicators(tp=tp, pp_peers=len(peers), dp=dp, cp=cp, ep=ep,
                          expert_dp=dp if expert_dp is None else expert_dp, pp=num_ranks,
                          pp_net_channels=pp_net_channels) for peers in neighbours]


def p2p_links(placement: Sequence[int], rank: int) -> dict[tuple[int, str], list[int]]:
    """The pipeline links of ``rank``: per neighbouring rank and direction (``"in"``: it
    sends ``rank`` activations, ``"out"``: ``rank`` sends it its own), the stages whose
    boundary crosses that link, the lower stage of each (the one whose output it carries).
    Interleaved chunks share their rank's links: every chunk of rank r reads rank r-1's
    outputs over one link."""
    links: dict[tuple[int, str], list[int]] = {}
    for stage, owner in enumerate(placement):
        if owner != rank:
            continue
        source = dataflow.input_from(placement, stage, ActionKind.F)
        if source is not None and placement[source] != rank:
            links.setdefault((placement[source], "in"), []).append(source)
        target = dataflow.output_to(placement, stage, ActionKind.F)
        if target is not None and placement[target] != rank:
            links.setdefault((placement[target], "out"), []).append(stage)
    return links


def p2p_buffer_bytes(costs: Costs, placement: Sequence[int], rank: int) -> float:
    """What ``rank`` holds for its pipeline transfers: per link (``p2p_links``) two of the
    largest boundary activation it carries, one activation and one gradient in flight.

    Per link, not per stage: the schedules post one exchange per neighbour at a time, and
    a tensor is allocated when it is received and freed once used or sent (Megatron-Core,
    ``pipeline_parallel/p2p_communication.py``: ``_communicate`` allocates each receive
    with ``torch.empty``; ``schedules.py``'s ``deallocate_output_tensor`` frees a stage's
    output once sent, keeping only its autograd node), so interleaving v chunks a rank
    does not multiply the buffers by v. A received activation, once its forward runs, is
    the first layer's input, counted in that microbatch's stash."""
    return sum(2 * max(costs.stages[boundary].act_bytes for boundary in boundaries)
               for boundaries in p2p_links(placement, rank).values())


def rank_workspaces(costs: Costs, placement: Sequence[int], num_ranks: int) -> list[float]:
    """Per rank, what it holds for a moment inside one of its actions: the largest
    ``workspace_bytes`` of its stages (one action runs at a time)."""
    workspaces = [0.0] * num_ranks
    for stage, cost in enumerate(costs.stages):
        workspaces[placement[stage]] = max(workspaces[placement[stage]], cost.workspace_bytes)
    return workspaces


def static_bytes(cost, bytes_per_param: BytesPerParam, dp: int, zero: int, expert_dp: int | None = None) -> float:
    """A stage's parameters, gradients and optimizer state on one device: its dense ones
    sharded over ``dp``, its routed experts' over ``expert_dp`` (default ``dp``). Of the
    stage it reads only ``pipesim.model.costs.parameter_figures`` (a planner keeps it
    under them)."""
    params = stage_params(cost.params, cost.param_bytes, bytes_per_param)
    experts = cost.expert_params
    return ((params - experts) * static_bytes_per_param(bytes_per_param, dp, zero)
            + experts * static_bytes_per_param(bytes_per_param, dp if expert_dp is None else expert_dp, zero))


def reduction_buffer_bytes(costs: Costs, placement: Sequence[int], rank: int, bytes_per_param: BytesPerParam,
                           bucket_bytes: float, zero: int) -> float:
    """What a data-parallel rank holds for its collectives: one gradient bucket, or under
    ZeRO-3 the working set of its largest layer (``pipesim.sim.zero.working_bytes``)."""
    if not gathers_per_layer(zero):
        return bucket_bytes
    units = [stage_params(cost.params, cost.param_bytes, bytes_per_param) / gather_units(cost.layers)
             for stage, cost in enumerate(costs.stages) if placement[stage] == rank]
    return working_bytes(max(units, default=0.0), bytes_per_param.weights, bytes_per_param.grads)


def program_order_trace(schedule) -> Trace:
    """The compute actions of ``schedule``'s programs, each rank's one after another in
    program order (action ``i`` of a rank from ``2i`` to ``2i + 1``): a Trace whose stash
    timeline has the simulated step's order without its timing.

    A rank runs its compute actions one after another in program order whatever the
    timing, so the stashes it takes (at a forward's start) and releases (at the last
    backward piece's end) follow that order too, and ``memory_report`` of this Trace
    gives the simulated peak of every rank without simulating: exactly, when every
    forward that takes a stash takes time. (The simulation orders a release before a take
    at the same moment; a release can share its moment with an earlier take only if that
    forward and every action between them took no time. Then the peak here is the higher
    one.) ``tests/test_memory.py`` holds it equal to the simulation for every generator."""
    from schedules.program_arrays import COMPUTE_CODES, program_arrays

    arrays = program_arrays(schedule)
    compute = arrays.kind < len(COMPUTE_CODES)
    start = 2.0 * arrays.position[compute]
    columns = TraceColumns(arrays.rank[compute].astype(np.int64), arrays.kind[compute].astype(np.int64),
                           arrays.stage[compute].astype(np.int64), arrays.microbatch[compute].astype(np.int64),
                           start, start + 1.0, np.zeros(int(compute.sum()), dtype=np.int64), KINDS, ("compute",))
    return Trace(columns=columns, meta={"pp": schedule.pp})


def stash_shares(costs: Costs) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, a microbatch's stash bytes and the share of them it keeps between its
    I and its W (``StageCost.wgrad_stash_share``)."""
    return (np.array([stage.stash_bytes for stage in costs.stages]),
            np.array([stage.wgrad_stash_share for stage in costs.stages]))


def stash_timelines(trace: Trace, costs: Costs, bases: list[float],
                    microbatch_weight: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
                    ) -> list[tuple[float, tuple]]:
    """Per rank: its peak stash bytes and its memory timeline, ``(0.0, base)`` then a
    point at every stash change (changes at one moment merged into the last)."""
    stash, kept = stash_shares(costs)
    rank, time, change = stash_changes(trace.columns, lambda stages: stash[stages], lambda stages: kept[stages],
                                       microbatch_weight)
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
    sharded over ``dp`` as ZeRO stage ``zero`` says (Rajbhandari et al. 2020, Table 1:
    ``pipesim.sim.zero.bytes_per_param_on_device``)."""
    return bytes_per_param_on_device(bytes_per_param.weights, bytes_per_param.grads, bytes_per_param.optimizer,
                                     dp, zero)


def optimizer_step_bytes_per_param(bytes_per_param: BytesPerParam, dp: int = 1, zero: int = 0) -> float:
    """Bytes per parameter the optimizer step passes over on a device
    (``pipesim.sim.zero.optimizer_bytes_per_param``: the replica's shard under ZeRO)."""
    return optimizer_bytes_per_param(bytes_per_param.weights, bytes_per_param.grads, bytes_per_param.optimizer,
                                     dp, zero)


def check_memory(report: list[RankMemory]) -> None:
    """Raise ``OutOfMemoryError`` naming the first rank that does not fit."""
    for rank in report:
        if rank.oom:
            raise OutOfMemoryError(
                f"out of memory: rank {rank.rank} on {rank.device} peaks at {rank.peak_bytes / 1e9:.2f} GB "
                f"(static {rank.static_bytes / 1e9:.2f} GB params+grads+optimizer, "
                f"stash {rank.peak_stash_bytes / 1e9:.2f} GB, buffers {rank.buffer_bytes / 1e9:.2f} GB) "
                f"but the device holds {rank.capacity_bytes / 1e9:.2f} GB"
                + (f", {rank.usable_bytes / 1e9:.2f} GB of it usable after the {rank.headroom_bytes / 1e9:.2f} GB "
                   f"headroom ({headroom_words(rank)}--memory-headroom)" if rank.headroom_bytes else "") + "; "
                "add pipeline/tensor ranks, fewer microbatches in flight (1F1B), sequence parallelism or --zero"
            )


def headroom_words(rank: RankMemory) -> str:
    """The rule's parts for ``rank`` in words, ``"CUDA context 0.45 GB, NCCL 1.01 GB, 3%
    fragmentation; "``, or ``""`` when a number overrides the rule."""
    parts = rank.headroom_parts
    if not parts:
        return ""
    nccl = sum(parts["nccl_bytes"].values())
    return (f"CUDA context {parts['cuda_context_bytes'] / 1e9:.2f} GB, NCCL {nccl / 1e9:.2f} GB, "
            f"{parts['fragmentation_share']:.0%} fragmentation; ")
