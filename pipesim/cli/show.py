"""``pipesim show``: print a schedule's programs and its timeline in the terminal."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from pipesim.cli.options import add_p2p_arg, add_schedule_args
from pipesim.cli.text_timeline import text_timeline
from pipesim.job import Job, default_split_note, simulate_job
from pipesim.sim.stash_budget import MemoryBudget
from schedules.p2p import RENDEZVOUS

UNIT_FWD, UNIT_BWD = 1.0, 2.0  # show's costs: what `simulate --fwd 1 --bwd 2` is given


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "show", help="print a schedule's per-rank programs and timeline",
        description="Print each rank's program and a text timeline with unit costs (F=1, B=2 per rank; "
                    "split-backward schedules I=W=1): the step `simulate --fwd 1 --bwd 2` predicts on free links.",
    )
    add_schedule_args(parser)
    parser.add_argument("--lowered", action="store_true",
                        help="list the programs with their SEND/RECV actions, P2P groups joined by '+'")
    add_p2p_arg(parser, "rendezvous (NCCL's rule, which also holds on gloo)")
    parser.add_argument("--wgrad", type=float, default=None,
                        help="W's part of B = 2 units, for schedules that split the backward (default: 1, so "
                             "I = W = F = 1)")
    parser.add_argument("--width", type=int, default=160, help="timeline width in characters (default: 160)")
    parser.add_argument("--html", help="also write the unit-cost Gantt chart")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Simulate the step exactly as ``simulate --fwd 1 --bwd 2`` does (one lowering, one
    engine), then print the programs and the timeline in units."""
    if isinstance(args.memory_limit, MemoryBudget):
        raise ValueError(f"--memory-limit {args.memory_limit.text}: show runs unit costs, which hold no memory to "
                         f"fit a budget; give the limit in microbatches here, or run the budget through "
                         f"`pipesim simulate` or `pipesim export` with --model")
    job = replace(Job.from_namespace(args), fwd=UNIT_FWD, bwd=UNIT_BWD, p2p=args.p2p or RENDEZVOUS)
    result = simulate_job(job)
    note = default_split_note(job)  # after the step: a job that fails says one line, its error
    if note:
        print(note, file=sys.stderr)
    lowered = result.schedule
    print(lowered.describe() if args.lowered else lowered.compute_only().describe())
    if "order" in lowered.meta:  # a handcrafted order adapted to costs says which it runs
        print(f"order: {lowered.meta['order']}")
    trace = result.trace
    trace.meta["time_unit"] = "units"  # F = 1, B = 2: charts say "units", not seconds
    print()
    print(text_timeline(trace, width=args.width))
    if args.html:
        from viz.gantt import write_gantt_html

        write_gantt_html([trace], args.html, titles=[f"{lowered.name} (unit costs)"], plotly=args.plotly)
        print(f"wrote {args.html}")
    return 0
