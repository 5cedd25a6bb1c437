"""What ``pipesim plan`` is given, as one config object (``PlanRequest``), checked before
anything is simulated, and the plan it asks for (``Planner``): the base job every layout
starts from, the space of layouts, their evaluator, and the search.

The command line fills a ``PlanRequest`` from its flags and ``pipesim.api.plan`` takes one
from Python; both run the same ``Planner``, so a notebook gets the rows the command
prints and writes. Errors name the flag of the field at fault, as the command line's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pipesim.cluster.presets import nodes_for
from pipesim.job import Job, clip_grad_of, model_spec_of, parallel_of, topology_of
from pipesim.model.loss_traffic import TORCHTITAN_CROSS_ENTROPY
from pipesim.model.per_op_checkpoint import PER_OP, check_per_op
from pipesim.model.spec import FP8_SCALINGS, NORM_MLA_UP, moe_act_conflict
from pipesim.plan.evaluate import LayoutEvaluator
from pipesim.plan.layouts import (
    RECOMPUTE_MODES,
    SearchSpace,
    enumerate_layouts,
    parse_constraints,
    searched_recompute,
    values_left_out,
)
from pipesim.plan.search import PlanResult, search
from pipesim.plan.torchtitan_experts import TORCHTITAN_NO_MOE_ACT
from pipesim.plan.torchtitan_fsdp import with_reduce_bytes
from pipesim.plan.workers import default_workers
from pipesim.sim.stash_budget import MemoryBudget, parse_memory_limit
from pipesim.sim.zero import ZERO_STAGES
from schedules.generators import GROUPED, PLANNABLE_SCHEDULES, PLANNED_SCHEDULES

# The plan builds the cluster device by device and prices each layout's data-parallel
# groups over their devices: 131,072 GPUs (16,384 nodes of 8) build in a fifth of a second,
# 10 million in a minute before the first layout. The largest published runs use 16-32k.
MAX_PLAN_GPUS = 131_072


@dataclass(frozen=True)
class PlanRequest:
    """A plan: ``model`` on ``gpus`` GPUs (``gpus_per_node`` a node; tp stays within one) of
    ``topology`` (``gpu`` its devices) at ``global_batch`` sequences a step of ``seq_len``
    tokens, searched over the ``schedules``, ``microbatch_sizes``, ``virtual_stages`` (of
    multi-chunk schedules), ``recompute`` modes (None: ``searched_recompute``, norm-mla-up
    for models with latent attention only), ``zero`` stages, ``sequence_parallel``
    choices, context-parallel sizes ``cp``, expert-parallel sizes ``ep``, combined 1F1B off or
    on (``ep_overlap``; None: both for a mixture of experts, where it runs), the experts' tensor
    parallelism ``etp`` (0: split over tp, 1: folded, whole on every rank; None: both for a
    mixture of experts, folded only where tp > 1) and interleaved-1f1b's
    microbatch groups ``microbatch_group`` (None: the defaults of ``pipesim.plan.layouts``),
    keeping layouts that match every one of ``constraints`` (``"pp=8"``,
    ``"schedule=1f1b,zb-h1"``); ``top`` rows ranked on ``workers`` processes (None: the CPUs
    available). ``mfu``, ``compute_model``, ``fp8``, ``ep_dispatch``, ``ep_dispatcher``, ``comm_sms``, ``qkv``,
    ``cross_entropy``, ``max_actions``, ``memory_headroom``, ``memory_limit`` and ``clip_grad`` are
    ``pipesim simulate``'s, the same for every layout. ``recompute_moe_act`` searches the routed
    experts' activation recomputed off, on or both (``(False,)``, ``(True,)``, ``(False, True)``;
    a bool for one), never beside the recompute modes it cannot go with (full, per-op).
    ``torchtitan`` keeps only the layouts torchtitan 0.3 runs as priced (its replicas sharded
    with FSDP where ``fsdp``): where its expert mesh puts the experts. Field names are the command's flags."""

    model: str
    gpus: int
    global_batch: int
    gpus_per_node: int = 8
    seq_len: int | None = None
    topology: str = "ib"
    gpu: str | None = None
    schedules: Sequence[str] = PLANNED_SCHEDULES
    microbatch_sizes: Sequence[int] = (1, 2, 4)
    virtual_stages: Sequence[int] = (2, 4)
    recompute: Sequence[str] | None = None
    zero: Sequence[int] = ZERO_STAGES
    sequence_parallel: Sequence[bool] = (False, True)
    cp: Sequence[int] | None = None
    ep: Sequence[int] | None = None
    ep_overlap: Sequence[bool] | None = None
    etp: Sequence[int] | None = None
    microbatch_group: Sequence[int] | None = None
    constraints: Sequence[str] = ()
    mfu: float | None = None
    compute_model: str | None = None
    fp8: bool | str = False  # on (True) or its scaling (pipesim.model.spec.FP8_SCALINGS)
    ep_dispatch: str | None = None  # pipesim.model.quantization.EP_DISPATCHES; None: the model's recipe
    ep_dispatcher: str | None = None  # pipesim.model.experts.EP_DISPATCHERS; None: alltoall
    comm_sms: int = 0
    qkv: str = "separate"  # pipesim.model.spec.QKV_PROJECTIONS
    cross_entropy: str | None = None  # pipesim.model.loss_traffic.CROSS_ENTROPY; None: unfused
    max_actions: int | None = None
    memory_headroom: str = "auto"
    # zb-auto's and zbv-auto's stashes, or a budget ("60GB", "device": pipesim.sim.stash_budget); None: pp
    memory_limit: float | str | MemoryBudget | None = None
    clip_grad: float | None = None  # None: pipesim.job.CLIP_GRAD
    # the routed experts' activation recomputed (ModelSpec.moe_act_recompute): off, on or both
    recompute_moe_act: bool | Sequence[bool] = (False,)
    top: int = 10
    workers: int | None = None
    torchtitan: bool = False  # keep only the layouts torchtitan 0.3 runs as priced (``--torchtitan``)
    fsdp: bool = False  # with torchtitan: its replicas shard with FSDP (``--fsdp``)


class Planner:
    """A checked ``PlanRequest`` ready to search: its base job, its layouts (and those
    ruled out while enumerating, by cause; the searched values no layout kept, each with
    the causes of its candidates) and their evaluator."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self.base, self.space = checked(request)
        by_value: dict = {}
        self.layouts, self.ruled_out = enumerate_layouts(self.space, by_value)
        self.values_left_out = values_left_out(self.layouts, by_value)
        self.evaluator = LayoutEvaluator(self.base, torchtitan_fsdp=request.torchtitan and request.fsdp)
        self.workers = request.workers or default_workers()

    @property
    def considered(self) -> int:
        return len(self.layouts) + sum(self.ruled_out.values())

    def search(self, progress: Callable[[int, int], None] | None = None, describe: bool = False) -> PlanResult:
        """The plan: every layout screened best bound first, the finalists simulated
        exactly (``pipesim.plan.search.search``)."""
        result = search(self.layouts, self.evaluator, self.request.top, self.workers, progress, self.ruled_out,
                        describe=describe)
        result.values_left_out = self.values_left_out
        model = model_reference(self.request.model)
        clip = clip_grad_of(self.base)
        seq_len = self.space.seq_len
        for row in result.rows:  # a row names its model: `pipesim run --plan plan.json --row N` builds that one
            # and clips as the plan priced; `export --from-plan` writes its sequence length
            row["model"], row["qkv"], row["clip_grad"], row["seq_len"] = model, self.request.qkv, clip, seq_len
        return result


def model_reference(model: str) -> str:
    """How a plan's rows name ``--model``: a preset by its name, a config file by its
    absolute path (the plan file may be read from another directory)."""
    path = Path(model)
    return str(path.resolve()) if path.is_file() else model


def checked(request: PlanRequest) -> tuple[Job, SearchSpace]:
    """The job every layout starts from and the space to search, every field checked (one
    line naming its flag) before anything is simulated."""
    for flag, value in (("--gpus", request.gpus), ("--global-batch", request.global_batch),
                        ("--gpus-per-node", request.gpus_per_node), ("--top", request.top)):
        _whole(flag, value)
    for flag, value in (("--seq-len", request.seq_len), ("--workers", request.workers),
                        ("--max-actions", request.max_actions)):
        if value is not None:
            _whole(flag, value)
    if request.mfu is not None and not 0 < request.mfu <= 1:  # NaN fails this too
        raise ValueError(f"--mfu is a fraction of peak in (0, 1], got {request.mfu}")
    if not isinstance(request.fp8, bool) and request.fp8 not in FP8_SCALINGS:
        raise ValueError(f"--fp8 is on or off (True or False) or a scaling ({', '.join(FP8_SCALINGS)}), "
                         f"got {request.fp8!r}")
    if isinstance(request.comm_sms, bool) or not isinstance(request.comm_sms, int) or request.comm_sms < 0:
        raise ValueError(f"--comm-sms must be a whole number of SMs >= 0, got {request.comm_sms!r}")
    if request.gpus > MAX_PLAN_GPUS:
        raise ValueError(f"--gpus {request.gpus:,}: plan models the cluster device by device and prices every "
                         f"data-parallel group over its devices, which at this size takes hours; it searches up to "
                         f"{MAX_PLAN_GPUS:,} GPUs")
    if request.gpus % request.gpus_per_node and request.gpus > request.gpus_per_node:
        raise ValueError(f"--gpus {request.gpus} is not a whole number of {request.gpus_per_node}-GPU nodes")
    if "dualpipe" in request.schedules:
        raise ValueError("--schedules dualpipe: plan does not search bidirectional DualPipe (two copies of the model "
                         "share one placement with zbv and dualpipev, which the plan's per-placement costs cannot "
                         "tell apart); simulate it with `pipesim simulate --schedule dualpipe`, or plan dualpipev")
    for flag, values, known in (("--schedules", request.schedules, PLANNABLE_SCHEDULES),
                                ("--recompute", RECOMPUTE_MODES if request.recompute is None else request.recompute,
                                 RECOMPUTE_MODES),
                                ("--zero", request.zero, ZERO_STAGES),
                                ("--sequence-parallel", request.sequence_parallel, (False, True)),
                                ("--ep-overlap", (False,) if request.ep_overlap is None else request.ep_overlap,
                                 (False, True))):
        _known(flag, values, known)
    for flag, values in (("--microbatch-sizes", request.microbatch_sizes),
                         ("--virtual-stages", request.virtual_stages), ("--cp", request.cp), ("--ep", request.ep),
                         ("--microbatch-group", request.microbatch_group)):
        if values is not None:
            _sizes(flag, values)
    if request.microbatch_group and not GROUPED & set(request.schedules):
        raise ValueError(f"--microbatch-group {_listed(request.microbatch_group)}: only "
                         f"{', '.join(sorted(GROUPED))} runs microbatches in groups, and --schedules leaves it out")
    base = Job(model=request.model, seq_len=request.seq_len, topology=request.topology,
               nodes=nodes_for(request.topology, request.gpus, request.gpus_per_node), gpu=request.gpu, mfu=request.mfu,
               compute_model=request.compute_model, memory_headroom=request.memory_headroom, fp8=request.fp8,
               clip_grad=request.clip_grad, memory_limit=request.memory_limit,
               ep_dispatch=request.ep_dispatch, ep_dispatcher=request.ep_dispatcher, comm_sms=request.comm_sms,
               qkv=request.qkv, cross_entropy=request.cross_entropy or (TORCHTITAN_CROSS_ENTROPY if request.torchtitan
                                                                        else None),
               **({"max_actions": request.max_actions} if request.max_actions else {}))
    if request.torchtitan and request.fsdp:  # torchtitan's FSDP reduces the gradients in float32
        base = replace(base, bytes_per_param=with_reduce_bytes(base.bytes_per_param))
    check_memory_limit(request.memory_limit, request.schedules)  # here, not in every layout
    parallel_of(base)  # a bad --memory-headroom fails here
    clip_grad_of(base)  # and a bad --clip-grad
    spec = model_spec_of(base)  # an unknown model or config, or a bad field, fails here
    topology = topology_of(base)
    topology.require_devices(request.gpus, "GPUs")  # and an unknown cluster
    _check_precision(base, spec, topology, request.gpus)
    _check_degrees(request, spec)
    recompute = searched_recompute(spec) if request.recompute is None else tuple(request.recompute)
    moe_act = searched_moe_act(request, base)
    if moe_act == (True,):
        recompute = moe_act_recompute_modes(recompute, request)
    if NORM_MLA_UP in recompute and not spec.mla:
        raise ValueError(f"--recompute {NORM_MLA_UP}: {request.model} has no latent attention (MLA), whose "
                         f"up-projections it recomputes (DeepSeek-V3's); use none, selective or full")
    if PER_OP in recompute:
        check_per_op(spec, PER_OP)
    space = SearchSpace(
        gpus=request.gpus, gpus_per_node=min(request.gpus_per_node, request.gpus),
        global_batch=request.global_batch, layers=spec.layers, heads=spec.heads,
        kv_heads=getattr(spec, "kv_heads", None) or spec.heads, schedules=list(request.schedules),
        microbatch_sizes=list(request.microbatch_sizes), virtual_stages=list(request.virtual_stages),
        recompute=list(recompute), zero=[int(level) for level in request.zero],
        sequence_parallel=[bool(choice) for choice in request.sequence_parallel],
        constraints=parse_constraints(request.constraints), experts=spec.moe.experts if spec.moe else 0,
        expert_parallel=list(request.ep) if request.ep else None, seq_len=spec.seq_len,
        context_parallel=list(request.cp) if request.cp else None,
        ep_overlap=searched_overlap(request, spec),
        expert_tp=searched_expert_tp(request, spec), torchtitan=request.torchtitan, fsdp=request.fsdp,
        recompute_moe_act=moe_act,
        microbatch_groups=list(request.microbatch_group) if request.microbatch_group else None,
    )
    return base, space


def searched_moe_act(request: PlanRequest, base: Job) -> tuple[bool, ...]:
    """The routed experts' activation recomputed off, on or both, as asked (each value once);
    on refused in one line for a model without experts (``pipesim.job.with_moe_act_recompute``)
    and under ``--torchtitan``, which has no such module."""
    values = request.recompute_moe_act
    values = (values,) if isinstance(values, bool) else tuple(values)
    if not values or any(not isinstance(value, bool) for value in values):
        raise ValueError(f"--recompute-moe-act is off, on or both (False, True), got {request.recompute_moe_act!r}")
    values = tuple(dict.fromkeys(values))
    if True in values:
        if request.torchtitan:
            raise ValueError(f"--recompute-moe-act conflicts with --torchtitan: {TORCHTITAN_NO_MOE_ACT}; drop one")
        model_spec_of(replace(base, recompute_moe_act=True))  # a model without experts fails here
    return values


def moe_act_recompute_modes(recompute: tuple[str, ...], request: PlanRequest) -> tuple[str, ...]:
    """The recompute modes a plan with the experts' activation recomputed on every layout
    searches: those it goes with (``pipesim.model.spec.moe_act_conflict``), full and per-op
    left out of the default ones and refused, in one line, where asked for by name."""
    if request.recompute is not None:
        for mode in recompute:
            why = moe_act_conflict(mode)
            if why:
                raise ValueError(f"--recompute {mode} conflicts with --recompute-moe-act: {why}; drop one")
        return recompute
    return tuple(mode for mode in recompute if moe_act_conflict(mode) is None)


def searched_overlap(request: PlanRequest, spec) -> list[bool]:
    """Combined 1F1B's settings to search: the request's, else both for a mixture of experts
    (where it runs: ``pipesim.plan.layouts``) and off for a dense model. Asking for it on a
    dense model is refused in one line: there is no all-to-all to overlap."""
    if request.ep_overlap is None:
        return [False, True] if spec.moe else [False]
    if any(request.ep_overlap) and not spec.moe:
        raise ValueError(f"--ep-overlap on: {request.model} has no experts, so no expert-parallel all-to-all for "
                         "combined 1F1B to overlap; drop --ep-overlap")
    return [bool(choice) for choice in dict.fromkeys(request.ep_overlap)]


# What ``etp`` a plan tries: the experts split over tp (0) or folded (1), the two the
# executor runs (``pipesim simulate --etp`` prices any divisor of tp).
PLANNED_EXPERT_TP = (0, 1)


def searched_expert_tp(request: PlanRequest, spec) -> list[int]:
    """The experts' tensor parallelism to search: the request's (0: split over tp, 1:
    folded), else both for a mixture of experts and 0 for a dense model; one line for a
    value the plan does not search or a fold of a model without experts."""
    if request.etp is None:
        return [0, 1] if spec.moe else [0]
    if not request.etp or any(isinstance(value, bool) or value not in PLANNED_EXPERT_TP for value in request.etp):
        raise ValueError(f"--etp {_listed(request.etp)}: plan tries the experts split over tp (tp, 0) or folded, "
                         "whole on every rank (1), the two `pipesim run` executes; simulate prices any --etp dividing "
                         "--tp")
    if 1 in request.etp and not spec.moe:
        raise ValueError(f"--etp 1: {request.model} has no experts to fold (parallel folding needs a "
                         "mixture-of-experts model); drop --etp")
    return sorted(set(request.etp))


def _check_precision(base: Job, spec, topology, gpus: int) -> None:
    """Refuse FP8 on a GPU without FP8 tensor cores, and ``--comm-sms`` beyond a GPU's SMs,
    before the search (each layout would fail alike): the check ``simulate`` makes when it
    builds a stage's compute model, asked of every GPU model among the job's devices."""
    from pipesim.model.compute_model import stage_compute_model

    if spec.fp8 and base.compute_model:
        raise ValueError(f"--fp8 conflicts with --compute-model {base.compute_model}: the profiled model measured "
                         "BF16 GEMMs; drop one")
    for gpu in dict.fromkeys(topology.device_gpu(device) for device in topology.devices[:gpus]):
        stage_compute_model(1.0, 1.0, gpu or base.gpu, base.mfu, None, spec.fp8, base.comm_sms)


def _check_degrees(request: PlanRequest, spec) -> None:
    """Refuse a cp or ep size no layout can have, naming each rule it breaks: for the
    model, the reason ``pipesim simulate`` gives (``pipesim.model.layout.check_layout``);
    for the job, a size that does not divide the GPUs. Each bad size named, not filtered
    out in silence (a cp that splits no layout used to leave "no layout to consider")."""
    from pipesim.model.layout import check_layout

    if request.ep and not spec.moe:
        raise ValueError(f"--ep {_listed(request.ep)}: {request.model} has no experts to split (expert parallelism "
                         "needs a mixture-of-experts model)")
    for flag, sizes, field in (("--cp", request.cp, "cp"), ("--ep", request.ep, "ep")):
        problems = []
        for size in dict.fromkeys(sizes or ()):
            try:
                check_layout(spec, **{field: size})
            except ValueError as error:
                problems.append(str(error))
            if request.gpus % size:
                problems.append(f"{flag} {size} does not divide the {request.gpus} GPUs (--gpus)")
        if problems:
            raise ValueError("; ".join(problems))


def _whole(flag: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def _known(flag: str, values: Sequence, known: Sequence) -> None:
    """Every one of ``values`` (at least one) is one of ``known``."""
    values = list(values) if not isinstance(values, str) else [values]
    unknown = [value for value in values if not any(value == option and type(value) is type(option)
                                                    for option in known)]
    if unknown or not values:
        names = ", ".join(map(str, unknown)) or "nothing"
        raise ValueError(f"{flag}: unknown {names}; available: {', '.join(map(str, known))}")


def _sizes(flag: str, values: Sequence[int]) -> None:
    """``values`` are whole numbers >= 1, at least one."""
    if not values or any(isinstance(value, bool) or not isinstance(value, int) or value < 1 for value in values):
        raise ValueError(f"{flag} {_listed(values)}: expected integers >= 1")


def _listed(values: Sequence) -> str:
    return ",".join(map(str, values)) if not isinstance(values, str) else values


def plan(request: PlanRequest, progress: Callable[[int, int], None] | None = None) -> PlanResult:
    """The plan ``request`` asks for: ``PlanResult`` (``.rows`` best first, the buckets and
    their causes; ``.to_dict(top)`` is what ``pipesim plan --json`` writes)."""
    return Planner(request).search(progress)


def check_memory_limit(memory_limit, schedules: Sequence[str]) -> None:
    """``--memory-limit`` as every planned zb-auto or zbv-auto layout will take it: a budget
    (``60GB``, ``device``), or a count of at least one stash, whole where zb-auto is
    searched (zbv-auto counts halves); one line naming the flag otherwise."""
    limit = memory_limit
    if isinstance(limit, str):
        try:
            limit = parse_memory_limit(limit)
        except ValueError as error:
            raise ValueError(f"--memory-limit: {error}") from None
    if limit is None or isinstance(limit, MemoryBudget):
        return
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 1:
        raise ValueError(f"--memory-limit {limit!r}: a count of stashes must be a number >= 1 (or give a budget "
                         f"such as 60GB, or 'device')")
    if "zb-auto" in schedules and not float(limit).is_integer():
        raise ValueError(f"--memory-limit {limit:g}: zb-auto counts whole stashes; give a whole number, or leave "
                         f"zb-auto out of --schedules (zbv-auto counts halves)")
