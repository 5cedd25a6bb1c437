"""``pipesim profile``: measure each stage's compute and the runtime's overheads on the
real device and backend, and write the costs file ``simulate --costs`` reads.

Takes the same model and split flags as ``pipesim run``, so the costs are for that
microbatch size and that split. With ``--compute-model FILE`` it fits the compute model
of this machine's GPU instead (``pipesim.cli.profile_kernels``). torch is imported only
inside the handler.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from executor.estimate import DEFAULT_MIN_TIME, ROUNDS
from executor.options import add_run_arguments, config_from_args, refuse_copies
from pipesim.cli.progress import add_quiet_arg, progress_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile", help="time every stage's F/B/I/W and the runtime overheads; write a costs file",
        description="Profile the stages of a pipelined model on this machine's device and backend "
                    "(one process per pipeline rank, as pipesim run starts them) and write a costs file.",
    )
    add_run_arguments(parser, outputs=False)
    add_profile_arguments(parser)
    parser.add_argument("--out", metavar="PATH", help="the costs file to write (JSON)")
    add_compute_model_arguments(parser)
    add_quiet_arg(parser)
    parser.set_defaults(handler=handle, output_files=("compute_model",))


def add_compute_model_arguments(parser: argparse.ArgumentParser) -> None:
    from pipesim.hardware.gpus import GPUS  # noqa: PLC0415

    group = parser.add_argument_group("compute model (instead of --out)")
    group.add_argument("--compute-model", metavar="PATH",
                       help="time this GPU's GEMMs and attention (the gpt layer of --hidden, --heads, --seq-len, "
                       "--batch-size / --microbatches sequences, at --tp; and a spread of shapes), fit the compute "
                       "model and write it for simulate --compute-model (needs a CUDA GPU)")
    group.add_argument("--gpu", choices=tuple(GPUS), default=None,
                       help="the GPU whose datasheet peak and HBM bandwidth the model is in units of (default: "
                       "recognised from the device's name)")


CALIBRATIONS = ("run", "stages")


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("profiling")
    group.add_argument("--warmup", type=int, default=3, help="untimed repetitions per measurement (default 3)")
    group.add_argument("--repeats", type=int, default=20, help="timed repetitions, averaged (default 20)")
    group.add_argument("--min-time", type=float, default=DEFAULT_MIN_TIME, metavar="SECONDS",
                       help="time each stage's forward + backward, and the cost of a transfer, for at least this "
                            f"long as well (default {DEFAULT_MIN_TIME:g}): a small stage's mean needs hundreds of "
                            "passes to settle")
    group.add_argument("--calibration", choices=CALIBRATIONS, default=None,
                       help="how the costs are measured: run (the executor runs --calibration-steps steps of the "
                            "schedule and every action is timed by the wall clock, under the run's own contention, "
                            "with --tp/--cp/--ep too) or stages (each stage alone, in loops, by --compute-clock; "
                            "whole stages only) (default: run for compare, stages for profile)")
    group.add_argument("--calibration-steps", type=int, default=ROUNDS, metavar="N",
                       help="with --calibration run, the steps whose actions' mean wall times are the costs (default "
                            f"{ROUNDS}; each after a warm-up step of its own; the median of their means is kept; in "
                            "compare, none of them is a timed step)")
    group.add_argument("--compute-clock", choices=("thread", "wall"), default="thread",
                       help="on a CPU, time the compute by the rank thread's CPU time (thread: what it takes on a "
                            "core of its own) or by the wall clock the run is timed by (wall: slowed as much as "
                            "ranks and other work sharing the cores slow it) (default thread)")


def check_profile_arguments(args: argparse.Namespace) -> None:
    """Refuse measurement settings that cannot give a mean, before any rank starts."""
    if args.warmup < 0 or args.repeats < 1:
        raise ValueError(f"--warmup must be >= 0 and --repeats >= 1, got {args.warmup} and {args.repeats}")
    if not (math.isfinite(args.min_time) and args.min_time >= 0):
        raise ValueError(f"--min-time must be a finite number of seconds >= 0, got {args.min_time}")
    if args.calibration_steps < 1:
        raise ValueError(f"--calibration-steps must be >= 1, got {args.calibration_steps}")


def run_profile(args: argparse.Namespace) -> dict:
    """The costs document for the config the flags describe."""
    check_profile_arguments(args)
    config = config_from_args(args)
    refuse_copies(config, "profile")
    if (args.calibration or "stages") == "run":
        return run_calibration(args, config)
    from executor.profile import profile  # noqa: PLC0415 - loads torch

    with progress_from_args("profile", args).phase(f"profiling {config.pp} stages on {config.pp} ranks (one replica)"):
        return profile(config, args.warmup, args.repeats, args.min_time, args.verbose, args.compute_clock)


def run_calibration(args: argparse.Namespace, config) -> dict:
    """The costs document read off ``--calibration-steps`` steps the executor runs of this
    config on all its ranks (``executor.run_costs``)."""
    from executor.launch import launch, validate_schedule  # noqa: PLC0415 - loads torch
    from executor.run_costs import calibration_configs, calibration_document  # noqa: PLC0415

    schedule = validate_schedule(config)
    with progress_from_args("profile", args).phase(
            f"running {args.calibration_steps} calibration steps on {config.world_size} ranks"):
        calibrated = launch(calibration_configs(config, args.calibration_steps), verbose=args.verbose)
    return calibration_document(config, schedule, calibrated)


def describe(document: dict) -> list[str]:
    """One line per stage and one for the overheads, in milliseconds."""
    lines = []
    for entry in document["stages"]:
        stash = f"stash {entry['stash_bytes'] / 1e6:.2f} MB  " if "stash_bytes" in entry else ""
        lines.append(f"stage {entry['stage']}: F {entry['fwd'] * 1e3:.3f} ms  B {entry['bwd'] * 1e3:.3f} ms  "
                     f"I {entry['igrad'] * 1e3:.3f} ms  W {entry['wgrad'] * 1e3:.3f} ms  "
                     f"act {entry['act_bytes'] / 1e3:.1f} kB  {stash}params {entry['param_bytes'] / 1e6:.2f} MB")
    for stage, pair in document.get("meta", {}).get("measured", {}).get("pairs", {}).items():
        lines.append(f"pair F{stage} + B{pair['backward_stage']}: {pair['seconds'] * 1e3:.3f} ms, "
                     f"{pair['factor']:.2f} x their F + B (overlap_fb of stage {stage}; halves "
                     f"{'overlapped' if document.get('pairs_overlap') else 'one after the other'})")
    lines.append(f"overheads: per action {document['action_overhead'] * 1e6:.1f} us, per send/recv "
                 f"{document['comm_overhead'] * 1e6:.1f} us, per step {document['step_overhead'] * 1e3:.3f} ms")
    return lines


def handle(args: argparse.Namespace) -> int:
    if bool(args.out) == bool(args.compute_model):
        raise ValueError("pipesim profile writes stage costs (--out PATH) or a compute model (--compute-model PATH): "
                         "give one of them")
    if args.compute_model:
        check_profile_arguments(args)
        from pipesim.cli.profile_kernels import handle_compute_model  # noqa: PLC0415

        return handle_compute_model(args)
    if args.gpu:
        raise ValueError("--gpu names the GPU of a --compute-model profile; stage costs (--out) are measured as they "
                         "are; drop --gpu")
    from executor.launch import PipelineRunError  # noqa: PLC0415 - loads torch
    from executor.spawn import SpawnError  # noqa: PLC0415

    try:
        document = run_profile(args)
    except (PipelineRunError, SpawnError) as error:
        print(f"pipesim profile: failed: {error}", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    print("\n".join(describe(document)))
    print(f"wrote {args.out}")
    return 0
