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


def run_local(config: RunConfig, model: PipelineModel | None = None) -> dict:
    """Run a config on this process alone (``pp=1``: every stage here, no communication)."""
    if config.pp != 1:
        raise ValueError(f"run_local runs pp=1 only; pp={config.pp} needs launch() or torchrun")
    config.check()
    (result,) = run_worker([config], model)
    return result


def run_config(config: RunConfig, model: PipelineModel | None, rank: int, world: int, backend: str,
               device: torch.device, progress: ProgressWriter | None) -> dict:
    """Train ``config.steps`` steps of this rank's stages under the config's schedule."""
    run = RankRun(config, model, rank, world, backend, device, progress)
    for step in range(config.steps):
        run.step(step)
    return run.result()


class RankRun:
    """This rank's stages, optimizer and runtime for one config, stepped one step at a
    time (so a benchmark can interleave it with another runtime step by step)."""

    def __init__(self, config: RunConfig, model: PipelineModel | None, rank: int, world: int, backend: str,
                 device: torch.device, progress: ProgressWriter | None) -> None:
        schedule = build_schedule(config)
        if schedule.pp != world:
            raise RankFailedError(f"the schedule has pp={schedule.pp} ranks but {world} processes were started; "
                                  f"start exactly --pp processes (torchrun --nproc-per-node {schedule.pp})")
        self.config, self.schedule, self.rank, self.world = config, schedule, rank, world
        self.backend, self.device, self.progress = backend, device, progress
        self.model = model = model or build_model(config)
        self.stages = {stage: model.build_stage(stage, schedule.num_stages).to(device)
                       for stage in schedule.stages_of(rank)}
        params = [p for stage in self.stages.values() for p in stage.parameters()]
        optimizer_class = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.SGD
        self.optimizer = optimizer_class(params, lr=config.lr)
        sizes = [len(part) for part in torch.tensor_split(torch.arange(config.batch_size), config.microbatches)]
        self.links = PeerLinks(schedule.placement, config.microbatches, device, getattr(torch, config.dtype),
                               lambda microbatch: model.boundary_shape(sizes[microbatch]))
        self.runtime = PipelineRuntime(rank, schedule, self.stages, model, self.links, clock_for(device),
                                       config.batch_size, action_hook(config, rank, progress),
                                       prefetch_recvs=config.prefetch_receives(backend))
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.events: list = []
        self.grads: dict[str, torch.Tensor] = {}

    def step(self, step: int) -> None:
        """One training step: the program, the optimizer, the loss made known to all."""
        config, device = self.config, self.device
        inputs, targets = self.model.make_batch(step, config.batch_size)
        inputs = list(torch.tensor_split(inputs.to(device), config.microbatches))
        targets = list(torch.tensor_split(targets.to(device), config.microbatches))
        self.optimizer.zero_grad(set_to_none=True)
        if self.progress is not None:
            self.progress.step = step
        if self.world > 1:
            dist.barrier()
        started = time.perf_counter()
        try:
            loss, self.events = self.runtime.run_step(inputs, targets)
        except Exception as error:
            action = self.runtime.current
            waiting = ""
            if action is not None and not action.is_compute:
                waiting = f" (waiting for rank {self.links.peer(action)})"
            raise RankFailedError(f"rank {self.rank} failed in step {step} on action {action}{waiting}: "
                                  f"{type(error).__name__}: {error}") from error
        if config.return_grads and step == 0:
            self.grads = {f"{stage}.{name}": p.grad.detach().cpu().clone()
                          for stage, module in self.stages.items() for name, p in module.named_parameters()}
        self.optimizer.step()
        if self.world > 1:
            dist.all_reduce(loss)  # only the last stage holds a non-zero share
        self.losses.append(loss.item())
        self.step_times.append(time.perf_counter() - started)

    def result(self) -> dict:
        """Rank 0: the run's summary and the last step's Trace from every rank; every
        rank: its gradients of the first step, when the config asked for them."""
        schedule, events = self.schedule, self.events
        meta = {"pp": schedule.pp, "virtual_stages": schedule.virtual_stages, "schedule": schedule.name,
                "microbatches": schedule.microbatches, "source": "measured", "backend": self.backend,
                "world_size": self.world, "step": len(self.losses) - 1}
        if self.world > 1:
            events = gather_events(schedule, self.rank, events, self.device)
        result = {"rank": self.rank, "grads": self.grads}
        if self.rank == 0:
            result.update(schedule=schedule.name, pp=schedule.pp, microbatches=schedule.microbatches,
                          virtual_stages=schedule.virtual_stages, world_size=self.world, backend=self.backend,
                          losses=self.losses, step_times=self.step_times,
                          trace=Trace.merge([Trace(events)], meta))
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
