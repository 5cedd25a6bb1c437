"""Time point-to-point and collective communication on the backend the executor uses:
the measuring half of ``pipesim bench-comm`` (the fitting half, pure Python, is
``pipesim.cluster.comm_fit``).

Each operation follows nccl-tests: ``sendrecv`` has every rank send ``size`` bytes to
the next rank while receiving as many from the previous one; ``all_reduce`` reduces a
``size``-byte buffer; ``all_gather`` and ``reduce_scatter`` have ``size`` bytes as the
whole (gathered, or to-be-scattered) buffer, ``size / n`` per rank. A time is the mean
over iterations of the slowest rank's (nccl-tests reports an average too).

Two more time the collectives the executor runs inside its compute actions, each over
groups of ``group`` consecutive ranks that all exchange at once (as every ep or cp group
of a run does): ``all_to_all`` is one ``all_to_all_single`` in which every rank holds
``size`` bytes, ``size / group`` for each member (expert parallelism's dispatch and
combine, ``executor.inside_timing``); ``ring_exchange`` has every rank send ``size``
bytes to its successor in its group while receiving as many from its predecessor, in
one batch (ring attention's K/V step, ``executor.ring_attention``). Every rank of such
a collective is held by it, and the simulator holds each rank for its price, so their
time is the mean over ranks as well as iterations (nccl-tests' default, ``-a 1``), not
the slowest rank's (on a shared CPU the slowest of the ranks has often waited for a
core, which the others did not pay).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from executor.process import init_rank
from executor.spawn import launch_ranks, synchronize

OPERATIONS = ("sendrecv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ring_exchange")
GROUPED = ("all_to_all", "ring_exchange")  # run over groups of --group ranks, timed as the mean over ranks
ITERATION_BYTES = 512 * 2**20  # bytes moved per size and operation, so small sizes repeat more
MIN_ITERATIONS, MAX_ITERATIONS = 30, 400


def operation(name: str, size: int, rank: int, world: int, device: torch.device,
              group: tuple[dist.ProcessGroup, list[int]] | None = None) -> Callable[[], None]:
    """One iteration of ``name`` on ``size`` bytes of float32, ready to call; a
    ``GROUPED`` operation runs in ``group`` (the process group and its ranks)."""
    if name in GROUPED:
        return grouped_operation(name, size, rank, device, *group)
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


def grouped_operation(name: str, size: int, rank: int, device: torch.device, process_group: dist.ProcessGroup,
                      members: list[int]) -> Callable[[], None]:
    """One ``all_to_all`` or ``ring_exchange`` of ``size`` bytes of float32 over ``members``."""
    width = len(members)
    if name == "all_to_all":
        elements = max(width, size // 4 // width * width)
        outgoing, incoming = torch.ones(elements, device=device), torch.empty(elements, device=device)
        return lambda: dist.all_to_all_single(incoming, outgoing, group=process_group)
    elements = max(1, size // 4)
    outgoing, incoming = torch.ones(elements, device=device), torch.empty(elements, device=device)
    place = members.index(rank)
    after, before = members[(place + 1) % width], members[(place - 1) % width]

    def ring_exchange() -> None:
        # posted as ring attention posts a step's transfer: one batch, then wait
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, after, process_group),
                                            dist.P2POp(dist.irecv, incoming, before, process_group)]):
            work.wait()

    return ring_exchange


def rank_groups(world: int, group: int) -> list[list[int]]:
    """``world`` ranks cut into groups of ``group`` consecutive ranks."""
    if group < 2 or world % group:
        raise ValueError(f"--group {group}: a group needs 2 or more ranks and must divide --ranks {world}")
    return [list(range(first, first + group)) for first in range(0, world, group)]


def time_operation(run: Callable[[], None], size: int, device: torch.device, warmup: int,
                   per_rank: bool = False) -> float:
    """Mean seconds of one iteration on the slowest rank. A mean, not a median: on a
    shared CPU about one gloo message in eight stalls for milliseconds, and a pipeline
    waiting on a transfer pays those stalls, so its expected cost is the mean (the
    median, used at first, put the fitted latency at a third of it); hence many
    iterations for small sizes. Each iteration starts from a barrier: gloo run back to
    back lets one iteration's sends arrive before the next iteration's receives are
    posted, which costs milliseconds per message and is not how the executor
    communicates (both ends of a transfer are posted in one group). With ``per_rank``
    the mean is over every rank's time too (a collective that holds every rank)."""
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
    dist.all_reduce(seconds, op=dist.ReduceOp.SUM if per_rank else dist.ReduceOp.MAX)
    return float(seconds.mean().item()) / (dist.get_world_size() if per_rank else 1)


def bench_rank(operations: list[str], sizes: dict[str, list[int]], backend: str, threads: int, warmup: int,
               groups: dict[str, int]) -> dict:
    """Every (operation, size) timing on this rank's view (identical on every rank);
    ``sizes``: each operation's message sizes; ``groups``: the group size of each
    ``GROUPED`` operation."""
    rank, world, device, backend = init_rank(backend, threads)
    rows = []
    try:
        for name in operations:
            group, extra = None, {}
            if name in GROUPED:
                extra = {"group": groups.get(name, world)}
                for members in rank_groups(world, extra["group"]):  # new_group is called alike on every rank
                    process_group = dist.new_group(members)
                    if rank in members:
                        group = (process_group, members)
            for size in sizes[name]:
                try:
                    run = operation(name, size, rank, world, device, group)
                    seconds = time_operation(run, size, device, warmup, per_rank=name in GROUPED)
                except RuntimeError as error:
                    if "not supported" in str(error).lower() or "unsupported" in str(error).lower():
                        rows.append({"operation": name, "bytes": size, "seconds": None, "note": str(error)[:120],
                                     **extra})
                        break
                    raise
                rows.append({"operation": name, "bytes": size, "seconds": seconds, **extra})
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "world": world, "backend": backend, "device": str(device), "rows": rows}


def bench_comm(ranks: int, operations: list[str], sizes: list[int], backend: str = "auto", threads: int = 1,
               warmup: int = 2, verbose: bool = False, groups: dict[str, int] | None = None,
               sizes_of: dict[str, list[int]] | None = None) -> dict:
    """Launch ``ranks`` local processes and time every operation at every size (the
    operations in ``sizes_of`` at their own sizes), each ``GROUPED`` operation over
    groups of ``groups[operation]`` ranks (default all)."""
    if ranks < 2:
        raise ValueError(f"--ranks must be at least 2 to communicate, got {ranks}")
    unknown = [name for name in operations if name not in OPERATIONS]
    if unknown:
        raise ValueError(f"unknown operation(s) {', '.join(unknown)}; known: {', '.join(OPERATIONS)}")
    groups = dict(groups or {})
    for name in GROUPED:
        rank_groups(ranks, groups.get(name, ranks))  # refused here, before any process starts
    sizes_of = {name: list((sizes_of or {}).get(name, sizes)) for name in operations}
    return launch_ranks(bench_rank, (operations, sizes_of, backend, threads, warmup, groups), ranks, threads,
                        backend, verbose)[0]
