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
loads it as lowered (docs/interop.md). torchtitan wraps every stage in FSDP whatever the
data-parallel layout (dp 1 and DDP included), so the lowered file always has torch's
UNSHARD/RESHARD around the stages' compute.

The config is ``torchtitan.args``: command-line overrides for torchtitan 0.3.x, which is
configured in Python (``--module llama3 --config NAME``) and has no TOML loader; they go
last on its command line, since the activation-checkpointing choice is a subcommand.
Microbatches are ``local_batch_size / pipeline_parallel_microbatch_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from executor.config import has_split_backward
from executor.torchtitan_launch import AC_SUBCOMMAND, ARGS_FILE, SELECTIVE_FAILS, SUPPORTED_RELEASE
from pipesim.model.per_op_checkpoint import fusing_qkv_changes_per_op
from schedules.csv_io import schedule_to_csv
from schedules.schedule import Schedule
from schedules.torch_compat import TorchClass, stages_per_rank, torch_class_for
from schedules.torch_runtime import lower_for_torch_runtime

if TYPE_CHECKING:
    from pipesim.model.spec import ModelSpec

SCHEDULE_FILE, LOWERED_FILE = "schedule.csv", "schedule-lowered.csv"
FUSED_QKV = (f"torchtitan {SUPPORTED_RELEASE}'s Llama 3 fuses Q, K and V into one wqkv, whose per-op checkpointing "
             "keeps K's output too and does not re-run K's GEMM")


TORCHTITAN_MAX_NORM = 1.0  # torchtitan's training.max_norm default, written only where the job clips otherwise


@dataclass(frozen=True)
class TorchtitanLayout:
    """What torchtitan needs beyond the schedule: data-parallel replicas ``dp`` (sharding
    parameters with FSDP when ``fsdp``, else replicating them as DDP), tensor-parallel
    ranks ``tp`` (with Megatron sequence parallelism when ``sequence_parallel``),
    expert-parallel ranks ``ep``, context-parallel ranks ``cp``, sequences per microbatch,
    activation ``recompute`` (pipesim's none/per-op/full), and where known the model's
    layers and sequence length, and how the simulated model built Q, K and V (``qkv``,
    ``qkv_of``), gradient clipping's ``max_norm`` (``--clip-grad``, which simulate
    priced); ``torch_class`` overrides the class chosen from the placement."""

    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    microbatch_size: int = 1
    layers: int | None = None
    seq_len: int | None = None
    torch_class: str | None = None
    ep: int = 1  # expert-parallel ranks, cut from the data-parallel ones (folded: from dp x cp x tp)
    etp: int = 0  # the routed experts' tensor parallelism: 0 split over tp, 1 folded (whole on every rank)
    cp: int = 1  # context-parallel ranks, each holding a share of every sequence
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_moe_act: bool = False  # Megatron-Core's moe_act, which torchtitan has no knob for: refused
    qkv: str | None = None  # the simulated model's Q, K and V (--qkv) where per-op tells them apart (qkv_of)
    max_norm: float = TORCHTITAN_MAX_NORM  # gradient clipping's norm (--clip-grad; 0: none)


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
    CSV for loading as lowered, and the command-line overrides. Refuses, before writing
    anything, a class that places stages other than the file does, a placement torchtitan
    cannot build, layers it cannot split as pipesim does, and a recompute choice that
    torchtitan cannot run with this order. Returns the paths written."""
    if schedule.is_lowered:
        schedule = schedule.compute_only()
    cls = torch_class_for(schedule, layout.torch_class)
    per_stage = layers_per_stage(schedule, layout.layers, cls)
    check_recompute(schedule, layout.recompute, layout.qkv)
    if layout.recompute_moe_act:
        from pipesim.plan.torchtitan_experts import TORCHTITAN_NO_MOE_ACT  # noqa: PLC0415

        raise ValueError(f"--recompute-moe-act: {TORCHTITAN_NO_MOE_ACT}, so it would not run what pipesim priced; "
                         "drop --recompute-moe-act or --torchtitan")
    check_experts(layout)
    folder = Path(directory)
    if any(character.isspace() for character in str(folder.resolve())):
        raise ValueError(f"--torchtitan {directory}: the overrides name the CSV by its path, which must have no "
                         "spaces to pass through $(cat torchtitan.args)")
    lowered = lower_for_torch_runtime(schedule)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / name for name in (SCHEDULE_FILE, LOWERED_FILE, ARGS_FILE)]
    schedule_to_csv(schedule, paths[0], groups=False)
    schedule_to_csv(lowered, paths[1], groups=False, fsdp=True)  # torchtitan shards every stage (FSDP)
    paths[2].write_text(args_text(schedule, layout, cls, per_stage, paths[0].resolve()) + "\n")
    return paths


def qkv_of(spec: ModelSpec) -> str | None:
    """``--qkv`` of a simulated model where per-op checkpointing counts the two forms apart
    (bias-less Q, K and V: ``fusing_qkv_changes_per_op``), else None (nothing simulated
    depends on it)."""
    if not fusing_qkv_changes_per_op(spec):
        return None
    return "fused" if spec.fused_qkv else "separate"


def check_experts(layout: TorchtitanLayout) -> None:
    """Refuse an expert layout torchtitan would run otherwise than simulated, by the rule
    of ``pipesim.plan.torchtitan_experts`` (which ``plan --torchtitan`` rules out by)."""
    from pipesim.plan.torchtitan_experts import TORCHTITAN_FOLDS, torchtitan_expert_cause

    cause = torchtitan_expert_cause(layout.dp, layout.tp, layout.cp, layout.ep, layout.etp, layout.fsdp)
    if cause == TORCHTITAN_FOLDS and layout.ep > 1:
        raise ValueError(f"ep {layout.ep} with tp {layout.tp}, the experts split over tp: torchtitan "
                         f"{SUPPORTED_RELEASE} folds them whenever ep > 1 (every expert whole on each rank, ep cut "
                         "from the FSDP x cp x tp ranks), so it would not run what pipesim priced; plan or simulate "
                         "with --etp 1")
    if cause == TORCHTITAN_FOLDS:
        raise ValueError(f"etp 1 at ep 1 with tp {layout.tp}: torchtitan {SUPPORTED_RELEASE} splits the experts over "
                         "tp when ep is 1, so it would not run what pipesim priced; use ep > 1, or the experts split "
                         "over tp (--etp tp)")
    if cause:
        shard = layout.dp if layout.fsdp else 1
        raise ValueError(f"ep {layout.ep} must divide torchtitan {SUPPORTED_RELEASE}'s FSDP shard x cp x tp = "
                         f"{shard} x {layout.cp} x {layout.tp} ranks (its expert mesh; DDP's replicas are outside "
                         "it): add --fsdp, or choose another ep")


def check_recompute(schedule: Schedule, recompute: str, qkv: str | None = None) -> None:
    """Refuse a recompute choice torchtitan has no knob for (pipesim's ``selective``,
    Megatron's attention-core recompute: torchtitan's "selective" is per-op), cannot run
    with this order (``SELECTIVE_FAILS``), or would run otherwise than simulated: per-op
    over separate Q, K and V, where torchtitan 0.3's Llama 3 runs a fused ``wqkv``
    (``fuse_qkv=True`` in every config it ships, no command-line knob), which keeps K's
    output and does not re-run its GEMM (``FUSED_QKV``)."""
    if recompute == "selective":
        raise ValueError("--recompute selective (Megatron's: only the attention core recomputed) has no torchtitan "
                         f"{SUPPORTED_RELEASE} counterpart: its activation_checkpoint:selective is per-op selective "
                         "checkpointing (SelectiveAC); use --recompute per-op, none or full")
    if recompute not in AC_SUBCOMMAND:
        raise ValueError(f"--recompute {recompute}: torchtitan knows {', '.join(AC_SUBCOMMAND)}")
    if recompute == "per-op" and has_split_backward(schedule):
        raise ValueError(f"--recompute per-op with {schedule.name}: {SELECTIVE_FAILS}; use --recompute full or none")
    check_per_op_qkv(recompute, qkv)


def check_per_op_qkv(recompute: str, qkv: str | None) -> None:
    """Refuse per-op checkpointing priced over separate Q, K and V for torchtitan, which
    runs them fused (``FUSED_QKV``)."""
    if recompute == "per-op" and qkv == "separate":
        raise ValueError(f"--recompute per-op with --qkv separate: {FUSED_QKV}, so it would not run what pipesim "
                         "priced; give --qkv fused, or a recompute mode other than per-op")


def config_fields(schedule: Schedule, layout: TorchtitanLayout, cls: TorchClass, per_stage: int | None,
                  csv_path: Path) -> dict[str, dict[str, object]]:
    """Section -> field -> value, in torchtitan 0.3's names (``--section.field value``;
    ``True`` is a bare flag, ``False`` its ``no_`` form)."""
    parallelism: dict[str, object] = {
        "pipeline_parallel_degree": schedule.pp,
        "pipeline_parallel_schedule": cls.name,
        "pipeline_parallel_schedule_csv": str(csv_path),
    }
    if per_stage is not None:
        parallelism.update(pipeline_parallel_layers_per_stage=per_stage,
                           pipeline_parallel_first_stage_less_layers=0,
                           pipeline_parallel_last_stage_less_layers=0)
    parallelism.update(pipeline_parallel_microbatch_size=layout.microbatch_size,
                       data_parallel_replicate_degree=1 if layout.fsdp else layout.dp,
                       data_parallel_shard_degree=layout.dp if layout.fsdp else 1,
                       tensor_parallel_degree=layout.tp,
                       enable_sequence_parallel=layout.sequence_parallel,
                       expert_parallel_degree=layout.ep, context_parallel_degree=layout.cp)
    training: dict[str, object] = {"local_batch_size": schedule.microbatches * layout.microbatch_size}
    if layout.seq_len is not None:
        training["seq_len"] = layout.seq_len
    if schedule.pp > 1:
        training["disable_cuda_graphs"] = True  # 0.3 refuses CUDA graphs with pipeline parallelism
    if layout.max_norm != TORCHTITAN_MAX_NORM:
        training["max_norm"] = layout.max_norm
    return {"parallelism": parallelism, "training": training}


def args_text(schedule: Schedule, layout: TorchtitanLayout, cls: TorchClass, per_stage: int | None,
              csv_path: Path) -> str:
    """The overrides on one line, the activation-checkpointing subcommand last (torchtitan
    0.3's parser takes no option after a subcommand)."""
    args = []
    for section, fields in config_fields(schedule, layout, cls, per_stage, csv_path).items():
        for key, value in fields.items():
            if value is True:
                args.append(f"--{section}.{key}")
            elif value is False:
                args.append(f"--{section}.no_{key}")
            else:
                args.append(f"--{section}.{key} {value}")
    args.append(AC_SUBCOMMAND[layout.recompute])
    return " ".join(args)


def torchtitan_shards_line(job, step: float, peak: float, usable: float, chosen: tuple[float, float]) -> str:
    """The line that says how torchtitan's FSDP runs ``job``'s replicas and what that
    costs (``pipesim.plan.torchtitan_fsdp``): its ``step`` seconds and ``peak`` bytes of
    ``usable``, beside ``chosen`` (the step seconds and peak bytes the job was chosen by)."""
    from pipesim.plan.torchtitan_fsdp import torchtitan_fsdp_flags  # noqa: PLC0415

    how = ("each stage's parameters whole in bf16 and its gradients whole in float32 for the step (torch's "
           "pipelining runtime), reduce-scattered after the last backward" if job.pp > 1 else
           "each block gathered for its forward and backward, its gradients' shards in float32")
    memory = f", peak {peak / 1e9:.1f} GB" if peak else ""
    memory += f" of {usable / 1e9:.1f} usable" if peak and usable != float("inf") else ""
    was = f"{chosen[0]:.3f} s" + (f", {chosen[1] / 1e9:.1f} GB" if chosen[1] else "")
    over = f"the {job.dp} replicas" if job.cp == 1 else f"dp x cp = {job.dp * job.cp} ranks"
    return (f"torchtitan shards {over} with FSDP: {how}; priced so (simulate {torchtitan_fsdp_flags(job)}): "
            f"step {step:.3f} s{memory} (as chosen: {was})")


def priced_as_torchtitan_shards(job) -> str:
    """``torchtitan_shards_line`` of ``job`` simulated as torchtitan's FSDP runs it, beside
    ``job`` simulated as given; "" with nothing to shard over (dp x cp of 1). A one-line
    error where torchtitan would not fit it."""
    from pipesim.job import simulate_job  # noqa: PLC0415 - simulates only when asked
    from pipesim.plan.torchtitan_fsdp import torchtitan_fsdp_job  # noqa: PLC0415

    if job.dp * job.cp <= 1:
        return ""
    priced = torchtitan_fsdp_job(job)
    result = simulate_job(priced)
    given = result if priced == job else simulate_job(job)
    peaks = [max((memory.peak_bytes for memory in run.memory), default=0.0) for run in (result, given)]
    usable = min((memory.usable_bytes for memory in result.memory), default=float("inf"))
    line = torchtitan_shards_line(job, result.metrics.makespan, peaks[0], usable, (given.metrics.makespan, peaks[1]))
    if result.oom:
        raise ValueError(f"{line}: it does not fit; choose pp 1, more pipeline stages or recompute, or drop --fsdp")
    return line
