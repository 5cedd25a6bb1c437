"""``pipesim plan``: the best layout for a model on a cluster, searched by simulation.

Each layout is a ``Job`` (``pipesim.job``): the plan's own settings with the layout's
schedule, pp, tp, dp, microbatches and options filled in, simulated by the very
functions ``pipesim simulate`` calls, so the table's numbers are the ones ``simulate``
prints for the chosen layout. Every flag is checked before the search starts.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import sys
import time
from dataclasses import replace
from itertools import repeat
from operator import add
from pathlib import Path
from typing import NamedTuple

from pipesim.cli.options import add_memory_headroom_arg
from pipesim.hardware.gpus import GPUS
from pipesim.job import Job, costs_of, parallel_of, schedule_of, throughput_figures, topology_of
from pipesim.model.costs import parameter_figures
from pipesim.plan.bounds import (
    Reductions,
    bound_of,
    busy_terms,
    floor_of,
    reductions_of,
    stash_floor,
    static_floor,
    with_tail,
)
from pipesim.plan.search import (
    Layout,
    SearchSpace,
    enumerate_layouts,
    layout_fields,
    pareto_front,
    parse_constraints,
    search,
    terminal_progress,
)
from pipesim.plan.workers import default_workers
from pipesim.sim.zero import ZERO_STAGES, gathers_after_optimizer, gathers_per_layer, reduces_every_backward
from schedules.collector import without_collector
from schedules.generators import SCHEDULE_NAMES, V_SHAPED, splits_backward

RECOMPUTE_MODES = ("none", "selective", "full")
SEQUENCE_PARALLEL = {"off": False, "on": True}
PROGRESS_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal
# The plan builds the cluster device by device and prices each layout's data-parallel
# groups over their devices: 131,072 GPUs (16,384 nodes of 8) build in a fifth of a second,
# 10 million in a minute before the first layout. The largest published runs use 16-32k.
MAX_PLAN_GPUS = 131_072


class CostsKey(NamedTuple):
    """What a layout's per-stage costs depend on (``_placed_costs``'s arguments): the name
    the floors and bounds keep them under (a Costs of a hundred stages is slow to hash
    for every lookup)."""

    placement: tuple[int, ...]
    pp: int
    tp: int
    dp: int
    microbatch_size: int
    recompute: str
    zero: int
    sequence_parallel: bool
    ep: int
    cp: int


# Set per worker process by ``_init_worker``: the job every layout starts from and its
# cluster, loaded once so its routes are computed once per process.
_BASE: dict = {}
# ``_parameter_gathers``, ``_reductions`` and ``_static_floor`` under what they read of the
# costs (a key built from the costs, not their arguments, so no ``functools`` cache): emptied
# with the job.
_PARAMETER_GATHERS: dict[tuple, dict[int, float]] = {}
_REDUCTIONS: dict[tuple, Reductions | None] = {}
_STATIC_FLOORS: dict[tuple, list[float]] = {}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="search pp x tp x dp, schedule, microbatch size, ... for the fastest layout that fits",
        description="Enumerate the layouts of a model on a cluster at a fixed global batch, drop those that cannot "
        "work (counting why), simulate the rest (best lower bound first) and rank them by tokens per second.",
    )
    parser.add_argument("--model", required=True, help="model preset or config.json (see `pipesim simulate --help`)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; tp stays within one (default: 8)")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--topology", default="ib", help="cluster preset or topology file (default: ib)")
    parser.add_argument("--gpu", choices=tuple(GPUS), default=None,
                        help="GPU model of the preset's devices (default: h100)")
    parser.add_argument("--schedules", default=",".join(SCHEDULE_NAMES),
                        help="schedules to try, comma-separated (default: all)")
    parser.add_argument("--microbatch-sizes", default="1,2,4", help="microbatch sizes to try (default: 1,2,4)")
    parser.add_argument("--virtual-stages", default="2,4",
                        help="chunks per rank to try for multi-chunk schedules (default: 2,4)")
    parser.add_argument("--recompute", default=",".join(RECOMPUTE_MODES),
                        help=f"recompute modes to try, comma-separated (default: {','.join(RECOMPUTE_MODES)})")
    parser.add_argument("--zero", default=",".join(map(str, ZERO_STAGES)),
                        help="ZeRO stages to try with dp > 1: 1 optimizer state, 2 and gradients, 3 and parameters "
                        f"(FSDP) sharded over dp (default: {','.join(map(str, ZERO_STAGES))})")
    add_memory_headroom_arg(parser)
    parser.add_argument("--cp", default=None,
                        help="context-parallel sizes to try, comma-separated (default: every power of two leaving each "
                        "rank at least 8192 tokens of a sequence; none at 8k or shorter)")
    parser.add_argument("--ep", default=None,
                        help="expert-parallel sizes to try for a mixture-of-experts model, comma-separated (default: "
                        "every power of two dividing its routed experts; ranks cut from the dp replicas)")
    parser.add_argument("--sequence-parallel", default="off,on",
                        help="sequence parallelism to try with tp > 1: off, on or both (default: off,on)")
    parser.add_argument("--mfu", type=float, default=None,
                        help="one compute efficiency for every kernel instead of the GPU's compute model")
    parser.add_argument("--compute-model", default=None, metavar="FILE",
                        help="a compute model fitted by pipesim profile --compute-model (default: the GPU's own)")
    parser.add_argument("--max-actions", type=int, default=None,
                        help="skip layouts whose schedule has more lowered actions than this (default: simulate's)")
    parser.add_argument("--constraint", action="append", default=[],
                        help="keep only layouts with FIELD=VALUE[,VALUE] (e.g. pp=8, schedule=1f1b); repeatable")
    parser.add_argument("--top", type=int, default=10, help="rows in the table (default: 10)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: the CPUs available)")
    parser.add_argument("--json", help="write the ranked layouts, counts and causes as JSON")
    parser.add_argument("--csv", help="write the ranked layouts as CSV")
    parser.add_argument("--html", help="write every considered layout's throughput vs peak memory (Pareto front) "
                        "and the best layout's Gantt")
    parser.add_argument("--torchtitan", metavar="DIR",
                        help="write the best layout for torchtitan: its schedule CSVs and config fragment, as "
                        "`pipesim export --torchtitan` does (default: none)")
    parser.add_argument("--fsdp", action="store_true",
                        help="with --torchtitan: the data-parallel replicas shard parameters with FSDP (torchtitan's "
                        "default); a ZeRO layout needs it")
    parser.add_argument("--quiet", action="store_true", help="no progress (shown on stderr while the search runs)")
    parser.set_defaults(handler=handle, output_dirs=("torchtitan",))


def handle(args: argparse.Namespace) -> int:
    base, space = _checked_job(args)
    layouts, ruled_out = enumerate_layouts(space)
    workers = args.workers or default_workers()
    print(f"plan: {args.model} on {args.gpus} GPUs ({args.topology}), global batch {args.global_batch}: "
          f"{len(layouts) + sum(ruled_out.values())} layouts to consider on {workers} process(es)", file=sys.stderr)
    if not layouts:
        print(format_causes("ruled out", ruled_out) or "no layout to consider", file=sys.stderr)
        return 1
    _init_worker(base)
    result = search(layouts, screen_layout, lower_bound, args.top, workers, _progress(args), ruled_out,
                    reject=reject_cause, describe=describe_layout if args.html else None, refine=evaluate_layout,
                    evaluate_takes_cutoff=True)
    print(format_plan(result, args))
    _write_outputs(args, result)
    return 0 if result.rows else 1


def _checked_job(args: argparse.Namespace) -> tuple[Job, SearchSpace]:
    """The job every layout starts from and the space to search, every flag checked (one
    line naming it) before anything is simulated."""
    from pipesim.job import model_spec_of

    for flag, value in (("--gpus", args.gpus), ("--global-batch", args.global_batch),
                        ("--gpus-per-node", args.gpus_per_node), ("--top", args.top)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.mfu is not None and not 0 < args.mfu <= 1:  # NaN fails this too
        raise ValueError(f"--mfu is a fraction of peak in (0, 1], got {args.mfu}")
    if args.fsdp and not args.torchtitan:
        raise ValueError("--fsdp says how torchtitan shards the data-parallel replicas; add --torchtitan DIR")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.max_actions is not None and args.max_actions < 1:
        raise ValueError(f"--max-actions must be >= 1, got {args.max_actions}")
    if args.gpus > MAX_PLAN_GPUS:
        raise ValueError(f"--gpus {args.gpus:,}: plan models the cluster device by device and prices every "
                         f"data-parallel group over its devices, which at this size takes hours; it searches up to "
                         f"{MAX_PLAN_GPUS:,} GPUs")
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        raise ValueError(f"--gpus {args.gpus} is not a whole number of {args.gpus_per_node}-GPU nodes")
    schedules = _names(args.schedules, "--schedules", SCHEDULE_NAMES)
    base = Job(model=args.model, seq_len=args.seq_len, topology=args.topology,
               nodes=max(1, args.gpus // args.gpus_per_node), gpu=args.gpu, mfu=args.mfu,
               compute_model=args.compute_model, memory_headroom=args.memory_headroom,
               **({"max_actions": args.max_actions} if args.max_actions else {}))
    parallel_of(base)  # a bad --memory-headroom fails here
    spec = model_spec_of(base)  # an unknown model or config, or a bad field, fails here
    topology_of(base).require_devices(args.gpus, "GPUs")  # and an unknown cluster
    space = SearchSpace(
        gpus=args.gpus, gpus_per_node=min(args.gpus_per_node, args.gpus), global_batch=args.global_batch,
        layers=spec.layers, heads=spec.heads, kv_heads=getattr(spec, "kv_heads", None) or spec.heads,
        schedules=schedules, microbatch_sizes=_ints(args.microbatch_sizes, "--microbatch-sizes"),
        virtual_stages=_ints(args.virtual_stages, "--virtual-stages"),
        recompute=_names(args.recompute, "--recompute", RECOMPUTE_MODES),
        zero=[int(level) for level in _names(args.zero, "--zero", tuple(map(str, ZERO_STAGES)))],
        sequence_parallel=[SEQUENCE_PARALLEL[mode] for mode in _names(args.sequence_parallel, "--sequence-parallel",
                                                                       tuple(SEQUENCE_PARALLEL))],
        constraints=parse_constraints(args.constraint),
        experts=spec.moe.experts if spec.moe else 0,
        expert_parallel=_ints(args.ep, "--ep") if args.ep else None,
        seq_len=spec.seq_len, context_parallel=_ints(args.cp, "--cp") if args.cp else None,
    )
    if args.ep and not spec.moe:
        raise ValueError(f"--ep {args.ep}: {args.model} has no experts to split (expert parallelism needs a "
                         "mixture-of-experts model)")
    return base, space


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"{flag} {text!r}: expected integers separated by commas") from error
    if not values or any(value < 1 for value in values):
        raise ValueError(f"{flag} {text!r}: expected integers >= 1")
    return values


def _names(text: str, flag: str, known: tuple[str, ...]) -> list[str]:
    """The comma-separated values of ``flag``, each one of ``known``."""
    values = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [value for value in values if value not in known]
    if unknown or not values:
        raise ValueError(f"{flag}: unknown {', '.join(unknown) or repr(text)}; available: {', '.join(known)}")
    return values


def _progress(args: argparse.Namespace):
    """A progress bar on a terminal; elsewhere a line every ``PROGRESS_EVERY`` seconds, so
    a long search is never silent."""
    if args.quiet:
        return None
    bar = terminal_progress("simulating")
    if bar is not None:
        return bar
    last = [time.perf_counter()]

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] >= PROGRESS_EVERY:
            last[0] = now
            print(f"plan: {done}/{total} layouts simulated or pruned", file=sys.stderr, flush=True)

    return report


def _init_worker(base: Job) -> None:
    _BASE["job"] = base
    _BASE["topology"] = topology_of(base)
    _PARAMETER_GATHERS.clear()
    _REDUCTIONS.clear()
    _STATIC_FLOORS.clear()
    for cache in (_layout_costs, _placed_costs, _placed_job, _placement_shell, _shell, _layout_parallel, _bound,
                  _bound_terms, _reductions, _busy_terms, _holds, _order_timing, _overlaps_pairs, _tp_holds,
                  _route_seconds, _floor_cause, _floors, _parameter_figures, _stash_floor, _pipeline_devices,
                  _usable_memory, _lowered_for, _ordered_by_costs):
        cache.cache_clear()  # they kept the job set up before


def layout_job(layout: Layout) -> Job:
    """The plan's job with ``layout`` filled in: what ``pipesim simulate`` would be given."""
    return replace(_BASE["job"], schedule=layout.schedule, pp=layout.pp, tp=layout.tp, dp=layout.dp,
                   microbatches=layout.microbatches, microbatch_size=layout.microbatch_size,
                   virtual_stages=layout.virtual_stages, recompute=layout.recompute, zero=layout.zero,
                   sequence_parallel=layout.sequence_parallel, ep=layout.ep, cp=layout.cp)


@functools.cache
def _layout_costs(layout: Layout):
    """The layout's parallel settings, per-stage costs and a shell schedule with its
    placement (no programs: costs depend only on the stages), without generating its
    order. Kept per layout: the memory floor and the lower bound both read them."""
    shell = _shell(layout.schedule, layout.pp, layout.virtual_stages, layout.microbatches)
    # the costs see ZeRO only through the optimizer step's bytes, alike for stages 1 to 3
    # (``pipesim.sim.zero.optimizer_bytes_per_param``): those layouts share them
    key = CostsKey(shell.placement, layout.pp, layout.tp, layout.dp, layout.microbatch_size, layout.recompute,
                   min(layout.zero, 1), layout.sequence_parallel, layout.ep, layout.cp)
    return _layout_parallel(layout.dp, layout.tp, layout.zero, layout.ep, layout.cp), _placed_costs(*key), shell, key


@functools.lru_cache(maxsize=4096)
def _shell(schedule: str, pp: int, virtual_stages: int, microbatches: int):
    """A schedule with ``schedule``'s placement and no programs: what costs and bounds read."""
    from schedules.generators import placement_of
    from schedules.schedule import Schedule

    placement = tuple(placement_of(schedule, pp, virtual_stages))
    return Schedule(pp, microbatches, placement, [()] * pp, name=schedule)


@functools.lru_cache(maxsize=1024)
def _layout_parallel(dp: int, tp: int, zero: int, ep: int = 1, cp: int = 1):
    """``parallel_of`` the layout's job: only dp, tp, ZeRO, ep and cp differ between layouts."""
    return parallel_of(replace(_BASE["job"], dp=dp, tp=tp, zero=zero, ep=ep, cp=cp))


@functools.lru_cache(maxsize=8192)
def _placed_costs(placement: tuple[int, ...], pp: int, tp: int, dp: int, microbatch_size: int, recompute: str,
                  zero: int, sequence_parallel: bool, ep: int = 1, cp: int = 1):
    """The per-stage costs of every layout with these stages on these ranks: the schedule
    and the microbatch count do not change them (1F1B, GPipe and the zero-bubble orders
    share them), so they are derived once."""
    job = _placed_job(pp, tp, dp, microbatch_size, recompute, zero, sequence_parallel, ep, cp)
    return costs_of(job, _placement_shell(placement), _BASE["topology"])


@functools.lru_cache(maxsize=4096)
def _placed_job(pp: int, tp: int, dp: int, microbatch_size: int, recompute: str, zero: int, sequence_parallel: bool,
                ep: int, cp: int) -> Job:
    """The plan's job with ``_placed_costs``'s settings, kept: the placements of one pp
    (looped, V, every chunk count) share it, and a job is slow to copy."""
    return replace(_BASE["job"], pp=pp, tp=tp, dp=dp, microbatch_size=microbatch_size, recompute=recompute, zero=zero,
                   sequence_parallel=sequence_parallel, ep=ep, cp=cp)


@functools.lru_cache(maxsize=1024)
def _placement_shell(placement: tuple[int, ...]):
    """A one-microbatch schedule of ``placement`` and no programs: what the costs and the
    bounds' collectives read of a schedule, built once per placement."""
    from schedules.schedule import Schedule

    pp = max(placement) + 1
    return Schedule(pp, 1, placement, [()] * pp)


def lower_bound(layout: Layout) -> float:
    """``pipesim.plan.bounds.step_lower_bound`` of the layout, with its tp collectives,
    ZeRO gathers and hops priced as the simulation prices them."""
    try:
        _, costs, _, key = _layout_costs(layout)
    except ValueError:
        return float("inf")  # the evaluation reports why
    if layout.schedule in V_SHAPED and _overlaps_pairs(key):
        return costs.step_overhead  # overlapped pairs of a given cost may undercut F + B: only the tail is certain
    return _bound(key, layout.zero, layout.microbatches, splits_backward(layout.schedule))


def order_bound(layout: Layout, schedule) -> float:
    """A step no lowering of ``schedule`` (the layout's compute order, as built for it)
    can beat: the order timed by the engine with free-flowing transfers, each taking its
    unloaded time (no contention, no rendezvous: every action starts at the earliest its
    rank and its input allow) and each action holding its rank as in ``lower_bound``;
    then each rank's tail (the optimizer step and the gathers after it). The simulation
    only ever waits more. ``lower_bound`` where the order is not the one its costs were
    derived for, or its overlapped pairs run at a cost of their own."""
    _, _, shell, key = _layout_costs(layout)
    if schedule.placement != shell.placement or any(schedule.fused) or (
            layout.schedule in V_SHAPED and _overlaps_pairs(key)):
        return lower_bound(layout)
    from schedules import engine  # only here: an import runs slowly per call

    parallel = _layout_parallel(layout.dp, layout.tp, layout.zero, layout.ep, layout.cp)
    timing = _order_timing(key._replace(zero=0), parallel.rank_order, parallel.algorithm,
                           gathers_per_layer(parallel.zero))
    run = engine.run(schedule, timing, engine.FREE)
    if run.stuck:
        return lower_bound(layout)  # the simulation says why
    tails = _terms_of(key, parallel).tail
    return max(lower_bound(layout), *map(add, run.rank_done.tolist(), tails))


@functools.lru_cache(maxsize=1024)
def _order_timing(costs_key: CostsKey, rank_order: str, algorithm: str, per_layer: bool):
    """``order_bound``'s engine timing of the costs named by ``costs_key``: each (stage,
    kind)'s seconds as the simulation has them, the bounds' holds, and each boundary a
    wire of its unloaded hop on a link of its own (so that transfers never queue)."""
    import numpy as np

    from schedules import engine

    costs = _placed_costs(*costs_key)
    durations = costs.durations()
    holds = _holds(costs_key, rank_order, algorithm, per_layer)
    stages = range(costs.num_stages)
    seconds = np.array([[durations[stage, kind] for kind in engine.COMPUTE_KINDS] for stage in stages])
    hold = np.array([[holds.get((stage, kind), 0.0) for kind in engine.COMPUTE_KINDS] for stage in stages])
    hop = _hop(costs_key, rank_order)
    hops = [hop(stage, stage + 1) for stage in range(costs.num_stages - 1)]
    return engine.StepTiming(seconds, hold, wires=engine.hop_wires(costs.num_stages, hops),
                             comm_overhead=costs.comm_overhead)


@functools.lru_cache(maxsize=8192)
def _overlaps_pairs(costs_key: CostsKey) -> bool:
    """Whether a stage of the costs named by ``costs_key`` gives its overlapped pair's cost
    (``overlap_fb``), kept: every V-shaped layout of them asks."""
    return any(stage.overlap_fb for stage in _placed_costs(*costs_key).stages)


@functools.lru_cache(maxsize=16384)
def _bound(costs_key: CostsKey, zero: int, microbatches: int, split_backward: bool) -> float:
    """``lower_bound`` of what it depends on, kept: the schedules of a placement that alike
    split the backward or not share it (the microbatch count follows from the key's dp
    and microbatch size)."""
    parallel = _layout_parallel(costs_key.dp, costs_key.tp, zero, costs_key.ep, costs_key.cp)
    terms = _terms_of(costs_key, parallel)
    reductions = _reductions(costs_key, parallel.rank_order, parallel.algorithm, parallel.bucket_bytes,
                             parallel.zero, parallel.overlap_dp)
    return bound_of(terms, microbatches, split_backward, reductions)


def _terms_of(costs_key: CostsKey, parallel):
    """``_bound_terms`` of the costs named by ``costs_key`` under ``parallel``'s settings.
    ZeRO enters them only through two flags, so stages 1 and 2 share them."""
    flags = (gathers_per_layer(parallel.zero), gathers_after_optimizer(parallel.zero))
    return _bound_terms(costs_key, parallel.rank_order, parallel.algorithm, parallel.bucket_bytes, flags)


@functools.lru_cache(maxsize=8192)
def _reductions(costs_key: CostsKey, rank_order: str, algorithm: str, bucket_bytes: float, zero: int,
                overlap_dp: bool) -> Reductions | None:
    """``pipesim.plan.bounds.Reductions`` of the layouts whose costs ``costs_key`` names
    under ZeRO ``zero`` (None where the dp stream cannot raise the bound), kept: every
    schedule of a placement and every microbatch count share them."""
    every_backward = reduces_every_backward(zero)
    after_compute = not overlap_dp and not every_backward
    if not (every_backward or after_compute):
        return None
    costs = _placed_costs(*costs_key)
    # what the reductions read of the costs: each stage's parameters and layers (ZeRO-3 reduces
    # per layer); the layouts of every microbatch size, recompute mode and sequence parallelism share them
    key = (costs_key.placement, costs_key.dp, costs_key.pp, costs_key.tp, costs_key.cp, costs_key.ep, rank_order,
           bucket_bytes, algorithm, zero, after_compute, _parameter_figures(costs_key),
           tuple(stage.layers for stage in costs.stages))
    reductions = _REDUCTIONS.get(key, _REDUCTIONS)
    if reductions is _REDUCTIONS:
        from pipesim.sim.parallel import gradient_reduction_seconds  # only here: an import runs slowly per call

        seconds = gradient_reduction_seconds(_placement_shell(costs_key.placement), costs, _BASE["topology"],
                                             _mapping(costs_key, rank_order), bucket_bytes, algorithm, zero)
        reductions = _REDUCTIONS[key] = reductions_of(costs_key.placement, seconds, every_backward, after_compute)
    return reductions


@functools.lru_cache(maxsize=4096)
def _bound_terms(costs_key: CostsKey, rank_order: str, algorithm: str, bucket_bytes: float, zero: tuple[bool, bool]):
    """The terms of ``pipesim.plan.bounds.step_lower_bound`` (``busy_terms`` and their
    tail, ``with_tail``) of what they depend on, kept: every schedule of
    a placement and every microbatch count share them (1F1B and GPipe; every
    split-backward order). The costs are named by their key in ``_placed_costs``, whose
    placement, dp, tp and cp are the bound's too."""
    per_layer, after_optimizer = zero
    # the key's ZeRO stage changes only the optimizer step, which the busy terms do not read
    busy = _busy_terms(costs_key._replace(zero=0), rank_order, algorithm, per_layer)
    gather_seconds = _parameter_gathers(costs_key, rank_order, bucket_bytes) if after_optimizer else {}
    return with_tail(busy, _placed_costs(*costs_key), costs_key.placement, gather_seconds)


def _parameter_gathers(costs_key: CostsKey, rank_order: str, bucket_bytes: float) -> dict[int, float]:
    """``pipesim.sim.parallel.parameter_gather_seconds`` of the costs named by ``costs_key``
    on its mapping, kept under what it reads of them (``parameter_figures``): the
    layouts of every microbatch size and recompute mode share them."""
    costs = _placed_costs(*costs_key)
    key = (costs_key.placement, costs_key.dp, costs_key.pp, costs_key.tp, costs_key.cp, rank_order, bucket_bytes,
           _parameter_figures(costs_key))
    gathers = _PARAMETER_GATHERS.get(key)
    if gathers is None:
        from pipesim.sim.parallel import parameter_gather_seconds  # only here: an import runs slowly per call

        gathers = _PARAMETER_GATHERS[key] = parameter_gather_seconds(
            _placement_shell(costs_key.placement), costs, _BASE["topology"], _mapping(costs_key, rank_order),
            bucket_bytes)
    return gathers


@functools.lru_cache(maxsize=4096)
def _busy_terms(costs_key: CostsKey, rank_order: str, algorithm: str, per_layer: bool):
    """``pipesim.plan.bounds.busy_terms`` of the costs named by ``costs_key`` (ZeRO stage
    0: the others' stages alike), kept: ZeRO 0, 1 and 2 share them (none gathers per
    layer), their tails differ."""
    return busy_terms(_placed_costs(*costs_key), costs_key.placement,
                      _holds(costs_key, rank_order, algorithm, per_layer), _hop(costs_key, rank_order))


@functools.lru_cache(maxsize=4096)
def _holds(costs_key: CostsKey, rank_order: str, algorithm: str, per_layer: bool) -> dict[tuple[int, str], float]:
    """What holds a rank after each (stage, compute kind) in the bounds: the tp
    collectives and, under ZeRO-3, the layers' unhidden parameter gathers (ep and cp
    exchanges left out: the bounds only need less than the simulation holds), kept."""
    holds = _tp_holds(costs_key, rank_order, algorithm)
    if per_layer:  # the layers' gathers hold a rank as the tp collectives do
        from pipesim.sim.parallel import layer_gathers  # only here: an import runs slowly per call

        held = layer_gathers(_placement_shell(costs_key.placement), _placed_costs(*costs_key), _BASE["topology"],
                             _mapping(costs_key, rank_order))[0]
        keys = list(holds.keys() | held.keys())  # each key's two holds added by builtins, not per key
        sums = map(add, map(holds.get, keys, repeat(0.0)), map(held.get, keys, repeat(0.0)))
        holds = dict(zip(keys, sums, strict=True))
    return holds


def _hop(costs_key: CostsKey, rank_order: str):
    """``hop(source, target)``: a stage boundary's transfer on an empty route (latency +
    bytes / bandwidth), 0 between stages on one rank; what the bounds charge a hop."""
    costs = _placed_costs(*costs_key)
    placement = costs_key.placement
    devices = _pipeline_devices(costs_key.dp, costs_key.pp, costs_key.tp, rank_order, costs_key.cp)

    def hop(source: int, target: int) -> float:
        if placement[source] == placement[target]:
            return 0.0
        return _route_seconds(devices[placement[source]], devices[placement[target]],
                              costs.stages[min(source, target)].act_bytes)

    return hop


@functools.lru_cache(maxsize=4096)
def _tp_holds(costs_key: CostsKey, rank_order: str, algorithm: str) -> dict[tuple[int, str], float]:
    """``pipesim.sim.parallel.tp_collective_seconds`` of the costs named by ``costs_key``
    on its mapping, kept: the busy terms with and without ZeRO-3's per-layer gathers
    share them."""
    from pipesim.sim.parallel import tp_collective_seconds

    return tp_collective_seconds(_placement_shell(costs_key.placement), _placed_costs(*costs_key), _BASE["topology"],
                                 _mapping(costs_key, rank_order), algorithm)


def _mapping(costs_key: CostsKey, rank_order: str):
    """The ranks' mapping onto the cluster of the layouts whose costs ``costs_key`` names:
    what the bounds' collectives are priced on."""
    from pipesim.cluster.mapping import map_ranks

    return map_ranks(_BASE["topology"], costs_key.dp, costs_key.pp, costs_key.tp, rank_order, costs_key.cp,
                     costs_key.ep)


@functools.lru_cache(maxsize=65536)
def _route_seconds(source: str, target: str, num_bytes: float) -> float:
    """An unloaded transfer's seconds from device to device, kept: the bounds of many
    layouts cross the same boundaries with the same activations."""
    return _BASE["topology"].route(source, target).seconds(num_bytes)


def reject_cause(layout: Layout) -> str | None:
    """Why the layout cannot work without simulating it: out of memory even at the least
    any schedule holds; None otherwise (the simulation decides)."""
    key = _floors_key(layout)
    return None if key is None else _floor_cause(key, layout.zero)


@functools.lru_cache(maxsize=16384)
def _floor_cause(costs_key: CostsKey, zero: int) -> str | None:
    """``reject_cause`` of what it depends on, kept: layouts of several schedules and
    microbatch counts share their floors and so the verdict."""
    if any(floor > usable for floor, usable in _floors(costs_key, zero)):
        return "out of memory (parameters, optimizer state and one stash alone, with the headroom)"
    return None


def describe_layout(layout: Layout) -> dict:
    """What the chart shows of a layout never simulated: its largest memory floor and its
    lower bound."""
    floors = _memory_floors(layout)
    facts = {"lower_bound": lower_bound(layout)}
    return {**facts, "peak_memory_bytes": max(floor for floor, _ in floors)} if floors else facts


def _memory_floors(layout: Layout) -> list[tuple[float, float]] | None:
    """Per rank, (``pipesim.plan.bounds.floor_of``, the device's memory); None where
    the costs say nothing of memory."""
    key = _floors_key(layout)
    return None if key is None else _floors(key, layout.zero)


def _floors_key(layout: Layout) -> CostsKey | None:
    """The key of the layout's costs, None where they have no memory floor: they cannot be
    built (the evaluation reports why) or say nothing of memory."""
    try:
        _, costs, _, key = _layout_costs(layout)
    except ValueError:
        return None
    return key if costs.memory_known else None


@functools.lru_cache(maxsize=16384)
def _floors(costs_key: CostsKey, zero: int) -> list[tuple[float, float]]:
    """``_memory_floors`` of what it depends on, kept (layouts of several schedules share
    it); the costs named by their key in ``_placed_costs``, as for ``_bound_terms``."""
    parallel = _layout_parallel(costs_key.dp, costs_key.tp, zero, costs_key.ep, costs_key.cp)
    # the key's ZeRO stage changes only the optimizer step, which the stash does not read
    floors = floor_of(_static_floor(costs_key, zero), _stash_floor(costs_key._replace(zero=0)))
    usable = _usable_memory(costs_key.dp, costs_key.pp, costs_key.tp, parallel.rank_order, parallel.cp,
                            parallel.memory_headroom)
    return list(zip(floors, usable, strict=True))


def _static_floor(costs_key: CostsKey, zero: int) -> list[float]:
    """``pipesim.plan.bounds.static_floor`` of the costs named by ``costs_key`` under ZeRO
    stage ``zero``, kept under what it reads of them (``parameter_figures``), the placement
    and the sharding: the layouts of every microbatch size and recompute mode share it."""
    costs = _placed_costs(*costs_key)
    parallel = _layout_parallel(costs_key.dp, costs_key.tp, zero, costs_key.ep, costs_key.cp)
    holders = costs_key.dp * parallel.cp  # the ranks that hold each parameter, as simulate's memory counts them
    key = (costs_key.placement, holders, parallel.zero, parallel.ep, parallel.bytes_per_param,
           _parameter_figures(costs_key))
    static = _STATIC_FLOORS.get(key)
    if static is None:
        from pipesim.sim.memory import static_bytes  # only here: an import runs slowly per call

        distinct = {id(cost): cost for cost in costs.stages}  # a model's alike stages share one object (kept by costs)
        static_of = {key: static_bytes(cost, parallel.bytes_per_param, holders, parallel.zero, holders // parallel.ep)
                     for key, cost in distinct.items()}
        static = _STATIC_FLOORS[key] = static_floor(costs_key.placement,
                                                    [static_of[id(cost)] for cost in costs.stages])
    return static


@functools.lru_cache(maxsize=8192)
def _parameter_figures(costs_key: CostsKey) -> tuple[tuple[float, int, int], ...]:
    """``pipesim.model.costs.parameter_figures`` of the costs named by ``costs_key``, kept:
    the floors of every ZeRO stage and the gathers after the step read them."""
    return parameter_figures(_placed_costs(*costs_key))


@functools.lru_cache(maxsize=4096)
def _stash_floor(costs_key: CostsKey) -> list[float]:
    """``pipesim.plan.bounds.stash_floor`` of the costs named by ``costs_key``, kept: every
    ZeRO stage shares it."""
    return stash_floor(_placed_costs(*costs_key), costs_key.placement)


@functools.lru_cache(maxsize=1024)
def _usable_memory(dp: int, pp: int, tp: int, rank_order: str, cp: int, headroom) -> tuple[float, ...]:
    """Each pipeline device's memory less the headroom, kept per mapping (``_pipeline_devices``)."""
    topology = _BASE["topology"]
    capacities = [topology.device_memory(device) for device in _pipeline_devices(dp, pp, tp, rank_order, cp)]
    return tuple(capacity - headroom.of(capacity) for capacity in capacities)


@functools.lru_cache(maxsize=1024)
def _pipeline_devices(dp: int, pp: int, tp: int, rank_order: str, cp: int = 1) -> list[str]:
    """The simulated pipeline's devices of a layout's mapping, kept: floors and bounds of
    many layouts share a mapping."""
    from pipesim.cluster.mapping import map_ranks

    return map_ranks(_BASE["topology"], dp, pp, tp, rank_order, cp).pipeline()


@without_collector  # paused for the whole layout: its Trace is freed before the collector runs again
def evaluate_layout(layout: Layout, cutoff: float = math.inf) -> dict:
    """Simulate one layout exactly as ``pipesim simulate`` would; a row for the table, or
    ``{"error": cause}`` for a layout that cannot be built, or ``{"pruned": bound}`` where
    its order's ``order_bound`` is no better than ``cutoff`` (the search's ``top``-th
    best step so far: the layout cannot reach the top)."""
    return _evaluated(layout, exact=True, cutoff=cutoff)


@without_collector
def screen_layout(layout: Layout, cutoff: float = math.inf) -> dict:
    """``evaluate_layout`` with the searches that cost the most and change the least cut
    short: lowering places the transfers by one rule, untimed and unrepaired, zb-auto
    keeps its best heuristic without the solver's pass, and zbv-auto tries only its most
    often winning variants. Each only ever keeps what makes the step shorter, so a screened
    step is the exact one or a little longer; the planner screens every layout this way and
    simulates its finalists exactly."""
    return _evaluated(layout, exact=False, cutoff=cutoff)


def _evaluated(layout: Layout, exact: bool, cutoff: float = math.inf) -> dict:
    from pipesim.sim.engine import lower_for
    from pipesim.sim.step import run_simulation
    from schedules.generators import COST_AWARE, ScheduleUnavailableError
    from schedules.lowering import repair_budget
    from schedules.placement_search import SCREEN_RULE

    topology = _BASE["topology"]
    try:
        job = layout_job(layout)
        _, layout_costs, shell, costs_key = _layout_costs(layout)
        # orders and lowering read the stages' times and transfers, never the optimizer step:
        # layouts that differ in their ZeRO stage alone share them (built for ZeRO 0)
        unsharded = layout._replace(zero=0)
        # zb-auto's optimising pass and zbv-auto's full search are what screening leaves out; the
        # adapted orders have neither
        search_seconds = None if exact or layout.schedule not in COST_AWARE else 0.0
        schedule = _order_of(unsharded, search_seconds)
        # costs depend on the stages and their placement only (``_layout_costs``)
        costs = layout_costs if schedule.placement == shell.placement else costs_of(job, schedule, topology)
        cause = _order_memory_cause(schedule, costs, parallel_of(job), layout)
        if cause is not None:
            return {"rejected": cause}
        if cutoff < math.inf:  # an order whose best case cannot reach the top is not lowered or simulated
            bound = order_bound(layout, schedule)
            if bound >= cutoff:
                return {"pruned": bound}
        # screening places the transfers by one rule, untimed (``SCREEN_RULE``); the exact
        # lowering times every rule and repairs the best (where the budget has runs)
        repair_runs = None if exact and repair_budget(sum(map(len, schedule.programs))) else 0
        rule = None if exact else SCREEN_RULE
        if costs is layout_costs:
            schedule = _lowered_for(unsharded, search_seconds, repair_runs, rule)
        else:
            schedule = lower_for(schedule, costs, topology, _pipeline_devices(layout.dp, layout.pp, layout.tp,
                                                                             job.rank_order, layout.cp), repair_runs,
                                 rule)
        # Generated here and lowered for this layout's costs and links as simulate lowers it, so
        # valid by construction (tests/test_p2p.py proves it for every generator); the engine's
        # run is the deadlock check that remains.
        result = run_simulation(schedule, costs, topology, parallel=parallel_of(job), p2p=job.p2p, validate=False)
    except ScheduleUnavailableError:
        return {"error": f"{layout.schedule} does not exist for that microbatch count and pp"}
    except ValueError as error:
        return {"error": f"{type(error).__name__}: {str(error).split(';')[0]}"}
    metrics = result.metrics
    figures = throughput_figures(job, result)
    peak = max((memory.peak_bytes for memory in result.memory), default=0.0)
    capacity = min((memory.capacity_bytes for memory in result.memory), default=float("inf"))
    return {
        **layout_fields(layout),
        "step_time": metrics.makespan,
        "tokens_per_second": figures["tokens_per_second"] or 0.0,
        "mfu": figures["mfu"],
        "model_tflops_per_gpu": figures["model_tflops_per_gpu"],
        "bubble_fraction": metrics.bubble_fraction,
        "idle_fraction": metrics.idle_fraction,
        "exposed_comm": sum(rank.exposed_comm for rank in metrics.ranks) / len(metrics.ranks),
        "peak_memory_bytes": peak,
        "capacity_bytes": capacity if capacity != float("inf") else None,
        "oom": result.oom,
    }


ORDER_OUT_OF_MEMORY = "out of memory (its schedule's stashes in program order, parameters and optimizer state)"


def _order_memory_cause(schedule, costs, parallel, layout: Layout) -> str | None:
    """The layout's simulated peak memory, read off its programs' order before simulating
    (``pipesim.sim.memory.program_order_trace``: exact when every forward that takes a
    stash takes time): a cause when some rank does not fit its device less the headroom,
    else None."""
    from pipesim.sim.memory import memory_report, program_order_trace

    if not costs.memory_known or any(stage.stash_bytes > 0 and stage.fwd <= 0 for stage in costs.stages):
        return None  # a stash taken by a forward of no time: the simulation decides
    topology = _BASE["topology"]
    devices = _pipeline_devices(layout.dp, layout.pp, layout.tp, parallel.rank_order, layout.cp)
    report = memory_report(program_order_trace(schedule), costs, schedule.placement, devices,
                           [topology.device_memory(device) for device in devices], parallel.bytes_per_param,
                           parallel.dp * parallel.cp, parallel.bucket_bytes, parallel.zero,
                           parallel.dp * parallel.cp // parallel.ep, headroom=parallel.memory_headroom,
                           timelines=False)
    return ORDER_OUT_OF_MEMORY if any(rank.oom for rank in report) else None


@functools.lru_cache(maxsize=256)
def _generated(name: str, pp: int, microbatches: int, virtual_stages: int, max_actions: int):
    """The schedule's order, shared by every layout with the same one: tp, dp, microbatch
    size, recompute and sharding leave it alone (its transfers are placed for each
    layout's costs when it is simulated, as ``simulate`` places them)."""
    from schedules.generators import generate

    return generate(name, pp, microbatches, virtual_stages, max_actions=max_actions)


def _order_of(layout: Layout, search_seconds: float | None):
    """The layout's order as ``simulate`` builds it: generated, or for a cost-aware or
    adapted one (zb-auto, zbv-auto, zb-h1, zb-h2) built from the layout's costs
    (``search_seconds`` 0 when screening: their quick searches), kept either way."""
    from schedules.generators import COST_AWARE
    from schedules.generators.adaptive import ADAPTABLE

    if layout.schedule in COST_AWARE or layout.schedule in ADAPTABLE:
        return _ordered_by_costs(layout, search_seconds)
    return _generated(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages,
                      _BASE["job"].max_actions)


@functools.lru_cache(maxsize=256)
def _ordered_by_costs(layout: Layout, search_seconds: float | None):
    """``_order_of`` a cost-aware or adapted order, kept per layout and budget."""
    return schedule_of(layout_job(layout), _BASE["topology"], search_seconds=search_seconds)


@functools.lru_cache(maxsize=256)
def _lowered_for(layout: Layout, search_seconds: float | None, repair_runs: int | None, rule: int | None):
    """The layout's order lowered for its costs on its pipeline's devices, as ``simulate``
    lowers it (``pipesim.sim.engine.lower_for``; one untimed ``rule`` when screening),
    kept: layouts that differ only in what lowering does not read share it."""
    from pipesim.sim.engine import lower_for

    _, costs, _, _ = _layout_costs(layout)
    return lower_for(_order_of(layout, search_seconds), costs, _BASE["topology"],
                     _pipeline_devices(layout.dp, layout.pp, layout.tp, _BASE["job"].rank_order, layout.cp),
                     repair_runs, rule)


def format_causes(bucket: str, causes) -> str:
    return f"{bucket}: " + "; ".join(f"{cause}: {count}" for cause, count in causes.most_common()) if causes else ""


def format_plan(result, args: argparse.Namespace) -> str:
    """The ranked table and where every considered layout went; the buckets add up."""
    width = max([48] + [len(row["layout"]) for row in result.rows[:args.top]])
    lines = [f"{'#':>3}  {'layout':<{width}} {'step':>9} {'tokens/s':>11} {'MFU':>6} {'bubble':>7} "
             f"{'exp.comm':>9} {'peak mem':>9} {'capacity':>9}"]
    for index, row in enumerate(result.rows[:args.top], 1):
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "-"
        capacity = f"{row['capacity_bytes'] / 1e9:.1f} GB" if row.get("capacity_bytes") else "-"
        lines.append(f"{index:>3}  {row['layout']:<{width}} {row['step_time']:>8.3f}s "
                     f"{row['tokens_per_second']:>11,.0f} {mfu:>6} {row['bubble_fraction']:>7.1%} "
                     f"{row['exposed_comm'] * 1e3:>7.1f}ms "
                     f"{row['peak_memory_bytes'] / 1e9:>6.1f} GB {capacity:>9}")
    rate = result.simulated / result.seconds if result.seconds else 0.0
    failed = sum(result.failed.values())
    lines.append(f"considered {result.considered} layouts = {sum(result.ruled_out.values())} ruled out + "
                 f"{sum(result.screened.values())} rejected before simulation + {result.simulated} simulated "
                 f"({result.ranked} ranked, {failed} did not fit or could not be built) + {result.pruned} pruned "
                 f"by lower bound (cannot reach the top {args.top}); {result.seconds:.1f} s, {rate:.0f} simulated/s")
    if result.refined:
        lines.append(f"screened with one transfer-placement rule and the cost-aware orders' quick searches; the "
                     f"{result.refined} finalists simulated again exactly as `pipesim simulate` runs them")
    for bucket, causes in (("ruled out", result.ruled_out), ("rejected before simulation", result.screened),
                           ("simulated, not ranked", result.failed)):
        if causes:
            lines.append(format_causes(bucket, causes))
    if not result.rows:
        lines.append("no layout fits: see the causes above")
    return "\n".join(lines)


def _write_outputs(args: argparse.Namespace, result) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(args.top), indent=2))
        print(f"wrote {args.json}")
    if args.csv:
        rows = result.rows[:args.top]
        with open(args.csv, "w", newline="") as handle:
            if rows:
                writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
        print(f"wrote {args.csv}")
    if args.torchtitan and result.rows:
        _write_torchtitan(args, result.rows[0])
    if args.html and result.rows:
        from viz.plan import write_plan_html

        best = result.rows[0]
        layout = Layout(**{key: best[key] for key in Layout._fields})
        write_plan_html(result.rows, pareto_front(result.rows), _best_trace(layout), args.html,
                        title=f"{args.model} on {args.gpus} GPUs ({args.topology}): best {best['layout']}",
                        plotly=getattr(args, "plotly", "inline"), others=_charted_others(result))
        print(f"wrote {args.html}")


def _charted_others(result) -> list[dict]:
    """The layouts not ranked, with the throughput their lower bound allows (an upper
    bound: the chart greys them out at that height) and their memory where simulated."""
    tokens_per_step = result.rows[0]["tokens_per_second"] * result.rows[0]["step_time"]
    charted = []
    for other in result.others:
        bound = other.get("lower_bound")
        if bound:
            charted.append({**other, "tokens_per_second": tokens_per_step / bound})
    return charted


def _write_torchtitan(args: argparse.Namespace, best: dict) -> None:
    """The best layout's schedule CSVs and torchtitan config (``pipesim.cli.torchtitan``),
    the order being the one simulated."""
    from pipesim.cli.torchtitan import TorchtitanLayout, write_torchtitan
    from pipesim.job import model_spec_of

    layout = Layout(**{key: best[key] for key in Layout._fields})
    if layout.zero and not args.fsdp:
        raise ValueError(f"--torchtitan {args.torchtitan}: the best layout shards the optimizer (zero{layout.zero}), "
                         "which torchtitan does as FSDP: add --fsdp, or --constraint zero=0")
    job = layout_job(layout)
    spec = model_spec_of(job)
    written = write_torchtitan(args.torchtitan, schedule_of(job, _BASE["topology"]), TorchtitanLayout(
        dp=layout.dp, tp=layout.tp, fsdp=args.fsdp, microbatch_size=layout.microbatch_size, layers=spec.layers,
        seq_len=spec.seq_len, ep=layout.ep, cp=layout.cp))
    print(f"wrote {', '.join(str(path) for path in written)}: {best['layout']}")


def _best_trace(layout: Layout):
    from pipesim.job import simulate_job

    return simulate_job(layout_job(layout)).trace
