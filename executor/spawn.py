"""Start ``n`` local ranks running one function, for the measurement tools (``profile``,
``bench-comm``) that need a process group but not a pipeline run.

The same launcher as ``executor.launch`` (torch's ``elastic_launch``, the machinery behind
``torchrun --standalone``), so measurements are taken in processes started exactly like
the ones ``pipesim run`` starts: same thread settings, same backend, same rendezvous.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from executor.launch import failure_text
from executor.worker import resolve_backend


class SpawnError(RuntimeError):
    """A measuring rank failed; the message names the rank and its error."""


def launch_ranks(function: Callable[..., Any], args: tuple, nprocs: int, threads: int = 1) -> dict[int, Any]:
    """Run ``function(*args)`` on ``nprocs`` local processes; return each rank's result."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: PLC0415

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05,
        start_method="spawn", logs_specs=DefaultLogsSpecs(),
    )
    try:
        return elastic_launch(config, function)(*args)
    except ChildFailedError as error:
        lines = [f"rank {rank}: {failure_text(failure) or f'exit code {failure.exitcode}'}"
                 for rank, failure in sorted(error.failures.items())]
        raise SpawnError("; ".join(lines)) from None


def init_rank(backend: str, threads: int, timeout: float = 60.0) -> tuple[int, int, torch.device, str]:
    """Join the process group as a pipeline rank would: one torch thread per rank on CPU
    (what ``pipesim run`` uses), the rank's own GPU with NCCL. Returns rank, world
    size, device and the backend in use."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(threads)
    backend = resolve_backend(backend)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout),
                                device_id=device if backend == "nccl" else None)
    return rank, world, device, backend


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so host timers measure it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
