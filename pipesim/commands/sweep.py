"""``pipesim sweep``: compare schedules across microbatch counts (and pp sizes)."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from pipesim.commands.options import (
    add_cost_args,
    add_memory_limit_arg,
    add_model_args,
    add_p2p_arg,
    add_parallel_args,
    add_topology_args,
    costs_from_args,
    model_costs_from_args,
    parallel_from_args,
    split_list,
    topology_from_args,
)
from pipesim.sweep import ROW_FIELDS, format_table, run_sweep, sweep_points


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sweep", help="compare schedules across microbatch counts",
        description="Simulate every combination of schedules, pipeline sizes and microbatch counts.",
    )
    parser.add_argument("--schedule", default="gpipe,1f1b,interleaved-1f1b", help="comma-separated schedule names")
    parser.add_argument("--pp", default="4", help="pipeline ranks, comma-separated (default: 4)")
    parser.add_argument("--microbatches", "-m", default="4,8,16,32", help="microbatch counts, comma-separated")
    parser.add_argument("--virtual-stages", "-v", type=int, default=2, help="chunks per rank for interleaved schedules")
    add_memory_limit_arg(parser)
    add_cost_args(parser)
    add_model_args(parser)
    add_topology_args(parser)
    add_parallel_args(parser)
    add_p2p_arg(parser, "the predicted backend's: buffered for links measured on gloo, rendezvous otherwise")
    parser.add_argument("--csv", help="write the rows as CSV")
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--html", help="write the sweep chart (self-contained HTML)")
    parser.add_argument("--quiet", action="store_true", help="no per-point progress lines")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    points = sweep_points(
        split_list(args.schedule), split_list(args.pp, int), split_list(args.microbatches, int), args.virtual_stages
    )
    topology = topology_from_args(args)

    def costs_for(schedule):
        if args.model:
            return model_costs_from_args(args, schedule, topology)
        return costs_from_args(args, schedule.num_stages, schedule.virtual_stages)

    rows = run_sweep(points, costs_for, topology, progress=not args.quiet, parallel=parallel_from_args(args),
                     memory_limit=args.memory_limit, p2p=args.p2p)
    print(format_table(rows))
    if args.csv:
        with open(args.csv, "w", newline="") as handle_out:
            writer = csv.DictWriter(handle_out, fieldnames=ROW_FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.json}")
    if args.html:
        from viz.sweep import write_sweep_html

        write_sweep_html([row for row in rows if not row.get("note")], args.html,
                         title=f"pipesim sweep on {topology.name}", plotly=args.plotly)
        print(f"wrote {args.html}")
    return 0
