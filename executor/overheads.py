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
from collections.abc import Callable

import torch
import torch.distributed as dist

from executor.clock import CpuClock
from executor.config import RunConfig
from executor.estimate import ROUNDS, robust_mean
from executor.models import PipelineModel, build_model
from executor.runtime import PipelineRuntime
from executor.spawn import synchronize
from schedules.action import RECV_KINDS
from schedules.generators import generate
from schedules.lowering import lower
from schedules.schedule import Schedule

POSTS = 16  # sends and receives per sample of the post and wait costs
STALL_SAMPLES = 100  # samples of a cost with rare millisecond stalls, whose mean needs many
TRANSFER_BLOCK = 32  # iterations between barriers in the transfer-cost loop (half of them transfer)


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
    return statistics.fmean(gaps)


def p2p_overheads(shape: tuple[int, ...], dtype: torch.dtype, rank: int, world: int, device: torch.device,
                  warmup: int, repeats: int) -> dict[str, float]:
    """Seconds, on the real backend with a boundary-sized tensor, of: posting one P2P
    operation as the runtime posts it, in a batch (``send_post``: half of posting a
    send+receive pair), waiting on a receive whose data has already arrived
    (``recv_wait``), and the CPU time the backend's own threads spend per send or
    receive (``background_cpu``). Means, as for every cost the simulator adds up.

    Every transfer is posted as one ``batch_isend_irecv`` of a send to r+1 and a
    receive from r-1, the same on every rank, as the runtime's P2P groups are: safe
    under NCCL's rule (operations between a pair match in posting order and a send may
    wait for its receive). Posting many unbatched receives before any send, as this
    loop once did, deadlocks on NCCL.

    The last one matters on a CPU: gloo moves data on threads of its own, and with one
    core per rank that time is taken from the ranks' compute. It is the process's CPU
    time less the calling thread's while transfers are in flight (a blocking wait that
    spins is the caller's own time and is left out)."""
    if world < 2:
        return {"send_post": 0.0, "recv_wait": 0.0, "background_cpu": 0.0}
    after, before = (rank + 1) % world, (rank - 1) % world
    outgoing = torch.zeros(shape, dtype=dtype, device=device)
    samples: dict[str, list[float]] = {"send_post": [], "recv_wait": [], "background_cpu": []}

    def post_pairs() -> tuple[list[float], list[tuple[list, list]]]:
        """POSTS paired batches; per batch its post time and (send works, receive works)."""
        times, batches = [], []
        for tag in range(POSTS):
            receive = torch.empty(shape, dtype=dtype, device=device)
            begin = time.perf_counter()
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, after, tag=tag),
                                            dist.P2POp(dist.irecv, receive, before, tag=tag)])
            times.append(time.perf_counter() - begin)
            # gloo: one handle per op; NCCL coalesces the batch into one handle
            batches.append((works[:1], works[1:]) if len(works) == 2 else ([], works))
        return times, batches

    for index in range(warmup + repeats):
        # transfers in flight: post cost, and the CPU the backend's threads use
        dist.barrier()
        cpu = [(time.process_time(), time.thread_time())]
        post_times, batches = post_pairs()
        cpu.append((time.process_time(), time.thread_time()))
        for sends, receives in batches:
            for work in [*sends, *receives]:
                work.wait()
        synchronize(device)
        cpu.append((time.process_time(), time.thread_time()))
        # a receive whose data is already there: what waiting on it costs
        _, batches = post_pairs()
        for sends, _ in batches:
            for work in sends:
                work.wait()
        synchronize(device)  # NCCL: every transfer of the batch done on the device
        dist.barrier()  # the peer's sends completed too: every receive has arrived
        wait_times = []
        for _, receives in batches:
            begin = time.perf_counter()
            for work in receives:
                work.wait()
            wait_times.append(time.perf_counter() - begin)
        if index >= warmup:
            background = sum((cpu[i + 1][0] - cpu[i][0]) - (cpu[i + 1][1] - cpu[i][1]) for i in (0, 1))
            samples["send_post"].append(statistics.fmean(post_times) / 2)
            samples["recv_wait"].append(statistics.fmean(wait_times))
            samples["background_cpu"].append(max(background, 0.0) / (2 * POSTS))
    return {key: statistics.fmean(values) for key, values in samples.items()}


def transfer_interference(shape: tuple[int, ...], dtype: torch.dtype, rank: int, world: int, device: torch.device,
                          min_time: float) -> float:
    """Seconds one SEND or RECV adds to a rank that is computing between them, as in a
    pipeline. Every rank runs a loop of short computes in which every other iteration
    also sends a boundary-sized tensor to the next rank and receives one from the
    previous; the mean difference between an iteration with the transfers and the
    iteration before it without, halved, is the cost of one communication action.
    A receive is waited for two transfer iterations after it was posted, so its data
    has had time to arrive and the link's latency (modelled by the topology) is not
    counted a second time here; on a GPU the iterations are timed with CUDA events and
    nothing synchronises inside a block, for the same reason.

    On a CPU this is far more than posting the operation: gloo moves the data on
    threads of its own and the kernel copies it through loopback, and with one core
    per rank that time is taken from the compute of one rank or the other (hundreds of
    microseconds per transfer on a 2-core machine, where the call itself costs tens).
    On a GPU the compute runs on the device and the difference is the host's cost.

    Why adjacent iterations and a mean: a single transfer's cost is heavy-tailed
    (most cost tens of microseconds, a few a whole scheduler slice), and the pipeline
    pays the mean. Pairing neighbours cancels the machine's slow drifts, which a
    difference of two long loops (the first design) did not: it gave 140-410 us for
    one config from one launch to the next. The loop runs for at least ``min_time``
    seconds in ``ROUNDS`` rounds, and the estimate is the median of their means
    (``executor.estimate``); all ranks run the same number of blocks."""
    if world < 2:
        return 0.0
    after, before = (rank + 1) % world, (rank - 1) % world
    outgoing = torch.zeros(shape, dtype=dtype, device=device)
    work = torch.randn(160, 160, device=device)

    def compute() -> None:
        result = work
        for _ in range(4):
            result = (result @ work) * 1e-3

    # On a GPU each iteration is timed by CUDA events on the compute stream, resolved
    # after the block: no synchronisation inside it, so the transfer's time on the link
    # (counted by the topology) is not counted here again; what shows is what posting
    # and waiting cost the compute stream. On a CPU, host time.
    if device.type == "cuda":
        def stamp() -> torch.cuda.Event:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def elapsed(begin: torch.cuda.Event, end: torch.cuda.Event) -> float:
            end.synchronize()
            return begin.elapsed_time(end) / 1000.0
    else:
        stamp = time.perf_counter

        def elapsed(begin: float, end: float) -> float:
            return end - begin

    def block() -> list[float]:
        """One block of TRANSFER_BLOCK iterations, ranks aligned by a barrier first;
        returns the per-iteration differences (with transfers minus without)."""
        dist.barrier()
        marks, posted, buffers = [], [], []  # buffers: a receive's tensor must outlive it
        for index in range(TRANSFER_BLOCK):
            begin = stamp()
            compute()
            if index % 2:
                receive = torch.empty(shape, dtype=dtype, device=device)
                buffers.append(receive)
                tag = len(posted)  # gloo matches by tag; NCCL by order, which is the same on every rank
                posted.append(dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, after, tag=tag),
                                                      dist.P2POp(dist.irecv, receive, before, tag=tag)]))
                if len(posted) > 2:  # the transfer of two transfer-iterations ago
                    for done in posted[-3]:
                        done.wait()  # once only: a second wait on a gloo send waits for another send
            marks.append((begin, stamp()))
        for works in posted[-2:]:  # the ones not yet waited for
            for done in works:
                done.wait()
        durations = [elapsed(begin, end) for begin, end in marks]
        return [durations[index] - durations[index - 1] for index in range(1, TRANSFER_BLOCK, 2)]

    block()  # warm-up: connections, allocator, caches
    started = time.perf_counter()
    block()
    per_round = round(min_time / ROUNDS / max(time.perf_counter() - started, 1e-6))
    blocks = torch.tensor([max(1, per_round)], device=device)  # NCCL reduces device tensors only
    dist.all_reduce(blocks, op=dist.ReduceOp.MAX)  # every rank must post the same transfers
    round_means = [statistics.fmean(d for _ in range(int(blocks.item())) for d in block()) for _ in range(ROUNDS)]
    return max(robust_mean(round_means), 0.0) / 2


def loss_reduce(world: int, device: torch.device, warmup: int, repeats: int) -> float:
    """Seconds of the step's last act: the loss all-reduce and reading it on the host."""
    if world < 2:
        return 0.0
    loss = torch.zeros((), device=device)

    def reduce() -> None:
        dist.all_reduce(loss)
        loss.item()

    return mean_after_barrier(reduce, warmup, max(repeats, STALL_SAMPLES))


def mean_after_barrier(timed: Callable[[], Callable[[], None] | None], warmup: int, samples: int) -> float:
    """Mean seconds of ``timed()`` started right after a barrier, as at the start or
    end of a step; a callable it returns finishes the sample untimed. Many samples:
    on a shared 2-core VM most such operations take a hundred microseconds and one in
    a few takes milliseconds, and a step pays the mean."""
    seconds = []
    for index in range(warmup + samples):
        dist.barrier()
        start = time.perf_counter()
        finish = timed()
        elapsed = time.perf_counter() - start
        if finish is not None:
            finish()
        if index >= warmup:
            seconds.append(elapsed)
    return statistics.fmean(seconds)


def prefetch_cost(shape: tuple[int, ...], dtype: torch.dtype, receives: int, rank: int, world: int,
                  device: torch.device, warmup: int, repeats: int) -> float:
    """Seconds the runtime spends at the start of a step posting its ``receives``
    receives ahead (gloo): the same posts, right after a barrier as in a step. Rank r
    receives from r-1 and sends r+1 as many as r+1 posts, so every post completes."""
    if world < 2:
        return 0.0
    after, before = (rank + 1) % world, (rank - 1) % world
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([receives]))
    to_send = int(counts[after].item())
    outgoing = torch.zeros(shape, dtype=dtype, device=device)

    def post() -> Callable[[], None]:
        posted = [dist.irecv(torch.empty(shape, dtype=dtype, device=device), before, tag=tag)
                  for tag in range(receives)]

        def complete() -> None:
            for work in [*posted, *(dist.isend(outgoing, after, tag=tag) for tag in range(to_send))]:
                work.wait()

        return complete

    return mean_after_barrier(post, warmup, max(repeats, STALL_SAMPLES))


def microbatch_size(config: RunConfig) -> int:
    """Samples in microbatch 0: the size every microbatch has when the batch divides."""
    return -(-config.batch_size // config.microbatches)


def measure_overheads(config: RunConfig, model: PipelineModel, schedule: Schedule, rank: int, world: int,
                      device: torch.device, warmup: int, repeats: int, min_time: float) -> dict[str, float]:
    """Every runtime overhead of this rank, in seconds (see the module docstring);
    ``model`` is the config's model, already built."""
    shape, dtype = model.boundary_shape(microbatch_size(config)), getattr(torch, config.dtype)
    p2p = p2p_overheads(shape, dtype, rank, world, device, warmup, repeats)
    receives = sum(1 for action in schedule.programs[rank] if action.kind in RECV_KINDS)
    prefetch = config.prefetch_receives(dist.get_backend() if world > 1 else "gloo")
    return {
        "action_gap": action_gap(warmup, repeats),
        "comm_post": (p2p["send_post"] + p2p["recv_wait"]) / 2,
        "send_post": p2p["send_post"],
        "recv_wait": p2p["recv_wait"],
        "background_cpu": p2p["background_cpu"] if device.type == "cpu" else 0.0,
        "transfer_cost": transfer_interference(shape, dtype, rank, world, device, min_time),
        "prefetch_post": (prefetch_cost(shape, dtype, receives, rank, world, device, warmup, repeats)
                          if prefetch else 0.0),
        "loss_reduce": loss_reduce(world, device, warmup, repeats),
    }
