"""One rank of a pipelined run: set up the process group, build this rank's stages,
run the steps, and hand rank 0 the losses, step times and the gathered Trace.

``run_worker`` is the function every launched process runs (by ``pipesim run`` through
torch's elastic launcher, or by ``python -m executor`` under torchrun). Several configs
can share one process group, which lets tests run many schedules per launch.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from executor.clock import clock_for
from executor.comm import PeerLinks
from executor.config import RunConfig, parse_failure
from executor.gather import gather_events
from executor.models import PipelineModel, build_model
from executor.progress import ProgressWriter, progress_dir_from_env
from executor.runtime import PipelineRuntime
from schedules.action import Action
from schedules.generators import generate
from schedules.lowering import lower
from schedules.schedule import Schedule
from schedules.trace import Trace


class RankFailedError(RuntimeError):
    """A rank failed while running its program; the message names the rank, the step and
    the action it was on, and the launcher passes it on to the user."""


def resolve_backend(requested: str) -> str:
    """``auto`` means NCCL where CUDA is available, gloo everywhere else."""
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def build_schedule(config: RunConfig) -> Schedule:
    """The lowered schedule named by the config: the exact programs that will run."""
    if config.custom_schedule is not None:
        return lower(config.custom_schedule)
    return lower(generate(config.schedule, config.pp, config.microbatches, config.virtual_stages))


def run_worker(configs: list[RunConfig], model: PipelineModel | None = None) -> list[dict]:
    """Run each config in turn on this rank and return one result per config: the full
    result (losses, step times, gathered Trace) on rank 0, the gradients (when asked
    for) on every rank."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    first = configs[0]
    torch.set_num_threads(first.threads)
    backend = resolve_backend(first.backend)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group(backend, timeout=timedelta(seconds=first.timeout),
                                device_id=device if backend == "nccl" else None)
    directory = progress_dir_from_env()
    progress = ProgressWriter(directory, rank) if directory else None
    try:
        results = [run_config(config, model, rank, world, backend, device, progress) for config in configs]
    finally:
        if progress is not None:
            progress.close()
        if world > 1:
            dist.destroy_process_group()
    return results


def run_config(config: RunConfig, model: PipelineModel | None, rank: int, world: int, backend: str,
               device: torch.device, progress: ProgressWriter | None) -> dict:
    """Train ``config.steps`` steps of this rank's stages under the config's schedule."""
    schedule = build_schedule(config)
    if schedule.pp != world:
        raise RankFailedError(f"the schedule has pp={schedule.pp} ranks but {world} processes were started; "
                              f"start exactly --pp processes (torchrun --nproc-per-node {schedule.pp})")
    model = model or build_model(config)
    stage_ids = schedule.stages_of(rank)
    stages = {stage: model.build_stage(stage, schedule.num_stages).to(device) for stage in stage_ids}
    params = [p for stage in stages.values() for p in stage.parameters()]
    optimizer_class = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.SGD
    optimizer = optimizer_class(params, lr=config.lr)
    sizes = [len(part) for part in torch.tensor_split(torch.arange(config.batch_size), config.microbatches)]
    dtype = getattr(torch, config.dtype)
    links = PeerLinks(schedule.placement, config.microbatches, device, dtype,
                      lambda microbatch: model.boundary_shape(sizes[microbatch]))
    clock = clock_for(device)
    before = action_hook(config, rank, progress)
    runtime = PipelineRuntime(rank, schedule, stages, model, links, clock, config.batch_size, before)
    losses, step_times, events, grads = [], [], [], {}
    for step in range(config.steps):
        inputs, targets = model.make_batch(step, config.batch_size)
        inputs = list(torch.tensor_split(inputs.to(device), config.microbatches))
        targets = list(torch.tensor_split(targets.to(device), config.microbatches))
        optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            progress.step = step
        if world > 1:
            dist.barrier()
        started = time.perf_counter()
        try:
            loss, events = runtime.run_step(inputs, targets)
        except Exception as error:
            action = runtime.current
            waiting = ""
            if action is not None and not action.is_compute:
                waiting = f" (waiting for rank {links.peer(action)})"
            raise RankFailedError(f"rank {rank} failed in step {step} on action {action}{waiting}: "
                                  f"{type(error).__name__}: {error}") from error
        if config.return_grads and step == 0:
            grads = {f"{stage}.{name}": p.grad.detach().cpu().clone()
                     for stage, module in stages.items() for name, p in module.named_parameters()}
        optimizer.step()
        if world > 1:
            dist.all_reduce(loss)  # only the last stage holds a non-zero share
        losses.append(loss.item())
        step_times.append(time.perf_counter() - started)
    meta = {"pp": schedule.pp, "virtual_stages": schedule.virtual_stages, "schedule": schedule.name,
            "microbatches": schedule.microbatches, "source": "measured", "backend": backend,
            "world_size": world, "step": config.steps - 1}
    if world > 1:
        events = gather_events(schedule, rank, events, device)
    result = {"rank": rank, "grads": grads}
    if rank == 0:
        result.update(schedule=schedule.name, pp=schedule.pp, microbatches=schedule.microbatches,
                      virtual_stages=schedule.virtual_stages, world_size=world, backend=backend,
                      losses=losses, step_times=step_times, trace=Trace.merge([Trace(events)], meta))
    return result


def action_hook(config: RunConfig, rank: int, progress: ProgressWriter | None):
    """What runs before each action: the progress line, and any injected failure."""
    failure = parse_failure(config.inject_failure) if config.inject_failure else None
    target = failure if failure and failure[0] == rank else None
    if progress is None and target is None:
        return None

    def before(action: Action) -> None:
        if progress is not None:
            progress.on_action(action)
        if target is not None and str(action) == target[1] and (progress is None or progress.step == 0):
            if target[2] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if target[2] == "hang":
                time.sleep(24 * 3600)  # its peers must give up after --timeout
            raise RuntimeError(f"failure injected by --inject-failure {config.inject_failure}")

    return before
