"""ZeRO-3 (``--zero 3``): each pipeline stage sharded over its dp replicas with FSDP2's
``fully_shard``, torch's own building block, as torchtitan's ``apply_fsdp`` applies it.

A split backward (the zero-bubble schedules' I and W, ``executor.split_backward``) runs
as the simulator charges it: I all-gathers each block's parameters as B would (FSDP's
pre-backward hooks fire on it) and leaves the gradients alone; W computes the weight
gradients from what I kept, each unit gathered again first (a LayerNorm's
weight-gradient kernel reads the weight FSDP freed after I) and its gradients
reduce-scattered after (``ShardedWeightGrad``), every microbatch.

Each block of a stage is its own FSDP unit and the stage (embedding, head and whatever
else it holds) the root: a block's parameters are all-gathered just before its forward
and again before its backward and freed after each (``reshard_after_forward``), and its
gradient is reduce-scattered (averaged over dp) as its backward produces it, every
microbatch: the rule the simulator charges for ``--zero 3`` (``pipesim.sim.parallel``).
The parameters, gradients and optimizer state of a replica are its ``1/dp`` shards
(DTensors sharded on dim 0 over the dp mesh axis). The data-parallel averager does not
run: FSDP reduces the gradients itself.

With DualPipe's two copies of the model (``executor.copies``) a rank's two stages are
sharded over every holder of their model stages, the rank and its mirror in each dp
replica (and cp rank): both copies of a model stage are one set of shards, gathered by
the copy that runs and reduced from both, summed over the copies and divided by dp, as
the data-parallel averager reduces them without ZeRO-3. The mirror ranks' programs
pair every compute action (``check_mirrored``), so each collective meets its partner.

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
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from executor.architectures.moe import MixtureOfExperts
from executor.fsdp_timing import FsdpTimer, time_unit
from executor.gather import ROOT_UNIT
from executor.mesh import axis_options
from executor.split_backward import SplitBackward, WeightWork


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
                 expert_group: dist.ProcessGroup | None, timeout: float, timer: FsdpTimer | None = None,
                 copies: DeviceMesh | None = None) -> None:
    """``shard_stage`` every stage of this rank: dense parameters over the dp axis of the
    run's ``mesh`` (with cp, its dp and cp axes flattened: the dp x cp ranks of one
    (pp, tp) shard; with DualPipe's two copies, over the ``copies`` axis of ``copies``,
    every holder of this rank's two model stages: ``executor.copies.copies_mesh``), routed
    experts over ``expert_group`` when expert parallelism gives one; their collectives
    timed by ``timer`` when given."""
    options = axis_options(dist.get_backend(), timeout)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if mesh is None:  # a world of one builds no mesh (executor.mesh): one over its one rank
        mesh = init_device_mesh(device_type, (1, 1), mesh_dim_names=("dp", "cp"))
    if copies is not None:
        dense = copies["copies"]
    else:
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


class ShardedWeightGrad:
    """W of a sharded stage (``PipelineRuntime``'s ``weight_grad_runner`` under ZeRO-3).

    Its recorded calls run unit by unit (each FSDP unit's in the order they were
    recorded): the unit's parameters all-gathered by FSDP's own ``unshard`` (a
    LayerNorm's weight-gradient kernel reads its weight, which FSDP freed after I), the
    next unit's gather issued before this one's calls (one ahead, the prefetch the
    simulator charges), the calls' local backwards, then the unit's ``post_backward``,
    which reduce-scatters the gradients W left and reshards, as FSDP does at the end of
    a unit's whole backward.
    The stage root's end-of-backward callback ends it, as it ends every backward.

    W's local backwards start from module outputs, and where one is also a unit's output
    (the head's logits, a routed expert's output) FSDP's pre-backward hook on it would
    all-gather that unit, prefetch the next and queue the end-of-backward callback inside
    W. So while W runs every group reads as already in its backward (the hook then does
    nothing) and the callback as already queued. torch's pipelining runtime reduces a
    split backward's gradients once at the end of the step instead, with every stage's
    parameters kept gathered from its first action to its last (``perform_reduce_grad``;
    torchtitan keeps them so under pipeline parallelism); here they are gathered and
    reduced every microbatch, the rule ``--zero 3`` charges."""

    def __init__(self) -> None:
        self.owners: dict[int, dict[nn.Module, tuple]] = {}  # per stage: module -> its unit's param groups

    def __call__(self, splitter: SplitBackward, stage: nn.Module, work: WeightWork) -> None:
        if work.output is not None:
            raise RuntimeError("--zero 3 (FSDP) cannot run W for parameters used outside their own module "
                               f"({', '.join(splitter.uncovered_names)}): FSDP would reduce their gradients "
                               "partway through; use --zero 2 or whole backwards")
        owners = self.owners.get(id(stage))
        if owners is None:
            owners = self.owners[id(stage)] = unit_groups(stage)
        by_unit: dict[tuple, list] = {}
        for call in work.calls:
            by_unit.setdefault(owners[call[0].module], []).append(call)
        root = fully_shard.state(stage)
        context = root._state_ctx
        groups = [group for state in context.all_states for group in state._fsdp_param_groups]
        for group in groups:
            group._training_state = TrainingState.PRE_BACKWARD
        context.post_backward_final_callback_queued = True
        units = list(by_unit.items())
        try:
            if units:
                gather(units[0][0])
            for index, (unit, calls) in enumerate(units):
                for group in unit:
                    group.wait_for_unshard()
                if index + 1 < len(units):
                    gather(units[index + 1][0])  # one unit ahead, as FSDP prefetches in a backward
                splitter.call_weight_grads(calls)
                for group in unit:
                    group.post_backward()
        except BaseException:
            for group in groups:
                group._training_state = TrainingState.IDLE
            context.post_backward_final_callback_queued = False
            raise
        root._root_post_backward_final_callback()  # every group idle, the callback unqueued


def gather(unit: tuple) -> None:
    """Issue the all-gather of each of ``unit``'s parameter groups. They read as in their
    backward (``PRE_BACKWARD``), so on a GPU FSDP issues it on its all-gather stream, as
    its own backward prefetch does, and the compute waits for it only in
    ``wait_for_unshard``; on gloo the call returns when it is done."""
    for group in unit:
        group.unshard()


def unit_groups(stage: nn.Module) -> dict[nn.Module, tuple]:
    """Every module of ``stage`` mapped to the FSDP parameter groups of the unit that
    holds its parameters: the nearest ``fully_shard``-ed module at or above it."""
    owners: dict[nn.Module, tuple] = {}

    def walk(module: nn.Module, groups: tuple) -> None:
        if isinstance(module, FSDPModule):
            groups = tuple(fully_shard.state(module)._fsdp_param_groups)
        owners[module] = groups
        for child in module.children():
            walk(child, groups)

    walk(stage, ())
    return owners
