"""Data- and tensor-parallel communication around the simulated pipeline.

The engine simulates one data-parallel replica's pipeline (pp ranks). Each of its
ranks stands for a tensor-parallel group and a data-parallel group it belongs to, and
pays their collectives:

- tp: Megatron-LM's tensor parallelism does two collectives per layer in the forward
  and two in the input-gradient backward, on the critical path of the compute (the
  next GEMM needs the result). They are charged right after each compute action as a
  ``tp`` event that holds the rank. Without sequence parallelism each is an
  all-reduce of the layer's ``s*b*h`` activation; with it, an all-gather plus a
  reduce-scatter of the same size (the same ring cost, other memory), run beside the
  GEMMs unless ``overlap_tp`` is off (``tp_collective_seconds``).
- dp: each stage's gradient is reduced across the stage's dp group in buckets of
  ``bucket_bytes``, as DDP and Megatron-LM do. With overlap (the default) a bucket
  starts as soon as it is full during the stage's last backward of the step (the one
  that completes gradient accumulation): gradients appear in reverse layer order, a
  layer's at the end of its share of that backward, so the bucket that completes with
  layer k is ready ``k/L`` of the way through it (continuously in bytes when the stage
  has no layer count). Without overlap (``--no-dp-overlap``) every stage's reduction
  waits for the rank's step end. The reductions run in the engine's walk, on each rank's
  dp channel (``schedules.dp_channel``): issued as the rank runs the backward, served in
  issue order as NCCL runs the collectives of one communicator, each holding the links
  its ring crosses (``pipesim.cluster.collectives.links_crossed``) for its closed-form
  seconds, so a reduction and a P2P transfer that share a link (a GPU's NIC or NVLink
  port) delay each other, first come first served. Gradients are taken to be the size
  of the parameters (same dtype).
- ZeRO-1 (``zero=1``, Megatron's distributed optimizer): each bucket is
  reduce-scattered instead of all-reduced (half the ring traffic), and after the
  optimizer step the updated parameters are all-gathered in the same buckets (the
  other half), on the same dp channel: with ``overlap_param_gather`` (the default) under
  the next step's first forwards, in the engine's walk (``parameter_gathers``: the step is
  periodic, so they run from the step's start and its first forwards wait for them), or
  after the optimizer, before the next step can start.
- ZeRO-2 (``zero=2``): as ZeRO-1, but every backward's buckets are reduce-scattered, each
  microbatch's, since a replica keeps only its shard of the gradient
  (``pipesim.sim.zero``).
- ZeRO-3 / FSDP (``zero=3``): each layer's parameters are all-gathered before its
  forward and again before its backward (B, or each of I and W when split), in the engine's walk
  (``layer_gathers``): issued on the rank's dp channel when it reaches the action, in
  channel order with the reductions and holding their ring's links, the action waiting
  for its first layer's gather and each later layer for what of its gather did not fit
  under the layer before (on a free channel ``pipesim.sim.zero.exposed_gather_seconds``,
  FSDP's one-ahead prefetch). Each layer's gradient is reduce-scattered on the dp
  channel as its backward (B, or W) produces it, every microbatch; nothing is gathered
  after the optimizer step. With ``zero3_collectives`` ``in-costs`` neither is charged:
  the costs' actions already hold them (``pipesim.sim.zero``, FSDP2 on gloo).
- the optimizer step (``Costs.step_overhead``) follows the rank's last reduction, and
  the slowdown the reductions beside the compute cost it (``pipesim.sim.comm_overlap``);
  before it, the two ranks holding a tied embedding table's copies (``Costs.embedding_sums``)
  all-reduce its gradient once both are done (``embedding_sum_seconds``), as Megatron-LM's
  ``finalize_model_grads`` does after the data-parallel reductions; then, with gradient
  clipping (``Costs.grad_norm_overhead``), every rank's norm summed over all of them.

- the other replicas' and shards' P2P transfers (``pipesim.cluster.twins``): each simulated
  send also reserves the links of its twins where their routes meet another
  pipeline's.
- ep and cp: expert parallelism's all-to-alls (``pipesim.sim.expert_parallel``) and
  context parallelism's K/V exchanges (``pipesim.sim.context_parallel``) hold the rank
  after its compute actions, beside the tp collectives. With context parallelism the
  gradients are reduced over dp x cp (every rank holding the same dense shard); with
  expert parallelism the routed experts' share of them over the expert data-parallel
  group (``pipesim.cluster.mapping``), each bucket carrying both shares.

Collectives are analytical durations (see ``pipesim.cluster.collectives``). The gradient
reductions, the parameter all-gathers under the next step's forwards and ZeRO-3's
per-layer gathers also hold their links in the engine's walk (above); the optimizer
step and the parameter all-gathers after it (without the overlap) are placed from the
walk's moments (they reserve no links), and the tp, ep and cp collectives hold the
rank, not links.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import numpy as np

from pipesim.cluster.collectives import all_gather, all_reduce, bucket_runs, links_crossed, listed, reduce_scatter
from pipesim.cluster.mapping import DEFAULT_ORDER, RankMapping
from pipesim.cluster.topology import Topology
from pipesim.cluster.twins import boundary_rank_pairs, twin_transfers
from pipesim.model.costs import Costs, StageCost
from pipesim.model.tp_windows import backward_windows
from pipesim.sim.comm_overlap import OVERLAP_SLOWDOWN, check_slowdown, exposed_seconds, slowed_by
from pipesim.sim.context_parallel import check_cp_comm, cp_collective_seconds
from pipesim.sim.expert_parallel import ep_collective_seconds
from pipesim.sim.headroom import DEFAULT_HEADROOM, Headroom, parse_headroom
from pipesim.sim.memory import BytesPerParam
from pipesim.sim.zero import (
    ZERO3_OVERLAPPED,
    charges_collectives,
    check_zero,
    check_zero3_collectives,
    gather_units,
    gathers_after_optimizer,
    gathers_per_layer,
    reduces_every_backward,
)
from schedules.accounting import GRAD_NORM_ALLREDUCE
from schedules.action import KINDS, WEIGHT_GRAD_DONE_KINDS, ActionKind
from schedules.dp_channel import AT_ACTION, AT_STEP_START, Reductions
from schedules.engine import StepRun
from schedules.schedule import Schedule
from schedules.trace import LazyNames, TraceColumns, TraceEvent

T = TypeVar("T")

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb=25
TP_KIND = "TP"
DP_KIND = "ALLREDUCE_DP"
REDUCE_SCATTER_KIND = "REDUCE_SCATTER_DP"
PARAM_GATHER_KIND = "ALLGATHER_PARAMS"
OPTIMIZER_KIND = "OPTIMIZER"
EMBEDDING_SUM_KIND = "EMBEDDING_ALLREDUCE"  # a tied table's two copies' gradients summed (as the executor names it)
GRAD_NORM_KIND = GRAD_NORM_ALLREDUCE  # --clip-grad: the squares summed over every rank (as the executor names it)
DP_SLOWDOWN_KIND = "DP_SLOWDOWN"  # what the reductions beside the compute slowed it by


@dataclass(frozen=True)
class ParallelConfig:
    """How the job around the simulated pipeline is laid out and synchronised:
    ``dp`` replicas, ``tp`` shards per pipeline rank, the rank order onto devices,
    DDP bucket size, whether the gradient all-reduce overlaps the last backward, the
    collective algorithm, the bytes each parameter costs in memory, the ZeRO stage
    (``pipesim.sim.zero``: 0 all-reduce, 1 optimizer state sharded over dp, 2 gradients
    too, 3 parameters too), the memory each device keeps back (``memory_headroom``);
    ``cp`` context-parallel ranks per replica and how they exchange keys and values
    (``cp_comm``), ``ep`` expert-parallel ranks cut from the dp x cp ranks (under parallel
    folding, ``etp`` other than 0 or tp, from the stage's tp x cp x dp). What runs
    beside the compute (``pipesim.sim.comm_overlap``): the tp collectives with sequence
    parallelism (``overlap_tp``, Megatron-Core's ``--tp-comm-overlap``), the parameter
    all-gathers of ZeRO-1 and 2 with the next step's forwards (``overlap_param_gather``,
    ``--overlap-param-gather``), and the share compute slows by while a collective runs
    beside it (``overlap_slowdown``); under ZeRO-3, whether its gathers and reduce-scatters
    run beside the compute or are already in the actions' costs (``zero3_collectives``,
    ``pipesim.sim.zero``)."""

    dp: int = 1
    tp: int = 1
    rank_order: str = DEFAULT_ORDER
    bucket_bytes: float = DDP_BUCKET_BYTES
    overlap_dp: bool = True
    algorithm: str = "ring"
    bytes_per_param: BytesPerParam = BytesPerParam()
    zero: int = 0
    memory_headroom: Headroom = parse_headroom(DEFAULT_HEADROOM)
    cp: int = 1
    ep: int = 1
    etp: int = 0  # the experts' own tensor parallelism under parallel folding (pipesim.cluster.mapping); 0: tp
    cp_comm: str = "p2p"
    overlap_tp: bool = True
    overlap_param_gather: bool = True
    overlap_slowdown: float = OVERLAP_SLOWDOWN
    zero3_collectives: str = ZERO3_OVERLAPPED

    def __post_init__(self) -> None:
        check_zero(self.zero)
        check_zero3_collectives(self.zero3_collectives, self.zero)
        check_cp_comm(self.cp_comm)
        check_slowdown(self.overlap_slowdown)

    @property
    def gpus(self) -> int:
        """Devices per pipeline rank: every replica's tp shards and cp ranks (ep adds none)."""
        return self.dp * self.cp * self.tp

    def expert_holders(self, holders: int) -> int:
        """Of ``holders`` ranks that hold each dense parameter of a stage (its dp x cp
        replicas, times the model's copies), how many hold each routed expert's: ``1 / ep``
        of them, and under parallel folding ``tp / etp`` times that (the experts are split
        over ``etp`` ranks of the stage's ``tp x cp x dp``). ZeRO shards the experts' state
        over them (Megatron-Core's expert data-parallel group)."""
        return holders * self.tp // ((self.etp or self.tp) * self.ep)


@dataclass(frozen=True)
class CommPlan:
    """Seconds the engine charges beyond P2P: ``tp_seconds[stage, kind]`` after each
    compute action; per stage, ``dp_bucket_bytes`` (in reduction order, last layer's
    first; under ZeRO-3 one per layer), the seconds of each bucket's gradient reduction
    (``dp_bucket_seconds``) and, under ZeRO-1 and 2, of each bucket's parameter
    all-gather after the optimizer (``gather_bucket_seconds``). Under ZeRO-3,
    ``layer_gather_seconds[stage, kind]``: each layer's parameter gather before a compute
    action of that kind (``layer_gathers``).
    ``overlap_param_gather``: ZeRO-1 and 2's gathers run under the next step's forwards;
    ``overlap_slowdown``: what a collective beside the compute costs it
    (``pipesim.sim.comm_overlap``). ``dp_links[stage]``: the links the stage's gradient
    reductions cross (its dp group's ring, and its experts' group's), held while each runs."""

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
    layer_gather_seconds: dict[tuple[int, str], tuple[float, ...]] = field(default_factory=dict)
    overlap_param_gather: bool = True
    overlap_slowdown: float = OVERLAP_SLOWDOWN
    dp_links: dict[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    @property
    def dp_seconds(self) -> dict[int, float]:
        """Each stage's whole gradient reduction (of one backward under ZeRO-2 and 3), seconds."""
        return {stage: sum(seconds) for stage, seconds in self.dp_bucket_seconds.items()}


def comm_plan(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping,
              bucket_bytes: float = DDP_BUCKET_BYTES, overlap_dp: bool = True, algorithm: str = "ring",
              zero: int = 0, cp_comm: str = "p2p", overlap_tp: bool = True, overlap_param_gather: bool = True,
              slowdown: float = OVERLAP_SLOWDOWN, zero3_collectives: str = ZERO3_OVERLAPPED) -> CommPlan:
    """The tp, ep, cp and dp collective costs of every stage on its rank's groups, with
    what runs beside the compute as ``ParallelConfig`` says (``overlap_tp``,
    ``overlap_param_gather``, ``slowdown``); no dp collective where their time is in the
    costs (ZeRO-3's ``in-costs``, ``pipesim.sim.zero.charges_collectives``)."""
    check_zero(zero)
    check_zero3_collectives(zero3_collectives, zero)
    check_slowdown(slowdown)
    charged = charges_collectives(zero, zero3_collectives)
    bucket_bytes_of: dict[int, tuple[float, ...]] = {}
    reduce_seconds: dict[int, tuple[float, ...]] = {}
    gather_seconds: dict[int, tuple[float, ...]] = {}
    action_gathers = layer_gathers(schedule, costs, topology, mapping) if charged and gathers_per_layer(zero) else {}
    reduction = gradient_reduction(zero, algorithm)
    links_of: dict[int, tuple[tuple[str, str], ...]] = {}
    for stage, cost in enumerate(costs.stages):
        group = stage_dp_group(schedule, stage, mapping)
        if not charged or group is None or cost.param_bytes <= 0:
            continue
        experts = _expert_gradients(schedule, stage, cost, mapping)
        sizes = listed(gradient_buckets(cost, zero, bucket_bytes))
        # a stage has thousands of buckets but at most two sizes (full, and the rest): price each size once
        reduce = _per_bucket(sizes, _split_over(experts, partial(reduction, topology), group))
        if gathers_after_optimizer(zero):
            gather_seconds[stage] = _per_bucket(sizes, _split_over(experts, partial(all_gather, topology), group))
        if sum(reduce) > 0:
            bucket_bytes_of[stage] = sizes
            reduce_seconds[stage] = reduce
            # DualPipe: a model stage's two copies reduce in one collective over both copies'
            # holders, which holds its links once: on copy 0's stage (copy 1's rank takes its
            # part on its dp channel, at the same moment by the schedule's mirror symmetry)
            if stage < schedule.copy_stages:
                links_of[stage] = _reduction_links(topology, group, experts, "ring" if zero else algorithm)
    layers = {stage: cost.layers for stage, cost in enumerate(costs.stages)}
    return CommPlan(tp_collective_seconds(schedule, costs, topology, mapping, algorithm, overlap_tp, slowdown),
                    bucket_bytes_of, reduce_seconds, gather_seconds, overlap_dp, zero, layers,
                    _twins(schedule, topology, mapping), ep_collective_seconds(schedule, costs, topology, mapping),
                    cp_collective_seconds(schedule, costs, topology, mapping, cp_comm, slowdown),
                    layer_gather_seconds=action_gathers,
                    overlap_param_gather=overlap_param_gather, overlap_slowdown=slowdown, dp_links=links_of)


def _reduction_links(topology: Topology, group: list[str], experts: tuple[float, list[str]] | None,
                     algorithm: str) -> tuple[tuple[str, str], ...]:
    """The links a stage's gradient reduction holds: those its collective crosses over
    ``group`` and, with expert parallelism, over its experts' group (a bucket holds both
    shares: ``_split_over``)."""
    links = links_crossed(topology, group, algorithm)
    if experts is None:
        return links
    return tuple(dict.fromkeys(links + links_crossed(topology, experts[1], algorithm)))


def gradient_reductions(plan: CommPlan | None, link_numbers: dict[tuple[str, str], int]) -> Reductions | None:
    """The plan's gradient reductions as the engine's walk runs them on each rank's dp
    channel (``schedules.dp_channel.Reductions``): per stage its runs of buckets that fill
    together (``_stage_runs``: their fraction of the backward, each bucket's seconds) and the links
    they hold, numbered in ``link_numbers`` (the P2P wires' numbering, extended here) so
    that reductions and transfers on one link contend; with ``overlap_param_gather``, the
    parameter all-gathers the next step's forwards wait for (``parameter_gathers``); under
    ZeRO-3 each action's per-layer gathers (``layer_gathers``). None when the step has none."""
    if plan is None or not plan.dp_bucket_seconds:
        return None
    runs = {stage: tuple((fraction, plan.dp_bucket_seconds[stage][first:last + 1])
                         for fraction, first, last, _ in _stage_runs(plan, stage))
            for stage in plan.dp_bucket_seconds}
    links = {stage: tuple(link_numbers.setdefault(link, len(link_numbers)) for link in plan.dp_links.get(stage, ()))
             for stage in runs}
    return Reductions(runs, links, reduces_every_backward(plan.zero), plan.overlap_dp, parameter_gathers(plan),
                      plan.layer_gather_seconds)


def parameter_gathers(plan: CommPlan) -> dict[int, tuple[float, ...]]:
    """Under ZeRO-1 and 2 with ``overlap_param_gather`` (Megatron-Core's
    ``--overlap-param-gather``), per stage that reduces, the seconds of each of its layers'
    parameter all-gathers (``gather_units`` of them, the stage's buckets' seconds shared
    evenly): what the engine's walk runs on the rank's dp channel from the step's start,
    the stage's first forward waiting for them (``schedules.dp_channel``). Empty otherwise:
    without the overlap the gathers follow the optimizer (``step_tail_columns``)."""
    if not plan.overlap_param_gather:
        return {}
    gathers = {}
    for stage, seconds in plan.gather_bucket_seconds.items():
        if stage in plan.dp_bucket_seconds and seconds:
            units = gather_units(plan.stage_layers.get(stage, 0))
            gathers[stage] = (math.fsum(seconds) / units,) * units
    return gathers


def reduction_columns(step: StepRun, plan: CommPlan | None) -> TraceColumns | None:
    """The collectives the engine's walk ran on the ranks' dp channels, one ``dp`` event
    each: a gradient reduction per run of buckets (``3ALLREDUCE_DP[4-21]``: stage, kind,
    buckets) and a parameter all-gather per layer (``3ALLGATHER_PARAMS[L2]``: stage, kind,
    its layer; under ZeRO-3 its microbatch is the action's), listed by stage, then by the
    row that issued it (gathers before the reductions of their row); None when there are none."""
    channels = step.channels
    if plan is None or channels is None or not channels.count:
        return None
    ranks = np.repeat(np.arange(step.program.ranks), np.diff(channels.channel_start))
    ran = ~np.isnan(step.collective_end)
    gathering = (channels.mode == AT_STEP_START) | (channels.mode == AT_ACTION)
    order = np.lexsort((channels.run, ~gathering, channels.row, channels.stage))
    order = order[ran[order]]
    kind = REDUCE_SCATTER_KIND if plan.zero else DP_KIND
    gathers = gathering[order].astype(np.int64)  # codes into (kind, PARAM_GATHER_KIND)
    stages, runs, microbatches = channels.stage[order], channels.run[order], channels.microbatch[order]
    # ZeRO-3's: the kind of the action each gathered for (-1: none)
    issuing_kind = step.program.compute_kind[np.maximum(channels.row[order], 0)]
    for_kind = np.where(channels.mode[order] == AT_ACTION, issuing_kind, -1)
    return TraceColumns(ranks[order].astype(np.int64), gathers, stages.astype(np.int64),
                        microbatches.astype(np.int64), step.collective_start[order],
                        step.collective_end[order], np.zeros(len(order), dtype=np.int64), (kind, PARAM_GATHER_KIND),
                        ("dp",), LazyNames(len(order), partial(_run_names, plan, kind, stages, runs, gathers,
                                                               for_kind, microbatches)))


def gradient_reduction(zero: int, algorithm: str = "ring"):
    """The collective a bucket of gradients is reduced with, ``(topology, group, bytes) ->
    seconds``: an all-reduce (by ``algorithm``) without ZeRO, a reduce-scatter under any
    ZeRO stage (each replica keeps the shard it updates)."""
    return reduce_scatter if zero else partial(all_reduce, algorithm=algorithm)


def gradient_buckets(cost: StageCost, zero: int, bucket_bytes: float) -> tuple[tuple[float, int], ...]:
    """``(bytes, count)`` of the buckets a stage's gradient is reduced in, in reduction
    order: one per layer under ZeRO-3 (each layer's gradient as its backward produces
    it), else full buckets of ``bucket_bytes`` and the rest (``bucket_runs``)."""
    if cost.param_bytes <= 0:
        return ()
    if gathers_per_layer(zero):
        units = gather_units(cost.layers)
        return ((cost.param_bytes / units, units),)
    return bucket_runs(cost.param_bytes, bucket_bytes)


def gradient_reduction_seconds(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping,
                               bucket_bytes: float = DDP_BUCKET_BYTES, algorithm: str = "ring",
                               zero: int = 0) -> dict[int, float]:
    """Each stage's reduction of one backward's gradients over its dp group, every bucket
    (``comm_plan``'s ``dp_seconds``, priced per bucket size as it prices them): what a
    planner's bound charges a rank's one dp stream, once per step or, under ZeRO-2 and
    3, once per microbatch."""
    reduction = gradient_reduction(zero, algorithm)

    def total(stage: int, cost: StageCost) -> float | None:
        if not _reduces(schedule, stage, mapping) or cost.param_bytes <= 0:
            return None
        return sum(count * _dp_collective(reduction, topology, mapping, schedule, stage, cost, size)
                   for size, count in gradient_buckets(cost, zero, bucket_bytes))

    return {stage: seconds for stage, seconds in enumerate(_per_alike_stage(schedule, costs, total))
            if seconds is not None}


def layer_gathers(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping
                  ) -> dict[tuple[int, str], tuple[float, ...]]:
    """ZeRO-3: per (stage, compute kind), the seconds of each of its layers' parameter
    gathers before such an action (``gather_units`` of them, the stage's parameters shared
    evenly): what the engine's walk runs on the rank's dp channel as the rank reaches the
    action (``schedules.dp_channel``). A forward gathers every layer, a backward (B) again,
    and a split one in both halves: I, and W too, since FSDP frees a layer's parameters
    after I and a norm's weight-gradient kernel reads its weight (LayerNorm's does;
    ``executor.fsdp``). A layer's routed experts are gathered over their own group
    under expert parallelism."""
    def gathers(stage: int, cost: StageCost) -> tuple[float, ...] | None:
        if not _reduces(schedule, stage, mapping) or cost.param_bytes <= 0:
            return None
        units = gather_units(cost.layers)
        return (_dp_collective(all_gather, topology, mapping, schedule, stage, cost, cost.param_bytes / units),) * units

    return {(stage, kind): layers for stage, layers in enumerate(_per_alike_stage(schedule, costs, gathers))
            if layers is not None for kind in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)}


def _per_alike_stage(schedule: Schedule, costs: Costs, value_of: Callable[[int, StageCost], T]) -> list[T]:
    """``value_of(stage, its cost)`` of every stage, in stage order, called once per stage
    object and rank: it must read the stage only for its rank. ``model_costs`` shares one
    object between alike stages, so most of a deep model's stages on a rank are priced
    once, not each (a plan prices thousands of layouts' stages)."""
    stages = costs.stages
    firsts, index = _alike_stages(tuple(map(id, stages)), tuple(schedule.placement))
    values = [value_of(stage, stages[stage]) for stage in firsts]
    return list(map(values.__getitem__, index))


@functools.lru_cache(maxsize=4096)
def _alike_stages(objects: tuple[int, ...], placement: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """``_per_alike_stage``'s grouping, kept per stage objects and placement (a plan prices
    the same costs on the same placement for several collectives and layouts): the first
    stage of each (object, rank) pair in stage order, and each stage's pair by its place
    among them. A pure function of the ids' pattern of equality, so an id that a later
    object reuses cannot make it wrong."""
    place: dict[tuple[int, int], int] = {}
    firsts, index = [], []
    for stage, key in enumerate(zip(objects, placement, strict=True)):
        at = place.get(key)
        if at is None:
            at = place[key] = len(firsts)
            firsts.append(stage)
        index.append(at)
    return firsts, index


def _expert_gradients(schedule: Schedule, stage: int, cost: StageCost,
                      mapping: RankMapping) -> tuple[float, list[str]] | None:
    """(share of the stage's gradient bytes, devices) of its routed experts' gradients
    when expert parallelism reduces them over a group of their own; None otherwise."""
    if not _experts_apart(mapping) or not cost.expert_params or not cost.params:
        return None
    # with copies of the model (DualPipe), each copy's holders of these experts too
    ranks = [schedule.placement[copy * schedule.copy_stages + stage % schedule.copy_stages]
             for copy in range(schedule.copies)]
    return cost.expert_params / cost.params, [device for rank in ranks for device in mapping.expert_dp_group(rank, 0)]


def _experts_apart(mapping: RankMapping) -> bool:
    """Whether the routed experts' gradients are reduced over groups of their own: under
    expert parallelism, or parallel folding's own expert tensor parallelism."""
    return mapping.ep > 1 or mapping.folded


def _split_over(experts: tuple[float, list[str]] | None, collective, group: list[str]):
    """``size -> seconds`` of a bucket's collective: over ``group``, or with expert
    parallelism the dense share over ``group`` and the experts' share over theirs (a
    bucket holds both, as the layers' gradients come out mixed)."""
    if experts is None:
        return partial(collective, group)
    share, expert_group = experts
    return lambda size: collective(group, size * (1 - share)) + collective(expert_group, size * share)


def tp_collective_seconds(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping,
                          algorithm: str = "ring", overlap: bool = True,
                          slowdown: float = OVERLAP_SLOWDOWN) -> dict[tuple[int, str], float]:
    """Seconds of tensor-parallel collectives after each (stage, compute kind).

    With sequence parallelism and ``overlap`` (Megatron-Core's ``--tp-comm-overlap``,
    torch's async TP: both need sequence parallelism) a layer's all-gathers and
    reduce-scatters run beside the GEMMs they feed and follow, each beside its own
    (``pipesim.model.tp_windows``; ``_paired_tp_exposure``): only
    ``pipesim.sim.comm_overlap.exposed_seconds(gemms, collective, slowdown)`` of each holds
    the rank. Costs that do not give the GEMMs (a costs file without ``tp_window_*``) hide
    a layer's collectives under its whole compute outside the attention core in that pass.
    Without sequence parallelism the all-reduces are on the critical path whole, as
    Megatron runs them. A backward's ``tp_regathers`` (the executor's sequence shards
    gathered again before each sublayer's backward) hold the rank whole in either mode:
    the executor waits for each before the backward reads it; its ``tp_async_regathers``
    (Megatron's) run beside the input-gradient product each precedes, in either mode."""
    seconds: dict[tuple[int, str], float] = {}
    if mapping.tp == 1:
        return seconds
    overlapped = overlap and costs.sequence_parallel

    def held(stage: int, cost: StageCost) -> tuple[float, float, float] | None:
        """(after the forward, after a full backward, after an input-gradient backward) of
        the stage on its rank, None if nothing."""
        if not (cost.layers and cost.tp_message_bytes):
            return None
        rank = schedule.placement[stage]
        one = _tp_collective(topology, mapping, rank, costs.sequence_parallel, algorithm, cost.tp_message_bytes)
        experts = 0.0
        routes_apart = cost.dispatch_bytes or (mapping.folded and mapping.expert_tp == 1)
        if (mapping.ep > 1 or mapping.folded) and cost.moe_layers and routes_apart and not cost.moe_tp_dense:
            # Megatron-Core's all-to-all dispatcher: around the experts the expert tensor-parallel
            # group (the tp group unless parallel folding gives the experts their own) gathers and
            # scatters the routed copies its ranks received (etp x one rank's dispatch) instead
            # of the dense MLP's activation; at the combine's BF16 size, as Megatron-Core (the
            # stack that runs ep beside tp) dispatches in BF16. Under folding with etp 1 the
            # routed experts run no tensor-parallel collective at all. Shared experts (``moe_shared``)
            # run the dense MLP's pair besides, on the tp group. A block that runs the dense MLP's
            # pair instead (``moe_tp_dense``: pipesim's executor without sequence parallelism,
            # whose router reads the gathered sequence) is charged as one
            routed = cost.all_to_all_bytes[1]
            experts = cost.moe_layers * (_expert_tp_collective(topology, mapping, rank, costs.sequence_parallel,
                                                               algorithm, mapping.expert_tp * routed)
                                         - one * (1 - cost.moe_shared))
        per_pass = 2 * cost.layers * one + experts
        if not per_pass > 0:
            return None
        # full recompute re-runs the forward, and its collectives, inside the backward; per-op
        # checkpointing the collectives whose outputs it does not save (recomputed_tp_pairs)
        backward = per_pass + ((2 * cost.recompute_layers + cost.recomputed_tp_pairs) * one
                               + experts * cost.recompute_layers / cost.layers)
        # the sublayers' inputs gathered again before their backward, each waited for (an all-gather:
        # half the pair's ring cost)
        regathered = cost.layers * cost.tp_regathers * one / 2
        layers = cost.layers
        if not overlapped:
            beside = layers * _regathers_beside_dgrad(cost, one / 2, slowdown)
            return per_pass, backward + regathered + beside, backward + regathered + beside
        if any(cost.tp_windows):
            forward, full, split = _paired_tp_exposure(cost, one, experts / layers, slowdown)
            return forward, full + regathered, split + regathered
        backward += layers * cost.tp_async_regathers * one / 2  # beside the coarse window too
        windows = (cost.fwd / layers - cost.attention_fwd, cost.bwd / layers - cost.attention_bwd,
                   cost.input_grad / layers - cost.attention_bwd)
        forward, full, split = (layers * exposed_seconds(max(0.0, window), comm / layers, slowdown)
                                for window, comm in zip(windows, (per_pass, backward, backward), strict=True))
        return forward, full + regathered, split + regathered

    for stage, holds in enumerate(_per_alike_stage(schedule, costs, held)):
        if holds is not None:
            seconds[stage, ActionKind.F], seconds[stage, ActionKind.B], seconds[stage, ActionKind.I] = holds
    return seconds


def _paired_tp_exposure(cost: StageCost, pair: float, expert_extra: float,
                        slowdown: float) -> tuple[float, float, float]:
    """(F, B, I) seconds a stage's overlapped tp collectives hold its rank, each collective
    beside only the GEMMs it feeds or follows (``pipesim.model.tp_windows``): per layer an
    all-gather and a reduce-scatter of half ``pair``'s price around each block, the MLP's
    two each carrying half of ``expert_extra`` (a mixture of experts' gathers of its routed
    copies, per layer). Collectives a recompute re-runs inside the backward sit beside the
    re-run forward's GEMMs: full recompute's ``recompute_layers`` pay the forward's exposure
    again, per-op checkpointing's ``recomputed_tp_pairs`` a dense pair's forward exposure
    each."""
    half = pair / 2
    comms = (half, half, half + expert_extra / 2, half + expert_extra / 2)
    forward = cost.tp_windows

    def exposed(windows: tuple[float, ...], comms: tuple[float, ...]) -> float:
        return sum(exposed_seconds(window, comm, slowdown) for window, comm in zip(windows, comms, strict=True))

    layers = cost.layers
    per_layer = exposed(forward, comms)
    recomputed = (cost.recompute_layers * per_layer
                  + cost.recomputed_tp_pairs * exposed(forward, (half,) * len(forward)) / 2)
    full = exposed(backward_windows(forward, split=False), comms)
    split = exposed(backward_windows(forward, split=True), comms)
    # Megatron's column-parallel backward gathers its input again beside the input-gradient
    # product and reduce-scatters the input gradient beside the weight-gradient product (a B;
    # in an I both beside the input-gradient product): the input side's one window splits in two
    for side, share in _regathered_sides(cost):
        dgrad, scatter = forward[side], comms[side]
        full += share * (exposed_seconds(dgrad, half, slowdown) + exposed_seconds(dgrad, scatter, slowdown)
                         - exposed_seconds(2 * dgrad, scatter, slowdown))
        split += share * (exposed_seconds(dgrad, scatter + half, slowdown) - exposed_seconds(dgrad, scatter, slowdown))
    return layers * per_layer, layers * full + recomputed, layers * split + recomputed


def _regathered_sides(cost: StageCost) -> list[tuple[int, float]]:
    """(index in ``tp_windows``, share of the layers) of the input sides whose inputs a
    layer's backward gathers again beside its input-gradient product
    (``tp_async_regathers``: the attention's first, then the MLP's on the layers whose MLP
    is dense)."""
    count = cost.tp_async_regathers
    return [(side, share) for side, share in ((0, min(1.0, count)), (2, max(0.0, count - 1))) if share > 0]


def _regathers_beside_dgrad(cost: StageCost, gather: float, slowdown: float) -> float:
    """Seconds a layer's ``tp_async_regathers`` add to its backward without tp overlap:
    Megatron issues each beside the input-gradient product it precedes (its
    ``ColumnParallelLinear`` does so with or without ``--tp-comm-overlap``), which hides
    what it can of it; whole where the costs give no GEMM windows."""
    if not any(cost.tp_windows):
        return cost.tp_async_regathers * gather
    return sum(share * exposed_seconds(cost.tp_windows[side], gather, slowdown)
               for side, share in _regathered_sides(cost))


def _tp_collective(topology: Topology, mapping: RankMapping, rank: int, sequence_parallel: bool, algorithm: str,
                   message: float) -> float:
    """``_tp_pair`` on pipeline rank ``rank``'s tp group, kept on the topology per mapping,
    rank and message: a rank's stages share its group, and many layouts of a plan a
    mapping. The paces measured for the group's size (all-reduce, all-gather,
    reduce-scatter), which ``compare`` sets after its calibration steps, are part of the
    key, so a price kept before them is not reused after."""
    measured = tuple(topology.measured_collectives.get((operation, mapping.tp))
                     for operation in ("all_reduce", "all_gather", "reduce_scatter"))
    key = ("tp-collective", mapping.dp, mapping.pp, mapping.tp, mapping.cp, mapping.ep, mapping.order, rank, message,
           sequence_parallel, algorithm, measured)
    seconds = topology.pace_cache.get(key)
    if seconds is None:
        seconds = topology.pace_cache[key] = _tp_pair(topology, mapping.tp_group(0, rank), sequence_parallel,
                                                      algorithm, message)
    return seconds


def _expert_tp_collective(topology: Topology, mapping: RankMapping, rank: int, sequence_parallel: bool,
                          algorithm: str, message: float) -> float:
    """``_tp_collective`` over pipeline rank ``rank``'s expert tensor-parallel group
    (``RankMapping.expert_tp_group``): the tp group's unless parallel folding splits the
    experts otherwise; 0 over one rank."""
    if not mapping.folded:
        return _tp_collective(topology, mapping, rank, sequence_parallel, algorithm, message)
    if mapping.expert_tp == 1:
        return 0.0
    key = ("expert-tp-collective", mapping.dp, mapping.pp, mapping.tp, mapping.cp, mapping.ep, mapping.etp,
           mapping.order, rank, message, sequence_parallel, algorithm)
    seconds = topology.pace_cache.get(key)
    if seconds is None:
        seconds = topology.pace_cache[key] = _tp_pair(topology, mapping.expert_tp_group(rank), sequence_parallel,
                                                      algorithm, message)
    return seconds


def _tp_pair(topology: Topology, group: list[str], sequence_parallel: bool, algorithm: str, message: float) -> float:
    """One of a layer's tp collectives of ``message`` bytes: an all-reduce, or with sequence
    parallelism an all-gather and a reduce-scatter (the same ring cost)."""
    if sequence_parallel:
        return all_gather(topology, group, message) + reduce_scatter(topology, group, message)
    return all_reduce(topology, group, message, algorithm)


def layer_tp_seconds(topology: Topology, mapping: RankMapping, rank: int, message_bytes: float,
                     sequence_parallel: bool, recomputed_pairs: float = 0.0, algorithm: str = "ring") -> float:
    """Seconds of tensor-parallel collectives one layer's forward and backward hold pipeline
    rank ``rank`` for (two in each, and the ``recomputed_pairs`` the recompute repeats: two
    when full recompute re-runs the forward): what the balanced stage split adds to a
    layer's compute. Its tp pair is ``_tp_collective``'s, kept per mapping and rank: a plan
    asks for it for thousands of layouts."""
    return (4 + recomputed_pairs) * _tp_collective(topology, mapping, rank, sequence_parallel, algorithm,
                                                   message_bytes)


def parameter_gather_seconds(schedule: Schedule, costs: Costs, topology: Topology, mapping: RankMapping,
                             bucket_bytes: float = DDP_BUCKET_BYTES, overlapped: bool = True) -> dict[int, float]:
    """Under ZeRO-1 and 2, the seconds of each stage's parameter all-gather after the
    optimizer step that a step certainly pays (what a planner's lower bound may charge):
    without overlap all of it (``comm_plan``'s per bucket, summed). When the gathers run
    under the next step's forwards (``overlapped``, Megatron-Core's
    ``--overlap-param-gather``, the default), only stage 0's first layer's: a step starts
    with a forward of stage 0 on rank 0, which waits for that layer's gather whole (the
    engine's walk, ``parameter_gathers``); every other gather may hide under a rank's idle
    fill or its forwards. Of the costs it reads only
    ``pipesim.model.costs.parameter_figures`` and stage 0's layer count (a planner keeps
    it under the figures, which the layer counts follow)."""
    def total(stage: int, cost: StageCost) -> float | None:
        if not _reduces(schedule, stage, mapping) or cost.param_bytes <= 0:
            return None
        return sum(_dp_collective(all_gather, topology, mapping, schedule, stage, cost, size) * count
                   for size, count in gradient_buckets(cost, 1, bucket_bytes))  # the ZeRO-1/2 buckets

    if overlapped:
        first = total(0, costs.stages[0]) if costs.stages else None
        return {} if first is None else {0: first / gather_units(costs.stages[0].layers)}
    return {stage: seconds for stage, seconds in enumerate(_per_alike_stage(schedule, costs, total))
            if seconds is not None}


def _dp_collective(collective, topology: Topology, mapping: RankMapping, schedule: Schedule, stage: int,
                   cost: StageCost, num_bytes: float) -> float:
    """``collective`` of ``num_bytes`` of ``stage``'s parameters over the ranks that hold
    them (``stage_dp_group``, its routed experts' share over their own group: ``_split_over``),
    kept on the topology per mapping, rank, expert share and size: a rank's stages share
    its groups, many layouts of a plan share a mapping and sizes, and a group of
    thousands of replicas is long to list and to look up. The paces measured on the
    machine (which ``compare`` sets after its calibration steps) are part of the key, so a
    price kept before them is not reused after."""
    rank = schedule.placement[stage]
    experts = (cost.expert_params / cost.params if _experts_apart(mapping) and cost.expert_params and cost.params
               else 0.0)
    key = ("dp-collective", _collective_name(collective), mapping.dp, mapping.pp, mapping.tp, mapping.cp, mapping.ep,
           mapping.etp,
           mapping.order, rank, experts, num_bytes, schedule.copies,
           tuple(sorted(topology.measured_collectives.items())))
    seconds = topology.pace_cache.get(key)
    if seconds is None:
        share = _split_over(_expert_gradients(schedule, stage, cost, mapping), partial(collective, topology),
                            stage_dp_group(schedule, stage, mapping))
        seconds = topology.pace_cache[key] = share(num_bytes)
    return seconds


def _collective_name(collective) -> tuple:
    """What tells collectives apart in the pace cache: the function's name, and a
    partial's keywords (the all-reduce's algorithm)."""
    if isinstance(collective, partial):
        return (collective.func.__name__, *sorted(collective.keywords.items()))
    return (collective.__name__,)


def stage_dp_group(schedule: Schedule, stage: int, mapping: RankMapping) -> list[str] | None:
    """The devices that reduce ``stage``'s gradients, None when there is nothing to reduce:
    its rank's dp (and cp) replicas and, when the pipeline holds copies of the model
    (DualPipe), the replicas of the rank holding each other copy of the same layers, whose
    gradients are summed with these before the optimizer step."""
    if not _reduces(schedule, stage, mapping):
        return None
    per_copy = schedule.copy_stages
    ranks = [schedule.placement[copy * per_copy + stage % per_copy] for copy in range(schedule.copies)]
    return [device for rank in ranks for device in mapping.dp_cp_group(rank, 0)]


def _reduces(schedule: Schedule, stage: int, mapping: RankMapping) -> bool:
    """Whether ``stage`` has a ``stage_dp_group``, without listing it (thousands of devices)."""
    return mapping.dp * mapping.cp * schedule.copies > 1 and stage < schedule.num_stages


def _per_bucket(sizes: tuple[float, ...], seconds_of) -> tuple[float, ...]:
    """``tuple(seconds_of(size) for size in sizes)``, calling ``seconds_of`` once per run of
    equal sizes (``bucket_runs`` gives full buckets and one rest) and building the tuple
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
                 start: float, microbatch: int = -1) -> float:
    """One event for buckets ``first``, ``first + 1``, ... of a stage run back to back from
    ``start`` (each starts as the one before ends); returns when the last one ends."""
    end = start + math.fsum(seconds)
    last = first + len(seconds) - 1
    name = f"{stage}{kind}[{first}]" if last == first else f"{stage}{kind}[{first}-{last}]"
    tail.append(TraceEvent(rank, name, kind, stage, microbatch, start, end, "dp"))
    return end


Backwards = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""``(stage, rank, start, end, microbatch)`` of the backwards whose gradients are
reduced, one array per field, in stage order (each stage's by end)."""


def _run_names(plan: CommPlan, kind: str, stages: np.ndarray, runs: np.ndarray, gathers: np.ndarray,
               for_kind: np.ndarray, microbatches: np.ndarray) -> list[str]:
    """Each collective's name: a reduction's ``3ALLREDUCE_DP[4-21]`` (stage, kind, buckets)
    for the run ``runs[i]`` of stage ``stages[i]`` (``_stage_runs``), a parameter gather's
    ``3ALLGATHER_PARAMS[L2]`` (``gathers[i]``: its layer ``runs[i]``), under ZeRO-3 with
    the action it gathered for, ``3ALLGATHER_PARAMS[L2](3F5)`` (``for_kind[i]``'s code, its
    microbatch)."""
    names: dict[tuple[int, int], str] = {}
    reduced = stages[gathers == 0]
    for stage in np.unique(reduced).tolist():
        for index, (_, first, last, _) in enumerate(_stage_runs(plan, stage)):
            names[stage, index] = f"{stage}{kind}[{first}]" if first == last else f"{stage}{kind}[{first}-{last}]"
    return [(f"{stage}{PARAM_GATHER_KIND}[L{run}]" + (f"({stage}{KINDS[code]}{microbatch})" if code >= 0 else ""))
            if gather else names[stage, run]
            for stage, run, gather, code, microbatch in zip(stages.tolist(), runs.tolist(), gathers.tolist(),
                                                            for_kind.tolist(), microbatches.tolist(), strict=True)]


def _stage_runs(plan: CommPlan, stage: int) -> list[tuple[float, int, int, float]]:
    """``(fraction of the backward, first bucket, last bucket, seconds)`` of each run of a
    stage's buckets that fill together (``_bucket_runs``), or, without overlap, all of
    them as one run (its fraction unused)."""
    seconds = plan.dp_bucket_seconds[stage]
    if not plan.overlap_dp:
        return [(1.0, 0, len(seconds) - 1, math.fsum(seconds))]
    return [(fraction, first, stop - 1, math.fsum(seconds[first:stop]))
            for fraction, first, stop in _bucket_runs(plan.dp_bucket_bytes[stage], plan.stage_layers.get(stage, 0))]


def _rank_ends(columns: TraceColumns, num_ranks: int) -> np.ndarray:
    """Each rank's last end (0 for a rank with no event): the maximum of its events' ends,
    by sorting them per rank (``np.maximum.at`` costs half a millisecond a step)."""
    rank_end = np.zeros(num_ranks)
    if len(columns):
        order = np.argsort(columns.rank, kind="stable")
        ranks = columns.rank[order]
        firsts = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1]])
        rank_end[ranks[firsts]] = np.maximum(np.maximum.reduceat(columns.end[order], firsts), 0.0)
    return rank_end


def _tail_scan(columns: TraceColumns, num_ranks: int, every_backward: bool) -> tuple[np.ndarray, Backwards]:
    """Each rank's last end, and the backwards whose gradients are reduced: each
    stage's last-ending B or W, or every one of them (``every_backward``, ZeRO-2 and 3)."""
    rank_end = _rank_ends(columns, num_ranks)
    releases = np.logical_or.reduce([columns.kind == columns.kind_code(kind) for kind in WEIGHT_GRAD_DONE_KINDS])
    grads = np.flatnonzero(columns.on_stream("compute") & releases)
    order = grads[np.lexsort((columns.end[grads], columns.stage[grads]))]
    if not every_backward and len(order):
        order = order[np.r_[columns.stage[order][1:] != columns.stage[order][:-1], True]]
    return rank_end, (columns.stage[order], columns.rank[order], columns.start[order], columns.end[order],
                      columns.microbatch[order])


def embedding_sum_seconds(schedule: Schedule, costs: Costs, topology: Topology,
                          devices: Sequence[str]) -> tuple[tuple[int, int, float], ...]:
    """Each of ``costs.embedding_sums`` as ``(rank, rank, seconds)``: the all-reduce of the
    table's gradient between the devices of the ranks holding its two stages. Each tp
    shard (and replica) sums its own share with its peer at the same moment on its own
    pair of devices; replica 0's first shard's pair is priced, as the other collectives
    of ``step_tail_columns`` are."""
    sums = []
    for first, last, num_bytes in costs.embedding_sums:
        ranks = schedule.placement[first], schedule.placement[last]
        if ranks[0] != ranks[1] and num_bytes > 0:
            sums.append((*ranks, all_reduce(topology, [devices[ranks[0]], devices[ranks[1]]], num_bytes)))
    return tuple(sums)


def step_tail_columns(pipeline: TraceColumns, num_ranks: int, plan: CommPlan | None,
                      step_overhead: float, reductions: TraceColumns | None = None,
                      embedding_sums: tuple[tuple[int, int, float], ...] = (),
                      grad_norm: float = 0.0) -> TraceColumns | None:
    """The collectives the walk ran (``reductions``: ``reduction_columns``, on the ``dp``
    stream: the gradient reductions and, with ``overlap_param_gather``, the parameter
    all-gathers the step's first forwards waited for), then the tied embeddings'
    all-reduces (``embedding_sums``, ``embedding_sum_seconds``: from each rank's readiness
    to the pair's end, the earlier rank waiting in it, on the ``step`` stream), gradient
    clipping's norm (``grad_norm`` seconds, ``Costs.grad_norm_overhead``: a collective over
    every rank, on the ``step`` stream of every rank from the last rank's readiness; a
    rank ready earlier waits for it on the ``wait`` stream, which the accounting counts
    as bubble, the pipeline draining: ``schedules.accounting.JOINING_KINDS``), each rank's
    optimizer step (``step`` stream) and, under ZeRO-1 and 2 without
    ``overlap_param_gather``, the parameter all-gathers (``dp``), placed after the
    pipeline events ``pipeline`` and the rank's last reduction; None when the step has none.

    What a collective beside the compute costs it (``pipesim.sim.comm_overlap``): the
    collectives that ran while the rank computed slow its compute by ``slowed_by`` of
    their time beside it, a ``DP_SLOWDOWN`` event after the rank's last action that the
    optimizer waits for."""
    has_dp = plan is not None and bool(plan.dp_bucket_seconds)
    if not has_dp and step_overhead <= 0 and not embedding_sums and grad_norm <= 0:
        return None
    every = has_dp and reduces_every_backward(plan.zero)
    rank_end, backwards = _tail_scan(pipeline, num_ranks, every)
    tail: list[TraceEvent] = []
    # the optimizer follows the rank's last reduction; without overlap, under ZeRO-0 and 1, its step end
    dp_free = rank_end.copy() if not has_dp or (not plan.overlap_dp and not every) else np.zeros(num_ranks)
    slowed = [0.0] * num_ranks
    if has_dp and reductions is not None and len(reductions):
        np.maximum.at(dp_free, reductions.rank, reductions.end)
        if plan.overlap_slowdown > 0:
            beside = compute_beside(pipeline, reductions.rank, reductions.start, reductions.end, num_ranks)
            slowed = [slowed_by(seconds, plan.overlap_slowdown) for seconds in beside]
    stage_rank = dict(zip(backwards[0].tolist(), backwards[1].tolist(), strict=True))
    # without the overlap, the gathers after the optimizer (with it, they ran in the walk)
    gathers = plan.gather_bucket_seconds if has_dp and not plan.overlap_param_gather else {}
    ready = []
    for rank in range(num_ranks):
        end = float(rank_end[rank])
        if slowed[rank] > 0:
            tail.append(TraceEvent(rank, DP_SLOWDOWN_KIND, DP_SLOWDOWN_KIND, -1, -1, end, end + slowed[rank], "dp"))
        ready.append(max(end + slowed[rank], float(dp_free[rank])))
    for one, other, seconds in embedding_sums:  # a collective: it ends once both ranks are in it
        finish = max(ready[one], ready[other]) + seconds
        for rank in (one, other):
            tail.append(TraceEvent(rank, EMBEDDING_SUM_KIND, EMBEDDING_SUM_KIND, -1, -1, ready[rank], finish, "step"))
            ready[rank] = finish
    if grad_norm > 0:  # every rank's squares summed once the last rank is in; the wait before is the drain
        start = max(ready)
        for rank in range(num_ranks):
            if ready[rank] < start:
                tail.append(TraceEvent(rank, GRAD_NORM_KIND, GRAD_NORM_KIND, -1, -1, ready[rank], start, "wait"))
            tail.append(TraceEvent(rank, GRAD_NORM_KIND, GRAD_NORM_KIND, -1, -1, start, start + grad_norm, "step"))
            ready[rank] = start + grad_norm
    for rank in range(num_ranks):
        done = ready[rank]
        if step_overhead > 0:
            tail.append(TraceEvent(rank, OPTIMIZER_KIND, OPTIMIZER_KIND, -1, -1, done, done + step_overhead, "step"))
            done += step_overhead
        if gathers:  # every parameter bucket can be gathered once the optimizer is done
            for stage in sorted(stage for stage, rank_of in stage_rank.items() if rank_of == rank):
                seconds = gathers.get(stage, ())
                if seconds:
                    done = _add_buckets(tail, rank, stage, PARAM_GATHER_KIND, 0, seconds, done)
    parts = [part for part in (reductions, TraceColumns.from_events(tail) if tail else None) if part is not None]
    return TraceColumns.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else None)


def compute_beside(pipeline: TraceColumns, ranks: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                   num_ranks: int) -> list[float]:
    """Per rank, the seconds of the intervals ``[starts, ends)`` of ``ranks`` during which
    the rank computed (its ``compute`` events in ``pipeline``): how long collectives ran
    beside its compute. Each rank's compute events do not overlap, so the compute done
    before a moment is a piecewise-linear function of it, read at both ends."""
    beside = [0.0] * num_ranks
    compute = pipeline.on_stream("compute")
    for rank in np.unique(ranks).tolist():
        mine = compute & (pipeline.rank == rank)
        order = np.argsort(pipeline.start[mine], kind="stable")
        begin, finish = pipeline.start[mine][order], pipeline.end[mine][order]
        moments = np.column_stack([begin, finish]).ravel()
        done = np.column_stack([np.cumsum(finish - begin) - (finish - begin), np.cumsum(finish - begin)]).ravel()
        if not len(moments):
            continue
        selected = ranks == rank
        before_end = np.interp(ends[selected], moments, done, left=0.0, right=float(done[-1]))
        before_start = np.interp(starts[selected], moments, done, left=0.0, right=float(done[-1]))
        beside[rank] = float(np.sum(before_end - before_start))
    return beside
