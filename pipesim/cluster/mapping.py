"""Rank mapping: which device each (dp, pp, tp) position of a 3-D parallel job runs on.

Global ranks are numbered with one axis innermost (consecutive ranks differ in it),
then the next, then the outermost. Megatron-LM's order is ``tp-dp-pp``: tensor-parallel
peers are consecutive ranks, so on 8-GPU nodes a tp group of up to 8 stays inside one
node on NVLink, where its per-layer collectives belong; dp comes next and pp, whose
point-to-point traffic is the lightest, crosses nodes. Ranks fill the topology's devices
in their listed order (a topology file may reorder them with ``mapping``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipesim.cluster.topology import Topology, TopologyError

AXES = ("tp", "dp", "pp")
DEFAULT_ORDER = "tp-dp-pp"


def parse_rank_order(text: str) -> tuple[str, str, str]:
    """``"tp-dp-pp"`` -> ``("tp", "dp", "pp")``, innermost axis first."""
    axes = tuple(part.strip().lower() for part in text.replace(",", "-").split("-") if part.strip())
    if sorted(axes) != sorted(AXES):
        raise ValueError(
            f"--rank-order {text!r} must name tp, dp and pp once each, innermost first "
            f"(e.g. {DEFAULT_ORDER} (Megatron), tp-pp-dp, dp-tp-pp)"
        )
    return axes  # type: ignore[return-value]


@dataclass(frozen=True)
class RankMapping:
    """``devices[global_rank]`` for a ``dp x pp x tp`` job numbered in ``order``."""

    dp: int
    pp: int
    tp: int
    order: tuple[str, str, str]
    devices: tuple[str, ...]

    def global_rank(self, dp: int, pp: int, tp: int) -> int:
        """The global rank at position (dp, pp, tp)."""
        rank, stride = 0, 1
        for axis in self.order:  # innermost first; a branch per axis, no dictionaries: called per device
            if axis == "dp":
                index, size = dp, self.dp
            elif axis == "pp":
                index, size = pp, self.pp
            else:
                index, size = tp, self.tp
            if not 0 <= index < size:
                raise IndexError(f"{axis} index {index} is outside 0..{size - 1}")
            rank += index * stride
            stride *= size
        return rank

    def device(self, dp: int, pp: int, tp: int) -> str:
        return self.devices[self.global_rank(dp, pp, tp)]

    def pipeline(self, dp: int = 0, tp: int = 0) -> list[str]:
        """Devices of one replica's pipeline ranks, in pp order (the simulated pipeline)."""
        return [self.device(dp, stage_rank, tp) for stage_rank in range(self.pp)]

    def tp_group(self, dp: int, pp: int) -> list[str]:
        """Devices that split the layers of pipeline rank ``pp`` of replica ``dp``."""
        return [self.device(dp, pp, shard) for shard in range(self.tp)]

    def dp_group(self, pp: int, tp: int) -> list[str]:
        """Devices that hold the same shard (pp, tp) in every replica: they all-reduce
        its gradients. Read off with the dp axis's stride (a planner asks for thousands
        of replicas' groups per layout)."""
        first, stride = self.global_rank(0, pp, tp), self._stride("dp")
        return list(self.devices[first:first + stride * self.dp:stride])

    def _stride(self, axis: str) -> int:
        """How far apart in global rank two neighbours along ``axis`` are."""
        stride = 1
        for name in self.order:  # innermost first
            if name == axis:
                return stride
            stride *= {"dp": self.dp, "pp": self.pp, "tp": self.tp}[name]
        raise ValueError(f"unknown axis {axis!r}")


def map_ranks(topology: Topology, dp: int = 1, pp: int = 1, tp: int = 1, order: str = DEFAULT_ORDER) -> RankMapping:
    """Place a ``dp x pp x tp`` job on ``topology``'s devices (file/preset order).

    An ideal topology has as many free devices as asked for; any other must have at
    least ``dp * pp * tp``. Kept on the topology per shape: a plan maps thousands of
    layouts onto one cluster."""
    key = ("mapping", dp, pp, tp, order)
    cached = topology.pace_cache.get(key)
    if cached is None:
        cached = topology.pace_cache[key] = _map_ranks(topology, dp, pp, tp, order)
    return cached


def _map_ranks(topology: Topology, dp: int, pp: int, tp: int, order: str) -> RankMapping:
    for name, size in (("--dp", dp), ("--pp", pp), ("--tp", tp)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    axes = parse_rank_order(order)
    world = dp * pp * tp
    if topology.ideal:
        devices = tuple(f"gpu{rank}" for rank in range(world))
    else:
        if world > len(topology.devices):
            per_node = 8
            raise TopologyError(
                f"dp={dp} x pp={pp} x tp={tp} needs {world} devices but topology {topology.name} has "
                f"{len(topology.devices)}; shrink dp/pp/tp or use a larger cluster "
                f"(e.g. --topology ib --nodes {-(-world // per_node)})"
            )
        devices = tuple(topology.devices[:world])
    return RankMapping(dp=dp, pp=pp, tp=tp, order=axes, devices=devices)
