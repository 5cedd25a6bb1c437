"""What ``pipesim compare`` calibrated, written in the forms ``pipesim simulate`` reads,
and the simulate command that gives its prediction back from them.

A comparison's prediction is made of three things the user cannot otherwise get at: the
costs read off the run's calibration steps (``--costs-out``: F, B, I, W per stage and
chunk, the runtime's overheads, the pairs as the run ran them), the links it benchmarked
with every collective it calibrated on the run's own steps (``--topology-out``), and the
lowered programs it simulated (``--schedule-out``). The programs matter: compare's
calibration steps run the programs lowered before any cost is known, where simulate
lowers a generated schedule for the costs it is given, so the same flags can place the
transfers elsewhere and predict another step. Without ``--schedule-out`` the command
names the schedule by its flags, and the in-process check below says whether that gives
the same step.
"""

from __future__ import annotations

import argparse
import math
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executor.config import RunConfig
    from pipesim.cluster.topology import Topology
    from pipesim.model.costs import Costs
    from pipesim.sim.parallel import ParallelConfig
    from schedules.schedule import Schedule

OUTPUT_FILES = ("costs_out", "topology_out", "schedule_out")
# how close simulate's step must come to compare's prediction to be called the same step
SAME_STEP = 1e-9


def add_calibration_file_arguments(group: argparse._ArgumentGroup) -> None:
    """``--costs-out``, ``--topology-out`` and ``--schedule-out`` (the ``--out`` of
    ``profile`` and ``bench-comm``, one per file compare can write)."""
    group.add_argument("--costs-out", metavar="PATH",
                       help="write the costs the prediction used (a costs file for simulate --costs: F, B, I, W per "
                            "stage as calibrated, the runtime's overheads)")
    group.add_argument("--topology-out", metavar="PATH",
                       help="write the links and calibrated collectives the prediction used (a topology file for "
                            "simulate --topology)")
    group.add_argument("--schedule-out", metavar="PATH",
                       help="write the lowered programs the run ran and the prediction simulated (a schedule CSV for "
                            "simulate --schedule-file); with --costs-out and --topology-out, the simulate command "
                            "compare prints gives its predicted step back")


def check_calibration_files(args: argparse.Namespace) -> None:
    """Refuse, before anything runs, one path given for two files and an ideal topology
    to write (``pipesim.cluster.files.topology_to_dict``). Every schedule the executor
    runs has a CSV form (it refuses DualPipe's two copies of the model, which has none)."""
    given = [(f"--{dest.replace('_', '-')}", getattr(args, dest)) for dest in OUTPUT_FILES if getattr(args, dest)]
    seen: dict[str, str] = {}
    for flag, path in given:
        if path in seen:
            raise ValueError(f"{flag} {path}: {seen[path]} writes that file too; give each its own path")
        seen[path] = flag
    if args.topology_out and args.topology == "ideal":
        raise ValueError(f"--topology-out {args.topology_out}: --topology ideal has free links and no file form; "
                         "simulate takes it by name (--topology ideal)")


def write_calibration_files(args: argparse.Namespace, costs: Costs, topology: Topology,
                            simulated: Schedule) -> list[str]:
    """Write the files asked for; return their paths."""
    written = []
    if args.costs_out:
        costs.save(args.costs_out)
        written.append(args.costs_out)
    if args.topology_out:
        from pipesim.cluster.files import save_topology  # noqa: PLC0415

        save_topology(topology, args.topology_out)
        written.append(args.topology_out)
    if args.schedule_out:
        from schedules.csv_io import schedule_to_csv  # noqa: PLC0415

        schedule_to_csv(simulated, args.schedule_out)
        written.append(args.schedule_out)
    return written


def parallel_flags(parallel: ParallelConfig) -> list[str]:
    """simulate's flags for ``parallel``: dp and tp always, the rest where they are not
    simulate's defaults (a default parsed from simulate's own parser, not restated)."""
    from pipesim.cli import build_parser  # noqa: PLC0415
    from pipesim.job import Job, parallel_of  # noqa: PLC0415

    default = parallel_of(Job.from_namespace(build_parser("simulate").parse_args(["simulate"])))
    flags = ["--dp", str(parallel.dp), "--tp", str(parallel.tp)]
    for flag, name in (("--cp", "cp"), ("--ep", "ep"), ("--etp", "etp"), ("--cp-comm", "cp_comm"),
                       ("--rank-order", "rank_order"),
                       ("--collective", "algorithm"), ("--zero", "zero"), ("--overlap-slowdown", "overlap_slowdown"),
                       ("--zero3-collectives", "zero3_collectives")):
        if getattr(parallel, name) != getattr(default, name):
            flags += [flag, str(getattr(parallel, name))]
    if parallel.bucket_bytes != default.bucket_bytes:
        flags += ["--bucket-mb", repr(parallel.bucket_bytes / 2**20)]
    for flag, name in (("--no-dp-overlap", "overlap_dp"), ("--no-tp-overlap", "overlap_tp"),
                       ("--no-param-gather-overlap", "overlap_param_gather")):
        if not getattr(parallel, name) and getattr(default, name):
            flags.append(flag)
    return flags


def simulate_command(args: argparse.Namespace, config: RunConfig, parallel: ParallelConfig, p2p: str) -> list[str]:
    """The ``pipesim simulate`` arguments that predict compare's step from the files it
    wrote: its costs, its topology, its programs (or the schedule's flags), its P2P
    semantics and its parallelism."""
    from schedules.generators import MULTI_CHUNK  # noqa: PLC0415

    command = ["simulate", "--costs", args.costs_out, "--topology", args.topology_out]
    if args.schedule_out:
        command += ["--schedule-file", args.schedule_out]
    else:
        command += ["--schedule", config.schedule, "--pp", str(config.pp), "--microbatches", str(config.microbatches)]
        if config.schedule in MULTI_CHUNK:
            command += ["--virtual-stages", str(config.virtual_stages)]
        if config.microbatch_group is not None:
            command += ["--microbatch-group", str(config.microbatch_group)]
    return [*command, "--p2p", p2p, *parallel_flags(parallel)]


def simulated_step(command: list[str]) -> float:
    """The step time ``pipesim simulate`` predicts with ``command``, run in this process
    through simulate's own parser and job."""
    from pipesim.cli import build_parser  # noqa: PLC0415
    from pipesim.job import Job, simulate_job  # noqa: PLC0415

    return simulate_job(Job.from_namespace(build_parser("simulate").parse_args(command))).metrics.makespan


def reproduction_lines(command: list[str], predicted: float) -> list[str]:
    """The command, and whether simulate gives compare's predicted step with it (it is
    run here to say so, not assumed); where simulate refuses it, its error, in a note:
    compare has already reported the run and written the files."""
    text = shlex.join(["pipesim", *command])
    try:
        step = simulated_step(command)
    except ValueError as error:  # the run's result stands; what simulate cannot take back is said
        return [f"note: {text} cannot give this prediction back: {error}"]
    if math.isclose(step, predicted, rel_tol=SAME_STEP, abs_tol=0.0):
        return [f"simulate this prediction ({predicted * 1e3:.3f} ms) again: {text}"]
    missing = "" if "--schedule-file" in command else (
        "; the run's programs were lowered before the costs were known, simulate lowers them for the costs: "
        "give --schedule-out too")
    return [f"note: {text} predicts {step * 1e3:.3f} ms, not compare's {predicted * 1e3:.3f} ms{missing}"]
