"""``pipesim compare``: run a config for real and predict it with calibrated costs and
links, then report how far apart the two are.

Costs come from ``--costs``, or by default from calibration steps the job's own processes
run beside the timed ones (``--calibration run``: the wall time of every action under the
run's own contention, ``executor.run_costs``; interleaved with them by default,
``pipesim.cli.calibration_order``), or from the standalone stage profile
(``--calibration stages``, ``pipesim profile``); links from ``--topology`` or from a
short send/recv benchmark (``pipesim bench-comm``). The prediction simulates the same
lowered programs the executor runs. torch is imported only inside the handler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from executor.options import add_run_arguments, config_from_args
from executor.run_costs import RUN_CALIBRATED  # no torch at import
from pipesim.cli.calibration_files import (
    OUTPUT_FILES,
    add_calibration_file_arguments,
    check_calibration_files,
    reproduction_lines,
    simulate_command,
    write_calibration_files,
)
from pipesim.cli.calibration_order import (
    CALIBRATION,
    CALIBRATION_ORDERS,
    DEFAULT_CALIBRATION_ORDER,
    INTERLEAVED,
    TIMED,
    check_order_steps,
    launch_order,
    merged_timed_result,
    split_results,
    timed_configs,
)
from pipesim.cli.held_collectives import calibrate_held, held_collectives, held_message_sizes
from pipesim.cli.profile import add_profile_arguments, check_profile_arguments
from pipesim.cli.progress import StepWatcher, add_quiet_arg, progress_from_args
from pipesim.cli.variability import add_variability_args, variability_from_args
from pipesim.sim.zero import ZERO3_IN_COSTS, ZERO3_OVERLAPPED
from schedules.metrics import makespan
from schedules.units import duration

LINK_SIZES = "1KB..16MB"  # sendrecv sizes measured when no --topology is given


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare", help="run a schedule, predict it with calibrated costs and links, report the error",
        description="Profile (or take --costs), benchmark the links (or take --topology), run the executor for "
                    "a few steps and simulate the same programs; print measured vs predicted step time, per-rank "
                    "busy and idle time and bubble fraction.",
    )
    add_run_arguments(parser)
    add_profile_arguments(parser)
    group = parser.add_argument_group("calibration and outputs")
    group.add_argument("--costs", metavar="PATH", help="a costs file (pipesim profile) instead of measuring now")
    group.add_argument("--topology", metavar="PATH", help="a topology file (pipesim bench-comm) instead of "
                       "benchmarking send/recv now")
    group.add_argument("--warmup-steps", type=int, default=1,
                       help="first steps left out of the measured step time (default 1; --steps defaults to 6 "
                            "here, so 5 steps give the median and the spread); with --calibration-order "
                            "interleaved, the warm-up steps of each timed step's own fresh model")
    group.add_argument("--calibration-order", choices=CALIBRATION_ORDERS, default=None,
                       help="with --calibration run, when the calibration steps run beside the timed ones, in one "
                            "launch: interleaved (each timed step a config of its own, --warmup-steps warm-up steps "
                            "of a fresh model then the timed one, alternating with the calibration configs, so both "
                            "see the machine alike: --steps S gives S - --warmup-steps timed steps) or around (half "
                            "the calibration configs, then --steps steps of one model, then the rest) (default "
                            f"{DEFAULT_CALIBRATION_ORDER})")
    group.add_argument("--html", metavar="PATH", help="write the measured and predicted timelines on one axis")
    group.add_argument("--predicted-trace", metavar="PATH", help="write the predicted Trace")
    add_calibration_file_arguments(group)
    add_quiet_arg(parser)
    add_variability_args(parser, seed=False)
    parser.set_defaults(handler=handle, steps=6, output_files=OUTPUT_FILES)


def machine_load() -> float | None:
    """The 1-minute load average (runnable processes, the run's own ranks included), or
    None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def replicas(config):
    """The parallelism the run has, as the simulator describes it: ``dp`` replicas whose
    gradients are all-reduced in buckets of the run's size, each as soon as its gradients
    are ready (``executor.data_parallel``); ``tp`` shards whose collectives hold the
    rank after each compute action, never beside the GEMMs (the executor waits for each
    one where DTensor issues it; a MoE block's are Megatron-Core's under sequence
    parallelism, ``moe_shared``, else the dense MLP's, ``moe_tp_dense``); ``ep``
    ranks, whose all-to-alls the calibration takes out of the measured compute and the
    simulator prices from the links (``executor.inside_timing``), over the groups the run
    cuts (under parallel folding, ``--etp 1``, from every rank of a stage: ``etp``);
    ``cp`` ranks, whose ring's exposed waits the same (with ``--cp-comm all-gather`` the
    gathers stay in the measured compute); under
    ``--zero 1`` and ``2``, the buckets reduce-scattered (ZeRO-2: after every backward)
    and the updated parameters all-gathered after the optimizer step, before the step
    ends (``executor.data_parallel.gather_parameters`` waits for them: no overlap with
    the next step's forwards, ``overlap_param_gather`` off); under ``--zero 3``, ZeRO-3
    with its collectives where the run has them (``zero3_collectives``). Before the ZeRO-1
    and 2 rule compare predicted those runs as DDP ones: an all-reduce during the last
    backward, and no gathers after the optimizer."""
    from pipesim.sim.parallel import ParallelConfig  # noqa: PLC0415

    zero: dict = {}
    if config.zero in (1, 2):
        zero = {"zero": config.zero, "overlap_param_gather": False}
    elif config.zero == 3:
        zero = {"zero": 3, "zero3_collectives": zero3_collectives(config)}
    return ParallelConfig(dp=config.dp, bucket_bytes=config.dp_bucket_mb * 2**20, tp=config.tp, cp=config.cp,
                          ep=config.ep, overlap_tp=False, etp=config.expert_tp if config.folded else 0, **zero)


def zero3_collectives(config) -> str:
    """Where the run's FSDP2 gathers and reduce-scatters run, as the simulator names it
    (``pipesim.sim.zero.ZERO3_COLLECTIVES``). On gloo FSDP2 issues them synchronously
    (``async_op=False``): the rank is blocked in them inside its F and B actions, so the
    calibration steps' action times (``executor.run_costs``) already hold them, and
    ``in-costs`` keeps the simulator from charging them again (prefetch waits,
    reduce-scatters beside the backward, the overlap slowdown). Before this rule compare
    predicted a ZeRO-3 run as a DDP one: a gradient all-reduce after the last backward
    on top of costs that held the reduce-scatters (tiny gpt, dp 2 pp 2: 6.6 ms of a
    139 ms prediction). On NCCL FSDP2 runs them on its own CUDA streams beside the
    compute, which ``overlapped`` (the default) models."""
    from executor.process import resolve_backend  # noqa: PLC0415 - loads torch, as compare's run does
    return ZERO3_IN_COSTS if resolve_backend(config.backend) == "gloo" else ZERO3_OVERLAPPED



def check_whole_stages(config, source: str, meta: dict | None = None) -> None:
    """Refuse costs of whole pipeline stages (the stage profile, a file written by hand)
    for a run split into tp, cp or ep shards, or into ZeRO-3 shards on gloo: they hold
    neither a shard's compute nor its collectives (FSDP2's on gloo, which the simulator
    then charges nothing for: ``zero3_collectives``). Costs read off the run's own steps
    (``executor.run_costs``) time shards."""
    split = [(flag, size) for flag, size in (("--tp", config.tp), ("--cp", config.cp), ("--ep", config.ep)) if size > 1]
    if config.zero == 3 and config.dp > 1 and zero3_collectives(config) == ZERO3_IN_COSTS:
        split.append(("--zero", 3))
    if split and (meta or {}).get("source") != RUN_CALIBRATED:
        given = " ".join(f"{flag} {size}" for flag, size in split)
        raise ValueError(f"{source} times whole pipeline stages, not {given} shards; calibrate on the run's own "
                         "steps (--calibration run, or a costs file from profile --calibration run)")


def calibrated_costs(args: argparse.Namespace, config, num_stages: int):
    """The costs file given, or a fresh profile of this config."""
    from pipesim.model.costs import costs_from_dict, load_costs  # noqa: PLC0415

    if args.costs:
        costs = load_costs(args.costs, num_stages)
        check_whole_stages(config, f"--costs {args.costs}", costs.meta)
        check_costs_match(costs.meta, config, args.costs)
        return costs
    from executor.profile import profile  # noqa: PLC0415 - loads torch

    document = profile(config, args.warmup, args.repeats, args.min_time, args.verbose, args.compute_clock)
    return costs_from_dict(document, num_stages, name="profile")


def profiled_shape(config) -> dict:
    """What a profile's stage times depend on, as ``pipesim profile`` writes it in the
    costs file's ``meta``: the model and its sizes, the pipeline split, the microbatch
    size and the dtype (the schedule and the microbatch count change no stage's time)."""
    shape = {"model": config.model, "layers": config.layers, "hidden": config.hidden, "pp": config.pp,
             "virtual_stages": config.virtual_stages, "dtype": config.dtype,
             "microbatch_size": -(-config.replica_batch_size // config.microbatches),
             "tp": config.tp, "cp": config.cp, "ep": config.ep,  # only a file from the run's own steps has these
             "etp": config.expert_tp}
    if config.model != "mlp":  # a model of tokens: the gpt or an architecture
        shape["seq_len"] = config.seq_len
    return shape


def check_costs_match(meta: dict, config, path: str) -> None:
    """Refuse a costs file profiled on another model or shape: its stage times would be
    another model's (a costs file of a 4x wider model once gave a +5583.8% "error").
    Files without ``meta`` (written by hand) are taken as they are."""
    if not meta:
        return
    differences = [f"{key} {meta[key]} (this run: {value})" for key, value in profiled_shape(config).items()
                   if key in meta and meta[key] != value]
    if differences:
        raise ValueError(f"--costs {path} was profiled on another model or shape: {'; '.join(differences)}; "
                         "profile this config (drop --costs) or pass the flags it was profiled with")


def pairs_as_run(costs, overlap: bool):
    """``costs`` charging an overlapped pair as the executor runs it: its halves together
    (two CUDA streams) or one after the other (gloo, on the CPU; ``executor.pair_streams``)."""
    return costs if costs.pairs_overlap == overlap else dataclasses.replace(costs, pairs_overlap=overlap)


def calibrated_topology(args: argparse.Namespace, config, num_stages: int):
    """The topology file given, or measured now on every rank of the run and fitted:
    send/recv for the links, and the collectives the run holds its ranks for
    (``held_collectives``) as the executor runs them, over groups of the run's size, at
    the run's message sizes (``held_message_sizes``)."""
    from pipesim.cluster.files import load_topology, topology_from_dict  # noqa: PLC0415

    if args.topology:
        return load_topology(args.topology)
    from executor.bench_comm import bench_comm  # noqa: PLC0415 - loads torch
    from pipesim.cli.bench_comm import parse_sizes  # noqa: PLC0415
    from pipesim.cluster.comm_fit import fits_by_operation, topology_document  # noqa: PLC0415

    held = held_collectives(config)
    result = bench_comm(config.world_size, ["sendrecv", *held], parse_sizes(LINK_SIZES), config.backend,
                        config.threads, verbose=args.verbose, groups=held,
                        sizes_of=held_message_sizes(config, num_stages))
    return topology_from_dict(topology_document(result, fits_by_operation(result)), name="measured links")


def chart_summaries(document: dict, drawn_step: int | None = None, drawn_span: float | None = None) -> list[str]:
    """The Gantt's measured and predicted title lines, from the comparison document the
    terminal report prints (``report_lines``), in the same units and precision, so the
    chart and the terminal never disagree. Both are taken against a step time (measured:
    the drawn step's, as in the report), not the span of the drawn step's events: that
    span leaves out the optimizer step and the loss all-reduce, and once gave a chart
    bubble of 13.9% beside a reported 21.0%. The span of the drawn actions
    (``drawn_span`` seconds) is said beside it, so the bars' end is not read as the median."""
    kept = max(len(document["measured_step_times"]) - document["warmup_steps"], 0) or len(
        document["measured_step_times"])
    drawn = f" · drawn: step {drawn_step}" if drawn_step is not None else ""
    if drawn and drawn_span is not None:
        drawn += f", its actions {duration(drawn_span, 'ms')} long"
    traced = document.get("measured_traced_step_time")
    of_step = f" (of the drawn step's {traced * 1e3:.2f} ms)" if traced is not None else ""
    return [
        f"step time {document['measured_step_time'] * 1e3:.2f} ms (median of {kept} steps){drawn} · "
        f"bubble {document['measured_bubble_fraction']:.1%} · idle {document['measured_idle_fraction']:.1%}{of_step}",
        f"step time {document['predicted_step_time'] * 1e3:.2f} ms (error {document['error']:+.1%}) · "
        f"bubble {document['predicted_bubble_fraction']:.1%} · idle {document['predicted_idle_fraction']:.1%}",
    ]


def run_calibrated(args: argparse.Namespace, config, schedule, progress, order: str):
    """Run the calibration configs and the timed steps in one launch (the same processes,
    the same lowered programs) in ``order`` (``pipesim.cli.calibration_order``: timed
    configs interleaved with the calibration ones, or one timed config between two
    halves of them); return the measured result, as one timed config's reads, the
    costs read off the calibration steps (``executor.run_costs``) and the calibration
    steps' results (for the held collectives, ``pipesim.cli.held_collectives``). The timed steps are
    never read for a cost: the prediction stays a prediction. On a machine whose load
    drifts (the shared 2-core machine: compute 2x slower in one compare's calibration
    steps than in the timed steps that followed), calibration steps spread among the
    timed ones see the load the timed steps saw."""
    from executor.launch import launch  # noqa: PLC0415 - loads torch
    from executor.run_costs import calibration_configs, calibration_document  # noqa: PLC0415
    from pipesim.model.costs import costs_from_dict  # noqa: PLC0415

    calibration = calibration_configs(config, args.calibration_steps)
    timed = timed_configs(config, order, args.warmup_steps)
    sequence = launch_order(len(calibration), len(timed), order)
    if order == INTERLEAVED:
        progress.line(f"2/3 running {len(calibration)} calibration steps and {len(timed)} timed steps, interleaved "
                      f"(each after {args.warmup_steps} warm-up step(s) of a fresh model) on {config.world_size} "
                      "ranks")
    else:
        before = sequence.index((TIMED, 0))
        progress.line(f"2/3 running {before} calibration steps, {config.steps} timed steps, then "
                      f"{len(calibration) - before} calibration steps (each after a warm-up step) on "
                      f"{config.world_size} ranks")
    configs = {CALIBRATION: calibration, TIMED: timed}
    with StepWatcher(progress, config.world_size, config.steps):
        results = launch([configs[kind][index] for kind, index in sequence], verbose=args.verbose)
    calibrated, timed_results = split_results(sequence, results)
    result = merged_timed_result(timed_results) if order == INTERLEAVED else timed_results[0]
    document = calibration_document(config, schedule, calibrated)
    return result, costs_from_dict(document, schedule.num_stages, name="calibration steps"), calibrated


def handle(args: argparse.Namespace) -> int:
    check_profile_arguments(args)
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    calibration = args.calibration or "run"
    if args.costs and args.calibration:
        raise ValueError(f"--costs {args.costs} gives the costs; --calibration {args.calibration} measures them: "
                         "give one of them")
    if args.calibration_order and (args.costs or calibration != "run"):
        given = f"--costs {args.costs}" if args.costs else f"--calibration {calibration}"
        raise ValueError(f"--calibration-order {args.calibration_order} orders the calibration steps of --calibration "
                         f"run; {given} runs none: drop --calibration-order")
    order = (args.calibration_order or DEFAULT_CALIBRATION_ORDER) if calibration == "run" and not args.costs else None
    if order is not None:
        check_order_steps(order, args.steps, args.warmup_steps)
    variability = variability_from_args(args)  # the prediction's what-if flags, checked before anything runs
    config = config_from_args(args)
    if config.pp < 2:
        raise ValueError("compare needs --pp 2 or more: with one rank there is no pipeline to predict")
    if calibration == "stages" and not args.costs:
        check_whole_stages(config, "--calibration stages")
    from executor.launch import PipelineRunError, launch, p2p_semantics, validate_schedule  # noqa: PLC0415
    from executor.pair_streams import pairs_overlap_on  # noqa: PLC0415
    from executor.process import resolve_backend  # noqa: PLC0415
    from executor.spawn import SpawnError  # noqa: PLC0415
    from pipesim.sim.comparison import compare, launch_overheads, report_lines, runtime_per_rank  # noqa: PLC0415
    from pipesim.sim.cost_aware import adapt_to_costs  # noqa: PLC0415
    from pipesim.sim.engine import lower_for  # noqa: PLC0415
    from pipesim.sim.step import run_simulation  # noqa: PLC0415

    schedule = validate_schedule(config)
    check_calibration_files(args)
    progress = progress_from_args("compare", args)
    paces: dict[str, dict] = {}  # the collectives priced from the calibration steps
    try:
        if not args.costs and calibration == "run":
            with progress.phase("reading --topology" if args.topology
                                else f"1/3 benchmarking {', '.join(['send/recv', *held_collectives(config)])}"):
                topology = calibrated_topology(args, config, schedule.num_stages)
            # the calibration steps and the timed ones run the same lowered programs, the
            # ones the prediction simulates (lowered before any cost is known)
            result, costs, calibrated = run_calibrated(args, config, schedule, progress, order)
            paces = calibrate_held(topology, config, schedule, costs, calibrated, links_benchmarked=not args.topology)
        else:
            with progress.phase("reading --costs" if args.costs else "1/4 profiling the stages"):
                costs = pairs_as_run(calibrated_costs(args, config, schedule.num_stages),
                                     pairs_overlap_on(resolve_backend(config.backend)))
            with progress.phase("reading --topology" if args.topology
                                else f"2/4 benchmarking {', '.join(['send/recv', *held_collectives(config)])}"):
                topology = calibrated_topology(args, config, schedule.num_stages)
            # the run posts the transfers where lowering places them for these costs and links,
            # in the order zb-h1 and zb-h2 take on them, as the prediction does (pipesim
            # simulate builds and lowers the same way)
            ordered = adapt_to_costs(schedule.compute_only(), costs, topology)
            config = dataclasses.replace(config, custom_schedule=lower_for(ordered, costs, topology))
            schedule = validate_schedule(config)
            progress.line(f"3/4 running {config.steps} steps on {config.world_size} ranks")
            with StepWatcher(progress, config.world_size, config.steps):
                (result,) = launch(config, verbose=args.verbose)
        load = machine_load()
    except (PipelineRunError, SpawnError) as error:
        print(f"pipesim compare: run failed: {error}", file=sys.stderr)
        return 1
    # Predicted under the semantics the run had (--p2p, else its backend's), its pairs as it ran them.
    costs = pairs_as_run(costs, result["trace"].meta.get("pairs_overlap", costs.pairs_overlap))
    with progress.phase("3/3 simulating the same programs" if calibration == "run" and not args.costs
                        else "4/4 simulating the same programs"):
        predicted = run_simulation(schedule, costs, topology, p2p=p2p_semantics(config),
                                   parallel=replicas(config))
    written = write_calibration_files(args, costs, topology, predicted.schedule)
    # interleaved: the step times are the timed configs' timed steps only, their warm-ups apart
    interleaved = order == INTERLEAVED
    document = compare(result["trace"], result["step_times"], predicted.trace, predicted.metrics.makespan,
                       0 if interleaved else args.warmup_steps, load=load, cores=os.cpu_count(),
                       world_size=config.world_size, overheads=launch_overheads(schedule, costs),
                       # the runtime's own time beside busy, where the run marks each wait (buffered P2P)
                       runtime=runtime_per_rank(result["trace"], schedule, costs)
                       if p2p_semantics(config) == "buffered" else None, posting=costs.comm_overhead)
    if order is not None:
        document["calibration_order"] = order
    if interleaved:
        document["warmup_steps_per_timed_step"] = args.warmup_steps
        document["measured_warmup_step_times"] = result["warmup_step_times"]
    document["costs"] = costs.to_dict()  # what the prediction was made with, to read beside its error
    if paces:
        document["calibrated_collectives"] = paces
    if variability is not None:
        from pipesim.sim.comparison import add_spread  # noqa: PLC0415
        from pipesim.sim.whatif import sample_steps  # noqa: PLC0415

        add_spread(document, sample_steps(predicted, variability).step_times)
    if args.json:  # before the report: a reader of stdout that goes away (`| head`) must not cost it
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    print("\n".join(report_lines(document)))
    for path in [*([args.json] if args.json else []), *written]:
        print(f"wrote {path}")
    if args.costs_out and args.topology_out:
        print("\n".join(reproduction_lines(simulate_command(args, config, replicas(config), p2p_semantics(config)),
                                           predicted.metrics.makespan)))
    if args.trace or args.html:
        from pipesim.cli.run import memory_beside_prediction  # noqa: PLC0415

        # the simulated step carries no memory (its costs hold times only): the measured
        # peaks go into the measured Trace, with the memory model's prediction of this run
        memory_beside_prediction(result, {"memory": result.get("memory")}, config)
    if args.trace:
        result["trace"].save(args.trace)
    if args.predicted_trace:
        predicted.trace.save(args.predicted_trace)
    if args.html:
        from viz.gantt import write_gantt_html  # noqa: PLC0415

        traces = [result["trace"], predicted.trace]
        write_gantt_html(traces, args.html, titles=["measured", "predicted"],
                         summaries=chart_summaries(document, result["trace"].meta.get("step"),
                                                   makespan(result["trace"])), plotly=args.plotly)
        print(f"wrote {args.html}")
    return 0
