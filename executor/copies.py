"""DualPipe's two copies of the model: which model stage a pipeline stage runs, and the
group over which each stage's gradient is summed with its other copy's.

DualPipe (``schedules.generators.dualpipe``) runs copy 0 of the model from rank 0 to
rank ``pp - 1`` and copy 1 the other way, half of the microbatches each: pipeline stage
``s`` is model stage ``s mod pp`` of copy ``s // pp``, so rank ``r`` holds model stage
``r`` of copy 0 and model stage ``pp - 1 - r`` of copy 1, and rank ``pp - 1 - r`` the
same two model stages of the other copies. Both copies start from the same weights
(a model stage is built the same whatever copy asks for it) and stay equal: each
stage's gradient is reduced over every process holding that model stage (``copies_group``:
both ranks of the mirror pair, in every dp replica), summed over the copies and averaged
over the replicas, by the data-parallel averager (``executor.data_parallel``) bucket by
bucket as the backward fills them, as the simulator's dp stream charges it and DeepSeek's
runs do; under ZeRO-1 and 2 the optimizer state is sharded over that group, and the
parameters all-gathered over it keep both copies equal.

The averager posts a rank's buckets in its program's order of reducing backwards; a
collective over the pair is only right if the mirror rank reduces the same model stages
in the same order. DualPipe's programs are mirror images (rank ``pp - 1 - r`` runs rank
``r``'s with the copies swapped), so they do; ``check_mirrored`` refuses a schedule whose
programs are not (a hand-edited one), naming the ranks.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from executor.mesh import MeshPosition, axis_options
from schedules.action import COMPUTE_KINDS, WEIGHT_GRAD_DONE_KINDS
from schedules.schedule import Schedule

T = TypeVar("T")


def model_stage(schedule: Schedule, stage: int) -> int:
    """The model stage pipeline stage ``stage`` runs (itself without copies)."""
    return stage % schedule.copy_stages


def by_model_stage(schedule: Schedule, stages: dict[int, T]) -> dict[int, T]:
    """``stages`` ordered by the model stage each runs: the order in which a rank and its
    mirror (the same two model stages, copies swapped) meet in a collective over both."""
    return dict(sorted(stages.items(), key=lambda item: model_stage(schedule, item[0])))


def copy_of(schedule: Schedule, stage: int) -> int:
    """Which copy of the model pipeline stage ``stage`` belongs to."""
    return stage // schedule.copy_stages


def data_index(schedule: Schedule, stage: int, microbatch: int) -> int:
    """Which of the step's microbatches ``microbatch`` of ``stage``'s copy of the model
    is: copy ``c`` takes the ``c``-th share of them (one copy: the same index)."""
    return copy_of(schedule, stage) * schedule.microbatches + microbatch


def copies_group(schedule: Schedule, position: MeshPosition, timeout: float) -> dist.ProcessGroup:
    """The process group that reduces this rank's stages' gradients: every dp replica and
    cp rank of this pipeline rank and of its mirror rank ``pp - 1 - r`` (the holders of
    the same two model stages, summed over cp and the copies, averaged over dp, as
    ``executor.context_parallel`` reduces a stage's dense gradients without copies), at
    this process's tp place (a tp shard is reduced with the same shard); one group per
    pair and tp place, made alike on every rank (``new_group`` is collective)."""
    pp, mine = schedule.pp, None
    for tp_index in range(position.tp):
        for first in range(pp // 2):
            pair = (first, pp - 1 - first)
            members = [position.rank_at(index, dp_index, cp_index, tp_index) for index in pair
                       for dp_index in range(position.dp) for cp_index in range(position.cp)]
            group = dist.new_group(sorted(members), timeout=timedelta(seconds=timeout))
            if position.pp_index in pair and tp_index == position.tp_index:
                mine = group
    return mine


COPIES_MESH_DIMS = ("pair", "side", "dp", "cp", "tp")


def copies_mesh(schedule: Schedule, position: MeshPosition, device_type: str, timeout: float) -> DeviceMesh:
    """Every rank as a place of one device mesh ``(pair, side, dp, cp, tp)``: ``pair``
    the mirror pair ``(r, pp - 1 - r)``, ``side`` which rank of it, with ``(side, dp, cp)``
    flattened into ``copies``, the holders of this rank's two model stages at its tp place
    (``copies_group``'s members). ZeRO-3 shards a stage over ``copies`` (``executor.fsdp``),
    and tensor parallelism splits it over this mesh's ``tp``: FSDP2 composes with a
    tp-split parameter only when both axes come from one root mesh, which the run's mesh
    ``(pp, dp, cp, tp)`` cannot give, its pp axis holding the two sides of a pair apart.
    Collective: every rank builds it, alike."""
    pp = schedule.pp
    # global ranks as the run numbers them (executor.mesh: pp outermost, then dp, cp, tp),
    # the pp axis regrouped into the mirror pairs
    grid = torch.arange(pp * position.dp * position.cp * position.tp).reshape(pp, position.dp, position.cp,
                                                                             position.tp)
    ranks = grid[torch.tensor([(first, pp - 1 - first) for first in range(pp // 2)])]
    options = axis_options(dist.get_backend(), timeout)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=COPIES_MESH_DIMS,
                      backend_override=tuple(options for _ in COPIES_MESH_DIMS))
    mesh["side", "dp", "cp"]._flatten("copies", backend_override=options)
    return mesh


def reducing_order(schedule: Schedule, rank: int, kinds: Collection[str] = WEIGHT_GRAD_DONE_KINDS
                   ) -> list[tuple[str, int]]:
    """The (kind, model stage) of each action of ``kinds`` on ``rank`` in program order: by
    default each backward that completes a gradient (``B`` or ``W``), the order its dp
    buckets are posted in."""
    return [(action.kind, model_stage(schedule, action.stage)) for action in schedule.programs[rank]
            if action.kind in kinds]


def check_mirrored(schedule: Schedule, every_compute: bool = False) -> None:
    """Refuse a two-copy schedule in which a rank and its mirror complete their model
    stages' gradients in different orders: their reductions over one group would pair
    different model stages. Under ZeRO-3 (``every_compute``) every compute action issues
    collectives over the pair (FSDP's gathers too), so all of them must pair."""
    kinds = COMPUTE_KINDS if every_compute else WEIGHT_GRAD_DONE_KINDS
    for rank in range(schedule.pp // 2):
        mirror = schedule.pp - 1 - rank
        if reducing_order(schedule, rank, kinds) != reducing_order(schedule, mirror, kinds):
            what = "run their compute actions" if every_compute else "complete their gradients"
            raise ValueError(f"ranks {rank} and {mirror} hold the same two model stages but {what} in different "
                             "orders, so the collectives over both copies cannot pair them: a DualPipe schedule's "
                             "programs must be mirror images (rank pp-1-r runs rank r's with the copies swapped)")
