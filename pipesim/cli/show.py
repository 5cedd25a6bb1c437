"""``pipesim show``: print a schedule's programs and its timeline in the terminal."""

from __future__ import annotations

import argparse

from pipesim.cli.options import add_p2p_arg, add_schedule_args
from pipesim.cli.text_timeline import text_timeline
from pipesim.cluster.topology import ideal_topology
from pipesim.job import Job, schedule_of
from pipesim.model.costs import uniform_costs
from pipesim.sim.engine import simulate
from schedules.lowering import lower
from schedules.p2p import RENDEZVOUS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "show", help="print a schedule's per-rank programs and timeline",
        description="Print each rank's program and a text timeline with unit costs (F=1, B=2 per rank).",
    )
    add_schedule_args(parser)
    parser.add_argument("--lowered", action="store_true",
                        help="list the programs with their SEND/RECV actions, P2P groups joined by '+'")
    add_p2p_arg(parser, "rendezvous (NCCL's rule, which also holds on gloo)")
    parser.add_argument("--width", type=int, default=160, help="timeline width in characters (default: 160)")
    parser.add_argument("--html", help="also write the unit-cost Gantt chart")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from schedules.validate import validate

    schedule = schedule_of(Job.from_namespace(args))
    lowered = lower(schedule)
    p2p = args.p2p or RENDEZVOUS
    validate(lowered, p2p)
    print((lowered if args.lowered else schedule).describe())
    if "order" in schedule.meta:  # a handcrafted order adapted to costs says which it runs
        print(f"order: {schedule.meta['order']}")
    costs = uniform_costs(schedule.num_stages, 1.0, 2.0, virtual_stages=schedule.virtual_stages)
    trace = simulate(lowered, costs, ideal_topology(), p2p=p2p)
    trace.meta["time_unit"] = "units"  # F = 1, B = 2: charts say "units", not seconds
    print()
    print(text_timeline(trace, width=args.width))
    if args.html:
        from viz.gantt import write_gantt_html

        write_gantt_html([trace], args.html, titles=[f"{schedule.name} (unit costs)"], plotly=args.plotly)
        print(f"wrote {args.html}")
    return 0
