"""``pipesim plan``: the best layout for a model on a cluster, searched by simulation.

The flags become a ``pipesim.plan.request.PlanRequest`` (the config object
``pipesim.api.plan`` takes), checked before the search starts; the search and each
layout's evaluation live in ``pipesim.plan``. This module parses, prints and writes.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

from pipesim.cli.options import (
    add_clip_grad_arg,
    add_memory_headroom_arg,
    add_memory_limit_arg,
    add_precision_args,
    add_qkv_arg,
)
from pipesim.cli.variability import add_variability_args, objective_variability, rank_by_p99
from pipesim.hardware.gpus import GPUS
from pipesim.plan.layouts import RECOMPUTE_MODES, Layout
from pipesim.plan.search import pareto_front, terminal_progress
from pipesim.sim.zero import ZERO_STAGES
from schedules.generators import PLANNED_SCHEDULES

SWITCHES = {"off": False, "on": True}  # a searched switch: off, on or both
PROGRESS_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="search pp x tp x dp, schedule, microbatch size, ... for the fastest layout that fits",
        description="Enumerate the layouts of a model on a cluster at a fixed global batch, drop those that cannot "
        "work (counting why), simulate the rest (best lower bound first) and rank them by tokens per second.",
    )
    parser.add_argument("--model", required=True, help="model preset, shipped config by name (qwen3-30b-a3b, "
                        "gpt-oss-120b, ...) or config.json (all listed in `pipesim simulate --help`)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; tp stays within one (default: 8)")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--topology", default="ib", help="cluster preset or topology file (default: ib)")
    parser.add_argument("--gpu", choices=tuple(GPUS), default=None,
                        help="GPU model of the preset's devices (default: h100)")
    parser.add_argument("--schedules", default=",".join(PLANNED_SCHEDULES),
                        help="schedules to try, comma-separated (default: all but interleaved-auto, which is "
                        "interleaved-1f1b's order wherever that fits; name it to search orders within the memory)")
    parser.add_argument("--microbatch-sizes", default="1,2,4", help="microbatch sizes to try (default: 1,2,4)")
    parser.add_argument("--virtual-stages", default="2,4",
                        help="chunks per rank to try for multi-chunk schedules (default: 2,4)")
    parser.add_argument("--microbatch-group", default=None, metavar="N[,N...]",
                        help="interleaved-1f1b's microbatch groups to try, comma-separated (Megatron-Core's "
                        "--microbatch-group-size-per-virtual-pipeline-stage, Meta's flexible N; each layout keeps "
                        "those in Megatron's range: pp <= N <= microbatches, microbatches mod N zero or >= pp); "
                        "default: the schedule's own group (pp where pp divides the microbatches, the least "
                        "memory), else Megatron's smallest")
    parser.add_argument("--recompute", default=None,
                        help=f"recompute modes to try, comma-separated, of {','.join(RECOMPUTE_MODES)} (per-op: "
                        "torchtitan's SelectiveAC, per-op selective checkpointing that keeps each block's input, "
                        "attention output and every second matrix product's output and re-runs the rest, for dense "
                        "models without latent attention, never with a schedule that splits the backward into I and "
                        "W, which selective checkpointing cannot run; norm-mla-up: DeepSeek-V3's recompute of every "
                        "norm's output and latent attention's up-projections, for models with latent attention (MLA) "
                        "only) (default: all of them; per-op only where it is modelled, norm-mla-up only with MLA)")
    parser.add_argument("--zero", default=",".join(map(str, ZERO_STAGES)),
                        help="ZeRO stages to try with dp > 1: 1 optimizer state, 2 and gradients, 3 and parameters "
                        f"(FSDP) sharded over dp (default: {','.join(map(str, ZERO_STAGES))})")
    add_memory_headroom_arg(parser)
    add_memory_limit_arg(parser)
    add_clip_grad_arg(parser)
    parser.add_argument("--cp", default=None,
                        help="context-parallel sizes to try, comma-separated (default: every power of two leaving each "
                        "rank at least 8192 tokens of a sequence; none at 8k or shorter)")
    parser.add_argument("--ep", default=None,
                        help="expert-parallel sizes to try for a mixture-of-experts model, comma-separated (default: "
                        "every power of two dividing its routed experts; ranks cut from the dp replicas)")
    parser.add_argument("--sequence-parallel", default="off,on",
                        help="sequence parallelism to try with tp > 1: off, on or both (default: off,on)")
    parser.add_argument("--etp", default=None,
                        help="the routed experts' tensor parallelism to try for a mixture of experts, comma-separated: "
                        "tp (split over the tp ranks, Megatron-Core's default) and 1 (Megatron-Core's parallel "
                        "folding, --expert-tensor-parallel-size 1: every expert whole on each rank, the ep groups cut "
                        "from every tp x cp x dp rank of a stage; tried where tp > 1, with sequence parallelism) "
                        "(default: tp,1 for a mixture of experts)")
    parser.add_argument("--ep-overlap", default=None,
                        help="combined 1F1B to try for a mixture of experts (`pipesim simulate --ep-overlap`, "
                        "Megatron-Core's --overlap-moe-expert-parallel-comm: each steady-state forward beside a "
                        "backward, hiding the expert-parallel all-to-alls, at one more warm-up microbatch's memory): "
                        "off, on or both; tried where Megatron-Core runs it (ep > 1, interleaved-1f1b, or 1f1b "
                        "without pipelining, no full recompute) (default: off,on for a mixture of experts, off for "
                        "a dense model)")
    parser.add_argument("--mfu", type=float, default=None,
                        help="one compute efficiency for every kernel instead of the GPU's compute model")
    parser.add_argument("--compute-model", default=None, metavar="FILE",
                        help="a compute model fitted by pipesim profile --compute-model (default: the GPU's own)")
    add_precision_args(parser)
    add_qkv_arg(parser)
    parser.add_argument("--recompute-moe-act", nargs="?", const="on", default="off", metavar="off|on|off,on",
                        help="mixture of experts: Megatron-Core's moe_act recompute module (`pipesim simulate "
                        "--recompute-moe-act`: the routed experts keep their activation's inputs, not its output, "
                        "which every backward re-runs): off, on (the flag alone) or both, searched; never beside "
                        "full or per-op recompute (default: off)")
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
                        "`pipesim export --torchtitan` does; the layouts are priced with torchtitan's loss "
                        "(--cross-entropy torch) unless --cross-entropy says otherwise (default: none)")
    parser.add_argument("--fsdp", action="store_true",
                        help="with --torchtitan: the data-parallel replicas shard parameters with FSDP (torchtitan's "
                        "default); the layouts are then priced as torchtitan's FSDP runs them: zero3 without "
                        "pipelining, and under it every stage's parameters and float32 gradients whole for the step "
                        "(zero1, reduced after the backward: docs/interop.md)")
    parser.add_argument("--quiet", action="store_true", help="no progress (shown on stderr while the search runs)")
    parser.add_argument("--objective", choices=("step", "p99"), default="step",
                        help="rank by the deterministic step, or by the p99 of sampled steps under the what-if flags "
                        "below: the top --top layouts by step, sampled and put in p99 order (default: step)")
    add_variability_args(parser)
    parser.set_defaults(handler=handle, output_dirs=("torchtitan",))


def handle(args: argparse.Namespace) -> int:
    """Check the flags, search, print the table and the buckets, write the files."""
    from pipesim.plan.request import Planner

    if args.fsdp and not args.torchtitan:
        raise ValueError("--fsdp says how torchtitan shards the data-parallel replicas; add --torchtitan DIR")
    variability = objective_variability(args)
    planner = Planner(plan_request(args))
    if args.torchtitan:  # before the search: a best row of per-op over separate Q, K and V could not be written
        from pipesim.cli.torchtitan import check_per_op_qkv, qkv_of
        from pipesim.job import model_spec_of

        qkv = qkv_of(model_spec_of(planner.base))
        for mode in planner.space.recompute:
            check_per_op_qkv(mode, qkv)
    print(f"plan: {args.model} on {args.gpus} GPUs ({args.topology}), global batch {args.global_batch}: "
          f"{planner.considered} layouts to consider on {planner.workers} process(es)"
          + moe_act_note(planner.space.recompute_moe_act, args.recompute),
          file=sys.stderr)
    if not planner.layouts:
        print(format_causes("ruled out", planner.ruled_out) or "no layout to consider", file=sys.stderr)
        if planner.values_left_out:
            print(format_values_left_out(planner.values_left_out), file=sys.stderr)
        return 1
    from pipesim.job import model_spec_of
    from pipesim.model.layout import unmodelled_notes

    for note in unmodelled_notes(model_spec_of(planner.base)):
        print(f"note: {note}", file=sys.stderr)
    result = planner.search(_progress(args), describe=bool(args.html))
    if variability is not None:
        from pipesim.job import simulate_job
        from pipesim.plan.ranking import ranking_lines

        evaluator = planner.evaluator
        rank_by_p99(result.rows, args.top, variability,
                    lambda row: simulate_job(evaluator.layout_job(Layout(*(row[name] for name in Layout._fields)))))
    # the files first: a reader of stdout that goes away (`| head`) must not cost them
    written = _write_outputs(args, result, planner.evaluator)
    print(format_plan(result, args))
    if variability is not None:
        print(f"the table is in order of the p99 of {variability.samples} sampled steps (seed {variability.seed}):")
        print("\n".join(ranking_lines(result.rows[:args.top], "step_time", lambda row: row["layout"])))
    for path in written:
        print(f"wrote {path}")
    return 0 if result.rows else 1


def moe_act_note(searched: tuple[bool, ...], recompute: str | None) -> str:
    """What the plan's first line says of the experts' activation recompute it searches."""
    if True not in searched:
        return ""
    if False in searched:
        return "; the routed experts' activation recomputed or not (--recompute-moe-act off,on)"
    return ("; the routed experts' activation recomputed (--recompute-moe-act"
            + (", beside which full and per-op recompute are not searched)" if recompute is None else ")"))


def plan_request(args: argparse.Namespace):
    """The ``PlanRequest`` of the parsed flags: lists split, numbers and names read (one
    line naming a flag that does not parse); the request checks the rest."""
    from pipesim.plan.request import PlanRequest

    return PlanRequest(
        model=args.model, gpus=args.gpus, global_batch=args.global_batch, gpus_per_node=args.gpus_per_node,
        seq_len=args.seq_len, topology=args.topology, gpu=args.gpu,
        schedules=_listed(args.schedules),
        microbatch_sizes=_ints(args.microbatch_sizes, "--microbatch-sizes"),
        virtual_stages=_ints(args.virtual_stages, "--virtual-stages"),
        recompute=_listed(args.recompute) if args.recompute is not None else None,
        zero=[int(level) for level in _names(args.zero, "--zero", tuple(map(str, ZERO_STAGES)))],
        sequence_parallel=[SWITCHES[mode] for mode in _names(args.sequence_parallel, "--sequence-parallel",
                                                                       tuple(SWITCHES))],
        cp=_ints(args.cp, "--cp") if args.cp else None, ep=_ints(args.ep, "--ep") if args.ep else None,
        etp=[0 if size == "tp" else 1 for size in _names(args.etp, "--etp", ("tp", "1"))]
        if args.etp is not None else None,
        ep_overlap=[SWITCHES[mode] for mode in _names(args.ep_overlap, "--ep-overlap",
                                                               tuple(SWITCHES))]
        if args.ep_overlap is not None else None,
        microbatch_group=_ints(args.microbatch_group, "--microbatch-group") if args.microbatch_group else None,
        constraints=tuple(args.constraint), mfu=args.mfu, compute_model=args.compute_model,
        fp8=args.fp8, ep_dispatch=args.ep_dispatch, ep_dispatcher=args.ep_dispatcher, comm_sms=args.comm_sms,
        qkv=args.qkv, cross_entropy=args.cross_entropy,
        max_actions=args.max_actions, memory_headroom=args.memory_headroom, memory_limit=args.memory_limit,
        clip_grad=args.clip_grad,
        recompute_moe_act=[SWITCHES[mode] for mode in _names(args.recompute_moe_act, "--recompute-moe-act",
                                                              tuple(SWITCHES))],
        top=args.top, workers=args.workers, torchtitan=bool(args.torchtitan), fsdp=args.fsdp)


def _listed(text: str) -> list[str]:
    """The comma-separated values of a flag (the request checks them)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _ints(text: str, flag: str) -> list[int]:
    """The comma-separated integers of ``flag`` (the request checks their range)."""
    try:
        return [int(part) for part in _listed(text)]
    except ValueError as error:
        raise ValueError(f"{flag} {text!r}: expected integers separated by commas") from error


def _names(text: str, flag: str, known: tuple[str, ...]) -> list[str]:
    """The comma-separated values of ``flag``, each one of ``known`` (checked here: they
    are read as numbers or switches before the request sees them)."""
    values = _listed(text)
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


def format_causes(bucket: str, causes) -> str:
    return f"{bucket}: " + "; ".join(f"{cause}: {count}" for cause, count in causes.most_common()) if causes else ""


def format_values_left_out(left_out: dict[str, dict]) -> str:
    """The searched values no layout kept, each with its rules' counts."""
    return "searched values no layout kept: " + "; ".join(
        f"{value} ({', '.join(f'{cause}: {count}' for cause, count in causes.items())})"
        for value, causes in left_out.items())


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
    if result.values_left_out:
        lines.append(format_values_left_out(result.values_left_out))
    if not result.rows:
        lines.append("no layout fits: see the causes above")
    return "\n".join(lines)


def _write_outputs(args: argparse.Namespace, result, evaluator) -> list[str]:
    """Write the requested files; the paths written, for the caller to announce."""
    written = []
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(args.top), indent=2))
        written.append(args.json)
    if args.csv:
        rows = result.rows[:args.top]
        with open(args.csv, "w", newline="") as handle:
            if rows:
                writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
        written.append(args.csv)
    if args.torchtitan and result.rows:
        _write_torchtitan(args, result.rows[0], evaluator)
    if args.html and result.rows:
        from viz.plan import write_plan_html

        best = result.rows[0]
        layout = Layout(**{key: best[key] for key in Layout._fields})
        write_plan_html(result.rows, pareto_front(result.rows), evaluator.best_trace(layout), args.html,
                        title=f"{args.model} on {args.gpus} GPUs ({args.topology}): best {best['layout']}",
                        plotly=getattr(args, "plotly", "inline"), others=_charted_others(result))
        written.append(args.html)
    return written


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


def _write_torchtitan(args: argparse.Namespace, best: dict, evaluator) -> None:
    """The best layout's schedule CSVs and torchtitan config (``pipesim.cli.torchtitan``),
    the order being the one simulated; with ``--fsdp`` the line that says how torchtitan
    runs its replicas, as the plan priced them (``pipesim.plan.torchtitan_fsdp``)."""
    from pipesim.cli.torchtitan import TorchtitanLayout, qkv_of, torchtitan_shards_line, write_torchtitan
    from pipesim.job import clip_grad_of, model_spec_of

    layout = Layout(**{key: best[key] for key in Layout._fields})
    if layout.zero and not args.fsdp:
        raise ValueError(f"--torchtitan {args.torchtitan}: the best layout shards the optimizer (zero{layout.zero}), "
                         "which torchtitan does as FSDP: add --fsdp, or --constraint zero=0")
    job = evaluator.layout_job(layout)
    if args.fsdp and layout.dp * layout.cp > 1:  # the row is already priced as torchtitan's FSDP runs it
        figures = best["step_time"], best["peak_memory_bytes"]
        print(torchtitan_shards_line(job, *figures, best["usable_bytes"] or float("inf"), figures))
    spec = model_spec_of(job)
    written = write_torchtitan(args.torchtitan, evaluator.schedule_of(layout), TorchtitanLayout(
        dp=layout.dp, tp=layout.tp, fsdp=args.fsdp, microbatch_size=layout.microbatch_size, layers=spec.layers,
        seq_len=spec.seq_len, ep=layout.ep, etp=layout.etp, cp=layout.cp, sequence_parallel=layout.sequence_parallel,
        recompute=layout.recompute, qkv=qkv_of(spec), max_norm=clip_grad_of(evaluator.base)))
    print(f"wrote {', '.join(str(path) for path in written)}: {best['layout']}")
