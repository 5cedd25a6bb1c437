"""``pipesim simulate``: predict one step of one schedule on one cluster."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipesim.commands.options import (
    add_cost_args,
    add_model_args,
    add_p2p_arg,
    add_parallel_args,
    add_schedule_args,
    add_topology_args,
    costs_from_args,
    model_costs_from_args,
    parallel_from_args,
    schedule_from_args,
    topology_from_args,
)
from pipesim.simulation import run_simulation


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="predict one step: step time, bubbles, communication, memory",
        description="Simulate one training step of a pipeline schedule on a modelled cluster.",
    )
    add_schedule_args(parser)
    add_cost_args(parser)
    add_model_args(parser)
    add_topology_args(parser)
    add_parallel_args(parser)
    add_output_args(parser)
    add_p2p_arg(parser, "the predicted backend's: buffered for links measured on gloo, rendezvous otherwise")
    parser.add_argument("--fail-on-oom", action="store_true",
                        help="exit non-zero when a rank's peak memory exceeds its device's")
    parser.set_defaults(handler=handle)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("outputs")
    group.add_argument("--json", help="write the result (makespan, bubble, per-rank metrics, comm, memory) as JSON")
    group.add_argument("--trace", help="write the timeline as a pipesim Trace JSON")
    group.add_argument("--chrome-trace", help="write the timeline as Chrome/Perfetto trace JSON")
    group.add_argument("--html", help="write a Gantt chart (self-contained HTML)")


def write_outputs(args: argparse.Namespace, result_dict: dict, traces: list, titles: list[str],
                  metrics: list | None = None) -> None:
    """Write whichever of --json/--trace/--chrome-trace/--html were asked for."""
    written = []
    if args.json:
        Path(args.json).write_text(json.dumps(result_dict, indent=2))
        written.append(args.json)
    if args.trace:
        traces[0].save(args.trace)
        written.append(args.trace)
    if args.chrome_trace:
        from viz.chrome_trace import write_chrome_trace

        write_chrome_trace(traces[0], args.chrome_trace)
        written.append(args.chrome_trace)
    if args.html:
        from viz.gantt import write_gantt_html

        write_gantt_html(traces, args.html, titles=titles, metrics=metrics, plotly=args.plotly)
        written.append(args.html)
    for path in written:
        print(f"wrote {path}")


def handle(args: argparse.Namespace) -> int:
    from pipesim.memory import OutOfMemoryError, check_memory

    topology = topology_from_args(args)
    schedule = schedule_from_args(args, topology)
    if args.model:
        costs = model_costs_from_args(args, schedule, topology)
    else:
        costs = costs_from_args(args, schedule.num_stages, schedule.virtual_stages)
    result = run_simulation(schedule, costs, topology, parallel=parallel_from_args(args), p2p=args.p2p)
    if args.model:
        result.trace.meta["model"] = args.model  # the chart's title names it
    print(result.summary())
    write_outputs(args, result.to_dict(), [result.trace], [f"predicted: {schedule.name}"], [result.metrics])
    if args.fail_on_oom:
        try:
            check_memory(result.memory)
        except OutOfMemoryError as error:
            print(f"pipesim simulate: error: {error}", file=sys.stderr)
            return 3
    return 0
