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

from executor.launch import RankLogs, elastic_run, failure_text
from executor.process import check_devices


class SpawnError(RuntimeError):
    """A measuring rank failed; the message names the rank and its error."""


def launch_ranks(function: Callable[..., Any], args: tuple, nprocs: int, threads: int = 1, backend: str = "auto",
                 verbose: bool = False) -> dict[int, Any]:
    """Run ``function(*args)`` on ``nprocs`` local processes; return each rank's result.
    Refused before start when NCCL would put two ranks on one GPU; the ranks' output
    goes to a log folder unless ``verbose`` (see ``executor.launch.RankLogs``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415

    check_devices(backend, nprocs)
    logs = RankLogs(None, verbose)
    try:
        return elastic_run(function, args, nprocs, threads, logs)
    except ChildFailedError as error:
        lines = [f"rank {rank}: {failure_text(failure) or f'exit code {failure.exitcode}'}"
                 for rank, failure in sorted(error.failures.items())]
        raise SpawnError("; ".join(lines) + logs.hint()) from None
    finally:
        logs.close()


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so host timers measure it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
