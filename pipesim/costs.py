"""Per-stage costs: how long each compute action takes and how many bytes cross
each stage boundary.

Costs come from uniform flags (``--fwd``, ``--bwd``, ``--wgrad``, ``--act-bytes``),
from a costs file (JSON or YAML: written by hand, by ``pipesim profile``, or derived
from a model spec), and are looked up once per (stage, kind) before simulation so the
hot loop does a dict lookup, not arithmetic.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from schedules.action import ActionKind
from schedules.schedule import Schedule
from schedules.textfile import describe_yaml_error, read_text

STAGE_FIELDS = ("fwd", "bwd", "wgrad", "act_bytes", "stash_bytes", "param_bytes", "layers", "tp_message_bytes",
                "overlap_fb")


class CostsError(ValueError):
    """A costs file or flag value that cannot describe a pipeline."""


@dataclass(frozen=True)
class StageCost:
    """Seconds per microbatch on one stage (one chunk) and the bytes it sends forward.

    ``wgrad`` is the part of ``bwd`` that is weight-gradient work: a split backward runs
    ``I = bwd - wgrad`` then ``W = wgrad``. ``act_bytes`` is the size of this stage's
    output activation, which is also the size of the gradient coming back into it.
    ``stash_bytes`` is what one microbatch's forward keeps alive until its backward.
    ``param_bytes`` is this stage's parameters on one device, in the weights' dtype.
    All figures are per device: with tensor parallelism, one tp shard's share.

    ``layers`` and ``tp_message_bytes`` describe tensor-parallel traffic: each layer's
    forward does two collectives of ``tp_message_bytes`` (the full ``s*b*h`` activation)
    across the tp group and its input-gradient backward two more (Megatron-LM). Zero
    means no tp traffic is charged.

    ``overlap_fb`` is the time of an overlapped pair (DualPipe's ``OVERLAP_F_B``) whose
    forward runs on this stage and whose full backward runs on the rank's other chunk:
    what overlapping saves is a measured property of the model and the machine, so it is
    given, not derived. Zero means not given: the pair costs its ``F + B``.
    """

    fwd: float
    bwd: float
    wgrad: float = 0.0
    act_bytes: float = 0.0
    stash_bytes: float = 0.0
    param_bytes: float = 0.0
    layers: float = 0.0
    tp_message_bytes: float = 0.0
    overlap_fb: float = 0.0

    def seconds(self, kind: str) -> float:
        if kind == ActionKind.F:
            return self.fwd
        if kind == ActionKind.B:
            return self.bwd
        if kind == ActionKind.I:
            return self.bwd - self.wgrad
        if kind == ActionKind.W:
            return self.wgrad
        raise ValueError(f"{kind} is not a compute kind")


@dataclass(frozen=True)
class Costs:
    """Costs of every stage, plus fixed per-action overheads of the runtime.

    ``action_overhead`` is charged on the compute stream before every compute action
    and ``comm_overhead`` before every SEND/RECV (launching a P2P op), so a calibrated
    model can account for the executor's own Python and launch cost.
    ``step_overhead`` is charged once per rank after its last action and its gradient
    all-reduce (the optimizer step). ``sequence_parallel`` says the tp collectives are
    all-gather + reduce-scatter pairs (Korthikanti et al.) rather than all-reduces.
    """

    stages: tuple[StageCost, ...]
    action_overhead: float = 0.0
    comm_overhead: float = 0.0
    step_overhead: float = 0.0
    sequence_parallel: bool = False
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for index, stage in enumerate(self.stages):
            for name in STAGE_FIELDS:
                value = getattr(stage, name)
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                    raise CostsError(f"stage {index}: {name} must be a finite number >= 0, got {value!r}")
            if stage.wgrad > stage.bwd:
                raise CostsError(
                    f"stage {index}: wgrad ({stage.wgrad}) is part of bwd ({stage.bwd}) and cannot exceed it"
                )

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def durations(self) -> dict[tuple[int, str], float]:
        """Seconds of every (stage, compute kind), for the simulator's lookup table."""
        table = {}
        for stage, cost in enumerate(self.stages):
            for kind in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W):
                table[stage, kind] = cost.seconds(kind) + self.action_overhead
        return table

    def overlap_seconds(self, forward_stage: int, backward_stage: int, backward_kind: str = ActionKind.B) -> float:
        """Seconds of an overlapped pair: the forward stage's ``overlap_fb`` plus one
        launch overhead where given, otherwise the two actions as if run one after the
        other (the forward plus the backward, each with its overhead)."""
        given = self.stages[forward_stage].overlap_fb
        if given:
            return given + self.action_overhead
        return (self.stages[forward_stage].fwd + self.stages[backward_stage].seconds(backward_kind)
                + 2 * self.action_overhead)

    def to_dict(self) -> dict:
        return {
            "action_overhead": self.action_overhead,
            "comm_overhead": self.comm_overhead,
            "step_overhead": self.step_overhead,
            "sequence_parallel": self.sequence_parallel,
            "meta": self.meta,
            "stages": [asdict(stage) for stage in self.stages],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))


def uniform_costs(
    num_stages: int | Schedule,
    fwd: float,
    bwd: float,
    wgrad: float = 0.0,
    act_bytes: float = 0.0,
    virtual_stages: int | None = None,
) -> Costs:
    """Every stage alike. ``fwd``/``bwd``/``wgrad`` are per pipeline *rank* (its whole
    share of the model), so each of a rank's ``v`` chunks costs ``1/v`` of them; that
    keeps schedules with different ``v`` comparable at the same ``pp``.

    Pass the schedule itself as the first argument and ``v`` is taken from it: given
    only a stage count, an interleaved schedule's ``pp * v`` stages would each cost a
    whole rank's share and the step would come out ``v`` times too long. With a stage
    count, ``virtual_stages`` defaults to 1 (the figures are per stage)."""
    if isinstance(num_stages, Schedule):
        schedule = num_stages
        if virtual_stages not in (None, schedule.virtual_stages):
            raise CostsError(
                f"virtual_stages={virtual_stages} contradicts the schedule {schedule.name!r}, "
                f"which has {schedule.virtual_stages} per rank; leave it out"
            )
        num_stages, virtual_stages = schedule.num_stages, schedule.virtual_stages
    virtual_stages = virtual_stages or 1
    if wgrad > bwd:
        raise CostsError(f"--wgrad ({wgrad}) is part of --bwd ({bwd}) and cannot exceed it")
    for flag, value in (("--fwd", fwd), ("--bwd", bwd), ("--wgrad", wgrad), ("--act-bytes", act_bytes)):
        if not math.isfinite(value) or value < 0:
            raise CostsError(f"{flag} must be a finite number >= 0, got {value}")
    stage = StageCost(
        fwd=fwd / virtual_stages,
        bwd=bwd / virtual_stages,
        wgrad=wgrad / virtual_stages,
        act_bytes=act_bytes,
    )
    return Costs(stages=(stage,) * num_stages)


def _read_structured(path: Path) -> object:
    text = read_text(path, "costs file (JSON or YAML)")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise CostsError(f"{path}: not valid YAML ({describe_yaml_error(error)})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise CostsError(f"{path}: not valid JSON ({error})") from error


def load_costs(path: str | Path, num_stages: int | None = None) -> Costs:
    """Read a costs file: ``{"stages": [{"fwd": s, "bwd": s, "wgrad": s, "act_bytes": n}, ...],
    "action_overhead": s, ...}``. A single stage entry is repeated for every stage; any
    other count must equal ``num_stages``."""
    path = Path(path)
    return costs_from_dict(_read_structured(path), num_stages, name=str(path))


def costs_from_dict(data: object, num_stages: int | None = None, name: str = "costs") -> Costs:
    """Costs from a costs document already in memory (the form ``load_costs`` reads, e.g.
    what ``pipesim profile`` returns); error messages start with ``name``."""
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list) or not data["stages"]:
        raise CostsError(f"{name}: expected a mapping with a non-empty list 'stages'")
    known = {*STAGE_FIELDS, "stage"}
    stages = []
    for index, entry in enumerate(data["stages"]):
        if not isinstance(entry, dict):
            raise CostsError(f"{name}: stages[{index}] must be a mapping, got {entry!r}")
        unknown = set(entry) - known
        if unknown:
            raise CostsError(f"{name}: stages[{index}] has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        missing = {"fwd", "bwd"} - set(entry)
        if missing:
            raise CostsError(f"{name}: stages[{index}] is missing {sorted(missing)}")
        values = {key: float(value) for key, value in entry.items() if key != "stage"}
        stages.append(StageCost(**values))
    if num_stages is not None and len(stages) != num_stages:
        if len(stages) == 1:
            stages = stages * num_stages
        else:
            raise CostsError(f"{name}: has costs for {len(stages)} stages but the schedule has {num_stages}")
    overheads = {key: float(data.get(key, 0.0)) for key in ("action_overhead", "comm_overhead", "step_overhead")}
    return Costs(stages=tuple(stages), meta=dict(data.get("meta", {})),
                 sequence_parallel=bool(data.get("sequence_parallel", False)), **overheads)
