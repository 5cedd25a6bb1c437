"""``pipesim run``: run a schedule for real, on local processes, and measure it.

The ranks are started through torch's elastic launcher (the machinery behind
``torchrun``) on gloo, or NCCL where CUDA is available; ``--pp 1`` (with dp = tp = 1) runs the same model in
this process, as the reference. Started by ``torchrun`` itself (RANK, WORLD_SIZE and
LOCAL_RANK set), each process is one rank of one job and starts nothing. torch is
imported only inside the handler, so the rest of the command line never loads it.
"""

from __future__ import annotations

import argparse
import os
import sys

from executor.architectures.build import is_architecture, shrink_note, shrunk_spec
from executor.config import ConfigError
from executor.options import add_run_arguments, config_from_args
from pipesim.cli.plan_row import config_from_plan_row
from pipesim.cli.progress import StepWatcher, add_quiet_arg, progress_from_args
from pipesim.cli.refused import add_refused_flags, refusal


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run", help="run a schedule on real processes (torch.distributed) and measure it",
        description="Run training steps of a pipeline schedule on local ranks and record the measured timeline. "
                    "For several machines, start the ranks with: torchrun ... -m executor (same flags).",
    )
    add_run_arguments(parser)
    parser.add_argument("--html", default=None, metavar="PATH", help="write a Gantt chart of the measured step")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="keep each rank's stdout/stderr and the launcher's log here (default: a temporary "
                             "folder, kept only when the run fails)")
    plan = parser.add_argument_group("a layout from pipesim plan")
    plan.add_argument("--plan", default=None, metavar="PLAN.json",
                      help="run a row of `pipesim plan --json`: its schedule, pp, tp, dp, microbatches, ZeRO, "
                           "recompute and sequence parallelism kept, the model shrunk to this machine")
    plan.add_argument("--row", type=int, default=1, metavar="N",
                      help="the row of --plan to run, as its table numbers them (default 1, the best)")
    add_quiet_arg(parser)
    refused = add_refused_flags(parser)
    parser.epilog = (f"Flags and values of simulate and plan that run does not execute are refused in one line: "
                     f"{', '.join(refused)}.")
    parser.set_defaults(handler=handle)


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a job torchrun (or another launcher that sets
    torch's environment) started."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def handle(args: argparse.Namespace) -> int:
    refused = refusal(args)
    if refused:
        raise ConfigError(refused)
    if args.plan is not None:
        config, planned = config_from_plan_row(args)
        print(planned)
    else:
        config = config_from_args(args)
    if is_architecture(config.model):
        print(f"pipesim run: {shrink_note(config)}")
    if launched_by_torchrun():
        return run_as_rank(config, args)
    progress = progress_from_args("run", args)
    from executor.launch import PipelineRunError, launch, validate_schedule  # noqa: PLC0415 - loads torch
    from executor.worker import run_local  # noqa: PLC0415

    try:
        if config.world_size == 1:
            validate_schedule(config)  # launch() checks the schedule itself before starting ranks
            with progress.phase(f"{config.steps} steps in this process"):
                result = run_local(config)
        else:
            progress.line(f"starting {config.world_size} ranks for {config.steps} steps")
            with StepWatcher(progress, config.world_size, config.steps):
                (result,) = launch(config, log_dir=args.log_dir, verbose=args.verbose)
    except PipelineRunError as error:
        print(f"pipesim run: failed: {error}", file=sys.stderr)
        return 1
    report(result, config, args)
    return 0


def report(result: dict, config, args: argparse.Namespace) -> None:
    """Write ``--json``/``--trace``/``--html`` and print the summary of a finished run,
    with the shrunk architecture it ran and the simulator's memory beside the measured
    one (also in the Trace's ``meta["memory"]``, which the chart draws)."""
    from executor.report import summary, summary_lines, write_outputs  # noqa: PLC0415 - loads torch

    document = summary(result)
    if is_architecture(config.model):  # what ran: the shrunk architecture, as simulate --json describes one
        document["model"] = {**shrunk_spec(config).describe(), "source": config.model, "shrunk": shrink_note(config)}
    predicted = memory_beside_prediction(result, document, config)
    write_outputs(result, args.json, args.trace, document)
    print("\n".join(summary_lines(result, document) + predicted))
    if args.html:
        write_html(result["trace"], args.html, args.plotly)


def run_as_rank(config, args: argparse.Namespace) -> int:
    """Under torchrun: this process is one rank of one job across the launched processes
    (no ranks are started here). Rank 0 prints the summary and writes ``--json``,
    ``--trace`` and ``--html``; the other ranks print and write nothing. A world size that
    does not match dp x pp x tp x cp is refused before any collective, by rank 0 in one line
    (the other ranks exit with the same status, silently)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    problem = None
    if world != config.world_size:
        problem = (f"torchrun started {world} processes, but dp={config.dp} x pp={config.pp} x tp={config.tp} x "
                   f"cp={config.cp} is {config.world_size} ranks: use torchrun --nproc-per-node {config.world_size} "
                   f"(one node), or change --dp/--pp/--tp/--cp")
    elif args.log_dir is not None:
        problem = "--log-dir is for ranks pipesim run starts itself; under torchrun each rank's output is torchrun's"
    if problem is not None:
        if rank == 0:
            raise ConfigError(problem)
        return 2
    from executor.launch import validate_schedule  # noqa: PLC0415 - loads torch
    from executor.worker import RankFailedError, run_worker  # noqa: PLC0415

    validate_schedule(config)
    try:
        (result,) = run_worker([config])
    except RankFailedError as error:
        print(f"pipesim run: failed: {error}", file=sys.stderr)
        return 1
    if rank == 0:
        report(result, config, args)
    return 0


def memory_beside_prediction(result: dict, document: dict, config) -> list[str]:
    """Add the simulator's memory prediction to each of ``document``'s memory rows
    (``predicted_static``, ``predicted_peak``, ``predicted_activations``; CPU only), put
    the rows into the run's Trace as ``meta["memory"]`` (the chart's panel, the saved
    Trace) and return the lines to print."""
    from pipesim.cli.chart_data import measured_memory_meta  # noqa: PLC0415
    from pipesim.cli.run_memory import not_predicted, peak_lines  # noqa: PLC0415 - the simulator's memory model

    lines = predict_static_memory(document, config) + peak_lines(document, config)
    result["trace"].meta.update(measured_memory_meta(document.get("memory"), not_predicted(config)))
    return lines


def predict_static_memory(document: dict, config) -> list[str]:
    """Each rank's parameters, gradients and optimizer state as the simulator's memory
    model prices them (``pipesim.sim.memory``, ZeRO per Rajbhandari et al. Table 1), from
    the rank's parameter count, beside what was measured at the step's end: the weights'
    bytes for weights and gradients, and AdamW's two moments (SGD keeps none). Adds
    ``predicted_static`` to each memory row; returns the lines to print (CPU only)."""
    rows = document.get("memory") or []
    if not rows or rows[0]["source"] != "tracked":
        return []
    from pipesim.sim.memory import BytesPerParam, static_bytes_per_param  # noqa: PLC0415

    element = 8 if config.master_dtype == "float64" else 4
    optimizer = 2 * element if config.optimizer == "adamw" else 0
    # ZeRO shards over the dp x cp ranks, as the simulator's memory model does (with ep the
    # routed experts over dp x cp / ep: the rows do not tell them apart, so they are priced as dense).
    # (DualPipe's: over both copies' holders, executor.copies)
    holders = config.gradient_holders
    per_param = static_bytes_per_param(BytesPerParam(element, element, optimizer), holders, config.zero)
    over = f"dp {config.dp}" if config.cp == 1 else f"dp x cp {holders // config.copies}"
    if config.copies > 1:
        over = f"{over} and both copies' holders, {holders} ranks"
    routed = "; routed experts priced as dense" if config.ep > 1 and config.zero else ""
    lines = [f"parameters + gradients + optimizer state after the step, measured vs predicted (ZeRO {config.zero} "
             f"over {over}: {per_param:g} bytes per parameter{routed}):"]
    for row in rows:
        row["predicted_static"] = row["unsharded_params"] / element * per_param
        error = row["static"] / row["predicted_static"] - 1 if row["predicted_static"] else 0.0
        lines.append(f"  rank {row['rank']}: measured {row['static'] / 2**20:.3f} MiB, predicted "
                     f"{row['predicted_static'] / 2**20:.3f} MiB ({error:+.1%})")
    return lines


def write_html(trace, path: str, plotly: str = "inline") -> None:
    """Draw the measured step with ``viz`` if it is installed; say so if it is not."""
    try:
        from viz.gantt import write_gantt_html  # noqa: PLC0415
    except ImportError:
        print(f"--html: the chart module (viz.gantt) is not available; skipped {path}", file=sys.stderr)
        return
    meta = trace.meta
    shape = f"dp={meta.get('dp', 1)} pp={meta['pp']} tp={meta.get('tp', 1)}"
    write_gantt_html([trace], path, titles=[f"measured: {meta['schedule']} {shape} (one pipeline; dp, tp lanes)"],
                     plotly=plotly)
    print(f"wrote {path}")
