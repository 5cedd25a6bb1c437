"""``pipesim demo``: the three schedules on built-in defaults, with Gantt charts.

What a new user runs first: it needs no flags, finishes in seconds and writes charts
that open in a browser with no network."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipesim.cli.files import PLOTLY_MODES
from pipesim.cli.options import add_max_actions_arg
from pipesim.cluster.files import load_topology
from pipesim.model.costs import uniform_costs
from pipesim.plan.sweep import format_table, run_sweep, sweep_points
from pipesim.sim.step import run_simulation
from schedules.generators import generate

DEMO_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="simulate gpipe, 1f1b and interleaved-1f1b on defaults and write Gantt charts",
        description="Simulate the three built-in schedules (pp=4, 8 microbatches, NVLink node) and write charts.",
    )
    parser.add_argument("--out", default="pipesim-demo",
                        help="folder for the charts, created if missing (default: pipesim-demo)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default: 4)")
    parser.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step (default: 8)")
    parser.add_argument("--topology", default="nvlink", help="preset or topology file (default: nvlink)")
    parser.add_argument("--plotly", choices=PLOTLY_MODES, default="inline",
                        help="embed plotly.js in each chart (inline, opens offline; default) or load it from the CDN")
    add_max_actions_arg(parser)
    parser.set_defaults(handler=handle, output_dirs=("out",))


def handle(args: argparse.Namespace) -> int:
    from viz.gantt import write_gantt_html
    from viz.sweep import write_sweep_html

    if args.pp < 1 or args.microbatches < 1:
        raise ValueError(f"--pp and --microbatches must be at least 1, got {args.pp} and {args.microbatches}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    topology = load_topology(args.topology)
    fwd, bwd, act_bytes = 10e-3, 20e-3, 256e6  # a mid-size transformer stage; 256 MB activations
    print(f"demo costs, per pipeline rank and microbatch: forward {fwd * 1e3:g} ms, backward {bwd * 1e3:g} ms, "
          f"{act_bytes / 1e6:g} MB sent between stages (each of v chunks: 1/v of the compute); "
          f"{args.pp} ranks, {args.microbatches} microbatches on {topology.name} ({topology.description})\n")
    traces, titles, metrics = [], [], []
    for name, chunks in DEMO_SCHEDULES:
        schedule = generate(name, args.pp, args.microbatches, chunks, args.max_actions)
        costs = uniform_costs(schedule, fwd, bwd, act_bytes=act_bytes)  # per rank, 1/v per chunk
        result = run_simulation(schedule, costs, topology)
        print(result.summary())
        print()
        path = out / f"gantt-{name}.html"
        write_gantt_html([result.trace], path, titles=[f"{name} on {topology.name}"], metrics=[result.metrics],
                         plotly=args.plotly)
        print(f"wrote {path}\n")
        traces.append(result.trace)
        titles.append(name)
        metrics.append(result.metrics)
    path = out / "gantt-all.html"
    write_gantt_html(traces, path, titles=titles, title="gpipe vs 1f1b vs interleaved-1f1b", metrics=metrics,
                     plotly=args.plotly)
    print(f"wrote {path}")
    points = sweep_points([name for name, _ in DEMO_SCHEDULES], [args.pp], [4, 8, 16, 32, 64], 2)
    rows = run_sweep(
        points,
        lambda schedule: uniform_costs(schedule, fwd, bwd, act_bytes=act_bytes),
        topology,
        progress=False,
        max_actions=args.max_actions,
    )
    print(format_table(rows))
    path = out / "sweep.html"
    write_sweep_html([row for row in rows if not row.get("note")], path, title=f"sweep on {topology.name}",
                     plotly=args.plotly)
    print(f"wrote {path}")
    return 0
