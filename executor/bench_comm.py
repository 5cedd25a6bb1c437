"""Time point-to-point and collective communication on the backend the executor uses:
the measuring half of ``pipesim bench-comm`` (the fitting half, pure Python, is
``pipesim.cluster.comm_fit``).

Each operation follows nccl-tests: ``sendrecv`` has every rank send ``size`` bytes to
the next rank while receiving as many from the previous one; ``all_reduce`` reduces a
``size``-byte buffer; ``all_gather`` and ``reduce_scatter`` have ``size`` bytes as the
whole (gathered, or to-be-scattered) buffer, ``size / n`` per rank. A time is the mean
over iterations of the slowest rank's (nccl-tests reports an average too).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from executor.process import init_rank
from executor.spawn import launch_ranks, synchronize

OPERATIONS = ("sendrecv", "all_reduce", "all_gather", "reduce_scatter")
ITERATION_BYTES = 512 * 2**20  # bytes moved per size and operation, so small sizes repeat more
MIN_ITERATIONS, MAX_ITERATIONS = 30, 400


def operation(name: str, size: int, rank: int, world: int, device: torch.device) -> Callable[[], None]:
    """One iteration of ``name`` on ``size`` bytes of float32, ready to call."""
    elements = max(world, size // 4 // world * world)
    if name == "sendrecv":
        outgoing = torch.ones(elements, device=device)
        incoming = torch.empty(elements, device=device)
        after, before = (rank + 1) % world, (rank - 1) % world

        def sendrecv() -> None:
            # One batch of the send and the receive, as the executor posts a P2P group:
            # an unbatched receive posted before the send on every rank deadlocks on
            # NCCL (the receive waits for a send the peer queues behind its own receive).
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, after),
                                                dist.P2POp(dist.irecv, incoming, before)]):
                work.wait()

        return sendrecv
    if name == "all_reduce":
        buffer = torch.ones(elements, device=device)
        return lambda: dist.all_reduce(buffer)
    if name == "all_gather":
        whole = torch.empty(elements, device=device)
        part = torch.ones(elements // world, device=device)
        return lambda: dist.all_gather_into_tensor(whole, part)
    if name == "reduce_scatter":
        whole = torch.ones(elements, device=device)
        part = torch.empty(elements // world, device=device)
        return lambda: dist.reduce_scatter_tensor(part, whole)
    raise ValueError(f"unknown operation {name!r}; known: {', '.join(OPERATIONS)}")


def time_operation(run: Callable[[], None], size: int, device: torch.device, warmup: int) -> float:
    """Mean seconds of one iteration on the slowest rank. A mean, not a median: on a
    shared CPU about one gloo message in eight stalls for milliseconds, and a pipeline
    waiting on a transfer pays those stalls, so its expected cost is the mean (the
    median, used at first, put the fitted latency at a third of it); hence many
    iterations for small sizes. Each iteration starts from a barrier: gloo run back to
    back lets one iteration's sends arrive before the next iteration's receives are
    posted, which costs milliseconds per message and is not how the executor
    communicates (both ends of a transfer are posted in one group)."""
    iterations = max(MIN_ITERATIONS, min(MAX_ITERATIONS, ITERATION_BYTES // max(size, 1)))
    samples = []
    for index in range(warmup + iterations):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        run()
        synchronize(device)
        if index >= warmup:
            samples.append(time.perf_counter() - start)
    seconds = torch.tensor(samples, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.mean().item())


def bench_rank(operations: list[str], sizes: list[int], backend: str, threads: int, warmup: int) -> dict:
    """Every (operation, size) timing on this rank's view (identical on every rank)."""
    rank, world, device, backend = init_rank(backend, threads)
    rows = []
    try:
        for name in operations:
            for size in sizes:
                try:
                    run = operation(name, size, rank, world, device)
                    seconds = time_operation(run, size, device, warmup)
                except RuntimeError as error:
                    if "not supported" in str(error).lower() or "unsupported" in str(error).lower():
                        rows.append({"operation": name, "bytes": size, "seconds": None, "note": str(error)[:120]})
                        break
                    raise
                rows.append({"operation": name, "bytes": size, "seconds": seconds})
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "world": world, "backend": backend, "device": str(device), "rows": rows}


def bench_comm(ranks: int, operations: list[str], sizes: list[int], backend: str = "auto", threads: int = 1,
               warmup: int = 2, verbose: bool = False) -> dict:
    """Launch ``ranks`` local processes and time every operation at every size."""
    if ranks < 2:
        raise ValueError(f"--ranks must be at least 2 to communicate, got {ranks}")
    unknown = [name for name in operations if name not in OPERATIONS]
    if unknown:
        raise ValueError(f"unknown operation(s) {', '.join(unknown)}; known: {', '.join(OPERATIONS)}")
    return launch_ranks(bench_rank, (operations, sizes, backend, threads, warmup), ranks, threads, backend,
                        verbose)[0]
