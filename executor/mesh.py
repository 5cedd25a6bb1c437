"""The (dp, pp, tp) device mesh of a 3-D parallel run (with cp, 4-D).

Ranks are numbered as the cluster model numbers them (Megatron's order, tp innermost,
then dp, then pp): ``global rank = pp_index * (dp * tp) + dp_index * tp + tp_index``.
Context parallelism adds an axis right outside tp (``tp-cp-dp-pp``, as
``pipesim.cluster.mapping`` orders it): ``pp_index * (dp * cp * tp) + dp_index *
(cp * tp) + cp_index * tp + tp_index``, the mesh ``(pp, dp, cp, tp)``.
Tensor-parallel peers are therefore consecutive ranks (on one node, where their
per-layer collectives belong), and pipeline peers the farthest apart.

The mesh is ``torch.distributed.device_mesh.init_device_mesh`` over the shape
``(pp, dp, tp)`` (outermost first), which gives exactly that numbering and one
process group per axis: point-to-point along pp (to the global rank of the peer in the
same (dp, tp) position), gradient averaging along dp, DTensor collectives along tp.

Every axis group gets the run's ``--timeout``: ``init_device_mesh`` takes no timeout and
creates its sub-groups with the backend's default (30 minutes on gloo, 10 on NCCL), so a
rank hung inside a tp collective would hold its peers that long. The timeout travels
in the backend options of ``backend_override``, which the mesh hands to ``new_group``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")
MESH_DIMS_CP = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class MeshPosition:
    """Where one process sits in a ``dp x pp x tp`` job, and how to find its peers."""

    dp: int
    pp: int
    tp: int
    dp_index: int
    pp_index: int
    tp_index: int
    cp: int = 1
    cp_index: int = 0

    @classmethod
    def of_rank(cls, rank: int, dp: int, pp: int, tp: int, cp: int = 1) -> MeshPosition:
        """The position of global ``rank`` (tp innermost, then cp, dp, pp)."""
        pp_index, rest = divmod(rank, dp * cp * tp)
        dp_index, rest = divmod(rest, cp * tp)
        cp_index, tp_index = divmod(rest, tp)
        return cls(dp, pp, tp, dp_index, pp_index, tp_index, cp, cp_index)

    def rank_at(self, pp_index: int, dp_index: int, cp_index: int, tp_index: int) -> int:
        """The global rank at that place of the mesh."""
        return ((pp_index * self.dp + dp_index) * self.cp + cp_index) * self.tp + tp_index

    def global_rank(self, pp_index: int) -> int:
        """The global rank at pipeline rank ``pp_index`` and this process's own dp, cp
        and tp indices (its pipeline peer)."""
        return self.rank_at(pp_index, self.dp_index, self.cp_index, self.tp_index)

    def pipeline_ranks(self) -> tuple[int, ...]:
        """Global ranks of this process's pipeline, in pp order."""
        return tuple(self.global_rank(index) for index in range(self.pp))


@dataclass
class Mesh3D:
    """The device mesh and this process's position in it (``mesh`` is ``None`` on a
    single process, where there is nothing to communicate)."""

    position: MeshPosition
    mesh: DeviceMesh | None

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group along ``axis`` (``"pp"``, ``"dp"``, ``"tp"``, with cp ``"cp"``)."""
        return None if self.mesh is None else self.mesh.get_group(axis)

    def submesh(self, axis: str) -> DeviceMesh | None:
        """The 1-D mesh along ``axis`` (what ``parallelize_module`` takes for tp)."""
        return None if self.mesh is None else self.mesh[axis]


def axis_options(backend: str, timeout: float) -> tuple[str, object]:
    """The ``(backend, options)`` pair that gives a mesh axis group ``timeout`` seconds."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout)
    return backend, options


def build_mesh(rank: int, world: int, dp: int, pp: int, tp: int, device_type: str,
               timeout: float = 60.0, cp: int = 1) -> Mesh3D:
    """This process's mesh, every axis group with ``timeout`` seconds; raise naming the
    sizes when the world does not fit them."""
    if dp * cp * pp * tp != world:
        size = f"dp={dp} x pp={pp} x tp={tp}" + (f" x cp={cp}" if cp > 1 else "")
        raise ValueError(f"{size} = {dp * cp * pp * tp} ranks, but {world} processes were started; start exactly "
                         f"that many processes (torchrun --nproc-per-node {dp * cp * pp * tp})")
    position = MeshPosition.of_rank(rank, dp, pp, tp, cp)
    if world == 1:
        return Mesh3D(position, None)
    backend = dist.get_backend()
    shape, names = ((pp, dp, cp, tp), MESH_DIMS_CP) if cp > 1 else ((pp, dp, tp), MESH_DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names,
                            backend_override={axis: axis_options(backend, timeout) for axis in names})
    return Mesh3D(position, mesh)
