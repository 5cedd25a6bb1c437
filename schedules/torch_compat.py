"""What torch.distributed.pipelining (and torchtitan on top of it) must agree with a
schedule file on, checked before torch sees the file.

torch's runtime takes the order from the CSV but not the stages: those are built by
whoever calls it, and in torchtitan by the schedule class named in the config, which
places stages looped (stage ``s`` on rank ``s % pp``) or V-shaped (ranks ``0 .. p-1``
then back). When the two disagree torch fails far from the cause: a V file run over
looped stages asks a rank for a stage it does not hold and sizes a receive buffer from
garbage (a 94 TB allocation); a looped file over V stages aborts in gloo with "Received
data size doesn't match expected size". A lowered file without ``REDUCE_GRAD`` runs and
silently returns gradients ``m`` times too large. Each of those is a one-line error here.

Pure data: the class names are torch's (``get_schedule_class`` reads them
case-insensitively) and nothing is imported from torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schedules.action import WEIGHT_GRAD_DONE_KINDS
from schedules.schedule import Schedule, looped_placement, v_shape_placement
from schedules.torch_steps import REDUCE_GRAD, STEP_CELLS, parse_step_cell

LOOPED, V_SHAPED = "looped", "V-shaped"


class TorchMismatchError(ValueError):
    """A schedule file and the torch schedule (class, stages, microbatches) it is given to
    disagree; the message names both sides and what would match."""


@dataclass(frozen=True)
class TorchClass:
    """A torch schedule class as torchtitan uses it to build stages: how it places them
    and how many a rank holds (single-stage classes one; torchtitan builds two per rank for
    multi-stage ones unless told the layers per stage, and V classes exactly two)."""

    name: str  # as torch's get_schedule_class spells it
    style: str  # LOOPED or V_SHAPED
    single_stage: bool

    def holds(self, stages_per_rank: int) -> bool:
        if self.single_stage:
            return stages_per_rank == 1
        return stages_per_rank == 2 if self.style == V_SHAPED else stages_per_rank >= 2

    def describe(self) -> str:
        count = "one stage per rank" if self.single_stage else (
            "two stages per rank" if self.style == V_SHAPED else "two or more stages per rank")
        return f"{self.style}, {count}"


TORCH_CLASSES = {cls.name.lower(): cls for cls in (
    TorchClass("1F1B", LOOPED, True),
    TorchClass("GPipe", LOOPED, True),
    TorchClass("PipelineScheduleSingle", LOOPED, True),
    TorchClass("Interleaved1F1B", LOOPED, False),
    TorchClass("LoopedBFS", LOOPED, False),
    TorchClass("InterleavedZeroBubble", LOOPED, False),
    TorchClass("PipelineScheduleMulti", LOOPED, False),
    TorchClass("ZBVZeroBubble", V_SHAPED, False),
    TorchClass("DualPipeV", V_SHAPED, False),
)}

# The torch class of a generator's order, where torch ships one with the same placement
# and stages per rank (zb-h1 is torch's InterleavedZeroBubble with one stage per rank,
# which torchtitan would build two stages per rank for, so it takes the generic choice).
GENERATOR_CLASSES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                     "interleaved-zb": "InterleavedZeroBubble", "looped-bfs": "LoopedBFS",
                     "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
# Otherwise, by placement and stages per rank: the class only decides where the stages go.
_GENERIC = {(LOOPED, True): "1F1B", (LOOPED, False): "Interleaved1F1B", (V_SHAPED, False): "ZBVZeroBubble"}


def stages_per_rank(schedule: Schedule) -> int:
    """The stages each rank holds; refused when ranks hold different numbers, which no
    torch schedule class builds."""
    counts = {rank: len(schedule.stages_of(rank)) for rank in range(schedule.pp)}
    if len(set(counts.values())) > 1:
        raise TorchMismatchError(
            f"{schedule.name}: ranks hold different numbers of stages ({_counts(counts)}); torch's schedule classes "
            f"build the same number of stages on every rank")
    return counts[0]


def placement_style(schedule: Schedule) -> str | None:
    """LOOPED, V_SHAPED, or None for a placement that is neither (with one stage per
    rank the two coincide: it is looped)."""
    chunks = stages_per_rank(schedule)
    if schedule.placement == looped_placement(schedule.pp, chunks):
        return LOOPED
    if schedule.placement == v_shape_placement(schedule.pp, chunks):
        return V_SHAPED
    return None


def torch_class_for(schedule: Schedule, requested: str | None = None) -> TorchClass:
    """The torch schedule class that builds ``schedule``'s stages where its file puts
    them: ``requested`` (torch's name, any case) when it does, else a one-line error
    naming both placements and the classes that would; by default the generator's own
    class, or a class of the same placement."""
    chunks = stages_per_rank(schedule)
    style = placement_style(schedule)
    if style is None:
        raise TorchMismatchError(
            f"{schedule.name}: stages are placed {_holding(schedule.placement, schedule.pp)}, neither looped nor "
            f"V-shaped; torch's schedule classes (and torchtitan) build stages one of those two ways only")
    if requested is not None:
        cls = TORCH_CLASSES.get(requested.lower())
        if cls is None:
            raise TorchMismatchError(
                f"unknown torch schedule class {requested!r}; torch's are "
                f"{', '.join(cls.name for cls in TORCH_CLASSES.values())}")
        if cls.style != style or not cls.holds(chunks):
            fitting = [other.name for other in TORCH_CLASSES.values() if other.style == style and other.holds(chunks)]
            ours = f"{style}, {chunks} stage{'s' if chunks > 1 else ''} per rank"
            raise TorchMismatchError(
                f"{cls.name} builds stages {cls.describe()} ({_holding(_placement_of(cls, schedule), schedule.pp)}), "
                f"but {schedule.name}'s file places them {ours} ({_holding(schedule.placement, schedule.pp)}): torch "
                f"would run the file over the wrong stages; for this file use "
                f"{', '.join(fitting) if fitting else 'no torch class (none places it so)'}")
        return cls
    name = GENERATOR_CLASSES.get(schedule.name)
    if name is not None and TORCH_CLASSES[name.lower()].style == style and TORCH_CLASSES[name.lower()].holds(chunks):
        return TORCH_CLASSES[name.lower()]
    generic = _GENERIC.get((style, chunks == 1))
    if generic is None or not TORCH_CLASSES[generic.lower()].holds(chunks):
        raise TorchMismatchError(
            f"{schedule.name}: {style} with {chunks} stages per rank; torch's V-shaped classes (and torchtitan) "
            f"hold exactly two stages per rank")
    return TORCH_CLASSES[generic.lower()]


def check_torch_stages(schedule: Schedule, rank: int, stage_indices: Sequence[int], num_stages: int,
                       group_size: int, microbatches: int, label: str = "the file") -> None:
    """Refuse a file whose ranks, stages or microbatches differ from those of the torch
    schedule it is loaded into (``rank``'s stages ``stage_indices`` of ``num_stages``,
    ``group_size`` pipeline ranks, ``microbatches``), before torch reads it."""
    if schedule.pp != group_size:
        raise TorchMismatchError(f"{label} has {schedule.pp} rows (pipeline ranks) but torch's pipeline group has "
                                    f"{group_size} ranks")
    if schedule.num_stages != num_stages:
        raise TorchMismatchError(f"{label} has {schedule.num_stages} stages but torch's stages were built as "
                                    f"{num_stages} (stage count of the PipelineStage objects)")
    if sorted(stage_indices) != list(schedule.stages_of(rank)):
        in_file = schedule.stages_of(rank)
        raise TorchMismatchError(
            f"rank {rank} holds stages {_stages(sorted(stage_indices))} in torch, but {label} puts stages "
            f"{_stages(in_file)} on it ({placement_style(schedule) or 'custom'} placement, "
            f"{_holding(schedule.placement, schedule.pp)}): build the stages with a schedule class that places them "
            f"as the file does (e.g. {torch_class_for(schedule).name})")
    if schedule.microbatches != microbatches:
        raise TorchMismatchError(
            f"{label} runs {schedule.microbatches} microbatches but torch's schedule was built for {microbatches} "
            f"(n_microbatches; in torchtitan local_batch_size / pipeline_parallel_microbatch_size)")


def check_reduce_grad(schedule: Schedule, label: str = "the file") -> None:
    """A lowered file torch runs as written needs each stage's ``REDUCE_GRAD`` once, after
    the stage's last backward: that is where torch divides the gradients by the microbatch
    count (``scale_grads=True``) and reduces them under FSDP. Without it the step runs and
    the gradients are ``m`` times too large; refuse such a file, naming the first stage."""
    if not schedule.is_lowered:
        return
    steps = schedule.meta.get(STEP_CELLS, ((),) * schedule.pp)
    for rank in range(schedule.pp):
        program = schedule.programs[rank]
        reduced: dict[int, list[int]] = {}
        for position, cell in steps[rank]:
            stage, kind = parse_step_cell(cell)
            if kind == REDUCE_GRAD:
                reduced.setdefault(stage, []).append(position)
        for stage in schedule.stages_of(rank):
            last = max(at for at, action in enumerate(program)
                       if action.stage == stage and action.kind in WEIGHT_GRAD_DONE_KINDS)
            places = reduced.get(stage, [])
            if len(places) == 1 and places[0] > last:
                continue
            cell = f"{stage}{REDUCE_GRAD}"
            problem = (f"has no {cell} after" if not places else
                       f"has {len(places)} {cell} cells where torch wants one, after" if len(places) > 1 else
                       f"has {cell} before")
            raise TorchMismatchError(
                f"{label}: rank {rank} {problem} stage {stage}'s last backward {program[last]} (position {last}); "
                f"torch's runtime scales (scale_grads=True) and reduces (FSDP) a stage's gradients only there, so "
                f"they would come out wrong; write the file with `pipesim export --lowered`, which places them as "
                f"torch's own lowering does")


def _placement_of(cls: TorchClass, schedule: Schedule) -> tuple[int, ...]:
    chunks = 1 if cls.single_stage else 2 if cls.style == V_SHAPED else stages_per_rank(schedule)
    build = v_shape_placement if cls.style == V_SHAPED else looped_placement
    return build(schedule.pp, chunks)


def _holding(placement: Sequence[int], pp: int) -> str:
    """"rank 0 holds stages 0 and 7": rank 0's stages, the telling part of a placement."""
    first = [stage for stage, rank in enumerate(placement) if rank == 0]
    return f"rank 0 holds stage{'s' if len(first) > 1 else ''} {_stages(first)}"


def _stages(stages: Sequence[int]) -> str:
    stages = list(stages)
    return " and ".join(map(str, stages)) if len(stages) <= 2 else ", ".join(map(str, stages))


def _counts(counts: dict[int, int]) -> str:
    return ", ".join(f"rank {rank}: {count}" for rank, count in list(counts.items())[:4])
