"""ZeRO-3 (``--zero 3``): each pipeline stage sharded over its dp replicas with FSDP2's
``fully_shard``, torch's own building block, as torchtitan's ``apply_fsdp`` applies it.

Each block of a stage is its own FSDP unit and the stage (embedding, head and whatever
else it holds) the root: a block's parameters are all-gathered just before its forward
and again before its backward and freed after each (``reshard_after_forward``), and its
gradient is reduce-scattered (averaged over dp) as its backward produces it, every
microbatch: the rule the simulator charges for ``--zero 3`` (``pipesim.sim.parallel``).
The parameters, gradients and optimizer state of a replica are its ``1/dp`` shards
(DTensors sharded on dim 0 over the dp mesh axis). The data-parallel averager does not
run: FSDP reduces the gradients itself.

With context parallelism the dense parameters are sharded over the dp x cp ranks (the
mesh's two axes flattened into one, as torchtitan's ``dp_shard_cp``), and with expert
parallelism each routed expert over its expert data-parallel group
(``executor.expert_parallel``; torchtitan shards its experts over ``dp_mod_ep`` the same
way: the dp x cp axis unflattened into expert dp x ep, so that with tp the expert
mesh and the tp mesh are axes of one mesh, as FSDP2 needs), each expert its own unit so
that its parameters are gathered when the dispatcher runs it. FSDP averages over the
ranks it shards over; a cp rank's loss is its tokens' part of its replica's
(``executor.context_parallel``), so the gradients must be summed over cp and divided by
dp only: every unit's divide factor is set to dp.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from executor.architectures.moe import MixtureOfExperts
from executor.fsdp_timing import FsdpTimer, time_unit
from executor.gather import ROOT_UNIT
from executor.mesh import axis_options


def shard_stage(stage: nn.Module, mesh: DeviceMesh, replicas: int, expert_mesh: DeviceMesh | None = None,
                timer: FsdpTimer | None = None, index: int = 0) -> None:
    """``fully_shard`` each block of ``stage`` over ``mesh`` (dp, or dp x cp), each routed
    expert first over ``expert_mesh`` when given, then the stage; the gradients summed
    over the mesh and divided by ``replicas`` (dp). With a ``timer``, every unit's
    collectives are timed as those of stage ``index`` (``executor.fsdp_timing``)."""
    for layer, block in enumerate(getattr(stage, "blocks", ())):
        if expert_mesh is not None:
            for module in block.modules():
                if isinstance(module, MixtureOfExperts):
                    for expert in module.experts.children():
                        unit = fully_shard(expert, mesh=expert_mesh)
                        divide_by(unit, expert_mesh, replicas)
                        time_unit(unit, timer, index, layer)
        unit = fully_shard(block, mesh=mesh)
        divide_by(unit, mesh, replicas)
        time_unit(unit, timer, index, layer)
    unit = fully_shard(stage, mesh=mesh)
    divide_by(unit, mesh, replicas)
    time_unit(unit, timer, index, ROOT_UNIT)


def divide_by(unit: FSDPModule, mesh: DeviceMesh, replicas: int) -> None:
    """Make ``unit`` (sharded over ``mesh``) divide its summed gradients by ``replicas``
    rather than by the mesh's size. On a one-rank mesh (an expert data-parallel group of one: dp x cp = ep)
    torch 2.13 divides twice in float64 and float16 (before the reduction and again in
    place of it), so there the division is left to a hook that runs after the reduction."""
    if mesh.size() > 1:
        unit.set_gradient_divide_factor(float(replicas))
        if replicas != mesh.size():  # not an average: a sum then a division, which gloo runs too
            unit.set_force_sum_reduction_for_comms(True)  # (else float32 asks for NCCL's PreMulSum)
    else:
        unit.set_all_reduce_hook(lambda reduced: reduced.div_(replicas))


def shard_stages(stages: dict[int, nn.Module], mesh: DeviceMesh | None, cp: int, replicas: int,
                 expert_group: dist.ProcessGroup | None, timeout: float, timer: FsdpTimer | None = None) -> None:
    """``shard_stage`` every stage of this rank: dense parameters over the dp axis of the
    run's ``mesh`` (with cp, its dp and cp axes flattened: the dp x cp ranks of one
    (pp, tp) shard), routed experts over ``expert_group`` when expert parallelism gives one;
    their collectives timed by ``timer`` when given."""
    options = axis_options(dist.get_backend(), timeout)
    if mesh is None:  # a world of one builds no mesh (executor.mesh): one over its one rank
        mesh = init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (1, 1), mesh_dim_names=("dp", "cp"))
    dense = mesh["dp", "cp"]._flatten("dp_cp", backend_override=options) if cp > 1 else mesh["dp"]
    experts = None
    if expert_group is not None:
        # The dp x cp ranks as (expert dp, ep), ep innermost: the groups executor.expert_parallel
        # cuts, as axes of the run's mesh, so that FSDP composes them with a tp-split expert.
        ep = dense.size() // dist.get_world_size(expert_group)
        experts = dense._unflatten(0, (dense.size() // ep, ep), ("edp", "ep"),
                                   backend_override={"edp": options, "ep": options})["edp"]
    for index, stage in stages.items():
        shard_stage(stage, dense, replicas, experts, timer, index)
