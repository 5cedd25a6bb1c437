"""``pipesim simulate``: predict one step of one schedule on one cluster."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pipesim.cli.chart_data import memory_meta
from pipesim.cli.options import (
    add_cost_args,
    add_model_args,
    add_p2p_arg,
    add_parallel_args,
    add_schedule_args,
    add_topology_args,
)
from pipesim.cli.step_notes import bytes_hint, impossible_notes, placement_line, rack_hint
from pipesim.cli.variability import add_variability_args, variability_from_args, write_whatif_page
from pipesim.job import Job, default_split_note, model_figures, model_spec_of, simulate_job
from schedules.units import count, number, percent


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
    add_variability_args(parser)
    parser.add_argument("--fail-on-oom", action="store_true",
                        help="exit non-zero when a rank's peak memory exceeds its device's")
    parser.set_defaults(handler=handle)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("outputs")
    group.add_argument("--json", help="write the result (makespan, bubble, per-rank metrics, comm, memory) as JSON")
    group.add_argument("--trace", help="write the timeline as a pipesim Trace JSON")
    group.add_argument("--chrome-trace", help="write the timeline as Chrome/Perfetto trace JSON")
    group.add_argument("--html", help="write a Gantt chart (self-contained HTML)")


def finite_json(value):
    """``value`` with every non-finite float (an unbounded capacity, an undefined ratio)
    written as null, so ``--json`` is strict JSON that any parser reads."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


def write_outputs(args: argparse.Namespace, result_dict: dict, traces: list, titles: list[str],
                  metrics: list | None = None, announce: bool = True) -> list[str]:
    """Write whichever of --json/--trace/--chrome-trace/--html were asked for; the paths
    written, each said on stdout unless ``announce`` is off (the caller says them later)."""
    written = []
    if args.json:
        Path(args.json).write_text(json.dumps(finite_json(result_dict), indent=2, allow_nan=False))
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
    if announce:
        for path in written:
            print(f"wrote {path}")
    return written


def parameter_counts(model: dict) -> str:
    """``8.03 B params``, or for a mixture of experts ``46.7 B params (12.9 B active)``:
    memory holds the total, each token computes with the active ones; DeepSeek-V3's
    multi-token prediction modules after them (``+ 11.6 B multi-token prediction``)."""
    text = f"{model['params'] / 1e9:.3g} B params"
    if model["active_params"] != model["params"]:
        text += f" ({model['active_params'] / 1e9:.3g} B active)"
    if model.get("mtp_params"):
        text += f" + {model['mtp_params'] / 1e9:.3g} B multi-token prediction"
    return text


def mfu_text(figures: dict) -> str:
    """``41.2%``, or with FP8 GEMMs ``41.2% of the BF16 peak (20.6% of the FP8 peak)``."""
    if figures.get("mfu_fp8_peak") is None:
        return percent(figures["mfu"])
    return f"{percent(figures['mfu'])} of the BF16 peak ({percent(figures['mfu_fp8_peak'])} of the FP8 peak)"


def handle(args: argparse.Namespace) -> int:
    from pipesim.sim.memory import OutOfMemoryError, check_memory

    job = Job.from_namespace(args)
    variability = variability_from_args(args)  # bad what-if flags fail before the step is simulated
    result = simulate_job(job)
    note = default_split_note(job)  # after the step: a job that fails says one line, its error
    if note:
        print(note, file=sys.stderr)
    document = result.to_dict()
    whatif = None
    if variability is not None:
        from pipesim.sim.whatif import sample_steps

        whatif = sample_steps(result, variability)
        document.update(whatif.to_dict())
    figures = model_figures(job, result) if job.model else None
    if figures:
        document.update(figures)
    result.trace.meta.update(memory_meta(result))
    # the files first: a reader of stdout that goes away (`| head`) must not cost them
    # a what-if's --html is the distribution beside its median and p99 steps (written below)
    outputs = args if whatif is None else argparse.Namespace(**{**vars(args), "html": None})
    written = write_outputs(outputs, document, [result.trace], [f"predicted: {result.schedule.name}"],
                            [result.metrics], announce=False)
    print(result.summary())
    if whatif is not None:
        print(whatif.summary())
    placed = placement_line(result, document["rank_order"])
    if placed:
        print(placed)
    for hint in (bytes_hint(result), rack_hint(result)):
        if hint:
            print(hint, file=sys.stderr)
    if figures:
        print(f"  model {figures['model']['name']}: {parameter_counts(figures['model'])}; "
              f"{count(figures['tokens_per_second'])} tokens/s, {number(figures['model_tflops_per_gpu'])} TFLOP/s "
              f"per GPU (recompute counted), MFU {mfu_text(figures)} (attention counted {job.attention_flops})")
        print(f"  compute timed by: {'; '.join(figures['model']['compute_model'])}")
        spec = model_spec_of(job)
        for line in impossible_notes(spec, figures):
            print(line, file=sys.stderr)
        from pipesim.model.layout import layout_notes, unmodelled_notes

        for note in layout_notes(spec, job.tp) + unmodelled_notes(spec):
            print(f"  note: {note}")
    for path in written:
        print(f"wrote {path}")
    if whatif is not None and args.html:
        write_whatif_page(args.html, whatif, args.plotly)
        print(f"wrote {args.html}")
    if args.fail_on_oom:
        try:
            check_memory(result.memory)
        except OutOfMemoryError as error:
            print(f"pipesim simulate: error: {error}", file=sys.stderr)
            return 3
    return 0
