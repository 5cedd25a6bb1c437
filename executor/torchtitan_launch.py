"""``python -m executor.torchtitan_launch``: torchtitan's training with pipesim's schedule
files checked against the stages torchtitan builds, and loaded in the form they are
written in; ``--check CONFIG.toml`` checks a config against its CSV on any machine.

torchtitan builds its schedule from ``pipeline_parallel_schedule_csv`` with
``_PipelineScheduleRuntime(stages, ...)`` and then ``schedule._load_csv(path)``: torch's
default format, compute-only. A lowered file is refused there ("Expected compute-only
schedule but found communication action"), and a compute-only one is lowered again by
torch, so pipesim's placement of the transfers is lost. Run under this module,
``_load_csv`` is ``executor.torch_pipelining.load_schedule_csv``: the file is checked
against the stages torchtitan built (placement, stage count, microbatches, REDUCE_GRAD;
on NCCL, whether its order can hang torch's runtime) and loaded as compute-only or as
lowered, as it is written. Everything else is torchtitan's own ``torchtitan.train``::

    torchrun --nproc-per-node 8 -m executor.torchtitan_launch --job.config_file train.toml
    python -m executor.torchtitan_launch --check titan/torchtitan.toml
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

from schedules.csv_io import schedule_from_csv
from schedules.torch_compat import TorchMismatchError, stages_per_rank, torch_class_for

TORCHTITAN_DEFAULTS = {"pipeline_parallel_schedule": "1F1B", "pipeline_parallel_degree": 1,
                       "pipeline_parallel_microbatch_size": 1, "local_batch_size": 8}  # torchtitan 0.2.x's


def checked_load_csv(self, filename: str, format: str | None = None) -> None:  # noqa: A002 - torch's name
    """Stands in for ``_PipelineScheduleRuntime._load_csv``: pipesim's checks, then torch's
    loader in the file's own format. A ``format`` the caller insists on must be the file's."""
    from executor.torch_pipelining import load_schedule_csv, torch_format

    if format is not None and format != torch_format(schedule_from_csv(filename)):
        raise TorchMismatchError(f"{filename} is {torch_format(schedule_from_csv(filename))}, not {format}")
    load_schedule_csv(self, filename)


def install() -> None:
    """Make every ``_PipelineScheduleRuntime`` load its CSV through pipesim's checks."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime  # noqa: PLC0415

    import executor.torch_pipelining  # noqa: F401,PLC0415 - keeps torch's own loader before replacing it

    _PipelineScheduleRuntime._load_csv = checked_load_csv


def check_config(path: str | Path) -> str:
    """Check a torchtitan TOML config against the CSV it names, as torchtitan will build
    the stages from it (class, pipeline degree, stages per rank, microbatches); return a
    one-line summary, raise ``TorchMismatchError`` naming the field that disagrees."""
    import tomllib  # noqa: PLC0415 - Python >= 3.11

    with open(path, "rb") as handle:
        config = tomllib.load(handle)
    parallelism = config.get("parallelism", {})
    training = config.get("training", {})
    csv_path = parallelism.get("pipeline_parallel_schedule_csv")
    if not csv_path:
        raise TorchMismatchError(f"{path}: [parallelism] has no pipeline_parallel_schedule_csv")
    schedule = schedule_from_csv(csv_path)
    name = parallelism.get("pipeline_parallel_schedule", TORCHTITAN_DEFAULTS["pipeline_parallel_schedule"])
    cls = torch_class_for(schedule, name)
    degree = parallelism.get("pipeline_parallel_degree", TORCHTITAN_DEFAULTS["pipeline_parallel_degree"])
    if degree != schedule.pp:
        raise TorchMismatchError(f"{path}: pipeline_parallel_degree = {degree}, but {csv_path} has {schedule.pp} "
                                 f"rows (pipeline ranks)")
    chunks = stages_per_rank(schedule)
    if parallelism.get("pipeline_parallel_layers_per_stage") is None and chunks != (1 if cls.single_stage else 2):
        raise TorchMismatchError(
            f"{path}: without pipeline_parallel_layers_per_stage torchtitan builds "
            f"{1 if cls.single_stage else 2} stages per rank for {cls.name}, but {csv_path} has {chunks}")
    if "num_pp_microbatches" in parallelism:
        microbatches, source = parallelism["num_pp_microbatches"], "num_pp_microbatches"
    else:
        size = parallelism.get("pipeline_parallel_microbatch_size",
                               TORCHTITAN_DEFAULTS["pipeline_parallel_microbatch_size"])
        batch = training.get("local_batch_size", TORCHTITAN_DEFAULTS["local_batch_size"])
        if batch % size:
            raise TorchMismatchError(f"{path}: local_batch_size {batch} is not a multiple of "
                                     f"pipeline_parallel_microbatch_size {size}")
        microbatches, source = batch // size, f"local_batch_size {batch} / pipeline_parallel_microbatch_size {size}"
    if microbatches != schedule.microbatches:
        raise TorchMismatchError(f"{path}: {source} = {microbatches} microbatches, but {csv_path} runs "
                                 f"{schedule.microbatches}")
    form = "lowered (run it with this module)" if schedule.is_lowered else "compute-only"
    return (f"ok: {csv_path} ({form}, pp={schedule.pp}, {schedule.num_stages} stages, {schedule.microbatches} "
            f"microbatches) matches {path}: {cls.name} places the stages {cls.style}, as the file does")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--check"]:
        if len(argv) != 2:
            print("usage: python -m executor.torchtitan_launch --check CONFIG.toml", file=sys.stderr)
            return 2
        try:
            print(check_config(argv[1]))
        except (ValueError, OSError) as error:
            print(f"torchtitan_launch --check: error: {error}", file=sys.stderr)
            return 2
        return 0
    if importlib.util.find_spec("torchtitan") is None:
        print("torchtitan_launch: error: torchtitan is not installed in this environment "
              "(pip install torchtitan, or run from a torchtitan checkout)", file=sys.stderr)
        return 2
    install()
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
