"""Start the ranks of a local run through torch's elastic launcher, and turn a failed
rank into one message that names it and the action it was on.

The launcher is ``torch.distributed.launcher.api.elastic_launch``, the machinery behind
``torchrun --standalone``: it owns rendezvous, process start-up and the watchdog that
stops every rank as soon as one fails. A rank that dies cannot report where it was, so
each rank keeps a progress line in a memory-mapped file (``executor.progress``) that is
read here after the failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from executor.config import RunConfig, build_schedule
from executor.progress import read_progress
from schedules.schedule import Schedule
from schedules.validate import validate

# Errors a rank sees because a peer went away; they are consequences, not causes.
PEER_LOSS = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out",
             "Connection refused", "NCCL communicator was aborted", "recvBytes", "sendBytes")


class PipelineRunError(RuntimeError):
    """The job failed: the message says which rank failed first and on which action."""


def validate_schedule(config: RunConfig) -> Schedule:
    """Reject a schedule that cannot run before any process starts; return the lowered
    schedule that will run."""
    schedule = build_schedule(config)
    validate(schedule)
    return schedule


def launch(configs: RunConfig | list[RunConfig], model: Any = None, log_dir: str | None = None) -> list[dict]:
    """Run the configs (all with the same world size ``dp*pp*tp``) on that many local processes; return
    rank 0's results, one per config. Raises ``PipelineRunError`` if a rank fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415

    from executor.worker import run_worker  # noqa: PLC0415

    configs = [configs] if isinstance(configs, RunConfig) else list(configs)
    for config in configs:
        config.check()
        validate_schedule(config)
    worlds = {config.world_size for config in configs}
    if len(worlds) != 1:
        raise ValueError(f"configs launched together must share one world size (dp*pp*tp), got {sorted(worlds)}")
    nprocs = worlds.pop()
    progress_dir = tempfile.mkdtemp(prefix="pipesim_progress_")
    os.environ["PIPESIM_PROGRESS_DIR"] = progress_dir  # inherited by the spawned ranks
    try:
        results = elastic_run(run_worker, (configs, model), nprocs, configs[0].threads, log_dir)
    except ChildFailedError as error:
        raise PipelineRunError(describe_failure(error.failures, progress_dir)) from None
    finally:
        shutil.rmtree(progress_dir, ignore_errors=True)
    return merge_rank_results(results)


def elastic_run(function: Callable[..., Any], args: tuple, nprocs: int, threads: int,
                log_dir: str | None = None) -> dict[int, Any]:
    """Run ``function(*args)`` on ``nprocs`` local processes started by torch's elastic
    launcher (as ``torchrun --standalone`` would); return each rank's result. A failed
    rank raises ``ChildFailedError``, which each caller turns into its own message."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs  # noqa: PLC0415
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: PLC0415

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05,
        start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    return elastic_launch(config, function)(*args)


def merge_rank_results(per_rank: dict[int, list[dict]]) -> list[dict]:
    """Rank 0's results, with every rank's gradients folded into ``grads``."""
    merged = []
    for index, result in enumerate(per_rank[0]):
        grads = {}
        for rank in sorted(per_rank):
            grads.update(per_rank[rank][index]["grads"])
        merged.append({**result, "grads": grads})
    return merged


def failure_text(failure: Any) -> str:
    """The first line of a rank's own error message, without the traceback."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message).strip().splitlines()[0] if message else ""


def describe_failure(failures: dict[int, Any], progress_dir: str | None) -> str:
    """One line per failed rank, the root cause first: a rank killed by a signal other
    than the launcher's SIGTERM, or one whose error is not a lost peer."""

    def line(rank: int, failure: Any) -> tuple[int, str]:
        where = read_progress(progress_dir, rank) or "before its first action"
        if failure.exitcode < 0:
            name = failure.signal_name()
            stopped_by_launcher = -failure.exitcode == signal.SIGTERM
            return (2 if stopped_by_launcher else 0), f"rank {rank} was killed by {name} at {where}"
        text = failure_text(failure)
        symptom = any(marker in text for marker in PEER_LOSS)
        return (1 if symptom else 0), f"rank {rank} exited with code {failure.exitcode} at {where}: {text}"

    lines = [line(rank, failure) + (rank,) for rank, failure in failures.items()]
    # Ranks the launcher stopped without a failure record still say where they were.
    for path in sorted(Path(progress_dir).glob("rank*.progress")) if progress_dir else []:
        rank = int(path.stem.removeprefix("rank"))
        if rank not in failures and (where := read_progress(progress_dir, rank)):
            lines.append((3, f"rank {rank} was stopped at {where}", rank))
    lines = sorted(lines,
                   key=lambda item: (item[0], item[2]))
    first = lines[0][1]
    others = "; ".join(text for _, text, _ in lines[1:])
    return f"{first}" + (f" (then: {others})" if others else "")
