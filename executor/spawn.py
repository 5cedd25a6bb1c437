"""Start ``n`` local ranks running one function, for the measurement tools (``profile``,
``bench-comm``) that need a process group but not a pipeline run.

The same launcher as ``executor.launch`` (torch's ``elastic_launch``, the machinery behind
``torchrun --standalone``), so measurements are taken in processes started exactly like
the ones ``pipesim run`` starts: same thread settings, same backend, same rendezvous.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from executor.launch import elastic_run, failure_text


class SpawnError(RuntimeError):
    """A measuring rank failed; the message names the rank and its error."""


def launch_ranks(function: Callable[..., Any], args: tuple, nprocs: int, threads: int = 1) -> dict[int, Any]:
    """Run ``function(*args)`` on ``nprocs`` local processes; return each rank's result."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415

    try:
        return elastic_run(function, args, nprocs, threads)
    except ChildFailedError as error:
        lines = [f"rank {rank}: {failure_text(failure) or f'exit code {failure.exitcode}'}"
                 for rank, failure in sorted(error.failures.items())]
        raise SpawnError("; ".join(lines)) from None


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so host timers measure it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
