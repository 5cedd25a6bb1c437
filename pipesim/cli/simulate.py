"""``pipesim simulate``: predict one step of one schedule on one cluster."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pipesim.cli.options import (
    add_cost_args,
    add_model_args,
    add_p2p_arg,
    add_parallel_args,
    add_schedule_args,
    add_topology_args,
    costs_from_args,
    fallback_peak_flops,
    model_costs_from_args,
    model_spec_from_args,
    parallel_from_args,
    schedule_from_args,
    topology_from_args,
)
from pipesim.sim.step import run_simulation


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
                  metrics: list | None = None) -> None:
    """Write whichever of --json/--trace/--chrome-trace/--html were asked for."""
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
    for path in written:
        print(f"wrote {path}")


def model_figures(args: argparse.Namespace, result) -> dict:
    """``--json``'s model section: the architecture, the per-stage costs derived from it,
    and the throughput a training log would report for the simulated step."""
    spec = model_spec_from_args(args)
    figures, gpus, peak = _throughput(args, result, spec)
    model = spec.describe()
    model.update(recompute=args.recompute, flash_attention=not args.no_flash_attention,
                 sequence_parallel=args.sequence_parallel, gpus=gpus, peak_flops_per_gpu=peak,
                 compute_model=result.costs.meta.get("compute_model"))
    return {"model": model, "stage_costs": result.costs.to_dict()["stages"], **figures}


def parameter_counts(model: dict) -> str:
    """``8.03 B params``, or for a mixture of experts ``46.7 B params (12.9 B active)``:
    memory holds the total, each token computes with the active ones."""
    text = f"{model['params'] / 1e9:.3g} B params"
    if model["active_params"] != model["params"]:
        text += f" ({model['active_params'] / 1e9:.3g} B active)"
    return text


def throughput_figures(args: argparse.Namespace, result) -> dict:
    """Only the throughput of ``model_figures`` (tokens/s, MFU, model TFLOP/s per GPU):
    what a planner ranks thousands of layouts by, without the rest of the section."""
    return _throughput(args, result, model_spec_from_args(args))[0]


def _throughput(args: argparse.Namespace, result, spec) -> tuple[dict, int, float]:
    """The training figures, the GPU count and the mean peak FLOP/s per GPU."""
    from pipesim.model.transformer_costs import training_figures

    fallback = fallback_peak_flops(args)
    peaks = [result.topology.device_peak_flops(device) for device in result.devices]
    peaks = [peak if math.isfinite(peak) else fallback for peak in peaks] or [fallback]
    gpus = result.schedule.pp * result.parallel.tp * result.parallel.dp
    peak = sum(peaks) / len(peaks)
    figures = training_figures(spec, args.recompute, result.metrics.makespan, result.schedule.microbatches,
                               result.parallel.dp, gpus, peak)
    return figures, gpus, peak


def handle(args: argparse.Namespace) -> int:
    from pipesim.sim.memory import OutOfMemoryError, check_memory

    topology = topology_from_args(args)
    schedule = schedule_from_args(args, topology)
    if args.model:
        costs = model_costs_from_args(args, schedule, topology)
    else:
        costs = costs_from_args(args, schedule.num_stages, schedule.virtual_stages)
    result = run_simulation(schedule, costs, topology, parallel=parallel_from_args(args), p2p=args.p2p)
    if args.model:
        result.trace.meta["model"] = args.model  # the chart's title names it
    document = result.to_dict()
    print(result.summary())
    if args.model:
        figures = model_figures(args, result)
        document.update(figures)
        print(f"  model {figures['model']['name']}: {parameter_counts(figures['model'])}; "
              f"{figures['tokens_per_second']:.4g} tokens/s, {figures['model_tflops_per_gpu']:.4g} TFLOP/s per GPU "
              f"(Megatron's count), MFU {figures['mfu']:.1%}")
        print(f"  compute timed by: {'; '.join(figures['model']['compute_model'])}")
        from pipesim.model.layout import layout_notes

        for note in layout_notes(model_spec_from_args(args), args.tp):
            print(f"  note: {note}")
    write_outputs(args, document, [result.trace], [f"predicted: {schedule.name}"], [result.metrics])
    if args.fail_on_oom:
        try:
            check_memory(result.memory)
        except OutOfMemoryError as error:
            print(f"pipesim simulate: error: {error}", file=sys.stderr)
            return 3
    return 0
