"""A layout as torchtitan reads it: the schedule CSV, and the config fields that make
torchtitan build the stages where the CSV puts them.

torchtitan (``torchtitan/distributed/pipeline_parallel.py``) takes the order from
``pipeline_parallel_schedule_csv`` but builds the stages itself: their placement (looped
or V) from the class named in ``pipeline_parallel_schedule``, their number from
``pipeline_parallel_layers_per_stage`` (default: one per rank for single-stage classes,
two for the others), the layers on each from the same field and
``pipeline_parallel_{first,last}_stage_less_layers``. So the class is chosen to match the
file's placement (``schedules.torch_compat``) and the layers are written so that every
stage gets ``layers / stages`` of them, as pipesim splits them.

torchtitan loads the file as compute-only and lowers it itself (``_load_csv`` with its
default format), so pipesim's placement of the transfers does not carry over; the
lowered file is written beside it for ``python -m executor.torchtitan_launch``, which
loads it as lowered (docs/interop.md).

Two config forms: ``torchtitan.toml`` for the releases configured by TOML
(``--job.config_file``, up to 0.2.x: microbatches as ``local_batch_size /
pipeline_parallel_microbatch_size``), and ``torchtitan.args``, the command-line overrides
the later, Python-configured releases still accept (``num_pp_microbatches``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from schedules.csv_io import schedule_to_csv
from schedules.schedule import Schedule
from schedules.torch_compat import TorchClass, stages_per_rank, torch_class_for
from schedules.torch_runtime import lower_for_torch_runtime

SCHEDULE_FILE, LOWERED_FILE, TOML_FILE, ARGS_FILE = (
    "schedule.csv", "schedule-lowered.csv", "torchtitan.toml", "torchtitan.args")


@dataclass(frozen=True)
class TorchtitanLayout:
    """What torchtitan needs beyond the schedule: data-parallel replicas ``dp`` (sharding
    parameters with FSDP when ``fsdp``, else replicating them as DDP), tensor-parallel
    ranks ``tp``, expert-parallel ranks ``ep``, context-parallel ranks ``cp``, sequences per microbatch, and where known
    the model's layers and sequence length; ``torch_class`` overrides the class chosen
    from the placement."""

    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    microbatch_size: int = 1
    layers: int | None = None
    seq_len: int | None = None
    torch_class: str | None = None
    ep: int = 1  # expert-parallel ranks, cut from the data-parallel ones
    cp: int = 1  # context-parallel ranks, each holding a share of every sequence


def layers_per_stage(schedule: Schedule, layers: int | None, cls: TorchClass) -> int | None:
    """torchtitan's ``pipeline_parallel_layers_per_stage`` for ``layers`` over the
    schedule's stages (None when torchtitan's default stage count is already right and the
    layers are unknown); an error when torchtitan could not split them as pipesim does."""
    stages, chunks = schedule.num_stages, stages_per_rank(schedule)
    default_chunks = 1 if cls.single_stage else 2
    if layers is None:
        if chunks != default_chunks:
            raise ValueError(
                f"torchtitan builds {default_chunks} stages per rank for {cls.name} unless it is told the layers per "
                f"stage, and this schedule has {chunks}: give --layers (or --model) so it can be written")
        return None
    if layers % stages:
        raise ValueError(
            f"--layers {layers} over {stages} stages: pipesim gives every stage the same layers, and torchtitan's "
            f"pipeline_parallel_layers_per_stage can only say so when they divide evenly; choose layers divisible "
            f"by pp x virtual stages ({stages})")
    return layers // stages


def write_torchtitan(directory: str | Path, schedule: Schedule, layout: TorchtitanLayout) -> list[Path]:
    """Write ``schedule`` (compute-only, as a generator made it) for torchtitan into
    ``directory`` (created if missing): the compute-only CSV torchtitan loads, the lowered
    CSV for loading as lowered, and both config forms. Refuses, before writing anything, a
    class that places stages other than the file does, a placement torchtitan cannot
    build, and layers it cannot split as pipesim does. Returns the paths written."""
    if schedule.is_lowered:
        schedule = schedule.compute_only()
    cls = torch_class_for(schedule, layout.torch_class)
    per_stage = layers_per_stage(schedule, layout.layers, cls)
    lowered = lower_for_torch_runtime(schedule)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / name for name in (SCHEDULE_FILE, LOWERED_FILE, TOML_FILE, ARGS_FILE)]
    schedule_to_csv(schedule, paths[0], groups=False)
    schedule_to_csv(lowered, paths[1], groups=False, fsdp=layout.fsdp and layout.dp > 1)
    fields = config_fields(schedule, layout, cls, per_stage, paths[0].resolve())
    paths[2].write_text(toml_text(schedule, cls, fields))
    paths[3].write_text(args_text(fields) + "\n")
    return paths


def config_fields(schedule: Schedule, layout: TorchtitanLayout, cls: TorchClass, per_stage: int | None,
                  csv_path: Path) -> dict[str, dict[str, object]]:
    """Section -> field -> value, in torchtitan's names, shared by both forms; the
    microbatch fields of each form are added where each is written."""
    parallelism: dict[str, object] = {
        "pipeline_parallel_degree": schedule.pp,
        "pipeline_parallel_schedule": cls.name,
        "pipeline_parallel_schedule_csv": str(csv_path),
    }
    if per_stage is not None:
        parallelism.update(pipeline_parallel_layers_per_stage=per_stage,
                           pipeline_parallel_first_stage_less_layers=0,
                           pipeline_parallel_last_stage_less_layers=0)
    parallelism.update(data_parallel_replicate_degree=1 if layout.fsdp else layout.dp,
                       data_parallel_shard_degree=layout.dp if layout.fsdp else 1,
                       tensor_parallel_degree=layout.tp)
    if layout.ep > 1:
        parallelism["expert_parallel_degree"] = layout.ep
    if layout.cp > 1:
        parallelism["context_parallel_degree"] = layout.cp
    training: dict[str, object] = {}
    if layout.seq_len is not None:
        training["seq_len"] = layout.seq_len
    return {"parallelism": parallelism, "training": training,
            "microbatches": {"count": schedule.microbatches, "size": layout.microbatch_size}}


def toml_text(schedule: Schedule, cls: TorchClass, fields: dict[str, dict[str, object]]) -> str:
    """The TOML fragment (torchtitan up to 0.2.x): merge it into the job's config file."""
    count, size = fields["microbatches"]["count"], fields["microbatches"]["size"]
    parallelism = {**fields["parallelism"], "pipeline_parallel_microbatch_size": size}
    if cls.name == "DualPipeV":
        # 0.2.x overlaps expert-parallel all-to-alls inside DualPipeV's OVERLAP_F_B only for
        # its own ScheduleDualPipeV object; a CSV runs in the plain runtime, without them.
        parallelism["pipeline_parallel_expert_parallel_overlap"] = False
    training = {"local_batch_size": count * size, **fields["training"]}
    lines = [f"# pipesim: {schedule.name}, pp={schedule.pp}, {schedule.num_stages} stages "
             f"({cls.style}, {stages_per_rank(schedule)} per rank), {count} microbatches of {size}",
             f"# {cls.name} only places the stages ({cls.describe()}); the CSV's order is what runs.",
             "[parallelism]"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in parallelism.items()]
    sequences = f"{size} sequence{'s' if size > 1 else ''}"
    lines += ["", "[training]", f"# {count} microbatches x {sequences} per data-parallel rank"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in training.items()]
    return "\n".join(lines) + "\n"


def args_text(fields: dict[str, dict[str, object]]) -> str:
    """The same fields as command-line overrides (torchtitan's Python-configured releases)."""
    count, size = fields["microbatches"]["count"], fields["microbatches"]["size"]
    parallelism = {**fields["parallelism"], "num_pp_microbatches": count}
    args = [f"--parallelism.{key} {_arg_value(value)}" for key, value in parallelism.items()]
    seq_len = fields["training"].get("seq_len")
    if seq_len is not None:
        args.append(f"--training.num_tokens_per_microbatch_per_dp_rank {size * seq_len}")
    return " ".join(args)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def _arg_value(value: object) -> str:
    return shlex.quote(str(value))
