"""``pipesim draw``: redraw a saved Trace as a Gantt chart or a Chrome/Perfetto trace.

Any Trace will do — ``simulate --trace``, ``run --trace``, ``compare --predicted-trace``
or the file ``torchrun ... -m executor --trace`` writes — since predicted and measured
steps share one format. Several traces are drawn on one time axis, in the order given.
"""

from __future__ import annotations

import argparse

from pipesim.cli.files import PLOTLY_MODES
from schedules.units import count, duration, percent


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "draw", help="redraw saved Trace files as a Gantt chart (--html) or Chrome trace (--chrome-trace)",
        description="Read one or more pipesim Trace JSON files (from simulate --trace, run --trace or "
                    "python -m executor --trace) and draw them: --html stacks them on one time axis, "
                    "--chrome-trace writes the first for ui.perfetto.dev.",
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE.json", help="pipesim Trace files")
    parser.add_argument("--html", metavar="PATH", help="write a Gantt chart of the traces")
    parser.add_argument("--chrome-trace", metavar="PATH", help="write the first trace as Chrome/Perfetto JSON")
    parser.add_argument("--title", help="the chart's title (default: none; each trace's row says what it is)")
    parser.add_argument("--plotly", choices=PLOTLY_MODES, default="inline",
                        help="embed plotly.js (inline, opens offline; default) or load it from the CDN")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from schedules.metrics import step_metrics  # noqa: PLC0415
    from schedules.trace import Trace  # noqa: PLC0415

    if not (args.html or args.chrome_trace):
        raise ValueError("say what to write: --html PATH (Gantt chart) and/or --chrome-trace PATH")
    traces = [Trace.load(path) for path in args.traces]
    for path, trace in zip(args.traces, traces, strict=True):
        if not trace.events:
            raise ValueError(f"{path}: the trace has no events to draw")
        metrics = step_metrics(trace)
        print(f"{path}: {trace.num_ranks} ranks, {count(len(trace.events))} events, "
              f"makespan {duration(metrics.makespan)}, bubble fraction {percent(metrics.bubble_fraction)}")
    if args.html:
        from viz.gantt import write_gantt_html  # noqa: PLC0415

        write_gantt_html(traces, args.html, title=args.title, plotly=args.plotly)
        print(f"wrote {args.html}")
    if args.chrome_trace:
        from viz.chrome_trace import write_chrome_trace  # noqa: PLC0415

        write_chrome_trace(traces[0], args.chrome_trace)
        print(f"wrote {args.chrome_trace}")
    return 0
