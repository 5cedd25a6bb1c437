"""A simulation asked for as one object: what ``pipesim simulate`` is given, as data.

The command line parses its flags into a ``Job``; a notebook or the planner builds one
directly (``dataclasses.replace`` for each layout it tries) and hands it to the same
functions: ``schedule_of``, ``costs_of``, ``parallel_of``, ``topology_of``, and
``simulate_job`` for the whole step. The fields are the flags' names, with the same
defaults and the same ``None`` for "not given" (a schedule file refuses a ``--pp`` that was
given, not one left at its default), so a Job is a command line written as data and
``simulate --json`` reports what the flags meant.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from pipesim.cluster.files import load_topology
from pipesim.cluster.topology import Topology
from pipesim.model.costs import Costs, load_costs, uniform_costs
from pipesim.model.loss_traffic import check_cross_entropy
from pipesim.model.quantization import EP_DISPATCHES
from pipesim.model.spec import moe_act_conflict
from pipesim.sim.comm_overlap import OVERLAP_SLOWDOWN
from schedules.collector import without_collector
from schedules.generators import (
    COST_AWARE,
    DEFAULT_MAX_ACTIONS,
    GROUPED,
    MULTI_CHUNK,
    SCHEDULE_NAMES,
    generate,
    require_within_limit,
    splits_backward,
)
from schedules.generators.adaptive import ADAPTABLE
from schedules.generators.interleaved import require_microbatch_group
from schedules.schedule import Schedule

if TYPE_CHECKING:
    from pipesim.sim.stash_budget import MemoryBudget

DEFAULT_SCHEDULE, DEFAULT_PP, DEFAULT_MICROBATCHES = "1f1b", 4, 8
DEFAULT_VIRTUAL_STAGES = 2  # for schedules that place several chunks per rank
DEFAULT_FWD = 1e-3
# A schedule that splits the backward into I and W, given --fwd/--bwd but no --wgrad: W is
# this share of B, so at --bwd 2 x --fwd the passes cost F = I = W, the zero-bubble paper's
# unit costs. Without a split its W passes would take no time and draw as nothing.
DEFAULT_WGRAD_SHARE = 0.5
COST_FLAGS = (("--fwd", "fwd"), ("--bwd", "bwd"), ("--wgrad", "wgrad"), ("--act-bytes", "act_bytes"),
              ("--wgrad-stash-share", "wgrad_stash_share"))
# --dtype NAME -> bytes per element; --dtype-bytes N is the old spelling, kept working
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
CLIP_GRAD = 1.0  # Megatron-LM's --clip-grad and torchtitan's max_norm default: both stacks clip unless told not to
NORM_BYTES = 4  # the sum of squares all-reduced: one FP32 number


@dataclass(frozen=True)
class Job:
    """One simulated step, as ``pipesim simulate``'s flags describe it (see the module).

    Schedule: a generated ``schedule`` (or a ``schedule_file``), ``pp``, ``microbatches``,
    ``virtual_stages``. Costs: uniform flags (``fwd``...), a ``costs`` file, or a ``model``
    with its sizes and training options. Cluster: ``topology`` (preset or file), ``nodes``,
    ``gpu``. Around the pipeline: ``dp``, ``tp``, ``cp`` (context parallelism, and
    ``cp_comm``, how its ranks exchange keys and values), ``ep`` (expert parallelism, cut
    from the dp x cp ranks; with ``etp``, parallel folding, from every rank of a stage),
    how ranks map onto devices, gradient buckets, ZeRO. ``p2p``:
    the P2P semantics (None: the backend predicted)."""

    schedule: str | None = None
    schedule_file: str | None = None
    pp: int | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    microbatch_group: int | None = None  # interleaved-1f1b's N (schedules.generators.interleaved)
    memory_limit: float | MemoryBudget | None = None  # stashes, or a budget (pipesim.sim.stash_budget)
    max_actions: int = DEFAULT_MAX_ACTIONS
    fwd: float | None = None
    bwd: float | None = None
    wgrad: float | None = None
    act_bytes: float | None = None
    wgrad_stash_share: float | None = None
    stash_bytes: float | None = None
    param_bytes: float | None = None
    costs: str | None = None
    model: str | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    seq_len: int | None = None
    vocab: int | None = None
    microbatch_size: int | None = None
    dtype: str | None = None
    dtype_bytes: int | None = None
    mfu: float | None = None
    compute_model: str | None = None
    layers_per_stage: str | None = None
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_moe_act: bool = False  # Megatron-Core's moe_act recompute module (ModelSpec.moe_act_recompute)
    no_flash_attention: bool = False
    capacity_factor: float | None = None
    attention_flops: str = "causal"  # how MFU counts attention (pipesim.model.transformer_costs.ATTENTION_FLOPS)
    fp8: bool | str = False  # on (True) or its scaling (pipesim.model.spec.FP8_SCALINGS)
    ep_dispatch: str | None = None  # EP_DISPATCHES; None: the model's recipe (ModelSpec.fp8_dispatch)
    ep_dispatcher: str | None = None  # pipesim.model.experts.EP_DISPATCHERS; None: alltoall
    qkv: str = "separate"  # the attention's input projections (pipesim.model.spec.QKV_PROJECTIONS)
    cross_entropy: str | None = None  # the loss's kernels (pipesim.model.loss_traffic.CROSS_ENTROPY); None: unfused
    comm_sms: int = 0
    topology: str = "ideal"
    nodes: int | None = None
    gpu: str | None = None
    dp: int = 1
    tp: int = 1
    # context and expert parallelism (pipesim.sim.context_parallel, pipesim.sim.expert_parallel)
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # the routed experts' own tensor parallelism (parallel folding); None: tp
    ep_overlap: bool = False  # combined 1F1B, Megatron-Core's EP all-to-all overlap (schedules.generators.combined)
    delay_wgrad: bool = False  # Megatron-Core's --delay-wgrad-compute in overlapped pairs (pipesim.sim.overlap)
    cp_comm: str = "p2p"
    rank_order: str = "tp-dp-pp"
    bucket_mb: float = 25.0
    no_dp_overlap: bool = False
    # what runs beside the compute (pipesim.sim.comm_overlap): Megatron-Core's and torchtitan's defaults
    no_tp_overlap: bool = False
    no_param_gather_overlap: bool = False
    overlap_slowdown: float = OVERLAP_SLOWDOWN
    zero: int = 0
    zero3_collectives: str = "overlapped"  # pipesim.sim.zero.ZERO3_COLLECTIVES
    collective: str = "ring"
    bytes_per_param: str = "2,2,12"
    optimizer_moments: str = "fp32"  # pipesim.sim.memory.OPTIMIZER_MOMENTS
    clip_grad: float | None = None  # gradient clipping's norm, priced with --model (0: none; None: CLIP_GRAD)
    memory_headroom: str = "auto"  # pipesim.sim.headroom.DEFAULT_HEADROOM: what each device keeps back
    p2p: str | None = None

    def __post_init__(self) -> None:
        check_qkv(self.qkv)  # checked with or without a model, so a mistyped value never passes unseen

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> Job:
        """The Job of a parsed command line (flags a command does not have keep their defaults)."""
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls) if hasattr(args, field.name)})

    def generated(self) -> Job:
        """With the schedule flags a generated schedule leaves unset at their defaults."""
        return replace(self, schedule=self.schedule or DEFAULT_SCHEDULE,
                       pp=DEFAULT_PP if self.pp is None else self.pp,
                       microbatches=DEFAULT_MICROBATCHES if self.microbatches is None else self.microbatches)


def conflict(flag: str, other: str, why: str) -> ValueError:
    """The one form of every conflicting-flags error: both flags named, then why."""
    return ValueError(f"{flag} conflicts with {other}: {why}")


def reject_with_schedule_file(job, flags: dict[str, object]) -> None:
    """A schedule file fixes the schedule, pp, microbatches and chunks per rank: a flag
    that would say otherwise is an error, not silently ignored."""
    files = job.schedule_file if isinstance(job.schedule_file, str) else ",".join(job.schedule_file)
    for flag, value in flags.items():
        if value is not None:
            raise ValueError(f"{flag} conflicts with --schedule-file {files}: the file fixes the "
                             f"schedule, pp, microbatches and stages per rank; drop {flag}")


def virtual_stages_for(name: str, requested: int | None) -> int:
    """Chunks per rank: as requested for multi-chunk schedules, 1 for the others."""
    if name in MULTI_CHUNK:
        return requested or DEFAULT_VIRTUAL_STAGES
    return 1


def schedule_of(job: Job, topology: Topology | None = None, search_seconds: float | None = None,
                notes: bool = True) -> Schedule:
    """Generate the named schedule, or read the CSV given as ``schedule_file``.
    Cost-aware schedules (zb-auto, zbv-auto) are built from the job's costs on ``topology``
    (default: free links), their optimising pass under ``search_seconds`` (default:
    zb-auto's own budget). ``notes``: say on stderr what a flag did or did not do (a
    planner building thousands of layouts' orders says nothing)."""
    if job.schedule_file:
        from schedules.csv_io import schedule_from_csv

        reject_with_schedule_file(job, {"--schedule": job.schedule, "--pp": job.pp,
                                        "--microbatches": job.microbatches, "--virtual-stages": job.virtual_stages,
                                        "--microbatch-group": job.microbatch_group,
                                        "--memory-limit": job.memory_limit,
                                        "--ep-overlap": True if getattr(job, "ep_overlap", False) else None})
        return schedule_from_csv(job.schedule_file)
    job = job.generated()
    check_microbatch_group(job)
    if job.schedule in COST_AWARE:
        from pipesim.sim.cost_aware import cost_aware_stages

        chunks = cost_aware_stages(job.schedule, job.virtual_stages)
        require_within_limit(job.schedule, job.pp, job.microbatches, chunks, job.max_actions)
        return cost_aware_schedule_of(job, topology, search_seconds, notes)
    if job.memory_limit is not None and notes:
        print(f"note: --memory-limit applies to {', '.join(sorted(COST_AWARE))}; {job.schedule}'s memory is "
              "set by its order", file=sys.stderr)
    if job.virtual_stages not in (None, 1) and job.schedule not in MULTI_CHUNK:
        raise conflict(f"--virtual-stages {job.virtual_stages}", f"--schedule {job.schedule}",
                       f"{job.schedule} places one stage per rank; multi-chunk schedules are "
                       f"{', '.join(sorted(MULTI_CHUNK))}")
    if getattr(job, "ep_overlap", False):
        return combined_schedule_of(job)
    schedule = generate(job.schedule, job.pp, job.microbatches, virtual_stages_for(job.schedule, job.virtual_stages),
                        max_actions=job.max_actions, microbatch_group=job.microbatch_group)
    if job.schedule in ADAPTABLE:
        return adapted_schedule_of(job, schedule, topology)
    return schedule


def combined_schedule_of(job: Job) -> Schedule:
    """The job's schedule run as Megatron-Core's combined 1F1B (``--ep-overlap``:
    ``schedules.generators.combined``), refused in one line where Megatron-Core refuses it."""
    return combined_schedule(job, job.schedule, job.pp, job.microbatches,
                             virtual_stages_for(job.schedule, job.virtual_stages), job.microbatch_group)


def combined_schedule(job, name: str, pp: int, microbatches: int, virtual_stages: int,
                      microbatch_group: int | None) -> Schedule:
    """Schedule ``name`` of these sizes as combined 1F1B under the job's other flags (what
    ``simulate`` and each point of ``sweep`` run with ``--ep-overlap``)."""
    from schedules.generators.combined import combined_1f1b, combined_problem

    problem = combined_problem(name, pp, job.ep, job.recompute)
    if problem:
        raise ValueError(problem)
    require_within_limit(name, pp, microbatches, virtual_stages, job.max_actions)
    return combined_1f1b(name, pp, microbatches, virtual_stages, microbatch_group)


def check_microbatch_group(job: Job) -> None:
    """``--microbatch-group`` belongs to the schedules that group microbatches and must lie
    in Megatron-Core's range for the job's pp and microbatches; the error names the flag."""
    if job.microbatch_group is None:
        return
    if job.schedule not in GROUPED:
        raise conflict(f"--microbatch-group {job.microbatch_group}", f"--schedule {job.schedule}",
                       f"only {', '.join(sorted(GROUPED))} runs microbatches in groups per model chunk")
    try:
        require_microbatch_group(job.pp, job.microbatches, job.microbatch_group)
    except ValueError as error:
        raise ValueError(f"--microbatch-group {job.microbatch_group}: {error}") from None


def adapted_schedule_of(job: Job, schedule: Schedule, topology: Topology | None) -> Schedule:
    """zb-h1 and zb-h2 in the order that runs fastest on the job's costs and links (the
    textbook one, ``W`` placed for these costs, or 1F1B's; ``meta["order"]`` says which),
    so that a handcrafted zero-bubble order is never slower than 1F1B where the user runs it."""
    from pipesim.cluster.topology import ideal_topology
    from pipesim.sim.cost_aware import adapt_to_costs

    topology = topology or ideal_topology()
    return adapt_to_costs(schedule, costs_of(job, schedule, topology), topology, _pipeline_devices(job, topology))


def _pipeline_devices(job: Job, topology: Topology) -> list[str] | None:
    """The devices of the job's first pipeline on ``topology`` (None on free links:
    the default mapping)."""
    if topology.ideal:
        return None
    from pipesim.cluster.mapping import map_ranks

    return map_ranks(topology, job.dp, job.pp, job.tp, job.rank_order, job.cp, job.ep, expert_tp_of(job)).pipeline()


def cost_aware_schedule_of(job: Job, topology: Topology | None, search_seconds: float | None = None,
                           notes: bool = True) -> Schedule:
    """zb-auto or zbv-auto from the job's costs (flags, costs file or model spec; unit
    costs F = I = W where it has none) for the schedule's stages (zbv-auto's V: each
    rank's share in two chunks) and its cluster's hop time; ``search_seconds`` as in
    ``build_cost_aware``."""
    from pipesim.cluster.mapping import map_ranks
    from pipesim.cluster.topology import ideal_topology
    from pipesim.sim.cost_aware import cost_shell
    from pipesim.sim.stash_budget import build_within

    topology = topology or ideal_topology()
    shell = cost_shell(job.schedule, job.pp, job.microbatches, job.virtual_stages)
    if job.model:
        costs = model_costs_of(job, shell, topology)
    else:
        costs = flag_costs_of(job, shell.num_stages, shell.virtual_stages)
        if splits_backward(job.schedule) and not any(stage.wgrad for stage in costs.stages):
            print(f"note: {job.schedule} with no weight-gradient time (--wgrad 0 or none in the costs file) "
                  "has no W passes to fill bubbles with", file=sys.stderr)
    devices = _pipeline_devices(job, topology) or map_ranks(topology, 1, job.pp, 1).pipeline()
    schedule, budget, wider = build_within(job.memory_limit, job.schedule, job.pp, job.microbatches, costs,
                                           topology, devices, parallel_of(job), search_seconds)
    if budget is not None and notes:
        print(budget.note(job.schedule), file=sys.stderr)
        if wider:
            print(f"note: {job.schedule} at zbv's own memory ({job.pp} microbatches' activations a rank) fits the "
                  f"budget too, its stashes counted as held, and runs faster: taken", file=sys.stderr)
    return schedule


def check_cost_flags(job) -> None:
    """``--costs`` fixes every per-stage cost, so a cost flag beside it is refused, and
    ``--mfu`` and ``--compute-model`` only time a ``--model``'s operations."""
    if job.costs:
        for flag, dest in COST_FLAGS:
            if getattr(job, dest, None) is not None:
                raise conflict(flag, f"--costs {job.costs}", f"the costs file gives every stage's costs; drop {flag}")
    if getattr(job, "mfu", None) is not None and not getattr(job, "model", None):
        raise ValueError("--mfu needs --model: it scales the FLOPs of a model spec; give --model or drop --mfu")
    if getattr(job, "fp8", False) and not getattr(job, "model", None):
        raise ValueError("--fp8 needs --model: it runs a model spec's GEMMs in FP8; give --model or drop --fp8")
    if getattr(job, "ep_dispatch", None) is not None and not getattr(job, "model", None):
        raise ValueError(f"--ep-dispatch {job.ep_dispatch} needs --model: it sizes a mixture of experts' all-to-alls; "
                         f"give --model or drop --ep-dispatch")
    if getattr(job, "ep_dispatcher", None) is not None and not getattr(job, "model", None):
        raise ValueError(f"--ep-dispatcher {job.ep_dispatcher} needs --model: it sizes a mixture of experts' "
                         f"all-to-alls; give --model or drop --ep-dispatcher")
    if getattr(job, "cross_entropy", None) is not None and not getattr(job, "model", None):
        raise ValueError(f"--cross-entropy {job.cross_entropy} needs --model: it prices a model spec's loss over its "
                         f"vocabulary; give --model or drop --cross-entropy")
    if getattr(job, "comm_sms", 0) and not getattr(job, "model", None):
        raise ValueError(f"--comm-sms {job.comm_sms} needs --model: it slows a model spec's compute; give --model "
                         f"or drop --comm-sms")
    if getattr(job, "clip_grad", None) is not None and not getattr(job, "model", None):
        raise ValueError(f"--clip-grad {job.clip_grad:g} needs --model: it prices a model spec's gradient norm (a "
                         "costs file's step_overhead holds what a run measured); give --model or drop --clip-grad")
    if getattr(job, "compute_model", None) and not getattr(job, "model", None):
        raise ValueError(f"--compute-model {job.compute_model} needs --model: it times a model spec's operations; "
                         "give --model or drop --compute-model")


def costs_of(job: Job, schedule: Schedule, topology: Topology) -> Costs:
    """The job's per-stage costs for ``schedule``: from its model spec, else its flags or costs file."""
    delayed = getattr(job, "delay_wgrad", False)
    if delayed:
        check_delay_wgrad(job, schedule)
    if job.model:
        costs = model_costs_of(job, schedule, topology)
        return replace(costs, delayed_wgrad=True) if delayed else costs
    # a rank's share of the model in chunks: dualpipe's two copies each give it a whole 1/pp stage
    return flag_costs_of(job, schedule.num_stages, schedule.virtual_stages // schedule.copies)


def check_delay_wgrad(job, schedule: Schedule) -> None:
    """``--delay-wgrad`` moves a MoE layer's experts' weight gradient inside an overlapped
    pair priced layer by layer: it needs a model (whose costs time the experts apart) and
    a schedule with overlapped pairs (combined 1F1B, DualPipe); else a one-line error."""
    if not job.model:
        raise ValueError("--delay-wgrad needs --model: it moves a MoE layer's experts' weight gradient, which a "
                         "model's costs time apart; give --model or drop --delay-wgrad")
    if not any(schedule.fused):
        raise conflict("--delay-wgrad", f"--schedule {schedule.name} without --ep-overlap",
                       "it reorders the overlapped pairs of combined 1F1B (--ep-overlap) and of dualpipe and "
                       "dualpipev, and this schedule runs none")


def flag_costs_of(job, num_stages: int, virtual_stages: int) -> Costs:
    """Uniform costs from the flags, or the costs file; chunk costs are per-rank / v."""
    check_cost_flags(job)
    if job.costs:
        return with_sequence_parallel(job, load_costs(job.costs, num_stages, virtual_stages))
    fwd = DEFAULT_FWD if job.fwd is None else job.fwd
    bwd = 2 * fwd if job.bwd is None else job.bwd
    share = getattr(job, "wgrad_stash_share", None)
    return uniform_costs(num_stages, fwd, bwd, wgrad_of(job, bwd), job.act_bytes or 0.0, virtual_stages,
                         stash_bytes=job.stash_bytes, param_bytes=job.param_bytes,
                         wgrad_stash_share=1.0 if share is None else share)


def with_sequence_parallel(job, costs: Costs) -> Costs:
    """``--sequence-parallel`` on a costs file: the tp collectives are priced as all-gathers
    and reduce-scatters where the flag or the file says so. A file that does not say (one
    written by hand) takes the flag; one that says its run was not sequence-parallel
    (``profile``, ``compare --costs-out``) refuses the flag, since its stage times and tp
    messages are that run's: the flag would otherwise be ignored without a word."""
    if not getattr(job, "sequence_parallel", False) or costs.sequence_parallel:
        return costs
    from pipesim.model.costs import stated_sequence_parallel  # noqa: PLC0415

    if stated_sequence_parallel(job.costs) is False:
        raise ValueError(f"--sequence-parallel: costs file {job.costs} was measured without sequence parallelism "
                         "(its 'sequence_parallel' is false): measure it again with --sequence-parallel, or drop "
                         "the flag")
    return replace(costs, sequence_parallel=True)


def takes_default_split(job) -> bool:
    """Whether the job's W time is the stated default: a generated schedule that splits
    the backward, costs from flags, no ``--wgrad``."""
    name = getattr(job, "schedule", None) or DEFAULT_SCHEDULE
    return (getattr(job, "wgrad", None) is None and not getattr(job, "schedule_file", None)
            and not getattr(job, "costs", None) and not getattr(job, "model", None)
            and name in SCHEDULE_NAMES and splits_backward(name))


def wgrad_of(job, bwd: float) -> float:
    """The W part of ``bwd``: ``--wgrad`` as given, else ``DEFAULT_WGRAD_SHARE`` of it for
    a schedule that splits the backward, else none."""
    if takes_default_split(job):
        return DEFAULT_WGRAD_SHARE * bwd
    return getattr(job, "wgrad", None) or 0.0


def default_split_note(job) -> str | None:
    """The line that says a split-backward schedule runs on the default W share, or None."""
    if not takes_default_split(job):
        return None
    return (f"note: {job.schedule} splits the backward; without --wgrad W is {DEFAULT_WGRAD_SHARE:.0%} of --bwd "
            f"(I = W = F at --bwd 2 x --fwd); give --wgrad to set it")


def finite_flag(value: float, flag: str, positive: bool = False) -> float:
    """``value`` if it is a finite number >= 0 (> 0 with ``positive``); else a one-line
    error naming the flag and the value."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{flag} must be a finite number {bound}, got {value!r}")
    return value


def parallel_of(job):
    """The ``ParallelConfig`` of the job."""
    return _parallel(job.dp, job.tp, job.rank_order, job.bucket_mb, job.no_dp_overlap, job.collective, job.zero,
                     job.bytes_per_param, job.cp, job.ep, job.cp_comm, job.memory_headroom,
                     getattr(job, "no_tp_overlap", False), getattr(job, "no_param_gather_overlap", False),
                     getattr(job, "overlap_slowdown", OVERLAP_SLOWDOWN), getattr(job, "optimizer_moments", "fp32"),
                     getattr(job, "zero3_collectives", "overlapped"), expert_tp_of(job))


def expert_tp_of(job) -> int:
    """``--etp`` as the mapping and ``ParallelConfig`` take it: 0 when not given (tp)."""
    etp = getattr(job, "etp", None)
    return 0 if etp is None else etp


@functools.lru_cache(maxsize=1024)
def _parallel(dp: int, tp: int, rank_order: str, bucket_mb: float, no_dp_overlap: bool, collective: str, zero: int,
              bytes_per_param: str, cp: int = 1, ep: int = 1, cp_comm: str = "p2p", memory_headroom: str = "auto",
              no_tp_overlap: bool = False, no_param_gather_overlap: bool = False,
              overlap_slowdown: float = OVERLAP_SLOWDOWN, optimizer_moments: str = "fp32",
              zero3_collectives: str = "overlapped", etp: int = 0):
    from pipesim.sim.headroom import parse_headroom
    from pipesim.sim.memory import parse_bytes_per_param, with_optimizer_moments
    from pipesim.sim.parallel import ParallelConfig

    bucket_mb = finite_flag(bucket_mb, "--bucket-mb", positive=True)
    per_param = with_optimizer_moments(parse_bytes_per_param(bytes_per_param), optimizer_moments)
    return ParallelConfig(dp=dp, tp=tp, rank_order=rank_order, bucket_bytes=bucket_mb * 2**20,
                          overlap_dp=not no_dp_overlap, algorithm=collective, zero=zero,
                          bytes_per_param=per_param, cp=cp, ep=ep, cp_comm=cp_comm,
                          memory_headroom=parse_headroom(memory_headroom), overlap_tp=not no_tp_overlap,
                          overlap_param_gather=not no_param_gather_overlap, overlap_slowdown=overlap_slowdown,
                          zero3_collectives=zero3_collectives, etp=etp)


def check_zero3_in_costs(job) -> None:
    """Refuse ``--zero3-collectives in-costs`` where it cannot be right: without ``--zero
    3`` (``pipesim.sim.zero.check_zero3_collectives``), and without a costs file, since it
    charges nothing for the collectives beside the actions and only measured stage times
    hold them."""
    from pipesim.sim.zero import ZERO3_OVERLAPPED, check_zero3_collectives

    collectives = check_zero3_collectives(getattr(job, "zero3_collectives", ZERO3_OVERLAPPED), job.zero)
    if collectives != ZERO3_OVERLAPPED and not getattr(job, "costs", None):
        raise ValueError(f"--zero3-collectives {collectives} charges nothing for ZeRO-3's collectives beside the "
                         "actions: their time must be in measured stage times; give --costs (e.g. from "
                         "compare --costs-out on gloo) or drop the flag")


def check_parallel_layout(job) -> None:
    """Refuse, before any work, a layout the job cannot be split into, with a one-line
    error naming the flag: sizes below 1; an ``ep`` that does not cut the dp x cp ranks
    into groups; ``ep`` or ``cp`` without a model (they split a model's experts and
    sequence); and, with a model, what ``pipesim.model.layout.check_layout`` refuses (tp
    against the heads, ep against the routed experts, cp against the sequence) and ring
    attention without flash attention. What a planner asks of each layout it tries."""
    from pipesim.cluster.mapping import expert_group_problem
    from pipesim.sim.context_parallel import check_cp_comm

    dp, tp, cp, ep = job.dp, job.tp, getattr(job, "cp", 1), getattr(job, "ep", 1)
    etp = getattr(job, "etp", None)
    for flag, value in (("--dp", dp), ("--tp", tp), ("--cp", cp), ("--ep", ep), ("--etp", 1 if etp is None else etp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a whole number >= 1, got {value!r}")
    if etp is not None and not getattr(job, "model", None) and not (
            getattr(job, "costs", None) and calibrated_shards(job.costs).get("etp") == etp):
        raise ValueError(f"--etp {etp} needs --model: it splits a mixture of experts' routed experts; give --model, "
                         f"a costs file of compare --costs-out or profile --calibration run at --etp {etp}, or drop "
                         f"--etp")
    comm = check_cp_comm(getattr(job, "cp_comm", "p2p"))
    if comm != "p2p" and cp == 1:
        raise ValueError(f"--cp-comm {comm} needs --cp > 1: it says how context-parallel ranks exchange keys and "
                         f"values; give --cp or drop --cp-comm")
    problem = expert_group_problem(dp, cp, ep, tp, expert_tp_of(job))
    if problem:
        raise ValueError(problem)
    check_zero3_in_costs(job)
    if not getattr(job, "model", None):
        calibrated = calibrated_shards(job.costs) if getattr(job, "costs", None) else {}
        for flag, value, what in (("--ep", ep, "a mixture of experts' routed experts"),
                                  ("--cp", cp, "a model's sequence")):
            if value > 1 and calibrated.get(flag[2:]) != value:
                raise ValueError(f"{flag} {value} needs --model: it splits {what}, which flag costs and costs files "
                                 f"not timed on {flag} {value} shards do not describe; give --model, a costs file of "
                                 f"compare --costs-out or profile --calibration run at {flag} {value}, or drop {flag}")
        return
    from pipesim.model.layout import check_layout

    check_layout(model_spec_of(job), tp, ep, cp, sequence_parallel=job.sequence_parallel)
    if cp > 1 and job.no_flash_attention:
        raise conflict(f"--cp {cp}", "--no-flash-attention", "ring attention is built on the fused attention "
                       "kernel (Megatron-Core runs context parallelism in Transformer Engine's); drop "
                       "--no-flash-attention")


def calibrated_shards(path: str) -> dict:
    """The cp, ep and etp a costs file's stages were timed at, as the run's own
    calibration steps write them in its ``meta`` (``executor.run_costs``; ``compare
    --costs-out``, ``profile --calibration run``): such costs are a shard's, with each
    stage's attention and keys and values (cp) or dispatched bytes (ep, folded over etp)
    the simulator prices the split by. A file that does not say (a stage profile, one
    written by hand): none."""
    meta = load_costs(path).meta
    return {axis: meta[axis] for axis in ("cp", "ep", "etp") if isinstance(meta.get(axis), int)}


def split_list(text: str, cast=str) -> list:
    """``"8,16,32"`` -> ``[8, 16, 32]``; errors name the bad item."""
    items = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            items.append(cast(item))
        except ValueError as error:
            raise ValueError(f"{item!r} in {text!r} is not a valid {cast.__name__}") from error
    if not items:
        raise ValueError(f"empty list: {text!r}")
    return items


def topology_of(job) -> Topology:
    return load_topology(job.topology, job.nodes, getattr(job, "gpu", None))


# The executor's built-in transformer (``pipesim run --model gpt``) as a model spec, so
# one name means one model in both: its defaults are run's (LayerNorm, biases, learned
# positions, an untied head, no dropout, MLP 4 x hidden, float32), so ``simulate
# --model gpt --layers 4 --hidden 64`` predicts the model that ``run --model gpt
# --layers 4 --hidden 64`` trains.
EXECUTOR_GPT = {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 16, "vocab": 128, "dtype_bytes": 4}


def executor_gpt_spec(**fields: int | None):
    from dataclasses import replace

    from pipesim.model.spec import ModelSpec

    spec = ModelSpec(name="gpt", **EXECUTOR_GPT, tied_embeddings=False, dropout=False)
    return replace(spec, **{key: value for key, value in fields.items() if value is not None})


def dtype_bytes_of(job) -> int | None:
    dtype, size = getattr(job, "dtype", None), getattr(job, "dtype_bytes", None)
    if dtype is not None and size is not None:
        raise conflict("--dtype-bytes", f"--dtype {dtype}", "give one of them")
    return DTYPE_BYTES[dtype] if dtype is not None else size


def model_spec_of(job):
    """The ``ModelSpec`` of ``--model`` with the field flags applied: a preset, a
    config.json, or the executor's ``gpt`` (``mlp`` has no transformer FLOP model)."""
    spec = _model_spec(job.model, job.layers, job.hidden, job.heads, job.kv_heads, job.ffn_hidden, job.seq_len,
                       job.vocab, job.microbatch_size, dtype_bytes_of(job))
    factor = getattr(job, "capacity_factor", None)
    if factor is not None:
        spec = spec.with_capacity_factor(finite_flag(factor, "--capacity-factor", positive=True))
    fp8 = getattr(job, "fp8", False)
    if fp8:
        spec = replace(spec, fp8=True, fp8_scaling=fp8 if isinstance(fp8, str) else spec.fp8_scaling)
    spec = with_qkv(spec, getattr(job, "qkv", "separate"))
    cross_entropy = getattr(job, "cross_entropy", None)
    if cross_entropy is not None:
        spec = replace(spec, cross_entropy=check_cross_entropy(cross_entropy))
    cp_comm = getattr(job, "cp_comm", "p2p")
    if cp_comm != spec.cp_comm:
        from pipesim.sim.context_parallel import check_cp_comm

        spec = replace(spec, cp_comm=check_cp_comm(cp_comm))
    spec = with_moe_act_recompute(spec, getattr(job, "recompute_moe_act", False), getattr(job, "recompute", "none"),
                                  job.model)
    spec = with_ep_dispatch(spec, getattr(job, "ep_dispatch", None), job.model)
    spec = with_ep_dispatcher(spec, getattr(job, "ep_dispatcher", None), job.model)
    return replace(spec, expert_tp=expert_tp_of(job)) if expert_tp_of(job) else spec


def with_moe_act_recompute(spec, on: bool, recompute: str, model: str):
    """``spec`` with ``--recompute-moe-act`` applied (Megatron-Core's ``moe_act`` recompute
    module: the routed experts' activation re-run in every backward, its output not kept).
    Refused in one line for a model without experts, and beside a ``--recompute`` that
    already re-runs the whole layer (``full``) or refuses experts (``per-op``)."""
    if not on:
        return spec
    if spec.moe is None:
        raise ValueError(f"--recompute-moe-act: {model} has no mixture of experts, so no experts' activation to "
                         "recompute; drop --recompute-moe-act")
    why = moe_act_conflict(recompute)
    if why:
        raise conflict("--recompute-moe-act", f"--recompute {recompute}", why)
    return replace(spec, moe_act_recompute=True)


def with_ep_dispatcher(spec, dispatcher: str | None, model: str):
    """``spec`` with ``--ep-dispatcher`` applied (``pipesim.model.experts.EP_DISPATCHERS``;
    None keeps Megatron-Core's all-to-all dispatcher)."""
    from pipesim.model.experts import EP_DISPATCHERS

    if dispatcher is None:
        return spec
    check_dispatch_flag("--ep-dispatcher", dispatcher, EP_DISPATCHERS, spec, model)
    return replace(spec, ep_dispatcher=dispatcher)


def check_dispatch_flag(flag: str, value: str, known: tuple[str, ...], spec, model: str) -> None:
    """A flag about a mixture of experts' all-to-alls (``--ep-dispatch``,
    ``--ep-dispatcher``): refused in one line for a value not in ``known`` or a model
    without experts."""
    if value not in known:
        raise ValueError(f"{flag} {value!r} is not one of: {', '.join(known)}")
    if spec.moe is None:
        raise ValueError(f"{flag} {value}: {model} has no mixture of experts, so no all-to-all to dispatch; "
                         f"drop {flag}")


def with_qkv(spec, qkv: str):
    """``spec`` with ``--qkv`` applied: Q, K and V as three linears or one fused ``wqkv``
    (``pipesim.model.spec.QKV_PROJECTIONS``)."""
    check_qkv(qkv)
    return replace(spec, fused_qkv=qkv == "fused")  # ModelSpec refuses it for latent attention


def check_qkv(qkv: str) -> None:
    """Refuse a ``--qkv`` that is not one of ``QKV_PROJECTIONS``, in one line."""
    from pipesim.model.spec import QKV_PROJECTIONS

    if qkv not in QKV_PROJECTIONS:
        raise ValueError(f"--qkv {qkv!r} is not one of: {', '.join(QKV_PROJECTIONS)}")


def with_ep_dispatch(spec, dispatch: str | None, model: str):
    """``spec`` with ``--ep-dispatch`` applied: the all-to-all toward the experts in FP8
    or in BF16 (``EP_DISPATCHES``; None keeps the model's recipe, FP8 only for a config's
    block-scaled FP8 ``quantization_config``, DeepSeek-V3's). FP8 needs FP8 GEMMs: the
    FP8 copy is the up-projection's FP8 input (DeepSeek-V3, section 3.3.3), and before a
    BF16 GEMM it would only lose precision, which no stack does."""
    if dispatch is None:
        return spec
    check_dispatch_flag("--ep-dispatch", dispatch, EP_DISPATCHES, spec, model)
    if dispatch == "fp8" and not spec.fp8:
        raise ValueError("--ep-dispatch fp8 needs --fp8 (or a config.json's FP8 quantization_config): the FP8 "
                         "dispatch is the experts' FP8 GEMM input, and before BF16 GEMMs it would only lose "
                         "precision; give --fp8 or use --ep-dispatch bf16")
    return replace(spec, fp8_dispatch=dispatch == "fp8")


@functools.lru_cache(maxsize=256)
def _model_spec(model: str, layers, hidden, heads, kv_heads, ffn_hidden, seq_len, vocab, microbatch_size,
                dtype_bytes):
    """``model_spec_of``, kept per distinct input: a spec never changes, and a plan asks
    for the same model at a few microbatch sizes thousands of times."""
    from pipesim.model.spec import model_spec

    if model == "mlp":
        raise ValueError("--model mlp is the executor's toy MLP; the simulator models transformers: use "
                         "--model gpt (the executor's transformer), a preset, or --fwd/--bwd")
    build = executor_gpt_spec if model == "gpt" else lambda **fields: model_spec(model, **fields)
    return build(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn_hidden,
                 seq_len=seq_len, vocab=vocab, microbatch_size=microbatch_size, dtype_bytes=dtype_bytes)


def fallback_peak_flops(job) -> float:
    """Peak FLOP/s for devices the topology gives none (ideal): ``--gpu``'s, else H100's."""
    from pipesim.hardware.gpus import gpu_spec

    return gpu_spec(getattr(job, "gpu", None)).bf16_flops


def fallback_memory_bandwidth(job) -> float:
    """HBM bytes/s for devices the topology gives none: ``--gpu``'s, else H100's."""
    from pipesim.hardware.gpus import gpu_spec

    return gpu_spec(getattr(job, "gpu", None)).memory_bandwidth


def model_costs_of(job, schedule: Schedule, topology: Topology) -> Costs:
    """Costs of ``--model`` on the devices its pipeline ranks are mapped to."""
    from pipesim.cluster.mapping import map_ranks
    from pipesim.model.transformer_costs import device_memory_bandwidth
    from pipesim.sim.memory import optimizer_step_bytes_per_param
    from pipesim.sim.zero import optimizer_bytes_per_param

    given = [flag for flag, dest in (*COST_FLAGS, ("--costs", "costs"), ("--stash-bytes", "stash_bytes"),
                                      ("--param-bytes", "param_bytes")) if getattr(job, dest, None) is not None]
    if given:
        raise conflict(given[0], f"--model {job.model}", f"the model spec derives the costs; drop {given[0]}")
    check_parallel_layout(job)
    spec = model_spec_of(job)
    mapping = map_ranks(topology, job.dp, schedule.pp, job.tp, job.rank_order, job.cp, job.ep, expert_tp_of(job))
    # kept: a plan asks for thousands of layouts
    key = ("pipeline", job.dp, schedule.pp, job.tp, job.rank_order, job.cp, job.ep, expert_tp_of(job))
    devices = topology.pace_cache.get(key) or topology.pace_cache.setdefault(key, mapping.pipeline())
    figures_key = ("stage figures", *key[1:], tuple(schedule.placement))
    figures = topology.pace_cache.get(figures_key)
    if figures is None:  # each stage's device's peak, HBM bandwidth and GPU, kept per pipeline and placement
        stage_devices = [devices[schedule.placement[stage]] for stage in range(schedule.num_stages)]
        figures = topology.pace_cache[figures_key] = (
            tuple(topology.device_peak_flops(device) for device in stage_devices),
            tuple(device_memory_bandwidth(topology, device) for device in stage_devices),
            tuple(topology.device_gpu(device) for device in stage_devices))
    peaks, bandwidths, gpus = figures
    layout = split_list(job.layers_per_stage, int) if job.layers_per_stage else None
    if layout and schedule.copies > 1 and len(layout) != schedule.copy_stages:
        from pipesim.model.errors import ModelSpecError

        raise ModelSpecError(f"--layers-per-stage lists {len(layout)} stages but each of {schedule.name}'s "
                             f"{schedule.copies} copies of the model has {schedule.copy_stages} (pp), split alike")
    parallel = parallel_of(job)
    profiled = compute_model_of(job)
    layer_hold = 0.0
    if job.tp > 1 and layout is None:  # the tp collectives a layer holds its rank for weigh in the split
        from pipesim.model.per_op_checkpoint import recomputed_tp_pairs
        from pipesim.sim.parallel import layer_tp_seconds

        layer_hold = layer_tp_seconds(topology, mapping, schedule.placement[-1], spec.tp_message_bytes(),
                                      job.sequence_parallel, recomputed_tp_pairs(job.recompute, job.sequence_parallel),
                                      parallel.algorithm)
    shards = job.dp * job.cp * schedule.copies
    clipped = clip_grad_of(job) > 0
    return _model_costs(spec, schedule.num_stages, peaks, job.tp, job.mfu,
                        job.sequence_parallel, tuple(layout) if layout else None, job.recompute,
                        not job.no_flash_attention, fallback_peak_flops(job), bandwidths,
                        fallback_memory_bandwidth(job),
                        optimizer_step_bytes_per_param(parallel.bytes_per_param, shards, parallel.zero),
                        tuple(schedule.placement), gpus, getattr(job, "gpu", None), profiled, job.ep, job.cp,
                        layer_hold, getattr(job, "comm_sms", 0), schedule.copies,
                        optimizer_bytes_per_param(0.0, parallel.bytes_per_param.grads, 0.0, shards, parallel.zero)
                        if clipped else None,
                        norm_all_reduce_seconds(topology, mapping, parallel.zero > 0) if clipped else 0.0)


def clip_grad_of(job) -> float:
    """``--clip-grad``, checked: a finite norm, 0 for none, ``CLIP_GRAD`` where not given."""
    clip = getattr(job, "clip_grad", None)
    if clip is None:
        return CLIP_GRAD
    if not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip >= 0):
        raise ValueError(f"--clip-grad {clip!r}: expected a norm >= 0 (0: no clipping)")
    return float(clip)


def norm_all_reduce_seconds(topology: Topology, mapping, sharded: bool) -> float:
    """Gradient clipping's all-reduce of one FP32 number over the ranks holding shares of
    the gradient (``RankMapping.grad_norm_group``), as a tree: NCCL takes a tree or a
    low-latency protocol for a message this small, whatever algorithm the gradients'
    buckets use. Kept per layout: a plan prices thousands."""
    from pipesim.cluster.collectives import all_reduce

    key = ("grad norm", mapping.dp, mapping.pp, mapping.tp, mapping.order, mapping.cp, sharded)
    seconds = topology.pace_cache.get(key)
    if seconds is None:
        seconds = topology.pace_cache[key] = all_reduce(topology, mapping.grad_norm_group(sharded), NORM_BYTES, "tree")
    return seconds


def compute_model_of(job):
    """The profiled compute model of ``--compute-model FILE``, or None (read once per file)."""
    path = getattr(job, "compute_model", None)
    if not path:
        return None
    if getattr(job, "mfu", None) is not None:
        raise conflict(f"--mfu {job.mfu:g}", f"--compute-model {path}",
                       "one efficiency for every kernel or a profiled model of them; give one")
    return _load_compute_model(path)


@functools.lru_cache(maxsize=8)
def _load_compute_model(path: str):
    from pipesim.model.compute_model import load_compute_model

    return load_compute_model(path)


@functools.lru_cache(maxsize=1024)
def _model_costs(spec, num_stages: int, peaks: tuple, tp: int, mfu: float | None, sequence_parallel: bool,
                 layout: tuple | None, recompute: str, flash_attention: bool, fallback_peak: float,
                 bandwidths: tuple, fallback_bandwidth: float, optimizer_state_bytes: float,
                 stage_ranks: tuple, gpus: tuple, fallback_gpu: str | None, profiled, ep: int = 1,
                 cp: int = 1, layer_hold_seconds: float = 0.0, comm_sms: int = 0, copies: int = 1,
                 norm_grad_bytes: float | None = None, norm_all_reduce: float = 0.0) -> Costs:
    """``transformer_costs.model_costs``, kept per distinct input: it is a pure function of
    them and ``Costs`` never changes, and a plan asks for the same stages' costs for many
    layouts (every dp width on one kind of GPU, with and without ZeRO). The optimizer
    step is the one figure the optimizer's bytes per parameter change, in proportion
    (each rank reads and writes them once), so it is derived per placement for one byte
    per parameter and scaled; the stages, which no placement changes, once for all of them.
    With clipping (``norm_grad_bytes``: the gradient bytes a parameter's norm reads),
    ``Costs.grad_norm_overhead`` is that read, which is the same pass as the optimizer's
    but reading once where it reads and writes, and ``norm_all_reduce``."""
    per_byte = _model_costs_per_optimizer_byte(spec, num_stages, peaks, tp, mfu, sequence_parallel, layout, recompute,
                                               flash_attention, fallback_peak, bandwidths, fallback_bandwidth,
                                               stage_ranks, gpus, fallback_gpu, profiled, ep, cp, layer_hold_seconds,
                                               comm_sms, copies)
    costs = per_byte.with_step_overhead(per_byte.step_overhead * optimizer_state_bytes)
    if norm_grad_bytes is None:
        return costs
    return costs.with_grad_norm(per_byte.step_overhead * norm_grad_bytes / 2 + norm_all_reduce)


@functools.lru_cache(maxsize=1024)
def _model_costs_per_optimizer_byte(spec, num_stages: int, peaks: tuple, tp: int, mfu: float | None,
                                    sequence_parallel: bool, layout: tuple | None, recompute: str,
                                    flash_attention: bool, fallback_peak: float, bandwidths: tuple,
                                    fallback_bandwidth: float, stage_ranks: tuple, gpus: tuple,
                                    fallback_gpu: str | None, profiled, ep: int, cp: int,
                                    layer_hold_seconds: float, comm_sms: int = 0, copies: int = 1) -> Costs:
    """``_model_costs`` with an optimizer that passes over one byte per parameter. With
    ``copies`` of the model along the pipeline (DualPipe), the model is split into one
    copy's ``num_stages / copies`` stages and every copy's stages cost the same; each rank's
    optimizer then passes over the parameters of all the stages it holds. Where a rank holds
    both ends of the model (V placements, DualPipe) the split balances ranks
    (``pipesim.model.stage_split.ends_on_one_rank``)."""
    from pipesim.model.stage_split import ends_on_one_rank
    from pipesim.model.transformer_costs import with_embedding_copies, with_optimizer_step

    split = num_stages // copies
    stages = _model_stage_costs(spec, split, peaks[:split], tp, mfu, sequence_parallel, layout, recompute,
                                flash_attention, fallback_peak, bandwidths[:split], fallback_bandwidth, gpus[:split],
                                fallback_gpu, profiled, ep, cp, layer_hold_seconds, comm_sms,
                                None if layout else ends_on_one_rank(stage_ranks, copies))
    if copies > 1:
        stages = replace(stages, stages=stages.stages * copies, meta=dict(stages.meta))
    stages = with_embedding_copies(stages, spec, list(stage_ranks), copies, tp)
    return with_optimizer_step(stages, 1.0, list(stage_ranks), list(bandwidths), fallback_bandwidth)


@functools.lru_cache(maxsize=1024)
def _model_stage_costs(spec, num_stages: int, peaks: tuple, tp: int, mfu: float | None, sequence_parallel: bool,
                       layout: tuple | None, recompute: str, flash_attention: bool, fallback_peak: float,
                       bandwidths: tuple, fallback_bandwidth: float, gpus: tuple, fallback_gpu: str | None,
                       profiled, ep: int, cp: int, layer_hold_seconds: float, comm_sms: int = 0,
                       split_ranks: tuple | None = None) -> Costs:
    """``transformer_costs.model_stage_costs``, kept: every placement of as many stages on
    alike devices that splits alike (``split_ranks``: the looped placements, pp 8 and pp 4
    of two chunks, share them) shares them."""
    from pipesim.model.transformer_costs import model_stage_costs

    return model_stage_costs(spec, num_stages, list(peaks), tp=tp, mfu=mfu, sequence_parallel=sequence_parallel,
                             layers_per_stage=list(layout) if layout else None, recompute=recompute,
                             flash_attention=flash_attention, fallback_peak=fallback_peak,
                             stage_memory_bandwidth=list(bandwidths), fallback_memory_bandwidth=fallback_bandwidth,
                             stage_gpus=list(gpus), fallback_gpu=fallback_gpu, compute_model=profiled, ep=ep, cp=cp,
                             layer_hold_seconds=layer_hold_seconds, comm_sms=comm_sms, split_ranks=split_ranks)


@without_collector
def simulate_job(job: Job):
    """Simulate the job's step (``pipesim simulate`` without the printing): the
    ``SimulationResult``; for a model, its trace names the model. The collector is paused
    for the whole job, generation included, not phase by phase: each phase's objects
    outlive it, so every resumption would walk all that the phases before it built
    (``schedules.collector``)."""
    from pipesim.sim.step import run_simulation

    check_parallel_layout(job)
    parallel = parallel_of(job)  # its flags checked before any work
    topology = topology_of(job)
    schedule = schedule_of(job, topology)
    result = run_simulation(schedule, costs_of(job, schedule, topology), topology, parallel=parallel, p2p=job.p2p)
    if job.model:
        result.trace.meta["model"] = job.model  # the chart's title names it
    return result


def model_figures(job: Job, result) -> dict:
    """``--json``'s model section: the architecture, the per-stage costs derived from it,
    and the throughput a training log would report for the simulated step."""
    spec = model_spec_of(job)
    figures, gpus, peak = _throughput(job, result, spec)
    model = spec.describe()
    model.update(recompute=job.recompute, recompute_moe_act=spec.moe_act_recompute,
                 flash_attention=not job.no_flash_attention,
                 sequence_parallel=job.sequence_parallel, gpus=gpus, peak_flops_per_gpu=peak,
                 compute_model=result.costs.meta.get("compute_model"))
    return {"model": model, "stage_costs": result.costs.to_dict()["stages"], **figures}


def throughput_figures(job: Job, result) -> dict:
    """Only the throughput of ``model_figures`` (tokens/s, MFU, model TFLOP/s per GPU):
    what a planner ranks thousands of layouts by, without the rest of the section."""
    return _throughput(job, result, model_spec_of(job))[0]


def _throughput(job: Job, result, spec) -> tuple[dict, int, float]:
    """The training figures, the GPU count and the mean peak FLOP/s per GPU (the FP8
    peak taken as the BF16 peak times the GPU's ratio of the two)."""
    from pipesim.hardware.gpus import gpu_spec
    from pipesim.model.transformer_costs import training_figures

    fallback = fallback_peak_flops(job)
    peaks = [result.topology.device_peak_flops(device) for device in result.devices]
    peaks = [peak if math.isfinite(peak) else fallback for peak in peaks] or [fallback]
    gpus = result.schedule.pp * result.parallel.gpus
    peak = sum(peaks) / len(peaks)
    fp8_peak = peak * gpu_spec(getattr(job, "gpu", None)).fp8_peak_over_bf16
    figures = training_figures(spec, job.recompute, result.metrics.makespan, result.schedule.step_microbatches,
                               result.parallel.dp, gpus, peak, getattr(job, "attention_flops", "causal"), fp8_peak)
    return figures, gpus, peak
