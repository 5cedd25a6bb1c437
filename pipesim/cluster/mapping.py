"""Rank mapping: which device each (dp, cp, pp, tp) position of a parallel job runs on,
and the groups its collectives run over.

Global ranks are numbered with one axis innermost (consecutive ranks differ in it),
then the next, then the outermost. Megatron-LM's order is ``tp-cp-dp-pp`` (Megatron-Core
writes ``tp-cp-ep-dp-pp``): tensor-parallel peers are consecutive ranks, so on 8-GPU
nodes a tp group of up to 8 stays inside one node on NVLink, where its per-layer
collectives belong; context-parallel peers come next (their ring passes K and V every
layer), then dp, and pp, whose point-to-point traffic is the lightest, crosses nodes.
An order that does not name cp (``tp-dp-pp``, the default spelling) places it right
outside tp, where Megatron-Core does. Ranks fill the topology's devices in their
listed order (a topology file may reorder them with ``mapping``).

Expert parallelism adds no devices: the ranks that hold the same dense shard (one
position of tp and pp, every dp replica and cp rank: Megatron's data-parallel group
with cp) are cut into expert-parallel groups of ``ep`` consecutive members, as
Megatron-Core's expert rank generator numbers them with expert tensor parallelism equal
to tp (``tp``, then ``ep``, then expert ``dp``: ``parallel_state.initialize_model_parallel``).
Each ep group holds every routed expert once (``E / ep`` per rank) and trades tokens by
all-to-all; the members at the same place in every ep group hold the same experts and
reduce their gradients together (the expert data-parallel group, ``dp * cp / ep`` ranks).

Parallel folding (Megatron-Core's expert tensor parallelism ``etp`` other than ``tp``)
gives the experts a mesh of their own over the same ranks: the ``tp x cp x dp`` ranks of
a pipeline stage, in global-rank order, are numbered ``etp`` innermost, then ``ep``, then
expert ``dp`` (``tp x cp x dp / (etp x ep)`` of them), as Megatron-Core's expert rank
generator numbers them (order ``tp-ep-dp-pp`` with tp the expert tensor parallelism). An
expert tensor-parallel group is ``etp`` consecutive ranks, an ep group its ``ep``
members ``etp`` apart, so ep may span tp and cp ranks as well as replicas (Qwen3-235B:
ep 32 over tp 2 x dp 16 with etp 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipesim.cluster.presets import GPUS_PER_PRESET_NODE, nodes_for
from pipesim.cluster.topology import Topology, TopologyError

AXES = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-dp-pp"  # Megatron's; cp, not named, sits right outside tp


def parse_rank_order(text: str) -> tuple[str, str, str, str]:
    """``"tp-dp-pp"`` -> ``("tp", "cp", "dp", "pp")``, innermost axis first: tp, dp and pp
    once each, cp optionally (right outside tp when left out), and ep optionally where
    Megatron-Core writes it, right inside dp (it is not an axis of devices: ep groups are
    cut from the dp x cp ranks)."""
    axes = [part.strip().lower() for part in text.replace(",", "-").split("-") if part.strip()]
    if "ep" in axes:
        at = axes.index("ep")
        if axes.count("ep") > 1 or at + 1 >= len(axes) or axes[at + 1] != "dp":
            raise ValueError(f"--rank-order {text!r}: ep goes right inside dp (tp-cp-ep-dp-pp, Megatron-Core's "
                             f"order); expert-parallel groups are cut from the dp x cp ranks")
        axes.pop(at)
    if "cp" not in axes and "tp" in axes:
        axes.insert(axes.index("tp") + 1, "cp")
    if sorted(axes) != sorted(AXES):
        raise ValueError(
            f"--rank-order {text!r} must name tp, dp and pp once each (and cp at most once), innermost first "
            f"(e.g. {DEFAULT_ORDER} (Megatron), tp-cp-dp-pp, tp-pp-dp, dp-tp-pp)"
        )
    return tuple(axes)  # type: ignore[return-value]


@dataclass(frozen=True)
class RankMapping:
    """``devices[global_rank]`` for a ``dp x cp x pp x tp`` job numbered in ``order``,
    its dp x cp ranks cut into expert-parallel groups of ``ep`` (see the module)."""

    dp: int
    pp: int
    tp: int
    order: tuple[str, ...]
    devices: tuple[str, ...]
    cp: int = 1
    ep: int = 1
    etp: int = 0  # the experts' tensor parallelism under parallel folding; 0: tp

    @property
    def expert_tp(self) -> int:
        """Tensor-parallel ranks each routed expert is split over: ``etp``, or ``tp``."""
        return self.etp or self.tp

    @property
    def folded(self) -> bool:
        """Whether the experts have a mesh of their own (``expert_tp`` other than ``tp``)."""
        return self.expert_tp != self.tp

    def global_rank(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        """The global rank at position (dp, pp, tp, cp)."""
        rank, stride = 0, 1
        for axis in self.order:  # innermost first; a branch per axis, no dictionaries: called per device
            if axis == "dp":
                index, size = dp, self.dp
            elif axis == "pp":
                index, size = pp, self.pp
            elif axis == "tp":
                index, size = tp, self.tp
            else:
                index, size = cp, self.cp
            if not 0 <= index < size:
                raise IndexError(f"{axis} index {index} is outside 0..{size - 1}")
            rank += index * stride
            stride *= size
        return rank

    def device(self, dp: int, pp: int, tp: int, cp: int = 0) -> str:
        return self.devices[self.global_rank(dp, pp, tp, cp)]

    def pipeline(self, dp: int = 0, tp: int = 0, cp: int = 0) -> list[str]:
        """Devices of one pipeline's ranks, in pp order (replica 0, shard 0, cp rank 0
        by default: the simulated pipeline)."""
        return [self.device(dp, stage_rank, tp, cp) for stage_rank in range(self.pp)]

    def pipelines(self) -> list[list[str]]:
        """Every pipeline of the job, the simulated one first: one per (replica, cp
        rank, tp shard), each running the same program on its own devices."""
        return [self.pipeline(replica, shard, rank) for replica in range(self.dp) for rank in range(self.cp)
                for shard in range(self.tp)]

    def tp_group(self, dp: int, pp: int, cp: int = 0) -> list[str]:
        """Devices that split the layers of pipeline rank ``pp`` of replica ``dp``."""
        return [self.device(dp, pp, shard, cp) for shard in range(self.tp)]

    def cp_group(self, dp: int, pp: int, tp: int) -> list[str]:
        """Devices that split one sequence of replica ``dp`` (its ring, in cp order)."""
        return [self.device(dp, pp, tp, rank) for rank in range(self.cp)]

    def dp_group(self, pp: int, tp: int, cp: int = 0) -> list[str]:
        """Devices that hold the same shard (pp, tp) and sequence chunk ``cp`` in every
        replica. Read off with the dp axis's stride (a planner asks for thousands of
        replicas' groups per layout)."""
        first, stride = self.global_rank(0, pp, tp, cp), self._stride("dp")
        return list(self.devices[first:first + stride * self.dp:stride])

    def dp_cp_group(self, pp: int, tp: int) -> list[str]:
        """Every device holding the same dense shard (pp, tp): each replica's every cp
        rank, in global-rank order. They reduce the dense gradients (Megatron's
        data-parallel group with cp) and are cut into the ep groups."""
        if self.cp == 1:
            return self.dp_group(pp, tp)
        ranks = sorted(self.global_rank(replica, pp, tp, rank) for replica in range(self.dp) for rank in range(self.cp))
        return [self.devices[rank] for rank in ranks]

    def grad_norm_group(self, sharded: bool) -> list[str]:
        """Devices whose gradients' squares gradient clipping sums into one norm: every
        device when the optimizer state is sharded over the replicas (each holds a
        different share of the gradient: Megatron-Core's distributed optimizer, ZeRO,
        FSDP), else one replica's model-parallel ranks (tp x pp; the replicas hold the
        same reduced gradient), in global-rank order."""
        if sharded:
            return list(self.devices)
        ranks = sorted(self.global_rank(0, stage, shard) for stage in range(self.pp) for shard in range(self.tp))
        return [self.devices[rank] for rank in ranks]

    def stage_members(self, pp: int) -> list[str]:
        """Every device of pipeline rank ``pp`` (each replica's tp shards and cp ranks), in
        global-rank order: what parallel folding numbers the experts' mesh over."""
        ranks = sorted(self.global_rank(replica, pp, shard, rank) for replica in range(self.dp)
                       for shard in range(self.tp) for rank in range(self.cp))
        return [self.devices[rank] for rank in ranks]

    def expert_shard_members(self, pp: int, shard: int) -> list[str]:
        """The devices of pipeline rank ``pp`` that hold expert tensor-parallel shard
        ``shard`` of the experts they hold, in global-rank order: the dense shard's
        ``dp_cp_group``, or under parallel folding every ``etp``-th member of the stage."""
        if not self.folded:
            return self.dp_cp_group(pp, shard)
        return self.stage_members(pp)[shard::self.expert_tp]

    def expert_tp_group(self, pp: int) -> list[str]:
        """The expert tensor-parallel group of the simulated pipeline's rank ``pp``: its tp
        group, or under parallel folding the stage's first ``etp`` members."""
        if not self.folded:
            return self.tp_group(0, pp)
        return self.stage_members(pp)[:self.expert_tp]

    def ep_groups(self, pp: int, tp: int) -> list[list[str]]:
        """The expert-parallel groups of expert shard (pp, tp): ``expert_shard_members`` in
        runs of ``ep`` (the first holds the simulated pipeline's rank)."""
        members = self.expert_shard_members(pp, tp)
        return [members[first:first + self.ep] for first in range(0, len(members), self.ep)]

    def ep_group(self, pp: int, tp: int) -> list[str]:
        """The expert-parallel group of the simulated pipeline's rank ``pp`` (expert shard ``tp``)."""
        return self.expert_shard_members(pp, tp)[:self.ep]

    def expert_dp_group(self, pp: int, tp: int) -> list[str]:
        """Devices that hold the same experts as the simulated pipeline's rank ``pp``
        (expert shard ``tp``): the first member of every ep group. They reduce the experts'
        gradients (``dp * cp / ep`` of them; under folding ``tp * cp * dp / (etp * ep)``)."""
        return self.expert_shard_members(pp, tp)[::self.ep]

    def _stride(self, axis: str) -> int:
        """How far apart in global rank two neighbours along ``axis`` are."""
        stride = 1
        for name in self.order:  # innermost first
            if name == axis:
                return stride
            stride *= {"dp": self.dp, "pp": self.pp, "tp": self.tp, "cp": self.cp}[name]
        raise ValueError(f"unknown axis {axis!r}")


def map_ranks(topology: Topology, dp: int = 1, pp: int = 1, tp: int = 1, order: str = DEFAULT_ORDER, cp: int = 1,
              ep: int = 1, etp: int = 0) -> RankMapping:
    """Place a ``dp x cp x pp x tp`` job on ``topology``'s devices (file/preset order),
    its dp x cp ranks grouped by ``ep`` for the experts (under parallel folding, ``etp``
    other than 0 or ``tp``, its stages' ranks by ``etp`` and ``ep``).

    An ideal topology has as many free devices as asked for; any other must have at
    least ``dp * cp * pp * tp``. Kept on the topology per shape: a plan maps thousands of
    layouts onto one cluster."""
    key = ("mapping", dp, pp, tp, order, cp, ep, etp)
    cached = topology.pace_cache.get(key)
    if cached is None:
        cached = topology.pace_cache[key] = _map_ranks(topology, dp, pp, tp, order, cp, ep, etp)
    return cached


def _map_ranks(topology: Topology, dp: int, pp: int, tp: int, order: str, cp: int, ep: int,
               etp: int) -> RankMapping:
    for name, size in (("--dp", dp), ("--pp", pp), ("--tp", tp), ("--cp", cp), ("--ep", ep)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    if etp < 0:
        raise ValueError(f"--etp must be >= 1, got {etp}")
    problem = expert_group_problem(dp, cp, ep, tp, etp)
    if problem:
        raise ValueError(problem)
    axes = parse_rank_order(order)
    world = dp * cp * pp * tp
    sizes = f"dp={dp} x cp={cp} x pp={pp} x tp={tp}" if cp > 1 else f"dp={dp} x pp={pp} x tp={tp}"
    if topology.ideal:
        devices = tuple(f"gpu{rank}" for rank in range(world))
    else:
        if world > len(topology.devices):
            preset = topology.name if topology.name in GPUS_PER_PRESET_NODE else "ib"
            raise TopologyError(
                f"{sizes} needs {world} devices but topology {topology.name} has "
                f"{len(topology.devices)}; shrink dp/cp/pp/tp or use a larger cluster "
                f"(e.g. --topology {preset} --nodes {nodes_for(preset, world, 8)})"
            )
        devices = tuple(topology.devices[:world])
    return RankMapping(dp=dp, pp=pp, tp=tp, order=axes, devices=devices, cp=cp, ep=ep, etp=etp)


def expert_group_problem(dp: int, cp: int, ep: int, tp: int = 1, etp: int = 0) -> str:
    """Why ``ep`` cannot cut the ``dp x cp`` ranks of a dense shard into groups, or under
    parallel folding ``etp x ep`` the ``tp x cp x dp`` ranks of a stage ('' when it can)."""
    if etp and etp != tp:
        stage = tp * cp * dp
        if stage % (etp * ep) == 0:
            return ""
        return (f"--etp {etp} x --ep {ep} = {etp * ep} must divide the tp x cp x dp = {stage} ranks of a pipeline "
                f"stage (parallel folding cuts them into expert tensor- and expert-parallel groups, as "
                f"Megatron-Core does): lower --etp or --ep, or raise --dp")
    if (dp * cp) % ep == 0:
        return ""
    valid = [size for size in range(1, dp * cp + 1) if (dp * cp) % size == 0]
    return (f"--ep {ep} must divide the dp x cp = {dp * cp} ranks that hold each dense shard (expert-parallel "
            f"groups are cut from them, as Megatron-Core does): use one of {', '.join(map(str, valid))}, or raise --dp")
