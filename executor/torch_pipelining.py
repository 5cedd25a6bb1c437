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

``run_cases`` runs files through that path on one rank with the executor's models, for
the numerics tests: the loss and gradients of a step in torch's runtime against
``executor.reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from executor.config import RunConfig
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
    the checks prevent)."""

    label: str
    path: str
    scale_grads: bool
    loader: str = "checked"


def run_cases(jobs: list[tuple[RunConfig, list[TorchCase]]]) -> dict[str, dict]:
    """On this rank (started by ``executor.spawn.launch_ranks``): run every case of every
    job with the job's config (model, batch, ``steps`` steps of its optimizer) on pipeline
    ranks ``0 .. config.pp - 1`` (a smaller pipeline than the world gets a group of its
    own, so one launch serves several sizes; the first config's backend and timeout join
    the process group). Returns, per label, the batch loss of every step (on the rank that
    holds the last stage) and this rank's stages' gradients of the first step, named
    ``"{stage}.{parameter}"`` as ``reference_run`` names them."""
    first = jobs[0][0]
    rank, world, device, _ = init_rank("gloo" if first.backend == "auto" else first.backend, first.threads,
                                       first.timeout)
    groups = {}
    for config, _ in jobs:  # every rank creates every group, in the same order, as torch requires
        if config.pp not in groups:
            groups[config.pp] = dist.new_group(list(range(config.pp))) if config.pp < world else None
    results = {}
    for config, cases in jobs:
        if rank >= config.pp:
            continue
        model = build_model(config)
        for case in cases:
            results[case.label] = _run_case(case, config, model, rank, device, groups[config.pp])
    return results


def _run_case(case: TorchCase, config: RunConfig, model: PipelineModel, rank: int, device: torch.device,
              group: dist.ProcessGroup | None) -> dict:
    schedule = schedule_from_csv(case.path)
    num_stages = schedule.num_stages
    modules = {stage: model.build_stage(stage, num_stages).to(device) for stage in schedule.stages_of(rank)}
    stages = [PipelineStage(module, stage, num_stages, device, group=group) for stage, module in modules.items()]
    divisor = None if case.scale_grads else config.batch_size

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return model.loss_sum(output, target) / (divisor or output.shape[0])

    runtime = _PipelineScheduleRuntime(stages, n_microbatches=schedule.microbatches, loss_fn=loss_fn,
                                       scale_grads=case.scale_grads)
    if case.loader == "torchtitan":
        from executor.torchtitan_launch import install

        install()
        runtime._load_csv(case.path)
    elif case.loader == "torch":
        _TORCH_LOAD_CSV(runtime, case.path, format=torch_format(schedule))
    else:
        load_schedule_csv(runtime, case.path)
    optimizer = build_optimizer(config, [p for module in modules.values() for p in module.parameters()])
    first, last = 0 in modules, num_stages - 1 in modules
    losses, grads = [], {}
    for step in range(config.steps):
        inputs, targets = (tensor.to(device) for tensor in model.make_batch(step, config.batch_size))
        microbatch_losses: list[torch.Tensor] = []
        args = (inputs,) if first else ()
        extra = {"target": targets, "losses": microbatch_losses} if last else {}
        runtime.step(*args, **extra)
        if step == 0:
            grads = {f"{stage}.{name}": parameter.grad.detach().clone()
                     for stage, module in modules.items() for name, parameter in module.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if last:
            total = torch.stack(microbatch_losses).sum()
            losses.append((total / len(microbatch_losses) if case.scale_grads else total).item())
    return {"losses": losses, "grads": grads}
