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
- dp: each stage's gradient is reduced across the stage's dp group in buckets of
  ``bucket_bytes``, as DDP and Megatron-LM do. With overlap (the default) a bucket
  starts as soon as it is full during the stage's last backward of the step (the one
  that completes gradient accumulation): gradients appear in reverse layer order, a
  layer's at the end of its share of that backward, so the bucket that completes with
  layer k is ready ``k/L`` of the way through it (continuously in bytes when the stage
  has no layer count). Without overlap (``--no-dp-overlap``) every stage's reduction
  waits for the rank's last action. Buckets of every stage on a rank queue
  first-come first-served on the rank's one dp communicator, as NCCL runs the
  collectives of one communicator in issue order, and as the engine's links serve
  transfers (FIFO, never split). Gradients are taken to be the size of the
  parameters (same dtype).
- ZeRO-1 (``zero=1``, Megatron's distributed optimizer): each bucket is
  reduce-scattered instead of all-reduced (half the ring traffic), and after the
  optimizer step the updated parameters are all-gathered in the same buckets before
  the next step can start (the other half), on the same dp stream.
- the optimizer step (``Costs.step_overhead``) follows the rank's last reduction.

- the other replicas' and shards' P2P transfers (``pipesim.cluster.twins``): each simulated
  send also reserves the links of its twins where their routes meet another
  pipeline's.
- ep and cp: expert parallelism's all-to-alls (``pipesim.sim.expert_parallel``) and
  context parallelism's K/V exchanges (``pipesim.sim.context_parallel``) hold the rank
  after its compute actions, beside the tp collectives. With context parallelism the
  gradients are reduced over dp x cp (every rank holding the same dense shard); with
  expert parallelism the routed experts' share of them over the expert data-parallel
  group (``pipesim.cluster.mapping``), each bucket carrying both shares.

Collectives are analytical durations (see ``pipesim.cluster.collectives``): they do not
reserve links in the engine's link scheduler and so do not contend with P2P traffic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from pipesim.cluster.collectives import all_gather, all_reduce, bucket_sizes, reduce_scatter
from pipesim.cluster.mapping import DEFAULT_ORDER, RankMapping
from pipesim.cluster.topology import Topology
from pipesim.cluster.twins import boundary_rank_pairs, twin_transfers
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.context_parallel import check_cp_comm, cp_collective_seconds
from pipesim.sim.expert_parallel import ep_collective_seconds
from pipesim.sim.memory import BytesPerParam
from schedules.action import WEIGHT_GRAD_DONE_KINDS, ActionKind
from schedules.schedule import Schedule
from schedules.trace import TraceColumns, TraceEvent

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb=25
TP_KIND = "TP"
DP_KIND = "ALLREDUCE_DP"
REDUCE_SCATTER_KIND = "REDUCE_SCATTER_DP"
PARAM_GATHER_KIND = "ALLGATHER_PARAMS"
OPTIMIZER_KIND = "OPTIMIZER"
ZERO_STAGES = (0, 1)


@dataclass(frozen=True)
class ParallelConfig:
    """How the job around the simulated pipeline is laid out and synchronised:
    ``dp`` replicas, ``tp`` shards per pipeline rank, the rank order onto devices,
    DDP bucket size, whether the gradient all-reduce overlaps the last backward, the
    collective algorithm, the bytes each parameter costs in memory and the ZeRO stage
    (0: every replica holds the whole optimizer and all-reduces gradients; 1: the
    optimizer state is sharded over dp, gradients reduce-scattered and parameters
    all-gathered); ``cp`` context-parallel ranks per replica and how they exchange keys
    and values (``cp_comm``), ``ep`` expert-parallel ranks cut from the dp x cp ranks."""

    dp: int = 1
    tp: int = 1
    rank_order: str = DEFAULT_ORDER
    bucket_bytes: float = DDP_BUCKET_BYTES
    overlap_dp: bool = True
    algorithm: str = "ring"
    bytes_per_param: BytesPerParam = BytesPerParam()
    zero: int = 0
    cp: int = 1
    ep: int = 1
    cp_comm: str = "p2p"

    def __post_init__(self) -> None:
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"--zero {self.zero} is not supported: use 0 (all-reduce) or 1 (distributed optimizer)")
        check_cp_comm(self.cp_comm)

    @property
    def gpus(self) -> int:
        """Devices per pipeline rank: every replica's tp shards and cp ranks (ep adds none)."""
        return self.dp * self.cp * self.tp


@dataclass(frozen=True)
class CommPlan:
    """Seconds the engine charges beyond P2P: ``tp_seconds[stage, kind]`` after each
    compute action; per stage, ``dp_bucket_bytes`` (in reduction order, last layer's
    first), the seconds of each bucket's gradient reduction (``dp_bucket_seconds``) and,
    under ZeRO-1, of each bucket's parameter all-gather (``gather_bucket_seconds``)."""

    tp_seconds: dict[tuple[int, str], float] = field(default_factory=dict)
    dp_bucket_bytes: dict[int, tuple[float, ...]] = field(default_factory=dict)
    dp_bucket_seconds: dict[int, tuple[float, ...]] = field(default_factory=dict)
    gather_bucket_seconds: dict[int, tuple[float, ...]] = field(default_factory=dict)
    overlap_dp: bool = True
    zero: int = 0
    stage_layers: dict[int, int] = field(default_factory=dict)
    twin_transfers: dict[tuple[str, str], list[tuple[str, str]]] = field(default_factory=dict)
    ep_seconds: dict[tuple[int, str], float] = field(default_factory=dict)
    cp_seconds: dict[tuple[int, str], float] = field(default_factory=dict)

    @property
    def dp_seconds(self) -> dict[int, float]:
        """Each stage's whole gradient reduction, seconds."""
        return {stage: sum(seconds) for stage, seconds in self.dp_bucket_seconds.items()}


def comm_plan(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping,
              bucket_bytes: float = DDP_BUCKET_BYTES, overlap_dp: bool = True, algorithm: str = "ring",
              zero: int = 0, cp_comm: str = "p2p") -> CommPlan:
    """The tp, ep, cp and dp collective costs of every stage on its rank's groups."""
    bucket_bytes_of: dict[int, tuple[float, ...]] = {}
    reduce_seconds: dict[int, tuple[float, ...]] = {}
    gather_seconds: dict[int, tuple[float, ...]] = {}
    for stage, cost in enumerate(costs.stages):
        group = _dp_group(schedule, stage, mapping)
        if group is None or cost.param_bytes <= 0:
            continue
        sizes = bucket_sizes(cost.param_bytes, bucket_bytes)
        experts = _expert_gradients(schedule, stage, cost, mapping)
        # a stage has thousands of buckets but at most two sizes (full, and the rest): price each size once
        if zero:
            reduce = _per_bucket(sizes, _split_over(experts, partial(reduce_scatter, topology), group))
            gather_seconds[stage] = _per_bucket(sizes, _split_over(experts, partial(all_gather, topology), group))
        else:
            reduce = _per_bucket(sizes, _split_over(experts, partial(all_reduce, topology, algorithm=algorithm),
                                                    group))
        if sum(reduce) > 0:
            bucket_bytes_of[stage] = sizes
            reduce_seconds[stage] = reduce
    layers = {stage: cost.layers for stage, cost in enumerate(costs.stages)}
    return CommPlan(tp_collective_seconds(schedule, costs, topology, mapping, algorithm), bucket_bytes_of,
                    reduce_seconds, gather_seconds, overlap_dp, zero, layers, _twins(schedule, topology, mapping),
                    ep_collective_seconds(schedule, costs, topology, mapping),
                    cp_collective_seconds(schedule, costs, topology, mapping, cp_comm))


def _expert_gradients(schedule: Schedule, stage: int, cost: StageCost,
                      mapping: RankMapping) -> tuple[float, list[str]] | None:
    """(share of the stage's gradient bytes, devices) of its routed experts' gradients
    when expert parallelism reduces them over a group of their own; None otherwise."""
    if mapping.ep == 1 or not cost.expert_params or not cost.params:
        return None
    return cost.expert_params / cost.params, mapping.expert_dp_group(schedule.placement[stage], 0)


def _split_over(experts: tuple[float, list[str]] | None, collective, group: list[str]):
    """``size -> seconds`` of a bucket's collective: over ``group``, or with expert
    parallelism the dense share over ``group`` and the experts' share over theirs (a
    bucket holds both, as the layers' gradients come out mixed)."""
    if experts is None:
        return partial(collective, group)
    share, expert_group = experts
    return lambda size: collective(group, size * (1 - share)) + collective(expert_group, size * share)


def tp_collective_seconds(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping,
                          algorithm: str = "ring") -> dict[tuple[int, str], float]:
    """Seconds of tensor-parallel collectives after each (stage, compute kind)."""
    seconds: dict[tuple[int, str], float] = {}
    if mapping.tp == 1:
        return seconds
    for stage, cost in enumerate(costs.stages):
        if not (cost.layers and cost.tp_message_bytes):
            continue
        group = mapping.tp_group(0, schedule.placement[stage])
        one_pair = partial(_tp_pair, topology, group, costs.sequence_parallel, algorithm)
        one = one_pair(cost.tp_message_bytes)
        experts = 0.0
        if mapping.ep > 1 and cost.moe_layers and cost.dispatch_bytes:
            # Megatron-Core's all-to-all dispatcher: around the experts the tp group gathers and
            # scatters the routed copies its ranks received (tp x one rank's dispatch) instead
            # of the dense MLP's activation
            experts = cost.moe_layers * (one_pair(mapping.tp * cost.dispatch_bytes) - one)
        per_pass = 2 * cost.layers * one + experts
        if per_pass > 0:
            for kind in (ActionKind.F, ActionKind.B, ActionKind.I):
                seconds[stage, kind] = per_pass
            # full recompute re-runs the forward, and its collectives, inside the backward
            for kind in (ActionKind.B, ActionKind.I):
                seconds[stage, kind] += 2 * cost.recompute_layers * one + experts * cost.recompute_layers / cost.layers
    return seconds


def _tp_pair(topology: Topology, group: list[str], sequence_parallel: bool, algorithm: str, message: float) -> float:
    """One of a layer's tp collectives of ``message`` bytes: an all-reduce, or with sequence
    parallelism an all-gather and a reduce-scatter (the same ring cost)."""
    if sequence_parallel:
        return all_gather(topology, group, message) + reduce_scatter(topology, group, message)
    return all_reduce(topology, group, message, algorithm)


def parameter_gather_seconds(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping,
                             bucket_bytes: float = DDP_BUCKET_BYTES) -> dict[int, float]:
    """Under ZeRO, each stage's whole parameter all-gather after the optimizer step
    (``comm_plan``'s per bucket, summed)."""
    totals = {}
    for stage, cost in enumerate(costs.stages):
        group = _dp_group(schedule, stage, mapping)
        if group is not None and cost.param_bytes > 0:
            sizes = bucket_sizes(cost.param_bytes, bucket_bytes)
            totals[stage] = sum(all_gather(topology, group, sizes[first]) * (stop - first)
                                for first, stop in _size_runs(sizes))
    return totals


def _dp_group(schedule: Schedule, stage: int, mapping: RankMapping) -> list[str] | None:
    """The devices that reduce ``stage``'s gradients, None when there is nothing to reduce."""
    if mapping.dp * mapping.cp == 1 or schedule.num_stages <= stage:
        return None
    return mapping.dp_cp_group(schedule.placement[stage], 0)


def _per_bucket(sizes: tuple[float, ...], seconds_of) -> tuple[float, ...]:
    """``tuple(seconds_of(size) for size in sizes)``, calling ``seconds_of`` once per run of
    equal sizes (``bucket_sizes`` gives full buckets and one rest) and building the tuple
    by runs, not element by element: a stage has thousands of buckets."""
    seconds: tuple[float, ...] = ()
    for first, stop in _size_runs(sizes):
        seconds += (seconds_of(sizes[first]),) * (stop - first)
    return seconds


@functools.lru_cache(maxsize=1024)
def _size_runs(sizes: tuple[float, ...]) -> list[tuple[int, int]]:
    """``_runs`` of a stage's bucket sizes, kept: the same few stage sizes recur in every
    layout of a plan, and a stage has thousands of buckets to walk."""
    return _runs(sizes)


def _runs(values: Sequence) -> list[tuple[int, int]]:
    """``(first, stop)`` of each run of equal consecutive values."""
    runs, first = [], 0
    for index in range(1, len(values) + 1):
        if index == len(values) or values[index] != values[first]:
            runs.append((first, index))
            first = index
    return runs


def _twins(schedule: Schedule, topology: Topology, mapping: RankMapping) -> dict:
    """``twin_transfers`` of every (replica, shard) pipeline, kept on the topology per
    mapping and set of rank pairs: it routes every pipeline's transfers, the same work
    for every schedule with the same stage boundaries (a plan simulates thousands)."""
    key = ("twins", mapping.dp, mapping.cp, mapping.pp, mapping.tp, mapping.order, mapping.devices,
           tuple(sorted(boundary_rank_pairs(schedule))))
    cached = topology.pace_cache.get(key)
    if cached is None:
        cached = topology.pace_cache[key] = twin_transfers(schedule, topology, mapping.pipelines())
    return cached


def bucket_ready_fractions(sizes: tuple[float, ...], layers: int) -> list[float]:
    """How far through a stage's last backward each bucket is full (0..1). Gradients
    come out in reverse layer order, each layer's ``1/layers`` of the bytes at the end
    of its ``1/layers`` of the backward; with no layer count, continuously."""
    total = sum(sizes)
    fractions, filled = [], 0.0
    for size in sizes:
        filled += size
        share = min(1.0, filled / total)
        if layers > 0:
            share = math.ceil(share * layers - 1e-9) / layers
        fractions.append(share)
    return fractions


@functools.lru_cache(maxsize=4096)
def _bucket_runs(sizes: tuple[float, ...], layers: int) -> tuple[tuple[float, int, int], ...]:
    """``(fraction, first, stop)`` for each run of buckets ``first..stop-1`` that fill at
    the same fraction of the last backward (``bucket_ready_fractions``). The same for
    every layout whose stages hold as many bytes in as many layers, so kept: a plan
    prices thousands of layouts with a few stage sizes."""
    fractions = bucket_ready_fractions(sizes, layers)  # they only grow with the bucket index
    return tuple((fractions[first], first, stop) for first, stop in _runs(fractions))


def _add_buckets(tail: list[TraceEvent], rank: int, stage: int, kind: str, first: int, seconds: tuple[float, ...],
                 start: float) -> float:
    """One event for buckets ``first``, ``first + 1``, ... of a stage run back to back from
    ``start`` (each starts as the one before ends); returns when the last one ends."""
    end = start + math.fsum(seconds)
    last = first + len(seconds) - 1
    name = f"{stage}{kind}[{first}]" if last == first else f"{stage}{kind}[{first}-{last}]"
    tail.append(TraceEvent(rank, name, kind, stage, -1, start, end, "dp"))
    return end


def _place_runs(tail: list[TraceEvent], stages: list[tuple], dp_free: list[float], kind: str) -> None:
    """Each stage's bucket runs (every bucket as one run without overlap), reduced first
    come, first served per rank from ``dp_free`` (updated), one event per run."""
    runs = []  # (ready, stage, first bucket, seconds of each bucket of the run, rank)
    for stage, rank, start, end, bucket_runs, seconds, rank_end in stages:
        if bucket_runs is not None:
            for fraction, first, stop in bucket_runs:
                runs.append((start + fraction * (end - start), stage, first, seconds[first:stop], rank))
        else:
            runs.append((rank_end, stage, 0, seconds, rank))
    for ready, stage, first, seconds, rank in sorted(runs):
        start = max(dp_free[rank], ready)
        dp_free[rank] = _add_buckets(tail, rank, stage, kind, first, seconds, start)


def _tail_scan(columns: TraceColumns, num_ranks: int) -> tuple[np.ndarray, dict, dict]:
    """Each rank's last end; per stage the (start, end) of its last-ending B or W and the
    rank that ran it."""
    rank_end = np.zeros(num_ranks)
    np.maximum.at(rank_end, columns.rank, columns.end)
    grads = np.flatnonzero(columns.on_stream("compute") & np.isin(
        columns.kind, [columns.kind_code(kind) for kind in WEIGHT_GRAD_DONE_KINDS]))
    order = grads[np.lexsort((columns.end[grads], columns.stage[grads]))]
    last = order[np.r_[columns.stage[order][1:] != columns.stage[order][:-1], True]] if len(order) else order
    last_grad = {int(columns.stage[row]): (float(columns.start[row]), float(columns.end[row])) for row in last}
    stage_rank = {int(columns.stage[row]): int(columns.rank[row]) for row in last}
    return rank_end, last_grad, stage_rank


def step_tail_columns(pipeline: TraceColumns, num_ranks: int, plan: CommPlan | None,
                      step_overhead: float) -> TraceColumns | None:
    """The gradient reductions (``dp`` stream), optimizer steps (``step`` stream) and,
    under ZeRO-1, parameter all-gathers (``dp``) of each rank, placed after the pipeline
    events ``pipeline``; None when the step has none."""
    has_dp = plan is not None and bool(plan.dp_bucket_seconds)
    if not has_dp and step_overhead <= 0:
        return None
    rank_end, last_grad, stage_rank = _tail_scan(pipeline, num_ranks)
    tail: list[TraceEvent] = []
    dp_free = rank_end.tolist() if not has_dp or not plan.overlap_dp else [0.0] * num_ranks
    if has_dp:
        kind = REDUCE_SCATTER_KIND if plan.zero else DP_KIND
        # Buckets are reduced first come, first served per rank. Those of a stage that fill
        # at the same moment (one layer's gradients, or all of them without overlap) run back
        # to back and are one event (``3ALLREDUCE_DP[4-21]``), as the executor records one
        # per stage: a 70B-parameter stage has thousands of 25 MB buckets and a few layers.
        stages = [  # (stage, rank, its last B/W's start and end, its bucket runs, bucket seconds, rank end)
            (stage, stage_rank[stage], *last_grad[stage],
             _bucket_runs(plan.dp_bucket_bytes[stage], plan.stage_layers.get(stage, 0)) if plan.overlap_dp else None,
             seconds, float(rank_end[stage_rank[stage]]))
            for stage, seconds in plan.dp_bucket_seconds.items() if stage in stage_rank
        ]
        _place_runs(tail, stages, dp_free, kind)
    for rank in range(num_ranks):
        done = max(float(rank_end[rank]), dp_free[rank])
        if step_overhead > 0:
            tail.append(TraceEvent(rank, OPTIMIZER_KIND, OPTIMIZER_KIND, -1, -1, done, done + step_overhead, "step"))
            done += step_overhead
        if has_dp and plan.zero:  # every parameter bucket can be gathered once the optimizer step is done
            for stage in sorted(stage for stage, rank_of in stage_rank.items() if rank_of == rank):
                seconds = plan.gather_bucket_seconds.get(stage, ())
                if seconds:
                    done = _add_buckets(tail, rank, stage, PARAM_GATHER_KIND, 0, seconds, done)
    return TraceColumns.from_events(tail) if tail else None
