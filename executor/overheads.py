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
from executor.models import PipelineModel, build_model
from executor.runtime import PipelineRuntime
from executor.spawn import synchronize
from schedules.action import RECV_KINDS
from schedules.generators import generate
from schedules.lowering import lower
from schedules.schedule import Schedule

POSTS = 16  # receives posted per measurement of the prefetch cost
TRANSFER_SAMPLES = 9  # paired with/without-transfer loops; their difference is noisy on a CPU


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
    """Seconds, on the real backend with a boundary-sized tensor, of: posting one send
    (``send_post``), waiting on a receive whose data has already arrived
    (``recv_wait``), posting one receive (``recv_post``), and the CPU time the
    backend's own threads spend per send or receive (``background_cpu``).

    The last one matters on a CPU: gloo moves data on threads of its own, and with one
    core per rank that time is taken from the ranks' compute. It is the process's CPU
    time less the calling thread's while transfers are in flight (a blocking wait that
    spins is the caller's own time and is left out). Rank r sends to r+1 and receives
    from r-1."""
    if world < 2:
        return {"send_post": 0.0, "recv_wait": 0.0, "recv_post": 0.0, "background_cpu": 0.0}
    after, before = (rank + 1) % world, (rank - 1) % world
    outgoing = torch.zeros(shape, dtype=dtype, device=device)
    samples: dict[str, list[float]] = {"send_post": [], "recv_wait": [], "recv_post": [], "background_cpu": []}

    def post_receives() -> list:
        return [dist.irecv(torch.empty(shape, dtype=dtype, device=device), before, tag=tag) for tag in range(POSTS)]

    def send_all() -> list[float]:
        times, works = [], []
        for tag in range(POSTS):
            begin = time.perf_counter()
            works.append(dist.isend(outgoing, after, tag=tag))
            times.append(time.perf_counter() - begin)
        for work in works:
            work.wait()
        return times

    for index in range(warmup + repeats):
        # transfers in flight: post cost, and the CPU the backend's threads use
        cpu = [(time.process_time(), time.thread_time())]
        start = time.perf_counter()
        receives = post_receives()
        posted = time.perf_counter()
        cpu.append((time.process_time(), time.thread_time()))
        dist.barrier()
        cpu.append((time.process_time(), time.thread_time()))
        send_times = send_all()
        for work in receives:
            work.wait()
        cpu.append((time.process_time(), time.thread_time()))
        # a receive whose data is already there: what waiting on it costs
        receives = post_receives()
        dist.barrier()
        send_all()
        dist.barrier()  # the peer's sends completed: every receive has arrived
        wait_times = []
        for work in receives:
            begin = time.perf_counter()
            work.wait()
            wait_times.append(time.perf_counter() - begin)
        if index >= warmup:
            background = sum((cpu[i + 1][0] - cpu[i][0]) - (cpu[i + 1][1] - cpu[i][1]) for i in (0, 2))
            samples["recv_post"].append((posted - start) / POSTS)
            samples["send_post"].append(statistics.median(send_times))
            samples["recv_wait"].append(statistics.median(wait_times))
            samples["background_cpu"].append(max(background, 0.0) / (2 * POSTS))
    return {key: statistics.fmean(values) if key == "background_cpu" else statistics.median(values)
            for key, values in samples.items()}


def transfer_interference(shape: tuple[int, ...], dtype: torch.dtype, rank: int, world: int, device: torch.device,
                          warmup: int, repeats: int) -> float:
    """Seconds one SEND or RECV adds to a rank that is computing between them, as in a
    pipeline: every rank repeats [compute, post a send, wait for the receive posted
    ahead], and the same compute without the transfers; half the difference per
    iteration is the cost of one communication action. Each iteration waits for the
    previous iteration's data, which has had a whole compute to arrive, so the link's
    latency (modelled by the topology) is not counted a second time here.

    On a CPU this is far more than posting the operation: gloo moves the data on
    threads of its own, and with one core per rank they take their time from the
    compute of one rank or the other (hundreds of microseconds per transfer on a
    2-core machine, where the call itself costs tens). On a GPU the compute runs on
    the device and the difference is the host's launch cost."""
    if world < 2:
        return 0.0
    after, before = (rank + 1) % world, (rank - 1) % world
    outgoing = torch.zeros(shape, dtype=dtype, device=device)
    work = torch.randn(192, 192, device=device)

    def compute() -> None:
        result = work
        for _ in range(8):
            result = (result @ work) * 1e-3

    def iterations(with_transfers: bool) -> float:
        count = warmup + repeats
        receives = [dist.irecv(torch.empty(shape, dtype=dtype, device=device), before, tag=tag)
                    for tag in range(count)] if with_transfers else []
        sends = []
        dist.barrier()
        start = time.perf_counter()
        for tag in range(count):
            compute()
            if with_transfers:
                sends.append(dist.isend(outgoing, after, tag=tag))
                if tag:  # the previous iteration's data: it had a whole compute to arrive
                    receives[tag - 1].wait()
        synchronize(device)
        elapsed = time.perf_counter() - start
        if with_transfers:
            receives[-1].wait()
        for send in sends:
            send.wait()
        return elapsed / count

    samples = []
    for _ in range(TRANSFER_SAMPLES):  # alternated, so a slow spell of the machine hits both
        plain = iterations(False)
        samples.append(max(iterations(True) - plain, 0.0) / 2)
    return statistics.median(samples)


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


def microbatch_size(config: RunConfig) -> int:
    """Samples in microbatch 0: the size every microbatch has when the batch divides."""
    return -(-config.batch_size // config.microbatches)


def measure_overheads(config: RunConfig, model: PipelineModel, schedule: Schedule, rank: int, world: int,
                      device: torch.device, warmup: int, repeats: int) -> dict[str, float]:
    """Every runtime overhead of this rank, in seconds (see the module docstring);
    ``model`` is the config's model, already built."""
    size = microbatch_size(config)
    p2p = p2p_overheads(model.boundary_shape(size), getattr(torch, config.dtype), rank, world, device,
                        warmup, repeats)
    receives = sum(1 for action in schedule.programs[rank] if action.kind in RECV_KINDS)
    prefetch = config.prefetch_receives(dist.get_backend() if world > 1 else "gloo")
    return {
        "action_gap": action_gap(warmup, repeats),
        "comm_post": (p2p["send_post"] + p2p["recv_wait"]) / 2,
        "send_post": p2p["send_post"],
        "recv_wait": p2p["recv_wait"],
        "background_cpu": p2p["background_cpu"] if device.type == "cpu" else 0.0,
        "transfer_cost": transfer_interference(model.boundary_shape(size), getattr(torch, config.dtype), rank, world,
                                               device, warmup, repeats),
        "prefetch_post": p2p["recv_post"] * receives if prefetch else 0.0,
        "loss_reduce": loss_reduce(world, device, warmup, repeats),
    }
