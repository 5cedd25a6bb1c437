"""``pipesim sweep``: compare schedules across microbatch counts (and pp sizes)."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import replace
from pathlib import Path

from executor.options import MICROBATCH_GROUP_HELP
from pipesim.cli.options import (
    add_cost_args,
    add_max_actions_arg,
    add_memory_limit_arg,
    add_model_args,
    add_p2p_arg,
    add_parallel_args,
    add_topology_args,
)
from pipesim.cli.progress import progress_from_args
from pipesim.cli.variability import add_variability_args, variability_from_args
from pipesim.job import (
    Job,
    check_parallel_layout,
    combined_schedule,
    conflict,
    costs_of,
    default_split_note,
    model_spec_of,
    parallel_of,
    reject_with_schedule_file,
    split_list,
    topology_of,
)
from pipesim.plan.sweep import ROW_FIELDS, WHATIF_FIELDS, SweepPoint, format_table, run_sweep, sweep_points
from schedules.generators import GROUPED
from schedules.schedule import Schedule


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sweep", help="compare schedules across microbatch counts",
        description="Simulate every combination of schedules, pipeline sizes and microbatch counts.",
    )
    parser.add_argument("--schedule", default=None, help=f"comma-separated schedule names (default: {SCHEDULES})")
    parser.add_argument("--schedule-file", action="append", default=None, metavar="CSV",
                        help="a schedule CSV (torch.distributed.pipelining format) instead of --schedule; repeat "
                             "the flag (or separate with commas) to compare several, one row each (default: none)")
    parser.add_argument("--pp", default=None, help=f"pipeline ranks, comma-separated (default: {PP})")
    parser.add_argument("--microbatches", "-m", default=None,
                        help=f"microbatch counts, comma-separated (default: {MICROBATCHES})")
    parser.add_argument("--virtual-stages", "-v", type=int, default=None,
                        help=f"chunks per rank for interleaved schedules (default: {VIRTUAL_STAGES})")
    # its own destination: a list, where a Job's microbatch_group is one size
    parser.add_argument("--microbatch-group", dest="microbatch_groups", default=None, metavar="N[,N...]",
                        help="comma-separated group sizes to sweep for interleaved-1f1b; a point where N is outside "
                        "Megatron-Core's range for its pp and microbatches is a row with the reason. "
                        + MICROBATCH_GROUP_HELP + " (default: none, the schedule's own: pp where pp divides "
                        "microbatches)")
    add_max_actions_arg(parser)
    add_memory_limit_arg(parser)
    add_cost_args(parser)
    add_model_args(parser)
    add_topology_args(parser)
    add_parallel_args(parser)
    add_p2p_arg(parser, "the predicted backend's: buffered for links measured on gloo, rendezvous otherwise")
    add_variability_args(parser)
    parser.add_argument("--csv", help="write the rows as CSV")
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--html", help="write the sweep chart (self-contained HTML)")
    parser.add_argument("--quiet", action="store_true",
                        help="no per-point progress lines (they are shown only when stderr is a terminal)")
    parser.set_defaults(handler=handle)


SCHEDULES, PP, MICROBATCHES, VIRTUAL_STAGES = "gpipe,1f1b,interleaved-1f1b", "4", "4,8,16,32", 2


def file_points(args: argparse.Namespace) -> tuple[list[SweepPoint], dict[SweepPoint, Schedule]]:
    """One point per ``--schedule-file``, at the pp, microbatches and chunks its file fixes."""
    from schedules.csv_io import schedule_from_csv

    reject_with_schedule_file(args, {"--schedule": args.schedule, "--pp": args.pp,
                                     "--microbatches": args.microbatches, "--virtual-stages": args.virtual_stages,
                                     "--microbatch-group": args.microbatch_groups,
                                     "--memory-limit": args.memory_limit})
    points, schedules = [], {}
    for path in (path for text in args.schedule_file for path in split_list(text)):
        schedule = schedule_from_csv(path)
        point = SweepPoint(schedule.name, schedule.pp, schedule.microbatches, schedule.virtual_stages)
        if point in schedules:
            raise ValueError(f"--schedule-file {path}: a file named {schedule.name!r} with the same pp, microbatches "
                             "and stages is already in the sweep; rename one so their rows can be told apart")
        points.append(point)
        schedules[point] = schedule
    return points, schedules


def counts_of(text: str, flag: str) -> list[int]:
    """A comma-separated list of whole numbers >= 1; an error naming the flag and the
    item otherwise (``--pp 4,-2``), before any point is simulated."""
    values = split_list(text, int)
    for value in values:
        if value < 1:
            raise ValueError(f"{flag} {text}: {value} is not a whole number >= 1")
    return values


def microbatch_groups_of(args: argparse.Namespace) -> list[int | None]:
    """``--microbatch-group``'s sizes (whole numbers >= 1), refused when no swept schedule
    groups microbatches; ``[None]`` (each schedule's own) when not given."""
    if args.microbatch_groups is None:
        return [None]
    groups = counts_of(args.microbatch_groups, "--microbatch-group")
    names = split_list(args.schedule or SCHEDULES)
    if not GROUPED & set(names):
        raise conflict(f"--microbatch-group {args.microbatch_groups}", f"--schedule {','.join(names)}",
                       f"only {', '.join(sorted(GROUPED))} runs microbatches in groups per model chunk")
    return groups


def with_usable_limit(rows: list[dict], headroom) -> None:
    """Give each row with a capacity the limit its out-of-memory verdict was judged
    against (capacity less ``--memory-headroom``: the simulation's, else ``Headroom.usable``
    of the capacity alone), for the chart's line."""
    for row in rows:
        if row.get("capacity_bytes"):
            if row.get("usable_bytes") is None:
                row["usable_bytes"] = headroom.usable(row["capacity_bytes"])
            row["memory_headroom"] = headroom.text


def handle(args: argparse.Namespace) -> int:
    files: dict[SweepPoint, Schedule] = {}
    if args.schedule_file:
        points, files = file_points(args)
    else:
        points = sweep_points(
            split_list(args.schedule or SCHEDULES), counts_of(args.pp or PP, "--pp"),
            counts_of(args.microbatches or MICROBATCHES, "--microbatches"),
            VIRTUAL_STAGES if args.virtual_stages is None else args.virtual_stages,
            microbatch_groups_of(args),
        )
    variability = variability_from_args(args)
    job = Job.from_namespace(args)
    check_parallel_layout(job)
    topology = topology_of(job)
    combined = {}
    if job.ep_overlap and not files:  # every point as combined 1F1B, or the sweep refused in one line
        combined = {point: combined_schedule(job, point.schedule, point.pp, point.microbatches,
                                             point.virtual_stages, point.microbatch_group) for point in points}

    def costs_for(schedule):
        # each generated schedule's own name: a split backward takes the default W share, the others none
        return costs_of(job if files else replace(job, schedule=schedule.name), schedule, topology)

    for name in dict.fromkeys(point.schedule for point in points):
        note = None if files else default_split_note(replace(job, schedule=name))
        if note:
            print(note, file=sys.stderr)

    progress = progress_from_args("sweep", args).enabled  # per-point lines on a terminal only
    rows = run_sweep(points, costs_for, topology, progress=progress, parallel=parallel_of(job),
                     max_actions=args.max_actions, memory_limit=args.memory_limit, p2p=args.p2p,
                     schedules=files or combined, variability=variability)
    with_usable_limit(rows, parallel_of(job).memory_headroom)
    if args.model:
        # Tokens a microbatch carries across all dp replicas, so the chart draws tokens/s
        # (as plan does: microbatches x dp x microbatch size x sequence length per step).
        spec = model_spec_of(job)
        for row in rows:
            row["tokens_per_microbatch"] = spec.seq_len * spec.microbatch_size * args.dp
    written = []  # the files first: a reader of stdout that goes away (`| head`) must not cost them
    if args.csv:
        with open(args.csv, "w", newline="") as handle_out:
            fields = ROW_FIELDS + (WHATIF_FIELDS if variability is not None else ())
            writer = csv.DictWriter(handle_out, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        written.append(args.csv)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        written.append(args.json)
    if args.html:
        from viz.sweep import write_sweep_html

        write_sweep_html([row for row in rows if not row.get("note")], args.html,
                         title=f"pipesim sweep on {topology.name}", plotly=args.plotly)
        written.append(args.html)
    print(format_table(rows))
    if variability is not None:
        from pipesim.plan.ranking import ranking_lines

        print("\n".join(ranking_lines(rows)))
    for path in written:
        print(f"wrote {path}")
    return 0
