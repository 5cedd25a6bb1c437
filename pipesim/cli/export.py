"""``pipesim export``: write a generated schedule as CSV for torch.distributed.pipelining."""

from __future__ import annotations

import argparse

from pipesim.cli.options import (
    add_cost_args,
    add_p2p_arg,
    add_schedule_args,
    add_topology_args,
)
from pipesim.job import Job, schedule_of, topology_of
from schedules.lowering import lower
from schedules.p2p import RENDEZVOUS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="write a schedule as CSV (torch.distributed.pipelining format)",
        description="Write a schedule as CSV: one row per rank, one action per cell.",
    )
    add_schedule_args(parser, allow_file=False)
    add_cost_args(parser)  # zb-auto builds its order from the costs and the cluster's hop time
    add_topology_args(parser)
    parser.add_argument("--out", required=True, help="CSV file to write")
    parser.add_argument("--lowered", action="store_true",
                        help="include the SEND/RECV actions, each P2P group in one cell joined by '+'")
    parser.add_argument("--flat", action="store_true",
                        help="one action per cell even for P2P groups, as torch.distributed.pipelining's _load_csv "
                        "reads lowered files (it has no groups: read back, each transfer is posted alone)")
    add_p2p_arg(parser, "rendezvous (NCCL's rule, which also holds on gloo)")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from schedules.csv_io import schedule_to_csv
    from schedules.validate import validate

    job = Job.from_namespace(args)
    schedule = schedule_of(job, topology_of(job))
    if args.lowered:
        schedule = lower(schedule)
    validate(schedule, args.p2p or RENDEZVOUS)
    schedule_to_csv(schedule, args.out, groups=not args.flat)
    print(f"wrote {args.out}: {schedule.name}, pp={schedule.pp}, stages={schedule.num_stages}, "
          f"microbatches={schedule.microbatches}, {schedule.num_actions} actions")
    return 0
