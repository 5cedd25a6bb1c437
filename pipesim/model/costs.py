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
from operator import attrgetter
from pathlib import Path

from schedules.action import ActionKind
from schedules.schedule import Schedule
from schedules.textfile import describe_yaml_error, read_text, write_text_whole

STAGE_FIELDS = ("fwd", "bwd", "wgrad", "igrad", "act_bytes", "stash_bytes", "param_bytes", "params", "layers",
                "tp_message_bytes", "tp_regathers", "tp_async_regathers", "recompute_layers", "recomputed_tp_pairs",
                "overlap_fb",
                # expert and context parallelism (pipesim.sim.expert_parallel, pipesim.sim.context_parallel)
                "expert_params", "moe_layers", "dispatch_bytes", "attention_layers", "kv_bytes", "attention_fwd",
                "attention_bwd", "wgrad_stash_share", "dispatch_node_limit", "dispatch_copies", "combine_bytes",
                "moe_tp_dense", "moe_shared", "expert_fwd", "expert_igrad", "expert_wgrad",
                "workspace_bytes",
                # the GEMMs beside each tp collective under overlap (pipesim.model.tp_windows)
                "tp_window_attention_in", "tp_window_attention_out", "tp_window_mlp_in", "tp_window_mlp_out")
# per-stage fields that say yes (1) or no (0), with what yes means
SWITCH_FIELDS = {"moe_tp_dense": "the MoE block's tp collectives are the dense MLP's",
                 "moe_shared": "each MoE layer's shared experts run the dense MLP's tp collectives"}
OVERHEADS = ("action_overhead", "comm_overhead", "step_overhead", "grad_norm_overhead")
# what a stage's parameter memory and its gathers after the optimizer step read of it
_PARAMETER_FIGURES = attrgetter("param_bytes", "params", "expert_params")
# what a rank's share of the model is split into when it holds v chunks (the rest is per chunk)
PER_RANK_FIELDS = ("fwd", "bwd", "wgrad", "igrad", "stash_bytes", "param_bytes", "params", "layers", "recompute_layers",
                   "recomputed_tp_pairs", "overlap_fb", "expert_params", "moe_layers", "attention_layers")


class CostsError(ValueError):
    """A costs file or flag value that cannot describe a pipeline."""


@dataclass(frozen=True)
class StageCost:
    """Seconds per microbatch on one stage (one chunk) and the bytes it sends forward.

    ``wgrad`` is the part of ``bwd`` that is weight-gradient work: a split backward runs
    ``I = bwd - wgrad`` then ``W = wgrad``. ``igrad``, when given (non-zero), is the
    input-gradient backward's own time: a split backward as measured runs ``I = igrad``
    then ``W = wgrad``, which need not add up to ``bwd`` (on a CPU the two autograd
    passes of a small stage cost more than the one full backward; ``pipesim profile``
    writes what it measured). Zero keeps the older reading, ``I = bwd - wgrad``.
    ``act_bytes`` is the size of this stage's output activation, which is also the size
    of the gradient coming back into it.
    ``stash_bytes`` is what one microbatch's forward keeps alive until its backward.
    ``param_bytes`` is this stage's parameters on one device, in the weights' dtype.
    All figures are per device: with tensor parallelism, one tp shard's share.

    ``params`` is the parameter count on one device when known (a model spec knows it);
    otherwise memory counts ``param_bytes`` over the weights' bytes per parameter.

    ``layers`` is how many transformer layers the stage holds (zero: not known, or an
    embedding-only or head-only chunk): gradients come out and are reduced layer by
    layer, and ZeRO-3 gathers parameters per layer. With ``tp_message_bytes`` it also
    describes tensor-parallel traffic: each layer's forward does two collectives of
    ``tp_message_bytes`` (the full ``s*b*h`` activation) across the tp group and its
    input-gradient backward two more (Megatron-LM); zero bytes means no tp traffic is
    charged. ``recompute_layers`` of them re-run their forward inside the backward (full
    activation recomputation) and pay its two collectives again; ``recomputed_tp_pairs``
    more collectives (of ``pipesim.sim.parallel._tp_pair``'s price) are repeated in the
    backward by a partial recompute (per-op checkpointing re-runs the all-gathers or
    all-reduces whose outputs it does not save: ``pipesim.model.per_op_checkpoint``).

    ``overlap_fb`` is the time of an overlapped pair (DualPipe's ``OVERLAP_F_B``) whose
    forward runs on this stage and whose full backward runs on the rank's other chunk:
    what overlapping saves is a measured property of the model and the machine. Zero
    means not given: the pair costs its ``F + B``, and with expert parallelism each half's
    all-to-alls hide under the other half's compute (``pipesim.sim.overlap``).

    Expert parallelism: ``moe_layers`` of the stage's layers route their tokens to
    experts, each with two all-to-alls (one rank's routed token copies) in its forward
    and two in its input-gradient backward: one toward the experts of ``dispatch_bytes``
    (the forward's dispatch, the backward's combine gradient) and one back of
    ``combine_bytes`` (the combine, the dispatch's gradient). They differ under
    DeepSeek-V3's FP8 dispatch (``pipesim.model.spec.ModelSpec.dispatch_element_bytes``);
    ``combine_bytes`` 0 (a costs file that gives one size) is ``dispatch_bytes``. ``expert_params`` of
    ``params`` are routed experts, whose gradients are reduced over the expert
    data-parallel group. Context parallelism: each of the ``attention_layers`` passes its
    ``kv_bytes`` (the rank's keys and values) around the ring, overlapped with the
    attention core's ``attention_fwd`` / ``attention_bwd`` seconds (per layer, on this
    rank); full recompute (``recompute_layers``) repeats the forward's exchanges.

    Node-limited routing: a token's ``dispatch_copies`` routed copies (``k``) go to at
    most ``dispatch_node_limit`` nodes (0: no limit), so the all-to-all's pieces between
    nodes carry ``min(limit, nodes) / k`` of their bytes
    (``pipesim.model.experts.MixtureOfExperts.remote_share``).

    ``expert_fwd``, ``expert_igrad``, ``expert_wgrad`` (per MoE layer, like
    ``attention_fwd``): the seconds of a MoE layer's experts (its routed and shared
    experts' GEMMs: what runs between the dispatch and the combine) in the forward, the
    input-gradient and the weight-gradient backward, part of ``fwd``, ``bwd`` and
    ``wgrad``. With them an overlapped pair is priced layer by layer, each all-to-all
    beside the part of the other half that runs with it (``pipesim.sim.overlap``); 0 (a
    costs file that does not give them): beside the other half's whole compute.

    ``moe_tp_dense`` (1 or 0): under tp with expert parallelism or parallel folding, the
    MoE block runs the dense MLP's tp collectives (an all-gather of ``tp_message_bytes``
    before its router, a reduce-scatter after), as pipesim's executor runs it without
    sequence parallelism (``executor.tensor_parallel``: its router reads the gathered
    sequence), instead of Megatron-Core's rule (the routed copies gathered over the expert
    tensor-parallel group; none at ``--etp 1``), which 0 takes (a model's costs, a run's
    with sequence parallelism: ``executor.shard_routing``)
    (``pipesim.sim.parallel.tp_collective_seconds``). ``moe_shared`` (1 or 0): under that
    rule each MoE layer's shared experts run the dense MLP's pair besides, on the tp group
    (Megatron-Core's ``SharedExpertMLP``: split over tp, the sequence gathered before it and
    its output reduce-scattered, also at ``--etp 1``).

    ``wgrad_stash_share`` is the share of ``stash_bytes`` a microbatch still holds
    between its input-gradient backward (``I``) and its weight-gradient backward (``W``)
    when the backward is split: the matrix products' inputs and output gradients, which
    ``W`` needs (Qi et al. 2024, Table 1: ``32h`` of ``34h + 5as`` per token). 1 (the
    default for flags and costs files) holds the whole stash until ``W``; a model's
    costs derive it (``pipesim.model.activations.wgrad_stash_bytes``). Above 1, ``I``
    adds to what the microbatch holds: the executor's split backward keeps the whole
    graph until ``W`` and beside it the gradients of its modules' outputs
    (``pipesim.model.activations.output_grad_bytes``).

    ``tp_regathers`` (per layer): all-gathers of ``tp_message_bytes`` a layer's backward
    (``B`` or ``I``) runs beyond its sequence-parallel pair, each before a sublayer's
    backward, its wait held (the executor gathers the sequence shards its column-parallel
    GEMMs read again: ``executor.rebuilt_activations.read_gathered_shard``).
    ``tp_async_regathers`` (per layer): the same all-gathers as Megatron-Core issues them,
    each beside the input-gradient product of the projections it feeds (the attention's,
    and the MLP's on dense layers: 1 to 2), so only what that product does not hide holds
    the rank (``pipesim.sim.parallel.tp_collective_seconds``).

    ``workspace_bytes`` is what one of the stage's actions holds for a moment beyond the
    stashes: the loss's temporaries on a last stage
    (``pipesim.model.activations.loss_workspace_bytes``), a fully recomputed layer's
    rebuilt activations (``recompute_workspace_bytes``), the larger of the two. One
    action runs at a time, so a rank holds its stages' largest on top of everything else
    (``pipesim.sim.memory``).

    ``tp_window_*`` (per layer, like ``attention_fwd``): the forward seconds of the GEMMs
    each of a layer's four tp collectives runs beside when they are overlapped
    (``pipesim.model.tp_windows``: attention's input projections, its output projection,
    the MLP's input and output GEMMs). All zero (a costs file that does not give them):
    the collectives hide under the layer's whole compute outside the attention core.
    """

    fwd: float
    bwd: float
    wgrad: float = 0.0
    igrad: float = 0.0
    act_bytes: float = 0.0
    stash_bytes: float = 0.0
    param_bytes: float = 0.0
    params: float = 0.0
    layers: float = 0.0
    tp_message_bytes: float = 0.0
    tp_regathers: float = 0.0
    tp_async_regathers: float = 0.0
    recompute_layers: float = 0.0
    recomputed_tp_pairs: float = 0.0
    overlap_fb: float = 0.0
    expert_params: float = 0.0
    moe_layers: float = 0.0
    dispatch_bytes: float = 0.0
    attention_layers: float = 0.0
    kv_bytes: float = 0.0
    attention_fwd: float = 0.0
    attention_bwd: float = 0.0
    wgrad_stash_share: float = 1.0
    dispatch_node_limit: float = 0.0
    dispatch_copies: float = 0.0
    combine_bytes: float = 0.0
    moe_tp_dense: float = 0.0
    moe_shared: float = 0.0
    expert_fwd: float = 0.0
    expert_igrad: float = 0.0
    expert_wgrad: float = 0.0
    workspace_bytes: float = 0.0
    tp_window_attention_in: float = 0.0
    tp_window_attention_out: float = 0.0
    tp_window_mlp_in: float = 0.0
    tp_window_mlp_out: float = 0.0

    @property
    def all_to_all_bytes(self) -> tuple[float, float]:
        """(toward the experts, back from them): one rank's bytes in each of an MoE layer's
        two all-to-alls per pass, ``combine_bytes`` 0 read as ``dispatch_bytes``."""
        return self.dispatch_bytes, self.combine_bytes or self.dispatch_bytes

    @property
    def tp_windows(self) -> tuple[float, float, float, float]:
        """The four ``tp_window_*`` fields, in ``pipesim.model.tp_windows`` order."""
        return (self.tp_window_attention_in, self.tp_window_attention_out, self.tp_window_mlp_in,
                self.tp_window_mlp_out)

    @property
    def input_grad(self) -> float:
        """Seconds of the input-gradient backward ``I``: ``igrad`` when measured apart,
        else what the weight gradients leave of the full backward."""
        return self.igrad or self.bwd - self.wgrad

    def seconds(self, kind: str) -> float:
        if kind == ActionKind.F:
            return self.fwd
        if kind == ActionKind.B:
            return self.bwd
        if kind == ActionKind.I:
            return self.input_grad
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
    ``memory_known`` is false when nothing said what a stage keeps or holds (flag costs
    without ``--stash-bytes``/``--param-bytes``): memory is then reported as n/a, not 0.
    ``pairs_overlap`` says whether the executor these costs describe runs the two halves
    of an overlapped forward-backward pair at the same time (two CUDA streams) or one
    after the other (on a CPU, ``executor.pair_streams``): then each half costs what it
    costs alone, its all-to-alls included, and ``overlap_fb`` is not read.
    ``embedding_sums`` lists the embedding tables whose gradients two ranks sum after the
    step's reductions, each as ``(first stage, last stage, gradient bytes)``: a tied
    model's output layer, or DeepSeek-V3's prediction modules, read the table on the last
    stage from a copy there (``with_embedding_copies``), and Megatron-LM (and
    ``pipesim run``'s executor) all-reduce the two copies' gradients over the ranks
    holding the two stages before the optimizer. A measured ``step_overhead`` holds this
    all-reduce already, so costs measured by a run or a profile list none.
    ``delayed_wgrad`` (Megatron-Core's ``--delay-wgrad-compute``, ``simulate
    --delay-wgrad``): in an overlapped pair priced layer by layer, a MoE layer's experts'
    weight gradient runs after the backward's dispatch has started, beside it, instead
    of before it (``pipesim.sim.overlap``).
    ``grad_norm_overhead`` is gradient clipping's norm (``--clip-grad``,
    ``with_grad_norm``): each rank reads the gradients its optimizer steps for the sum of
    their squares, and the sums are all-reduced over every rank holding a share of them,
    a collective no rank leaves before the last one enters; charged after the embedding
    sums, before the optimizer, as the slowest rank's read plus the collective. A
    measured ``step_overhead`` holds it already (``pipesim run --clip-grad``), so measured
    costs carry none.
    """

    stages: tuple[StageCost, ...]
    action_overhead: float = 0.0
    comm_overhead: float = 0.0
    step_overhead: float = 0.0
    sequence_parallel: bool = False
    meta: dict = field(default_factory=dict, compare=False)
    memory_known: bool = True
    pairs_overlap: bool = True
    embedding_sums: tuple[tuple[int, int, float], ...] = ()
    grad_norm_overhead: float = 0.0
    delayed_wgrad: bool = False

    def __post_init__(self) -> None:
        for name in OVERHEADS:
            check_number(getattr(self, name), name)
        for index, (first, last, num_bytes) in enumerate(self.embedding_sums):
            where = f"embedding_sums[{index}]"
            check_number(num_bytes, f"{where}.bytes")
            if not (0 <= first < last < len(self.stages)):
                raise CostsError(f"{where}: stages {first} and {last} must be two of the {len(self.stages)} "
                                 f"stages, the first before the last")
        checked: set[int] = set()  # a stage object shared by many stages (a model's alike layers) is checked once
        for index, stage in enumerate(self.stages):
            if id(stage) in checked:
                continue  # the same values passed at its first index: the first bad index is still the one named
            checked.add(id(stage))
            values = [getattr(stage, name) for name in STAGE_FIELDS]
            # the usual case at once (a plan builds thousands of costs); else each value is
            # checked and the bad one named
            if not (all(type(value) is float or type(value) is int for value in values) and min(values) >= 0
                    and math.isfinite(math.fsum(values))):
                for name, value in zip(STAGE_FIELDS, values, strict=True):
                    check_number(value, f"stage {index}: {name}")
            if stage.wgrad > stage.bwd and not stage.igrad:
                raise CostsError(
                    f"stage {index}: wgrad ({stage.wgrad}) is part of bwd ({stage.bwd}) and cannot exceed it"
                )

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def with_step_overhead(self, seconds: float) -> Costs:
        """These costs with another optimizer step (``with_overhead``)."""
        return self.with_overhead("step_overhead", seconds)

    def with_grad_norm(self, seconds: float) -> Costs:
        """These costs with gradient clipping's norm taking ``seconds`` (see the class)."""
        return self.with_overhead("grad_norm_overhead", seconds)

    def with_overhead(self, name: str, seconds: float) -> Costs:
        """These costs with overhead ``name`` (one of ``OVERHEADS``) set to ``seconds``, the
        stages not checked again (they were): a planner derives thousands of layouts'
        costs that differ only there."""
        check_number(seconds, name)
        copy = object.__new__(Costs)
        copy.__dict__.update(self.__dict__, meta=dict(self.meta))
        object.__setattr__(copy, name, seconds)
        return copy

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
            "memory_known": self.memory_known,
            "action_overhead": self.action_overhead,
            "comm_overhead": self.comm_overhead,
            "step_overhead": self.step_overhead,
            **({"grad_norm_overhead": self.grad_norm_overhead} if self.grad_norm_overhead else {}),
            "sequence_parallel": self.sequence_parallel,
            **({} if self.pairs_overlap else {"pairs_overlap": False}),  # the usual case left unwritten
            **({"delayed_wgrad": True} if self.delayed_wgrad else {}),
            **({"embedding_sums": [{"first": first, "last": last, "bytes": num_bytes}
                                   for first, last, num_bytes in self.embedding_sums]}
               if self.embedding_sums else {}),
            "meta": self.meta,
            "stages": [asdict(stage) for stage in self.stages],
        }

    def save(self, path: str | Path) -> None:
        write_text_whole(path, json.dumps(self.to_dict(), indent=2))


def parameter_figures(costs: Costs) -> tuple[tuple[float, int, int], ...]:
    """Each stage's parameter bytes and counts (all, then its routed experts'): all that its
    parameter memory (``pipesim.sim.memory.static_bytes``) and its parameter gathers after
    the optimizer step (``pipesim.sim.parallel.parameter_gather_seconds``) read of it. A
    planner keeps both under them: layouts whose stages differ only in what they compute
    (microbatch size, recompute) hold and gather the same parameters."""
    return tuple(map(_PARAMETER_FIGURES, costs.stages))


# The largest cost a figure may carry (seconds or bytes): a million times any step's
# seconds, a petabyte. Sums over millions of actions stay far from float overflow, so a
# value like 1e308 is refused here in one line, not met as an OverflowError mid-step.
MAX_COST = 1e15


def check_number(value: object, where: str) -> float:
    """``value`` as a float if it is a finite number >= 0 and at most ``MAX_COST``;
    otherwise a ``CostsError`` naming ``where`` and the value (NaN, inf, null, negative,
    text, too large)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostsError(f"{where} must be a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise CostsError(f"{where} must be a finite number >= 0, got {value!r}")
    if value > MAX_COST:
        raise CostsError(f"{where} {value:g} is beyond what a step can cost: at most {MAX_COST:g} (seconds or bytes)")
    return float(value)


def uniform_costs(
    num_stages: int | Schedule,
    fwd: float,
    bwd: float,
    wgrad: float = 0.0,
    act_bytes: float = 0.0,
    virtual_stages: int | None = None,
    stash_bytes: float | None = None,
    param_bytes: float | None = None,
    wgrad_stash_share: float = 1.0,
) -> Costs:
    """Every stage alike. ``fwd``/``bwd``/``wgrad``, ``stash_bytes`` and ``param_bytes``
    are per pipeline *rank* (its whole share of the model), so each of a rank's ``v``
    chunks costs ``1/v`` of them; that keeps schedules with different ``v`` comparable at
    the same ``pp``. Without ``stash_bytes`` and ``param_bytes`` memory is unknown.

    Pass the schedule itself as the first argument and ``v`` is taken from it: given
    only a stage count, an interleaved schedule's ``pp * v`` stages would each cost a
    whole rank's share and the step would come out ``v`` times too long. With a stage
    count, ``virtual_stages`` defaults to 1 (the figures are per stage). A schedule holding
    copies of the model (DualPipe's two) has ``v / copies`` shares per rank: each of its
    stages is a whole ``1/pp`` of the model, as a 1F1B stage is."""
    if isinstance(num_stages, Schedule):
        schedule = num_stages
        if virtual_stages not in (None, schedule.virtual_stages):
            raise CostsError(
                f"virtual_stages={virtual_stages} contradicts the schedule {schedule.name!r}, "
                f"which has {schedule.virtual_stages} per rank; leave it out"
            )
        num_stages, virtual_stages = schedule.num_stages, schedule.virtual_stages // schedule.copies
    virtual_stages = virtual_stages or 1
    values = {"--fwd": fwd, "--bwd": bwd, "--wgrad": wgrad, "--act-bytes": act_bytes,
              "--stash-bytes": stash_bytes or 0.0, "--param-bytes": param_bytes or 0.0}
    for flag, value in values.items():
        check_number(value, flag)
    if wgrad > bwd:
        raise CostsError(f"--wgrad ({wgrad}) is part of --bwd ({bwd}) and cannot exceed it")
    check_number(wgrad_stash_share, "--wgrad-stash-share")
    if wgrad_stash_share > 1:
        raise CostsError(f"--wgrad-stash-share {wgrad_stash_share}: a share of the stash, between 0 and 1")
    stage = StageCost(
        wgrad_stash_share=wgrad_stash_share,
        fwd=fwd / virtual_stages,
        bwd=bwd / virtual_stages,
        wgrad=wgrad / virtual_stages,
        act_bytes=act_bytes,
        stash_bytes=(stash_bytes or 0.0) / virtual_stages,
        param_bytes=(param_bytes or 0.0) / virtual_stages,
    )
    return Costs(stages=(stage,) * num_stages, memory_known=stash_bytes is not None or param_bytes is not None)


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


def load_costs(path: str | Path, num_stages: int | None = None, virtual_stages: int = 1) -> Costs:
    """Read a costs file: ``{"stages": [{"fwd": s, "bwd": s, "wgrad": s, "act_bytes": n}, ...],
    "action_overhead": s, ...}``. See ``costs_from_dict`` for how entries map to stages."""
    path = Path(path)
    return costs_from_dict(_read_structured(path), num_stages, name=str(path), virtual_stages=virtual_stages)


def stated_sequence_parallel(path: str | Path) -> bool | None:
    """Whether the costs file at ``path`` says its run was sequence-parallel (the
    ``sequence_parallel`` key ``Costs.to_dict`` writes: ``profile``, ``compare
    --costs-out``), or None where it does not say (a file written by hand)."""
    data = _read_structured(Path(path))
    stated = data.get("sequence_parallel") if isinstance(data, dict) else None
    return None if stated is None else bool(stated)


def costs_from_dict(data: object, num_stages: int | None = None, name: str = "costs",
                    virtual_stages: int = 1) -> Costs:
    """Costs from a costs document already in memory (the form ``load_costs`` reads, e.g.
    what ``pipesim profile`` returns); error messages start with ``name``.

    Entries are per stage (per model chunk), in order, or placed by their ``stage`` key
    (then every stage must be given exactly once). A single entry without ``stage`` is
    every pipeline rank alike, as the flags are: with ``v`` chunks per rank its times,
    stash and parameters are split over them (``/v``), its ``act_bytes`` kept."""
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list) or not data["stages"]:
        raise CostsError(f"{name}: expected a mapping with a non-empty list 'stages'")
    known = {*STAGE_FIELDS, "stage"}
    entries: list[tuple[int | None, StageCost]] = []
    for index, entry in enumerate(data["stages"]):
        where = f"{name}: stages[{index}]"
        if not isinstance(entry, dict):
            raise CostsError(f"{where} must be a mapping, got {entry!r}")
        unknown = set(entry) - known
        if unknown:
            raise CostsError(f"{where} has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        missing = {"fwd", "bwd"} - set(entry)
        if missing:
            raise CostsError(f"{where} is missing {sorted(missing)}")
        values = {key: check_number(value, f"{where}.{key}") for key, value in entry.items() if key != "stage"}
        for key in ("tp_regathers", "tp_async_regathers"):  # a layer has two sublayers to gather for
            if values.get(key, 0.0) > 2:
                raise CostsError(f"{where}.{key} is per layer, at most 2 (the attention's input and the MLP's), "
                                 f"got {values[key]}")
        for key, meaning in SWITCH_FIELDS.items():
            if values.get(key, 0.0) not in (0.0, 1.0):
                raise CostsError(f"{where}.{key} is 1 ({meaning}) or 0, got {values[key]}")
        if values.get("wgrad", 0.0) > values["bwd"] and not values.get("igrad"):
            raise CostsError(
                f"{where}: wgrad ({values['wgrad']}) is part of bwd ({values['bwd']}) and cannot exceed it; "
                "give igrad too for a split backward measured apart")
        entries.append((_stage_key(entry, where), StageCost(**values)))
    stages = _place_stages(entries, num_stages, name, virtual_stages)
    overheads = {key: check_number(data.get(key, 0.0), f"{name}: {key}") for key in OVERHEADS}
    memory_known = any(key in entry for entry in data["stages"] for key in ("stash_bytes", "param_bytes", "params"))
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise CostsError(f"{name}: 'meta' must be a mapping, got {meta!r}")
    pairs_overlap = data.get("pairs_overlap", True)
    if not isinstance(pairs_overlap, bool):
        raise CostsError(f"{name}: 'pairs_overlap' must be true or false, got {pairs_overlap!r}")
    delayed_wgrad = data.get("delayed_wgrad", False)
    if not isinstance(delayed_wgrad, bool):
        raise CostsError(f"{name}: 'delayed_wgrad' must be true or false, got {delayed_wgrad!r}")
    try:  # the embedding sums, checked against the stages by Costs: its errors named after the document
        return Costs(stages=tuple(stages), meta=dict(meta),
                     sequence_parallel=bool(data.get("sequence_parallel", False)), memory_known=memory_known,
                     pairs_overlap=pairs_overlap, delayed_wgrad=delayed_wgrad,
                     embedding_sums=_embedding_sums(data.get("embedding_sums", [])),
                     **overheads)
    except CostsError as error:
        raise CostsError(f"{name}: {error}") from None


def _embedding_sums(entries: object) -> tuple[tuple[int, int, float], ...]:
    """A costs document's ``embedding_sums`` (``Costs``, which checks the stages and the
    bytes): a list of ``{first, last, bytes}``, each stage a whole number."""
    if not isinstance(entries, list):
        raise CostsError(f"'embedding_sums' must be a list of {{first, last, bytes}}, got {entries!r}")
    sums = []
    for index, entry in enumerate(entries):
        where = f"embedding_sums[{index}]"
        if not isinstance(entry, dict) or set(entry) != {"first", "last", "bytes"}:
            raise CostsError(f"{where} must be a mapping of exactly first, last and bytes, got {entry!r}")
        stages = [entry["first"], entry["last"]]
        if any(isinstance(stage, bool) or not isinstance(stage, int) for stage in stages):
            raise CostsError(f"{where}: first and last must be stage numbers, got {stages!r}")
        sums.append((stages[0], stages[1], entry["bytes"]))
    return tuple(sums)


def _stage_key(entry: dict, where: str) -> int | None:
    if "stage" not in entry:
        return None
    stage = entry["stage"]
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise CostsError(f"{where}: 'stage' must be an integer >= 0, got {stage!r}")
    return stage


def _place_stages(entries: list[tuple[int | None, StageCost]], num_stages: int | None, name: str,
                  virtual_stages: int) -> list[StageCost]:
    """Stage costs in stage order, from entries in order or keyed by ``stage``."""
    keyed = [stage for stage, _ in entries if stage is not None]
    if keyed and len(keyed) != len(entries):
        raise CostsError(f"{name}: give 'stage' on every entry or on none")
    if not keyed:
        stages = [cost for _, cost in entries]
        if num_stages is not None and len(stages) != num_stages:
            if len(stages) != 1:
                raise CostsError(f"{name}: has costs for {len(stages)} stages but the schedule has {num_stages}")
            rank = stages[0]
            chunk = StageCost(**{key: value / virtual_stages if key in PER_RANK_FIELDS else value
                                 for key, value in asdict(rank).items()})
            stages = [chunk] * num_stages
        return stages
    count = num_stages if num_stages is not None else max(keyed) + 1
    placed: dict[int, StageCost] = {}
    for stage, cost in entries:
        if stage >= count:
            raise CostsError(f"{name}: stage {stage} is out of range; the schedule has stages 0..{count - 1}")
        if stage in placed:
            raise CostsError(f"{name}: stage {stage} is given twice")
        placed[stage] = cost
    absent = [stage for stage in range(count) if stage not in placed]
    if absent:
        raise CostsError(f"{name}: no costs for stage(s) {absent}; the schedule has {count} stages")
    return [placed[stage] for stage in range(count)]
