"""The layouts of a plan: what may vary (``SearchSpace``), one choice of each (``Layout``),
every layout the space allows and why each other candidate was ruled out
(``enumerate_layouts``), and the user's constraints on them, each value checked against
what its field holds.

A layout is a schedule, pp × tp × dp, virtual stages, microbatch size (the microbatch
count follows from the global batch), for interleaved-1f1b its microbatch group ``N``
(``planned_groups``), recompute, the ZeRO stage, sequence parallelism,
context parallelism (cp ranks splitting each sequence, for long ones) and, for a mixture
of experts, the expert-parallel size (ep ranks cut from dp x cp, as ``simulate --ep``
places them), whether its experts are folded (``etp`` 1: Megatron-Core's parallel
folding, the routed experts whole on every rank and the ep groups cut from every
tp x cp x dp rank of a stage; 0: split over tp) and whether its expert-parallel
all-to-alls run as combined 1F1B (``ep_overlap``: Megatron-Core's
``--overlap-moe-expert-parallel-comm``, where ``schedules.generators.combined`` says it
runs). Layers need not divide over the pp × v stages: each layout's split is the balanced
one ``pipesim simulate`` makes (``pipesim.model.stage_split``), chosen per layout rather
than searched.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pipesim.model.per_op_checkpoint import PER_OP, per_op_refusal
from pipesim.model.spec import NORM_MLA_UP, RECOMPUTE, ModelSpec, moe_act_conflict
from pipesim.plan.torchtitan_experts import torchtitan_expert_cause
from pipesim.plan.torchtitan_fsdp import TORCHTITAN_FSDP, torchtitan_zero
from pipesim.sim.zero import ZERO_STAGES
from schedules.generators import (
    GROUPED,
    MULTI_CHUNK,
    PLANNABLE_SCHEDULES,
    PLANNED_SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
)
from schedules.generators.combined import combined_problem
from schedules.generators.common import ScheduleUnavailableError
from schedules.generators.interleaved import round_size, valid_microbatch_groups


class Layout(NamedTuple):
    """One way to run the job. ``microbatches`` per step follows from the global batch.

    A named tuple: a search makes, hashes, compares and sends tens of thousands of
    them (made and hashed several times faster than a frozen dataclass's), and they
    order field by field, as the ranking's ties need."""

    schedule: str
    pp: int
    tp: int
    dp: int
    virtual_stages: int
    microbatch_size: int
    microbatches: int
    recompute: str = "none"
    zero: int = 0
    sequence_parallel: bool = False
    ep: int = 1
    cp: int = 1
    microbatch_group: int | None = None  # interleaved-1f1b's N; None: the schedule's own (N = pp where pp | m)
    ep_overlap: bool = False  # combined 1F1B (schedules.generators.combined): ep's all-to-alls beside compute
    etp: int = 0  # the routed experts' tensor parallelism: 0 split over tp, 1 folded (whole on every rank)
    recompute_moe_act: bool = False  # the routed experts' activation recomputed (Megatron-Core's moe_act)

    def label(self) -> str:
        chunks = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        context = f" cp{self.cp}" if self.cp > 1 else ""
        experts = (f" ep{self.ep}" if self.ep > 1 else "") + (f" etp{self.etp}" if self.etp else "")
        extras = "".join([f" N{self.microbatch_group}" if self.microbatch_group else "",
                          f" recompute={self.recompute}" if self.recompute != "none" else "",
                          f" zero{self.zero}" if self.zero else "", " sp" if self.sequence_parallel else "",
                          " ep-overlap" if self.ep_overlap else "", " moe-act" if self.recompute_moe_act else ""])
        return (f"{self.schedule}{chunks} pp{self.pp} tp{self.tp}{context} dp{self.dp}{experts} "
                f"mbs{self.microbatch_size} m{self.microbatches}{extras}")


@dataclass
class SearchSpace:
    """What the search may vary, and the fixed facts of the job."""

    gpus: int
    gpus_per_node: int
    global_batch: int
    layers: int
    heads: int
    kv_heads: int
    schedules: Sequence[str] = PLANNED_SCHEDULES  # every schedule but dualpipe
    microbatch_sizes: Sequence[int] = (1, 2, 4)
    virtual_stages: Sequence[int] = (2, 4)
    recompute: Sequence[str] = ("none",)
    zero: Sequence[int] = (0,)
    sequence_parallel: Sequence[bool] = (False,)
    constraints: dict[str, set[str]] = field(default_factory=dict)
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    expert_parallel: Sequence[int] | None = None  # ep sizes to try; None: every power of two dividing the experts
    seq_len: int = 0  # tokens per sequence (0: unknown, no context parallelism)
    context_parallel: Sequence[int] | None = None  # cp sizes to try; None: ``context_parallel_sizes``
    microbatch_groups: Sequence[int] | None = None  # interleaved-1f1b's N to try; None: ``planned_groups``
    ep_overlap: Sequence[bool] = (False,)  # combined 1F1B off, on or both, where it runs (``_combines``)
    expert_tp: Sequence[int] = (0,)  # the experts' tp to try: 0 (tp) and 1 (folded, where tp > 1)
    recompute_moe_act: Sequence[bool] = (False,)  # the experts' activation recomputed off, on or both
    torchtitan: bool = False  # only the expert layouts torchtitan runs as priced (pipesim.plan.torchtitan_experts)
    fsdp: bool = False  # with torchtitan: its replicas shard with FSDP (else DDP, outside its expert mesh)


# Every recompute mode the simulator models; a plan searches norm-mla-up (DeepSeek-V3's
# recompute of the norms and latent attention's up-projections) for models with latent
# attention only, where it saves what the others do not, and per-op (torchtitan's
# SelectiveAC) where it is modelled: dense models without latent attention
# (``searched_recompute``).
RECOMPUTE_MODES = RECOMPUTE


def searched_recompute(spec: ModelSpec) -> tuple[str, ...]:
    """The recompute modes a plan searches for ``spec`` when none are asked for: every
    mode, norm-mla-up only with latent attention (MLA), per-op only where
    ``per_op_refusal`` has no reason against it (a plan keeps flash attention on)."""
    return tuple(mode for mode in RECOMPUTE_MODES
                 if (mode != NORM_MLA_UP or spec.mla) and (mode != PER_OP or per_op_refusal(spec) is None))


def parse_constraints(texts: Iterable[str]) -> dict[str, set[str]]:
    """``["pp=8", "schedule=1f1b,zb-h1"]`` -> ``{"pp": {"8"}, "schedule": {"1f1b", "zb-h1"}}``,
    each value checked against what its field can hold (``pp=banana`` would keep no
    layout): errors name the bad text, the bad value and what is valid."""
    names = set(Layout._fields)
    constraints: dict[str, set[str]] = {}
    for text in texts:
        key, sep, value = text.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not value.strip():
            raise ValueError(f"--constraint {text!r}: expected FIELD=VALUE[,VALUE...], e.g. pp=8")
        if key not in names:
            raise ValueError(f"--constraint {text!r}: unknown field {key!r}; fields: {', '.join(sorted(names))}")
        parts = [part.strip() for part in value.split(",")]
        if not all(parts):
            raise ValueError(f"--constraint {text!r}: an empty value in the list; expected FIELD=VALUE[,VALUE...]")
        try:
            constraints.setdefault(key, set()).update(_constraint_value(key, part) for part in parts)
        except ValueError as error:
            raise ValueError(f"--constraint {text!r}: {error}") from None
    return constraints


# How a constraint's value is written as a layout's field is (``str`` of it), by field.
_SWITCHES = {"true": "True", "on": "True", "1": "True", "false": "False", "off": "False", "0": "False"}


def _constraint_value(field: str, value: str) -> str:
    """``value`` as ``str`` of the ``Layout`` field ``field`` would write it; a ValueError
    naming what the field holds where it cannot be one."""
    if field == "schedule":
        if value not in PLANNABLE_SCHEDULES:
            raise ValueError(f"unknown schedule {value!r}; schedules: {', '.join(PLANNABLE_SCHEDULES)}")
        return value
    if field == "recompute":
        if value not in RECOMPUTE_MODES:
            raise ValueError(f"unknown recompute mode {value!r}; modes: {', '.join(RECOMPUTE_MODES)}")
        return value
    if field == "microbatch_group" and value.lower() == "none":
        return "None"  # the schedule's own group
    if field == "etp":
        number = 0 if value.lower() == "tp" else int(value) if value.isdigit() else None
        if number not in (0, 1):
            raise ValueError(f"etp is 1 (the experts folded, whole on every rank) or tp (0: split over tp), not "
                             f"{value!r}")
        return str(number)
    if field in ("sequence_parallel", "ep_overlap", "recompute_moe_act"):
        if value.lower() not in _SWITCHES:
            raise ValueError(f"{field} is on or off (true or false), not {value!r}")
        return _SWITCHES[value.lower()]
    try:
        number = int(value)
    except ValueError:
        number = None
    if field == "zero":
        if number not in ZERO_STAGES:
            raise ValueError(f"zero is a ZeRO stage, one of {', '.join(map(str, ZERO_STAGES))}, not {value!r}")
    elif number is None or number < 1:
        raise ValueError(f"{field} is a whole number >= 1, not {value!r}")
    return str(number)


def _powers_of_two(limit: int) -> list[int]:
    return [2**power for power in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


# The searched dimensions whose values the plan accounts for one by one (``values_left_out``).
SEARCHED_FIELDS = ("schedule", "microbatch_size", "virtual_stages", "recompute", "cp", "ep", "microbatch_group",
                   "ep_overlap", "etp", "recompute_moe_act")


def enumerate_layouts(space: SearchSpace, by_value: dict[tuple[str, object], Counter] | None = None
                      ) -> tuple[list[Layout], Counter]:
    """Every layout the space allows, and how many candidates each rule ruled out. A
    candidate is one choice of every dimension on a split of the GPUs (tp x pp dividing
    them); choices that only repeat another layout or describe none are not candidates:
    ZeRO or sequence parallelism with nothing to shard over, combined 1F1B where
    Megatron-Core does not run it (``_combines``), the experts' activation recomputed
    beside a recompute it cannot go with (``moe_act_conflict``), a V with other than two
    stages per rank, and at pp 1 (no pipeline: one rank runs every forward and backward)
    any schedule but one, 1F1B where it is searched. ``by_value``, where given, also
    counts the causes per value of each of ``SEARCHED_FIELDS`` (``(field, value)``)."""
    rejected: Counter = Counter()
    layouts = []
    alone = "1f1b" if "1f1b" in space.schedules else space.schedules[0]  # the one schedule at pp 1
    expert_sizes = expert_parallel_sizes(space)
    splits = [(tp, pp, cp) for tp in _powers_of_two(space.gpus_per_node) for cp in context_parallel_sizes(space)
              for pp in range(1, space.layers + 3)]  # a first and a last stage may hold no layer
    for tp, pp, cp in splits:
        if space.gpus % (tp * pp * cp):
            continue  # not a split of the GPUs at all: not a layout, not counted
        dp = space.gpus // (tp * pp * cp)
        # at tp 1 the experts are whole either way (folded is the same layout as not); a dense model has none
        expert_tps = sorted({etp if tp > 1 and space.experts else 0 for etp in space.expert_tp})
        for microbatch_size in space.microbatch_sizes:
            microbatches = space.global_batch // (dp * microbatch_size)
            for schedule in (space.schedules if pp > 1 else (alone,)):
                groups = planned_groups(space, schedule, pp, microbatches)
                for chunks, group in ((chunks, group) for chunks in _chunks(schedule, space) for group in groups):
                    for recompute in space.recompute:
                        for zero in space.zero:
                            if zero and dp * cp == 1:
                                continue  # nothing to shard over (ZeRO shards over dp x cp): as zero 0
                            for sequence_parallel in space.sequence_parallel:
                                if sequence_parallel and tp == 1:
                                    continue  # no tensor-parallel group: the same layout
                                for ep, overlap, etp, moe_act in (
                                        (ep, overlap, etp, moe_act) for ep in expert_sizes
                                        for overlap in space.ep_overlap for etp in expert_tps
                                        for moe_act in space.recompute_moe_act):
                                    if ep > dp * cp * (tp if etp else 1):
                                        continue  # its ranks are cut from dp x cp (folded: tp x dp x cp)
                                    if overlap and not _combines(schedule, pp, ep, recompute):
                                        continue  # no combined 1F1B of it exists: not a layout
                                    if moe_act and moe_act_conflict(recompute):
                                        continue  # full recompute re-runs it anyway, per-op runs no experts
                                    layout = Layout(schedule, pp, tp, dp, chunks, microbatch_size, microbatches,
                                                    recompute, zero, sequence_parallel, ep, cp, group, overlap,
                                                    etp, moe_act)
                                    cause = _ruled_out(layout, space)
                                    if cause is None:
                                        layouts.append(layout)
                                    else:
                                        rejected[cause] += 1
                                        if by_value is not None:
                                            for name in SEARCHED_FIELDS:
                                                by_value.setdefault((name, getattr(layout, name)),
                                                                    Counter())[cause] += 1
    return layouts, rejected


def values_left_out(layouts: list[Layout], by_value: dict[tuple[str, object], Counter]) -> dict[str, dict]:
    """The searched values (``"field=value"``) that no layout kept, each with the causes
    that ruled out its candidates (``enumerate_layouts``'s ``by_value``): a microbatch size
    the global batch never splits into, say, named with its rule instead of just missing.
    Only where the value stands out: another value of its field kept a layout or was tried
    too (when nothing is kept at all, the ruled-out causes say it for every field), and no
    candidate of it was excluded by a constraint (the constraints are checked last: such a
    candidate kept every other rule, so the user's own constraints left the value out)."""
    kept = {name: {getattr(layout, name) for layout in layouts} for name in SEARCHED_FIELDS}
    tried = Counter(name for name, _ in by_value)
    return {f"{name}={value}": dict(causes.most_common()) for (name, value), causes in by_value.items()
            if value not in kept[name] and (kept[name] or tried[name] > 1) and EXCLUDED not in causes}


def planned_groups(space: SearchSpace, schedule: str, pp: int, microbatches: int) -> Sequence[int | None]:
    """interleaved-1f1b's microbatch groups to try (None for the other schedules, and for
    the schedule's own group). Not given: the own group where it exists, else Megatron-Core's
    smallest (``N >= pp`` with ``m mod N`` zero or ``>= pp``: 50 microbatches on 16 ranks run
    in groups of 17, where equal rounds do not exist). No group below the own one exists to
    save memory (Megatron's range starts at ``pp``, and the own group is its least), so
    nothing else is searched unless asked for. Given: each one in Megatron's range, the own
    group written as None (the same order); one out of range is ruled out (``_ruled_out``)."""
    if schedule not in GROUPED or microbatches < 1:
        return (None,)
    try:
        own = round_size(pp, microbatches)
    except ScheduleUnavailableError:
        own = None
    if space.microbatch_groups is None:
        valid = valid_microbatch_groups(pp, microbatches)
        return (None,) if own is not None or not valid else (valid[0],)
    return tuple(dict.fromkeys(None if group == own else group for group in space.microbatch_groups))


def _combines(schedule: str, pp: int, ep: int, recompute: str) -> bool:
    """Whether combined 1F1B of this layout exists: the rule ``simulate --ep-overlap`` and
    ``run --ep-overlap`` refuse by (``schedules.generators.combined.combined_problem``: ep
    above 1, interleaved-1f1b or 1f1b without pipelining, no full recompute)."""
    return not combined_problem(schedule, pp, ep, recompute)


def _chunks(schedule: str, space: SearchSpace) -> Sequence[int]:
    """Stages per rank to try for ``schedule``: one for a looped one-chunk order, exactly
    two for a V (the only V there is), the searched counts for the other multi-chunk ones."""
    if schedule in V_SHAPED:
        return (2,)
    return space.virtual_stages if schedule in MULTI_CHUNK else (1,)


# Context parallelism is tried where each rank keeps at least this many tokens of a
# sequence: below it the ring's K/V exchange outweighs what splitting the attention saves
# (Llama 3 trained 8k sequences without it and turned it on for 128k, cp 16).
CP_MIN_TOKENS = 8192


def context_parallel_sizes(space: SearchSpace) -> list[int]:
    """The cp sizes to try: the given ones, else every power of two that leaves each rank
    at least ``CP_MIN_TOKENS`` of a sequence and splits it in ``2 cp`` even chunks (the
    load-balanced causal ring); 1 when the sequence is unknown."""
    if space.context_parallel is not None:
        return sorted(set(space.context_parallel))
    if not space.seq_len:
        return [1]
    return [size for size in _powers_of_two(space.seq_len // CP_MIN_TOKENS or 1)
            if space.seq_len % (2 * size) == 0 or size == 1]


def expert_parallel_sizes(space: SearchSpace) -> list[int]:
    """The ep sizes to try: 1 for a dense model, else the given ones or every power of two
    that divides the routed experts."""
    if not space.experts:
        return [1]
    if space.expert_parallel is not None:
        return sorted(set(space.expert_parallel))
    return [size for size in _powers_of_two(space.experts) if space.experts % size == 0]


def _ruled_out(layout: Layout, space: SearchSpace) -> str | None:
    """The first rule a candidate breaks, None if it keeps them all."""
    if space.heads % layout.tp or space.kv_heads % layout.tp:
        return "tp does not divide the attention (or key-value) heads"
    if space.global_batch % (layout.dp * layout.microbatch_size):
        return "global batch not divisible by dp x microbatch size"
    if layout.ep > 1 and layout.etp and (layout.tp * layout.dp * layout.cp % layout.ep or space.experts % layout.ep):
        return "ep does not divide tp x dp x cp (folded, its ranks are cut from them) or the routed experts"
    if layout.ep > 1 and not layout.etp and ((layout.dp * layout.cp) % layout.ep or space.experts % layout.ep):
        return "ep does not divide dp x cp (its ranks are cut from them) or the routed experts"
    if layout.ep > 1 and layout.tp > 1 and not layout.sequence_parallel:
        return EP_TP_WITHOUT_SP
    if layout.etp and not layout.sequence_parallel:
        return ETP_WITHOUT_SP
    if space.torchtitan:
        cause = torchtitan_expert_cause(layout.dp, layout.tp, layout.cp, layout.ep, layout.etp, space.fsdp)
        if cause:
            return cause
        if space.fsdp and layout.dp * layout.cp > 1 and layout.zero != torchtitan_zero(layout.pp):
            return TORCHTITAN_FSDP
    if layout.cp > 1 and space.seq_len % (2 * layout.cp):
        return "2 x cp does not divide the sequence (the causal ring's even chunks)"
    if layout.pp * layout.virtual_stages > space.layers + 2:
        return "more stages (pp x virtual stages) than layers + 2 (an embedding-only and a head-only chunk)"
    if layout.recompute == PER_OP and layout.schedule in SPLIT_BACKWARD:
        return PER_OP_SPLIT
    if layout.microbatch_group is not None and layout.microbatch_group not in valid_microbatch_groups(
            layout.pp, layout.microbatches):
        return "microbatch group outside Megatron-Core's range (pp <= N <= m, m mod N zero or >= pp)"
    if not _allowed(layout, space.constraints):
        return EXCLUDED
    return None


# Megatron-LM's all-to-all dispatcher sends each tp rank's shard of the sequence, so a
# mixture of experts with tensor parallelism needs sequence parallelism
# (``pipesim.model.layout.check_layout`` refuses the rest as ``simulate`` does).
EP_TP_WITHOUT_SP = "ep with tp > 1 needs sequence parallelism (Megatron-LM's dispatcher sends each tp rank's shard)"
# Folded, each tp rank dispatches its own shard of the sequence (Megatron-Core and simulate refuse the rest).
ETP_WITHOUT_SP = "etp 1 (folded experts) with tp > 1 needs sequence parallelism (each rank sends its own shard)"
# Per-op recompute is torch's selective checkpointing (torchtitan's SelectiveAC), which
# hands each saved output to one backward through the block: a split backward goes
# through it twice, I then W, and fails ("Trying to backward an extra time") in
# torchtitan's runtime and in pipesim's executor alike, so no plan recommends it.
PER_OP_SPLIT = "per-op recompute with a split backward (I, W): selective checkpointing runs one backward a block"
# The cause of a candidate a constraint does not allow.
EXCLUDED = "excluded by --constraint"


def _allowed(layout: Layout, constraints: dict[str, set[str]]) -> bool:
    return all(str(getattr(layout, key)) in values for key, values in constraints.items())


def layout_fields(layout: Layout) -> dict:
    """The layout as plain JSON fields, plus its one-line label."""
    return {**{name: getattr(layout, name) for name in LAYOUT_FIELDS}, "layout": layout.label()}


LAYOUT_FIELDS = Layout._fields
