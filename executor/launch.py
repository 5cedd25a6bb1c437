"""Start the ranks of a local run through torch's elastic launcher, and turn a failed
rank into one message that names it and the action it was on.

The launcher is ``torch.distributed.launcher.api.elastic_launch``, the machinery behind
``torchrun --standalone``: it owns rendezvous, process start-up and the watchdog that
stops every rank as soon as one fails. A rank that dies cannot report where it was, so
each rank keeps a progress line in a memory-mapped file (``executor.progress``) that is
read here after the failure.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.config import ConfigError, RunConfig, build_schedule
from executor.process import check_devices, resolve_backend
from executor.progress import Progress, read_progress
from executor.rank_exit import PEER_LOSS, ExitOnFailure
from schedules.schedule import Schedule
from schedules.validate import ScheduleValidationError, validate


class PipelineRunError(RuntimeError):
    """The job failed: the message says which rank failed first and on which action."""


def p2p_semantics(config: RunConfig) -> str:
    """The P2P semantics the run will have: ``--p2p``, else the backend's own."""
    return config.p2p_semantics(resolve_backend(config.backend))


def validate_schedule(config: RunConfig) -> Schedule:
    """Reject a schedule that cannot run before any process starts, checked under the
    P2P semantics of the run (an order gloo tolerates can hang on NCCL); return the
    lowered schedule that will run."""
    schedule = build_schedule(config)
    semantics = p2p_semantics(config)
    if semantics == "buffered" and resolve_backend(config.backend) == "nccl":
        raise ConfigError("--p2p buffered describes gloo, but this run uses NCCL (CUDA is available): use "
                          "--p2p rendezvous, or --backend gloo")
    try:
        validate(schedule, p2p=semantics)
    except ScheduleValidationError as error:
        backend = resolve_backend(config.backend)
        raise ScheduleValidationError(
            f"schedule {schedule.name!r} cannot run under {semantics} P2P semantics (--p2p {semantics}, "
            f"backend {backend}): {error}", action=error.action, rank=error.rank, position=error.position,
            cycle=error.cycle,
        ) from None
    return schedule


def launch(configs: RunConfig | list[RunConfig], model: Any = None, log_dir: str | None = None,
           verbose: bool = False, unchecked: bool = False) -> list[dict]:
    """Run the configs (all with the same world size ``dp*pp*tp``) on that many local processes; return
    rank 0's results, one per config. Raises ``PipelineRunError`` if a rank fails: its
    message is the one-line summary, then the failing rank's own error line. Each rank's
    output goes to ``log_dir`` (a temporary folder, kept only if the run fails), the
    console only with ``verbose``. ``unchecked`` skips the schedule check: it exists only
    so tests can show what the runtime does with an order the check would refuse."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415

    from executor.worker import run_worker  # noqa: PLC0415

    configs = [configs] if isinstance(configs, RunConfig) else list(configs)
    for config in configs:
        config.check()
        if not unchecked:
            validate_schedule(config)
    worlds = {config.world_size for config in configs}
    if len(worlds) != 1:
        raise ValueError(f"configs launched together must share one world size (dp*pp*tp), got {sorted(worlds)}")
    nprocs = worlds.pop()
    check_devices(configs[0].backend, nprocs)
    progress_dir = tempfile.mkdtemp(prefix="pipesim_progress_")
    os.environ["PIPESIM_PROGRESS_DIR"] = progress_dir  # inherited by the spawned ranks
    logs = RankLogs(log_dir, verbose)
    try:
        results = elastic_run(run_worker, (configs, model), nprocs, configs[0].threads, logs)
    except ChildFailedError as error:
        raise PipelineRunError(describe_failure(error.failures, progress_dir) + logs.hint()) from None
    finally:
        shutil.rmtree(progress_dir, ignore_errors=True)
        logs.close()
    return merge_rank_results(results)


class RankLogs:
    """Where the ranks' output and the launcher's own log lines go.

    By default the ranks' stdout and stderr are written to files under the log folder
    (torch's ``DefaultLogsSpecs`` layout) and the elastic launcher's log records go to
    ``launcher.log`` beside them, so a failed run prints the summary and the failing
    rank's error line, not a wall of tracebacks. ``verbose`` shows everything on the
    console as torch prints it. A temporary folder is removed after a run that
    succeeded and kept after one that failed."""

    LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher")

    def __init__(self, log_dir: str | None, verbose: bool) -> None:
        self.verbose = verbose
        self.temporary = log_dir is None and not verbose
        self.directory = tempfile.mkdtemp(prefix="pipesim_logs_") if self.temporary else log_dir
        self.failed = False
        self.saved: list[tuple[logging.Logger, int, bool]] = []
        self.handler: logging.Handler | None = None
        if not verbose and self.directory is not None:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            self.handler = logging.FileHandler(Path(self.directory) / "launcher.log")
            self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            for name in self.LOGGERS:
                logger = logging.getLogger(name)
                self.saved.append((logger, logger.level, logger.propagate))
                logger.addHandler(self.handler)
                logger.setLevel(logging.INFO)
                logger.propagate = False

    def specs(self) -> Any:
        """The ``LogsSpecs`` the elastic launcher takes."""
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std  # noqa: PLC0415

        if self.verbose:
            return DefaultLogsSpecs(log_dir=self.directory)
        return DefaultLogsSpecs(log_dir=self.directory, redirects=Std.ALL)

    def hint(self) -> str:
        self.failed = True
        if self.verbose:
            return ""
        return f"\n(each rank's output: {self.directory}; --verbose prints it)"

    def close(self) -> None:
        for logger, level, propagate in self.saved:
            logger.removeHandler(self.handler)
            logger.setLevel(level)
            logger.propagate = propagate
        if self.handler is not None:
            self.handler.close()
        if self.temporary and not self.failed:
            shutil.rmtree(self.directory, ignore_errors=True)


def elastic_run(function: Callable[..., Any], args: tuple, nprocs: int, threads: int,
                logs: RankLogs | None = None) -> dict[int, Any]:
    """Run ``function(*args)`` on ``nprocs`` local processes started by torch's elastic
    launcher (as ``torchrun --standalone`` would); return each rank's result. A failed
    rank raises ``ChildFailedError``, which each caller turns into its own message."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: PLC0415

    logs = logs or RankLogs(None, verbose=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05,
        start_method="spawn", logs_specs=logs.specs(),
    )
    # a failed rank ends before the launcher gives its stderr back to the console (executor.rank_exit)
    return unshared(elastic_launch(config, ExitOnFailure(function))(*args))


def unshared(value: Any) -> Any:
    """``value`` with every tensor the ranks sent back copied into this process's own
    memory. torch passes a tensor between processes as shared memory held open by a file
    descriptor for as long as the tensor lives; a caller that keeps many runs' results
    (a test session's gradients and weights) would otherwise hold thousands of them
    open, until a later run's results cannot be received ("received 0 items of
    ancdata")."""
    import torch  # noqa: PLC0415

    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_shared() else value
    if isinstance(value, dict):
        return {key: unshared(item) for key, item in value.items()}
    if isinstance(value, list):
        return [unshared(item) for item in value]
    if type(value) is tuple:  # a plain tuple (named tuples, such as trace events, hold no tensors)
        return tuple(unshared(item) for item in value)
    return value


def merge_rank_results(per_rank: dict[int, list[dict]]) -> list[dict]:
    """Rank 0's results, with every rank's gradients folded into ``grads``, final
    weights into ``params`` and ``{rank: elements its optimizer steps}``."""
    merged = []
    for index, result in enumerate(per_rank[0]):
        grads, params = {}, {}
        for rank in sorted(per_rank):
            grads.update(per_rank[rank][index]["grads"])
            params.update(per_rank[rank][index].get("params", {}))
        held = {rank: per_rank[rank][index].get("optimizer_elements") for rank in sorted(per_rank)}
        merged.append({**result, "grads": grads, "params": params, "optimizer_elements": held})
    return merged


def failure_text(failure: Any) -> str:
    """The first line of a rank's own error message, without the traceback."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message).strip().splitlines()[0] if message else ""


# How much a rank's end says about the cause, most first: it died or raised on its own;
# it stopped while running its own work (hung) and was stopped by the launcher; it gave
# up waiting for a peer (a consequence); it was stopped and said nothing more.
ROOT, STUCK, WAITED, STOPPED = range(4)


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended, for ordering the ranks by what caused the failure."""

    rank: int
    cause: int
    since: float  # when it last made progress: the first to stop is the earliest
    summary: str
    error: str = ""


def rank_end(rank: int, failure: Any | None, progress: Progress | None) -> RankEnd:
    """Classify one rank from its failure record (None: the launcher stopped it) and its
    progress line."""
    where = progress.where if progress else "before its first action"
    waiting = progress is not None and progress.waiting
    since = progress.since if progress else float("inf")
    if failure is None:
        if waiting:
            return RankEnd(rank, WAITED, since, f"rank {rank} was stopped at {where}")
        return RankEnd(rank, STUCK if progress else STOPPED, since,
                       f"rank {rank} stopped at {where} and did not go on (its peers timed out waiting)")
    if failure.exitcode < 0:
        name = failure.signal_name()
        if -failure.exitcode == signal.SIGTERM:  # the launcher stopping it after another failed
            cause = WAITED if waiting else STUCK
            if cause == STUCK:
                return RankEnd(rank, cause, since,
                               f"rank {rank} stopped at {where} and did not go on (its peers timed out waiting)")
            return RankEnd(rank, cause, since, f"rank {rank} was stopped at {where}")
        # A watchdog that aborts a waiting rank (NCCL) kills it by a signal too.
        cause = WAITED if waiting else ROOT
        return RankEnd(rank, cause, since, f"rank {rank} was killed by {name} at {where}")
    text = failure_text(failure)
    symptom = waiting or any(marker in text for marker in PEER_LOSS)
    return RankEnd(rank, WAITED if symptom else ROOT, since,
                   f"rank {rank} exited with code {failure.exitcode} at {where}", text)


def describe_failure(failures: dict[int, Any], progress_dir: str | None) -> str:
    """The one-line summary, the rank that stopped first named first, then that rank's
    own error line (or, for a rank that hung, the error of a rank that timed out
    waiting for it)."""
    ranks = set(failures)
    for path in sorted(Path(progress_dir).glob("rank*.progress")) if progress_dir else []:
        ranks.add(int(path.stem.removeprefix("rank")))
    ends = sorted((rank_end(rank, failures.get(rank), read_progress(progress_dir, rank)) for rank in ranks),
                  key=lambda end: (end.cause, end.since, end.rank))
    first, others = ends[0], ends[1:]
    line = first.summary
    shown = [end.summary for end in others if end.cause != STOPPED]
    if shown:
        line += f" (then: {'; '.join(shown)})"
    owner = next((end for end in ends if end.error), None)
    if owner is None:
        return line
    error = owner.error.removeprefix("RankFailedError: ")
    return f"{line}\n{error if error.startswith(f'rank {owner.rank} ') else f'rank {owner.rank}: {error}'}"
