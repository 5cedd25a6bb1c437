"""Data- and tensor-parallel communication around the simulated pipeline.

The engine simulates one data-parallel replica's pipeline (pp ranks). Each of its
ranks stands for a tensor-parallel group and a data-parallel group it belongs to, and
pays their collectives:

- tp: Megatron-LM's tensor parallelism does two collectives per layer in the forward
  and two in the input-gradient backward, on the critical path of the compute (the
  next GEMM needs the result). They are charged right after each compute action as a
  ``tp`` event that holds the rank. Without sequence parallelism each is an
  all-reduce of the layer's ``s*b*h`` activation; with it, an all-gather plus a
  reduce-scatter of the same size (the same ring cost, other memory).
- dp: each stage's gradient is all-reduced across the stage's dp group in DDP-style
  buckets, starting when that stage's last backward ends (overlap, the default) or
  after the rank's last action, one stage after another on the rank's ``dp`` stream.
  Gradients are taken to be the size of the parameters (same dtype).
- the optimizer step (``Costs.step_overhead``) follows the rank's last all-reduce.

Collectives are analytical durations (see ``pipesim.collectives``): they do not
reserve links in the engine's link scheduler and so do not contend with P2P traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipesim.collectives import all_gather, all_reduce, bucketed_all_reduce, reduce_scatter
from pipesim.costs import Costs
from pipesim.mapping import DEFAULT_ORDER, RankMapping
from pipesim.memory import BytesPerParam
from pipesim.topology import Topology
from schedules.action import WEIGHT_GRAD_DONE_KINDS, ActionKind
from schedules.schedule import Schedule
from schedules.trace import TraceEvent

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb=25
TP_KIND = "TP"
DP_KIND = "ALLREDUCE_DP"
OPTIMIZER_KIND = "OPTIMIZER"


@dataclass(frozen=True)
class ParallelConfig:
    """How the job around the simulated pipeline is laid out and synchronised:
    ``dp`` replicas, ``tp`` shards per pipeline rank, the rank order onto devices,
    DDP bucket size, whether the gradient all-reduce overlaps the last backward, the
    collective algorithm and the bytes each parameter costs in memory."""

    dp: int = 1
    tp: int = 1
    rank_order: str = DEFAULT_ORDER
    bucket_bytes: float = DDP_BUCKET_BYTES
    overlap_dp: bool = True
    algorithm: str = "ring"
    bytes_per_param: BytesPerParam = BytesPerParam()
    zero: int = 0


@dataclass(frozen=True)
class CommPlan:
    """Seconds the engine charges beyond P2P: ``tp_seconds[stage, kind]`` after each
    compute action, ``dp_seconds[stage]`` for each stage's bucketed gradient
    all-reduce (``dp_buckets[stage]`` buckets)."""

    tp_seconds: dict[tuple[int, str], float] = field(default_factory=dict)
    dp_seconds: dict[int, float] = field(default_factory=dict)
    dp_buckets: dict[int, int] = field(default_factory=dict)
    overlap_dp: bool = True


def comm_plan(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping,
              bucket_bytes: float = DDP_BUCKET_BYTES, overlap_dp: bool = True, algorithm: str = "ring") -> CommPlan:
    """The tp and dp collective costs of every stage on its rank's groups."""
    tp_seconds: dict[tuple[int, str], float] = {}
    dp_seconds: dict[int, float] = {}
    dp_buckets: dict[int, int] = {}
    for stage, cost in enumerate(costs.stages):
        rank = schedule.placement[stage]
        if mapping.tp > 1 and cost.layers and cost.tp_message_bytes:
            group = mapping.tp_group(0, rank)
            if costs.sequence_parallel:
                one = all_gather(topology, group, cost.tp_message_bytes) + reduce_scatter(
                    topology, group, cost.tp_message_bytes)
            else:
                one = all_reduce(topology, group, cost.tp_message_bytes, algorithm)
            per_pass = 2 * cost.layers * one
            if per_pass > 0:
                for kind in (ActionKind.F, ActionKind.B, ActionKind.I):
                    tp_seconds[stage, kind] = per_pass
                # full recompute re-runs the forward, and its collectives, inside the backward
                for kind in (ActionKind.B, ActionKind.I):
                    tp_seconds[stage, kind] += 2 * cost.recompute_layers * one
        if mapping.dp > 1 and cost.param_bytes > 0:
            seconds, buckets = bucketed_all_reduce(
                topology, mapping.dp_group(rank, 0), cost.param_bytes, bucket_bytes, algorithm)
            if seconds > 0:
                dp_seconds[stage] = seconds
                dp_buckets[stage] = buckets
    return CommPlan(tp_seconds, dp_seconds, dp_buckets, overlap_dp)


def step_tail_events(events: list[TraceEvent], num_ranks: int, plan: CommPlan | None,
                     step_overhead: float) -> list[TraceEvent]:
    """The gradient all-reduces (``dp`` stream) and optimizer steps (``step`` stream)
    that end each rank's step, placed after the pipeline events ``events``."""
    if (plan is None or not plan.dp_seconds) and step_overhead <= 0:
        return []
    rank_end = [0.0] * num_ranks
    ready: dict[int, float] = {}  # stage -> end of its last backward (B or W)
    stage_rank: dict[int, int] = {}
    for event in events:
        if event.end > rank_end[event.rank]:
            rank_end[event.rank] = event.end
        finishes_grads = event.stream == "compute" and event.kind in WEIGHT_GRAD_DONE_KINDS
        if finishes_grads and event.end > ready.get(event.stage, -1.0):
            ready[event.stage] = event.end
            stage_rank[event.stage] = event.rank
    tail: list[TraceEvent] = []
    dp_free = list(rank_end) if plan is None or not plan.overlap_dp else [0.0] * num_ranks
    if plan is not None:
        for stage in sorted(plan.dp_seconds, key=lambda stage: (ready.get(stage, 0.0), stage)):
            if stage not in stage_rank:
                continue
            rank = stage_rank[stage]
            start = max(dp_free[rank], ready[stage])
            end = start + plan.dp_seconds[stage]
            tail.append(TraceEvent(rank, f"{stage}{DP_KIND}", DP_KIND, stage, -1, start, end, "dp"))
            dp_free[rank] = end
    for rank in range(num_ranks):
        done = max(rank_end[rank], dp_free[rank] if plan is not None else 0.0)
        if step_overhead > 0:
            tail.append(TraceEvent(rank, OPTIMIZER_KIND, OPTIMIZER_KIND, -1, -1, done, done + step_overhead, "step"))
    return tail
