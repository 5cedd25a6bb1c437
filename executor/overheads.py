"""What the runtime costs around the compute, measured on the backend it runs on.

A step of the executor is more than its F/B/I/W: the Python loop between actions, the
posting of each SEND and the wait on each RECV, the receives gloo posts ahead at the
start of a step, the optimizer step and the all-reduce that makes the loss known. The
simulator charges each of these (``Costs.action_overhead``, ``comm_overhead``,
``step_overhead``); this module measures them with the executor's own code or calls.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from executor.clock import CpuClock
from executor.config import RunConfig
from executor.models import build_model
from executor.runtime import PipelineRuntime
from schedules.action import RECV_KINDS
from schedules.generators import generate
from schedules.lowering import lower
from schedules.schedule import Schedule

POSTS = 16  # receives posted per measurement of the prefetch cost


def action_gap(warmup: int, repeats: int) -> float:
    """Seconds the runtime spends between two compute actions (its loop, the clock
    marks, the bookkeeping): the executor's own ``PipelineRuntime`` on a one-rank
    program of a one-unit model, where the compute is nearly free and the gaps between
    the recorded actions are the loop itself."""
    microbatches = 8
    config = RunConfig(pp=1, microbatches=microbatches, layers=1, hidden=1, batch_size=microbatches, model="mlp")
    model = build_model(config)
    stages = {0: model.build_stage(0, 1)}
    schedule = lower(generate("gpipe", 1, microbatches, 1))
    runtime = PipelineRuntime(0, schedule, stages, model, None, CpuClock(), config.batch_size)
    inputs, targets = model.make_batch(0, config.batch_size)
    inputs, targets = list(inputs.split(1)), list(targets.split(1))
    gaps = []
    for index in range(warmup + repeats):
        _, events = runtime.run_step(inputs, targets)
        if index >= warmup:
            events.sort(key=lambda event: event.start)
            gaps.extend(after.start - before.end for before, after in zip(events, events[1:], strict=False))
    return statistics.median(gaps)


def p2p_overheads(shape: tuple[int, ...], dtype: torch.dtype, rank: int, world: int, device: torch.device,
                  warmup: int, repeats: int) -> dict[str, float]:
    """Host seconds to post one send (``send_post``), to wait on a receive whose data has
    already arrived (``recv_wait``), and to post one receive (``recv_post``), on the
    real backend with a boundary-sized tensor. Rank r sends to r+1, receives from r-1."""
    if world < 2:
        return {"send_post": 0.0, "recv_wait": 0.0, "recv_post": 0.0}
    after, before = (rank + 1) % world, (rank - 1) % world
    outgoing = torch.zeros(shape, dtype=dtype, device=device)
    samples: dict[str, list[float]] = {"send_post": [], "recv_wait": [], "recv_post": []}
    for index in range(warmup + repeats):
        buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(POSTS)]
        start = time.perf_counter()
        receives = [dist.irecv(buffer, before, tag=tag) for tag, buffer in enumerate(buffers)]
        posted = time.perf_counter()
        dist.barrier()
        sends = []
        send_times = []
        for tag in range(POSTS):
            begin = time.perf_counter()
            sends.append(dist.isend(outgoing, after, tag=tag))
            send_times.append(time.perf_counter() - begin)
        for work in sends:
            work.wait()
        dist.barrier()  # every receive has arrived: the peer's sends completed
        wait_times = []
        for work in receives:
            begin = time.perf_counter()
            work.wait()
            wait_times.append(time.perf_counter() - begin)
        if index >= warmup:
            samples["recv_post"].append((posted - start) / POSTS)
            samples["send_post"].append(statistics.median(send_times))
            samples["recv_wait"].append(statistics.median(wait_times))
    return {key: statistics.median(values) for key, values in samples.items()}


def loss_reduce(world: int, device: torch.device, warmup: int, repeats: int) -> float:
    """Seconds of the step's last act: the loss all-reduce and reading it on the host."""
    if world < 2:
        return 0.0
    loss = torch.zeros((), device=device)
    samples = []
    for index in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(loss)
        loss.item()
        if index >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_overheads(config: RunConfig, schedule: Schedule, rank: int, world: int, device: torch.device,
                      warmup: int, repeats: int) -> dict[str, float]:
    """Every runtime overhead of this rank, in seconds (see the module docstring)."""
    model = build_model(config)
    size = -(-config.batch_size // config.microbatches)
    p2p = p2p_overheads(model.boundary_shape(size), getattr(torch, config.dtype), rank, world, device,
                        warmup, repeats)
    receives = sum(1 for action in schedule.programs[rank] if action.kind in RECV_KINDS)
    prefetch = config.prefetch_receives(dist.get_backend() if world > 1 else "gloo")
    return {
        "action_gap": action_gap(warmup, repeats),
        "comm_post": (p2p["send_post"] + p2p["recv_wait"]) / 2,
        "send_post": p2p["send_post"],
        "recv_wait": p2p["recv_wait"],
        "prefetch_post": p2p["recv_post"] * receives if prefetch else 0.0,
        "loss_reduce": loss_reduce(world, device, warmup, repeats),
    }
