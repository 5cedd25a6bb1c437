"""``pipesim plan``: the best layout for a model on a cluster, searched by simulation.

Each layout is simulated exactly as ``pipesim simulate`` would with the same flags (the
arguments are built and parsed by the ``simulate`` parser), so the table's numbers are
the ones ``simulate`` prints for the chosen layout.
"""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import json
import sys
from pathlib import Path

from pipesim.plan.search import (
    Layout,
    SearchSpace,
    default_workers,
    enumerate_layouts,
    layout_fields,
    pareto_front,
    parse_constraints,
    search,
    terminal_progress,
)
from schedules.collector import without_collector
from schedules.generators import SCHEDULE_NAMES

# Set per worker process by ``_init_worker``: the simulate arguments every layout shares,
# and the topology, loaded once so its routes are computed once per process.
_BASE: dict = {}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="search pp x tp x dp, schedule, microbatch size, ... for the fastest layout that fits",
        description="Enumerate the layouts of a model on a cluster at a fixed global batch, drop those that cannot "
        "work (counting why), simulate the rest (best lower bound first) and rank them by tokens per second.",
    )
    parser.add_argument("--model", required=True, help="model preset (see `pipesim simulate --help`)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; tp stays within one (default: 8)")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--topology", default="ib", help="cluster preset or topology file (default: ib)")
    parser.add_argument("--gpu", default=None, help="GPU preset for the topology's devices, where supported")
    parser.add_argument("--schedules", default=",".join(SCHEDULE_NAMES),
                        help="schedules to try, comma-separated (default: all)")
    parser.add_argument("--microbatch-sizes", default="1,2,4", help="microbatch sizes to try (default: 1,2,4)")
    parser.add_argument("--virtual-stages", default="2,4",
                        help="chunks per rank to try for multi-chunk schedules (default: 2,4)")
    parser.add_argument("--recompute", default=None,
                        help="recompute modes to try, comma-separated (default: every mode simulate knows)")
    parser.add_argument("--zero", default=None, help="optimizer sharding levels to try (default: 0,1 where known)")
    parser.add_argument("--mfu", type=float, default=None, help="compute efficiency passed to simulate")
    parser.add_argument("--constraint", action="append", default=[],
                        help="keep only layouts with FIELD=VALUE[,VALUE] (e.g. pp=8, schedule=1f1b); repeatable")
    parser.add_argument("--top", type=int, default=10, help="rows in the table (default: 10)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: the CPUs available)")
    parser.add_argument("--json", help="write the ranked layouts, counts and rejections as JSON")
    parser.add_argument("--csv", help="write the ranked layouts as CSV")
    parser.add_argument("--html", help="write throughput vs peak memory (Pareto front) and the best layout's Gantt")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar (it is shown only when stderr is a terminal)")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from pipesim.cli import build_parser
    from pipesim.model.spec import model_spec

    if args.gpus < 1 or args.global_batch < 1 or args.gpus_per_node < 1 or args.top < 1:
        raise ValueError("--gpus, --global-batch, --gpus-per-node and --top must be >= 1")
    if args.mfu is not None and not 0 < args.mfu <= 1:  # NaN fails this too
        raise ValueError(f"--mfu is a fraction of peak in (0, 1], got {args.mfu}")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        raise ValueError(f"--gpus {args.gpus} is not a whole number of {args.gpus_per_node}-GPU nodes")
    spec = model_spec(args.model)
    simulate_flags = _simulate_flags(build_parser())
    schedules = [name.strip() for name in args.schedules.split(",") if name.strip()]
    unknown = [name for name in schedules if name not in SCHEDULE_NAMES]
    if unknown:
        raise ValueError(f"--schedules: unknown {', '.join(unknown)}; available: {', '.join(SCHEDULE_NAMES)}")
    space = SearchSpace(
        gpus=args.gpus, gpus_per_node=min(args.gpus_per_node, args.gpus), global_batch=args.global_batch,
        layers=spec.layers, heads=spec.heads, kv_heads=getattr(spec, "kv_heads", None) or spec.heads,
        schedules=schedules, microbatch_sizes=_ints(args.microbatch_sizes, "--microbatch-sizes"),
        virtual_stages=_ints(args.virtual_stages, "--virtual-stages"),
        recompute=_choices(args.recompute, simulate_flags.get("--recompute"), "none"),
        zero=[int(level) for level in _choices(args.zero, simulate_flags.get("--zero"), "0")],
        constraints=parse_constraints(args.constraint),
    )
    base = _base_argv(args, simulate_flags)
    layouts, rejected = enumerate_layouts(space)
    if not layouts:
        print(f"no layout to simulate; rejected: {dict(rejected)}", file=sys.stderr)
        return 1
    workers = args.workers or default_workers()
    print(f"plan: {args.model} on {args.gpus} GPUs ({args.topology}), global batch {args.global_batch}: "
          f"{len(layouts)} layouts to consider on {workers} process(es)", file=sys.stderr)
    _init_worker(base)
    progress = None if args.quiet else terminal_progress("simulating")
    result = search(layouts, evaluate_layout, lower_bound, args.top, workers, progress, rejected,
                    reject=memory_floor_cause)
    if progress is not None and result.pruned:
        sys.stderr.write("\n")
    print(format_plan(result, args))
    _write_outputs(args, result)
    return 0 if result.rows else 1


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"{flag} {text!r}: expected integers separated by commas") from error
    if not values or any(value < 1 for value in values):
        raise ValueError(f"{flag} {text!r}: expected integers >= 1")
    return values


def _choices(requested: str | None, action: argparse.Action | None, fixed: str) -> list[str]:
    """The values to try for a simulate flag: as requested (checked against the flag's
    choices), or every choice the flag has; ``fixed`` when simulate has no such flag."""
    known = list(action.choices) if action is not None and action.choices else [fixed]
    if requested is None:
        return known
    values = [part.strip() for part in requested.split(",") if part.strip()]
    bad = [value for value in values if value not in known]
    if bad or not values:
        raise ValueError(f"{requested!r}: choose from {', '.join(known)}")
    return values


def _simulate_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The ``simulate`` subcommand's flags by option string."""
    return {option: action for action in _simulate_parser(parser)._actions for option in action.option_strings}


def _simulate_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``simulate`` subcommand's own parser."""
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return subparsers.choices["simulate"]


def _base_argv(args: argparse.Namespace, flags: dict) -> list[str]:
    argv = ["simulate", "--model", args.model, "--topology", args.topology]
    nodes = max(1, args.gpus // args.gpus_per_node)
    argv += ["--nodes", str(nodes)]
    if args.seq_len is not None:
        argv += ["--seq-len", str(args.seq_len)]
    if args.mfu is not None:
        argv += ["--mfu", str(args.mfu)]
    if args.gpu is not None:
        if "--gpu" not in flags:
            raise ValueError("--gpu: this build's simulate has no GPU presets")
        argv += ["--gpu", args.gpu]
    return argv


def _layout_argv(layout: Layout) -> list[str]:
    argv = ["--schedule", layout.schedule, "--pp", str(layout.pp), "--tp", str(layout.tp), "--dp", str(layout.dp),
            "--microbatches", str(layout.microbatches), "--microbatch-size", str(layout.microbatch_size),
            "--virtual-stages", str(layout.virtual_stages)]
    if layout.recompute != "none":
        argv += ["--recompute", layout.recompute]
    if layout.zero:
        argv += ["--zero", str(layout.zero)]
    return argv


def _init_worker(base: list[str]) -> None:
    from pipesim.cli import build_parser
    from pipesim.cli.options import topology_from_args

    parser = build_parser()
    base_args = parser.parse_args(base)
    _BASE["parser"] = parser
    _BASE["argv"] = base
    _BASE["base_args"] = base_args
    _BASE["simulate_parser"] = _simulate_parser(parser)
    _BASE["topology"] = topology_from_args(base_args)
    _layout_costs.cache_clear()  # its costs belong to the job set up before


def _parse(layout: Layout) -> argparse.Namespace:
    """The layout's ``pipesim simulate`` flags, parsed onto a copy of the job's own: only
    the layout's flags are read (argparse leaves values already in the namespace alone),
    which gives the Namespace of the whole command line (``tests/test_plan.py`` holds it
    to that) for a fraction of the cost; a plan parses thousands of layouts."""
    return _BASE["simulate_parser"].parse_args(_layout_argv(layout), namespace=copy.copy(_BASE["base_args"]))


def _parse_whole(layout: Layout) -> argparse.Namespace:
    """The layout's whole ``pipesim simulate`` command line, parsed from scratch."""
    return _BASE["parser"].parse_args(_BASE["argv"] + _layout_argv(layout))


def _costs(args: argparse.Namespace, schedule) -> object:
    from pipesim.cli.options import model_costs_from_args

    return model_costs_from_args(args, schedule, _BASE["topology"])


@functools.cache
def _layout_costs(layout: Layout):
    """The layout's parsed flags, per-stage costs and a shell schedule with the layout's
    placement (no programs: costs depend only on the stages), without generating its
    order. Kept per layout: the memory floor and the lower bound both read them."""
    from schedules.generators import placement_of
    from schedules.schedule import Schedule

    args = _parse(layout)
    shell = Schedule(layout.pp, layout.microbatches, placement_of(layout.schedule, layout.pp, layout.virtual_stages),
                     [()] * layout.pp, name=layout.schedule)
    return args, _costs(args, shell), shell


def lower_bound(layout: Layout) -> float:
    """A step time no order of this layout's schedule can beat, so that layouts whose
    bound cannot reach the top need not be simulated (``tests/test_plan.py`` checks it
    against the simulation of every schedule, with tp, dp and ZeRO).

    For each pipeline rank r (whose lowest stage is stage r under both the looped and
    the V placement):
    - it cannot start before microbatch 0's forward has crossed stages 0..r-1: their
      forwards, tensor-parallel collectives and the unloaded transfer of each boundary
      (latency + bytes / bandwidth);
    - it then runs all its work: every microbatch's forward and backward of its stages,
      each with its tp collectives;
    - without a split backward its last action is a backward of stage r (any later
      backward of a higher stage would feed one of stage r after it), which then still
      has to cross stages r-1..0; with a split backward the weight gradients may come
      last, so nothing is added;
    - then the optimizer step and, under ZeRO-1, the parameter all-gathers of the rank
      that ends the step."""
    from schedules.generators import V_SHAPED, splits_backward

    try:
        args, costs, shell = _layout_costs(layout)
        tp_seconds, gather_seconds, hop = _bound_parts(layout, args, costs, shell)
    except ValueError:
        return float("inf")  # the evaluation reports why
    stages = costs.stages
    fused = layout.schedule in V_SHAPED and any(stage.overlap_fb for stage in stages)
    if fused:  # a given overlapped-pair cost may undercut F + B: only the step's tail is certain
        return costs.step_overhead

    def forward(stage: int) -> float:
        return stages[stage].fwd + tp_seconds.get((stage, "F"), 0.0)

    def backward(stage: int) -> float:
        return stages[stage].bwd + tp_seconds.get((stage, "B"), 0.0)

    split = splits_backward(layout.schedule)
    tail = [costs.step_overhead + sum(gather_seconds.get(stage, 0.0) for stage, rank in enumerate(shell.placement)
                                      if rank == own) for own in range(layout.pp)]
    best = 0.0
    for rank in range(layout.pp):
        own = [stage for stage, owner in enumerate(shell.placement) if owner == rank]
        busy = layout.microbatches * sum(forward(stage) + backward(stage) for stage in own)
        fill = sum(forward(stage) + hop(stage, stage + 1) for stage in range(rank))
        best = max(best, fill + busy + tail[rank])
        if not split and rank > 0:
            drain = sum(backward(stage) + hop(stage + 1, stage) for stage in range(rank))
            best = max(best, fill + busy + drain + tail[0])
    return best


def _bound_parts(layout: Layout, args: argparse.Namespace, costs, shell):
    """What the bound needs beyond the stage costs: tp seconds per (stage, kind), the
    ZeRO-1 parameter gathers per stage, and the unloaded transfer time between two
    stages' ranks, all as the simulation computes them."""
    from pipesim.cli.options import parallel_from_args
    from pipesim.cluster.mapping import map_ranks
    from pipesim.sim.parallel import comm_plan

    topology = _BASE["topology"]
    parallel = parallel_from_args(args)
    mapping = map_ranks(topology, layout.dp, layout.pp, layout.tp, parallel.rank_order)
    devices = mapping.pipeline()
    tp_seconds: dict = {}
    gather_seconds: dict = {}
    if layout.dp > 1 or layout.tp > 1:
        plan = comm_plan(shell, costs, topology, mapping, parallel.bucket_bytes, parallel.overlap_dp,
                         parallel.algorithm, parallel.zero)
        tp_seconds = plan.tp_seconds
        gather_seconds = {stage: sum(seconds) for stage, seconds in plan.gather_bucket_seconds.items()}
    placement = shell.placement

    def hop(source: int, target: int) -> float:
        """Unloaded seconds of the activation (or its gradient) between two neighbouring stages."""
        if placement[source] == placement[target]:
            return 0.0
        route = topology.route(devices[placement[source]], devices[placement[target]])
        if not route.links:
            return 0.0
        return route.latency + costs.stages[min(source, target)].act_bytes / route.bandwidth

    return tp_seconds, gather_seconds, hop


def memory_floor_cause(layout: Layout) -> str | None:
    """"out of memory" when even the least any schedule can hold — parameters, gradients
    and optimizer state, P2P buffers, and one microbatch's stash of the rank's largest
    stage — exceeds the device; None otherwise (the simulation decides)."""
    from pipesim.cli.options import parallel_from_args
    from pipesim.cluster.mapping import map_ranks
    from pipesim.sim.memory import stage_params, static_bytes_per_param

    try:
        args, costs, shell = _layout_costs(layout)
        parallel = parallel_from_args(args)
    except ValueError:
        return None
    if not costs.memory_known:
        return None
    topology = _BASE["topology"]
    devices = map_ranks(topology, layout.dp, layout.pp, layout.tp, parallel.rank_order).pipeline()
    per_param = static_bytes_per_param(parallel.bytes_per_param, layout.dp, parallel.zero)
    for rank in range(layout.pp):
        own = [costs.stages[stage] for stage, owner in enumerate(shell.placement) if owner == rank]
        floor = sum(stage_params(cost.params, cost.param_bytes, parallel.bytes_per_param) * per_param for cost in own)
        floor += max(cost.stash_bytes for cost in own)
        if floor > topology.device_memory(devices[rank]):
            return "out of memory (parameters, optimizer state and one stash alone)"
    return None


@without_collector  # paused for the whole layout: its Trace is freed before the collector runs again
def evaluate_layout(layout: Layout) -> dict:
    """Simulate one layout as ``pipesim simulate`` would; a row for the table, or
    ``{"error": cause}`` for a layout that cannot be built."""
    from pipesim.cli.options import parallel_from_args, schedule_from_args
    from pipesim.cli.simulate import throughput_figures
    from pipesim.sim.step import run_simulation
    from schedules.generators import COST_AWARE, ScheduleUnavailableError

    try:  # the memory floor built them already (in this process, for most layouts)
        args, layout_costs, shell = _layout_costs(layout)
    except ValueError:  # raised again below, where it becomes the layout's error row
        args, layout_costs, shell = _parse(layout), None, None
    topology = _BASE["topology"]
    try:
        if layout.schedule in COST_AWARE:  # its order follows from this layout's costs
            schedule = schedule_from_args(args, topology)
        else:
            schedule = _lowered(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
        # costs depend on the stages and their placement only (``_layout_costs``)
        same_stages = shell is not None and schedule.placement == shell.placement
        costs = layout_costs if same_stages else _costs(args, schedule)
        # Generated and lowered here, so valid by construction (tests/test_p2p.py proves it
        # for every generator); validating each of thousands of layouts again would double the search.
        result = run_simulation(schedule, costs, topology, parallel=parallel_from_args(args), p2p=args.p2p,
                                validate=False)
    except ScheduleUnavailableError:
        return {"error": f"{layout.schedule} does not exist for that microbatch count and pp"}
    except ValueError as error:
        return {"error": f"{type(error).__name__}: {str(error).split(';')[0]}"}
    metrics = result.metrics
    figures = throughput_figures(args, result)
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


@functools.lru_cache(maxsize=256)
def _lowered(name: str, pp: int, microbatches: int, virtual_stages: int):
    """The lowered schedule, shared by every layout with the same order: lowering does
    not depend on costs, and tp, dp, microbatch size, recompute and sharding leave it alone."""
    from schedules.generators import generate
    from schedules.lowering import lower

    return lower(generate(name, pp, microbatches, virtual_stages))


def format_plan(result, args: argparse.Namespace) -> str:
    """The ranked table and the search's counts."""
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
    lines.append(f"considered {result.considered} layouts: {result.screened} rejected before simulation, "
                 f"simulated {result.simulated}, "
                 f"{result.pruned} pruned by lower bound (cannot reach the top {args.top}); "
                 f"{result.seconds:.1f} s, {rate:.0f} simulated/s")
    if result.rejected:
        causes = "; ".join(f"{cause}: {count}" for cause, count in result.rejected.most_common())
        lines.append(f"rejected: {causes}")
    if not result.rows:
        lines.append("no layout fits: see the rejections above")
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
    if args.html and result.rows:
        from viz.plan import write_plan_html

        best = result.rows[0]
        layout = Layout(**{key: best[key] for key in Layout.__dataclass_fields__})
        trace = _best_trace(layout)
        write_plan_html(result.rows, pareto_front(result.rows), trace, args.html,
                        title=f"{args.model} on {args.gpus} GPUs ({args.topology}): best {best['layout']}",
                        plotly=getattr(args, "plotly", "inline"))
        print(f"wrote {args.html}")


def _best_trace(layout: Layout):
    from pipesim.cli.options import parallel_from_args, schedule_from_args
    from pipesim.sim.step import run_simulation

    args = _parse(layout)
    schedule = schedule_from_args(args)
    result = run_simulation(schedule, _costs(args, schedule), _BASE["topology"], parallel=parallel_from_args(args),
                            p2p=args.p2p)
    return result.trace
