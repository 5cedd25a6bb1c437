"""Schedule files in torch.distributed.pipelining's own runtime: loaded only after pipesim
has checked them against the torch schedule they go into, and run on a model pipesim
also runs as a one-process reference.

``load_schedule_csv`` is the check-then-load a user (or ``executor.torchtitan_launch``)
calls instead of ``_PipelineScheduleRuntime._load_csv``: it tells torch the file's format
(compute-only or lowered, which torch cannot tell itself), refuses a file whose
placement, stage count or microbatch count differs from the runtime's stages
(``schedules.torch_compat``), a lowered file without its ``REDUCE_GRAD`` cells, one with
pipesim's ``+`` groups (torch reads a group as its first action), and, on NCCL, an order
that can hang torch's runtime (``schedules.torch_runtime``).

``run_cases`` runs files through that path on one rank with the executor's models (and,
with data parallelism, FSDP2's ``fully_shard`` over the replicas, which is what the
lowered file's ``UNSHARD``/``RESHARD``/``REDUCE_GRAD`` drive), for the numerics tests: the
loss and gradients of a step in torch's runtime against ``executor.reference``. A case
with torchtitan's parsed ``parallelism`` config goes through torchtitan itself: its
placement of the stages on ranks, FSDP on every stage (as torchtitan wraps them, over a
one-rank mesh without data parallelism), and its schedule builder, which loads the CSV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch.distributed.tensor import DTensor

from executor.architectures.moe import balanced_layers, set_balance_scale
from executor.config import RunConfig
from executor.lr_schedule import attach_schedule
from executor.models import PipelineModel, build_model, build_optimizer
from executor.process import init_rank
from schedules.csv_io import schedule_from_csv
from schedules.schedule import Schedule
from schedules.torch_compat import TorchMismatchError, check_reduce_grad, check_torch_stages
from schedules.torch_runtime import as_torch_posts, check_torch_runtime
from schedules.validate import validate

COMPUTE_ONLY, COMPUTE_COMMS = "compute_only", "compute_comms"  # torch's names of the two formats
# torch's own loader, kept before ``executor.torchtitan_launch`` puts ``load_schedule_csv`` in its place
_TORCH_LOAD_CSV = _PipelineScheduleRuntime._load_csv
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # torch's checkpoint wrapper's prefix to parameter names


def torch_format(schedule: Schedule) -> str:
    """The ``format`` torch's ``_load_csv`` must be given for this file."""
    return COMPUTE_COMMS if schedule.is_lowered else COMPUTE_ONLY


def check_for_runtime(schedule: Schedule, runtime: _PipelineScheduleRuntime, label: str, backend: str) -> None:
    """Everything ``load_schedule_csv`` refuses, on a schedule already read."""
    if any(schedule.joins):
        rank = next(rank for rank, joined in enumerate(schedule.joins) if joined)
        raise TorchMismatchError(
            f"{label}: rank {rank}'s row holds P2P groups joined by '+' (pipesim's own form, `export --groups`), "
            f"which torch reads as each group's first action; write it with `pipesim export --lowered` instead")
    check_torch_stages(schedule, runtime.rank, [stage.stage_index for stage in runtime._stages], runtime._num_stages,
                       runtime.pp_group_size, runtime._n_microbatches, label)
    check_reduce_grad(schedule, label)
    if schedule.is_lowered and backend == "nccl":
        check_torch_runtime(schedule)
    else:
        validate(as_torch_posts(schedule), "buffered")


def load_schedule_csv(runtime: _PipelineScheduleRuntime, path: str) -> Schedule:
    """Load the CSV at ``path`` into torch's ``runtime`` in the format it is written in,
    once it is known to fit the runtime's stages (see the module docstring); return the
    schedule as pipesim read it. Errors are one line naming the file and what differs."""
    schedule = schedule_from_csv(path)
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    check_for_runtime(schedule, runtime, str(path), backend)
    _TORCH_LOAD_CSV(runtime, str(path), format=torch_format(schedule))
    return schedule


@dataclass(frozen=True)
class TorchCase:
    """One file to run in torch's runtime: ``label`` names the result, ``scale_grads`` is
    the runtime's setting (True: losses are per-microbatch means and torch divides the
    gradients by the microbatch count; False: the loss function already divides).
    ``loader``: ``"checked"`` (``load_schedule_csv``), ``"torchtitan"`` (as torchtitan
    calls it, ``runtime._load_csv(path)``, under ``executor.torchtitan_launch``) or
    ``"torch"`` (torch's loader without pipesim's checks: it exists so tests can show what
    the checks prevent). ``parallelism``: torchtitan's parsed ``ParallelismConfig``, for a
    case built by torchtitan (``loader`` "torchtitan": its placement, FSDP on every stage,
    ``_build_pipeline_schedule``; ``path`` is then the config's CSV)."""

    label: str
    path: str
    scale_grads: bool
    loader: str = "checked"
    parallelism: object | None = None
    local_batch_size: int | None = None  # torchtitan's training.local_batch_size, with ``parallelism``
    activation_checkpoint: object | None = None  # torchtitan's parsed policy config, wrapped round each stage


@dataclass(frozen=True)
class _Position:
    """Where this process sits in a job's pp x dp grid, and what it talks over: the
    pipeline group, and with dp > 1 the mesh FSDP shards each stage over."""

    pp_rank: int
    dp_rank: int
    dp: int
    pp_group: dist.ProcessGroup | None
    dp_mesh: DeviceMesh | None
    unit_mesh: DeviceMesh | None = None  # one rank, for FSDP without replicas (as torchtitan shards)


def _positions(jobs: list[tuple[RunConfig, list[TorchCase]]], rank: int, world: int,
               device: torch.device) -> dict[tuple[int, int], _Position | None]:
    """Each job's (pp, dp) grid: pp x dp must fill the world when dp > 1 (FSDP over a
    device mesh); a pipeline alone may take the first ``pp`` ranks. Every rank creates
    every group, in the same order, as torch requires; None where this rank has no part."""
    positions: dict[tuple[int, int], _Position | None] = {}
    for config, _ in jobs:
        shape = (config.pp, config.dp)
        if shape in positions:
            continue
        if config.dp > 1:
            if config.pp * config.dp != world:
                raise ValueError(f"pp {config.pp} x dp {config.dp} must use all {world} ranks")
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp"))
            positions[shape] = _Position(mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), config.dp,
                                         mesh["pp"].get_group(), mesh["dp"])
        else:
            group = dist.new_group(list(range(config.pp))) if config.pp < world else None
            unit = None
            if config.pp == world and any(case.parallelism is not None for job, cases in jobs
                                          if (job.pp, job.dp) == shape for case in cases):
                unit = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp"))["dp"]
            positions[shape] = _Position(rank, 0, 1, group, None, unit) if rank < config.pp else None
    return positions


def run_cases(jobs: list[tuple[RunConfig, list[TorchCase]]]) -> dict[str, dict]:
    """On this rank (started by ``executor.spawn.launch_ranks``): run every case of every
    job with the job's config (model, batch, ``steps`` steps of its optimizer; with
    ``dp`` > 1 each replica takes its slice of the batch and FSDP shards the stages over
    the replicas; a pipeline smaller than the world runs on its first ranks, so one launch
    serves several sizes; the first config's backend and timeout join the process group).
    Returns, per label, the batch loss of every step (on the ranks that hold the last
    stage, averaged over the replicas) and this rank's stages' full gradients of the first
    step, named ``"{stage}.{parameter}"`` as ``reference_run`` names them."""
    first = jobs[0][0]
    rank, world, device, _ = init_rank("gloo" if first.backend == "auto" else first.backend, first.threads,
                                       first.timeout)
    positions = _positions(jobs, rank, world, device)
    results = {}
    for config, cases in jobs:
        position = positions[(config.pp, config.dp)]
        if position is None:
            continue
        model = build_model(config)
        for case in cases:
            results[case.label] = _run_case(case, config, model, position, device)
    return results


def _run_case(case: TorchCase, config: RunConfig, model: PipelineModel, position: _Position,
              device: torch.device) -> dict:
    spec = getattr(model, "spec", None)
    if spec is not None and spec.mtp_depth:
        raise ValueError(f"{config.model}: multi-token prediction embeds each microbatch's targets in the last "
                         "stage's forward, which torch's runtime calls with the activation alone (run it with "
                         "pipesim's runtime)")
    schedule = schedule_from_csv(case.path)
    num_stages = schedule.num_stages
    if case.parallelism is not None:
        from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping

        placed = _get_pp_rank_to_stage_indices_mapping(position.pp_rank, schedule.pp,
                                                       case.parallelism.pipeline_parallel_schedule, num_stages)
    else:
        placed = schedule.stages_of(position.pp_rank)
    modules = {stage: model.build_stage(stage, num_stages).to(device) for stage in placed}
    if case.activation_checkpoint is not None:  # as torchtitan wraps each block, here each stage
        policy = case.activation_checkpoint.build(dump_folder="")
        modules = {stage: policy._wrap_block(module) for stage, module in modules.items()}
    shard_mesh = position.dp_mesh or (position.unit_mesh if case.parallelism is not None else None)
    if shard_mesh is not None:
        for module in modules.values():
            fully_shard(module, mesh=shard_mesh)
    stages = [PipelineStage(module, stage, num_stages, device, group=position.pp_group)
              for stage, module in modules.items()]
    replica = config.batch_size // position.dp
    divisor = None if case.scale_grads else replica  # FSDP averages the replicas' gradients

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return model.loss_sum(output, target) / (divisor or output.shape[0])

    # a MoE layer's balance loss is divided as loss_fn divides (scale_grads: by the microbatch,
    # torch then dividing every gradient by the microbatches)
    set_balance_scale(balanced_layers(modules.values()), 1 / (divisor or replica // schedule.microbatches))

    if case.parallelism is not None:
        if case.local_batch_size * position.dp != config.batch_size:
            raise TorchMismatchError(f"{case.label}: torchtitan's local_batch_size {case.local_batch_size} x dp "
                                     f"{position.dp} is not the run's batch of {config.batch_size}")
        runtime = _torchtitan_schedule(case, stages, loss_fn)  # its builder loads the CSV
    else:
        runtime = _PipelineScheduleRuntime(stages, n_microbatches=schedule.microbatches, loss_fn=loss_fn,
                                           scale_grads=case.scale_grads)
        _load(runtime, case, schedule)
    optimizer = build_optimizer(config, [p for module in modules.values() for p in module.parameters()])
    lr_schedule = attach_schedule(optimizer, config)
    first, last = 0 in modules, num_stages - 1 in modules
    own = slice(position.dp_rank * replica, (position.dp_rank + 1) * replica)
    losses, grads = [], {}
    for step in range(config.steps):
        inputs, targets = (tensor[own].to(device) for tensor in model.make_batch(step, config.batch_size))
        microbatch_losses: list[torch.Tensor] = []
        args = (inputs,) if first else ()
        extra = {"target": targets, "losses": microbatch_losses} if last else {}
        runtime.step(*args, **extra)
        if step == 0:
            grads = {f"{stage}.{name.replace(CHECKPOINT_PREFIX, '')}": _full(parameter.grad)
                     for stage, module in modules.items() for name, parameter in module.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if lr_schedule is not None:
            lr_schedule.step()
        if last:
            total = torch.stack(microbatch_losses).sum().detach()
            loss = total / len(microbatch_losses) if case.scale_grads else total
            if position.dp_mesh is not None:
                dist.all_reduce(loss, group=position.dp_mesh.get_group())
                loss = loss / position.dp
            losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def _load(runtime: _PipelineScheduleRuntime, case: TorchCase, schedule: Schedule) -> None:
    """Load the case's file into ``runtime`` with the case's loader (``TorchCase``)."""
    if case.loader == "torchtitan":
        from executor.torchtitan_launch import install

        install()
        runtime._load_csv(case.path)
    elif case.loader == "torch":
        _TORCH_LOAD_CSV(runtime, case.path, format=torch_format(schedule))
    else:
        load_schedule_csv(runtime, case.path)


def _torchtitan_schedule(case: TorchCase, stages: list[PipelineStage], loss_fn) -> _PipelineScheduleRuntime:
    """The schedule torchtitan builds for ``stages`` from its parsed config: its
    ``_build_pipeline_schedule`` (``scale_grads=False``, the microbatch count from
    ``local_batch_size / pipeline_parallel_microbatch_size``, the CSV loaded by
    ``_load_csv(path)``, through pipesim's loader when ``executor.torchtitan_launch`` has
    installed it, i.e. for a lowered file)."""
    from torchtitan.distributed.pipeline_parallel import _build_pipeline_schedule

    if schedule_from_csv(case.path).is_lowered:
        from executor.torchtitan_launch import install

        install()
    else:  # a compute-only file as torchtitan loads it without pipesim's launcher
        _PipelineScheduleRuntime._load_csv = _TORCH_LOAD_CSV
    return _build_pipeline_schedule(parallelism=case.parallelism, local_batch_size=case.local_batch_size, stages=stages,
                                    loss_fn=lambda *args, **kwargs: (loss_fn(*args, **kwargs), None))


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one tensor: an FSDP-sharded one gathered from every replica."""
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
