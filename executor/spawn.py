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
from typing import Any

import torch

from executor.launch import failure_text


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


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so host timers measure it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
