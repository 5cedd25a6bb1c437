"""Zero-bubble schedules measured on the executor beside their prediction: ZB-H1, ZB-V
and 1F1B (the peer every ratio is taken against), gpt, 4 ranks on gloo. The measured
half of ``bench_zero_bubble.py`` (which simulates every schedule on model costs).

For each schedule, as a user would do it (and as ``bench_fidelity.py`` does): profile
the config (``pipesim profile``: F, B, I, W per stage, on the schedule's own placement),
benchmark the links once (``bench-comm`` send/recv on 4 ranks), run it (``pipesim run``,
new processes) and simulate the same lowered programs with those costs and links. The
split backward runs as ``executor/split_backward.py`` does it, so a zero-bubble schedule's
measured gain over 1F1B is the one the hardware gives, not an artefact of W repeating B.

    PYTHONPATH=. python benchmarks/bench_zero_bubble_measured.py [--passes 3] [--microbatches 8,16]

Prints one row per (schedule, m): measured and predicted step time, the prediction's
error, and each schedule's step time as a ratio of 1F1B's in the same pass, measured and
predicted. Every config is profiled and run ``--passes`` times, a pass over all configs
at a time (a row holds the medians), so a slow spell of a shared machine lands on every
schedule rather than on one.

On a CPU machine each rank should have a core of its own: with fewer cores than ranks
the measured steps include time the ranks wait for a core, which the cluster model does
not describe (the profile times CPU time of a rank's own thread); the benchmark says so
when it happens, and the ratios to 1F1B remain the fairer comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fidelity import wait_until_idle  # noqa: E402 - a sibling script, not a package

PEER = "1f1b"
SCHEDULES = ("zb-h1", "zbv", PEER)
RANKS = 4
MICROBATCH_SIZE = 2
MODEL = {"layers": 8, "hidden": 128, "seq_len": 64, "vocab": 256, "heads": 4}


def config_for(schedule: str, microbatches: int, steps: int):
    from executor.config import RunConfig  # noqa: PLC0415
    from schedules.generators import MULTI_CHUNK  # noqa: PLC0415

    virtual = 2 if schedule in MULTI_CHUNK else 1
    return RunConfig(schedule=schedule, pp=RANKS, microbatches=microbatches, virtual_stages=virtual, model="gpt",
                     batch_size=MICROBATCH_SIZE * microbatches, steps=steps, threads=1, backend="gloo", **MODEL)


def parse_arguments() -> argparse.Namespace:
    from schedules.generators import GENERATORS  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help=f"comma list (default {','.join(SCHEDULES)}); {PEER} is always added as the peer")
    parser.add_argument("--microbatches", default="8", help="comma list of microbatch counts (default 8)")
    parser.add_argument("--steps", type=int, default=11, help="steps per run; the first is left out (default 11)")
    parser.add_argument("--passes", type=int, default=1,
                        help="profile and run every config this many times (default 1)")
    parser.add_argument("--repeats", type=int, default=20, help="profile repetitions (default 20)")
    parser.add_argument("--min-time", type=float, default=1.0, help="profile each stage at least this long (default 1)")
    parser.add_argument("--wait", type=float, default=30.0,
                        help="seconds to wait for idle CPUs before each profile and run (default 30)")
    parser.add_argument("--json", help="write every row as JSON (a list; each row's schedule, pp, microbatches and "
                        "step_time are what bench_zero_bubble.py --measured reads)")
    args = parser.parse_args()
    names = [name for name in args.schedules.split(",") if name]
    unknown = sorted(set(names) - set(GENERATORS))
    if unknown:
        parser.error(f"unknown schedule(s) {', '.join(unknown)}; available: {', '.join(sorted(GENERATORS))}")
    args.schedule_names = names if PEER in names else [*names, PEER]
    args.microbatch_counts = [int(m) for m in args.microbatches.split(",")]
    if args.passes < 1 or args.steps < 2:
        parser.error("--passes must be >= 1 and --steps >= 2 (the first step is left out)")
    return args


def main() -> None:
    args = parse_arguments()

    from executor.bench_comm import bench_comm  # noqa: PLC0415
    from executor.launch import launch  # noqa: PLC0415
    from executor.profile import profile  # noqa: PLC0415
    from executor.worker import build_schedule  # noqa: PLC0415
    from pipesim.cluster.comm_fit import fits_by_operation, topology_document  # noqa: PLC0415
    from pipesim.cluster.files import topology_from_dict  # noqa: PLC0415
    from pipesim.model.costs import costs_from_dict  # noqa: PLC0415
    from pipesim.sim.comparison import measured_step_time  # noqa: PLC0415
    from pipesim.sim.step import run_simulation  # noqa: PLC0415

    cores = os.cpu_count() or 1
    print(f"load average before: {os.getloadavg()}  cores: {cores}  ranks: {RANKS}")
    if cores < RANKS:
        print(f"note: {RANKS} ranks share {cores} cores: measured steps include waiting for a core, which the "
              "prediction does not; compare the ratios to 1f1b")
    started = time.perf_counter()
    bench = bench_comm(RANKS, ["sendrecv"], [2**k for k in range(10, 25, 2)], "gloo", 1)
    topology = topology_from_dict(topology_document(bench, fits_by_operation(bench)), name="bench-comm")
    configs = [(name, m) for m in args.microbatch_counts for name in args.schedule_names]
    trials: dict[tuple[str, int], list[dict]] = {config: [] for config in configs}
    for number in range(args.passes):
        for name, m in configs:
            config = config_for(name, m, args.steps)
            wait_until_idle(args.wait)
            document = profile(config, 3, args.repeats, args.min_time)
            wait_until_idle(args.wait)
            (result,) = launch(config)
            measured = measured_step_time(result["step_times"], 1)
            lowered = build_schedule(config)
            predicted = run_simulation(lowered, costs_from_dict(document, lowered.num_stages, name="profile"),
                                       topology).metrics.makespan
            trials[(name, m)].append({"pass": number, "measured": measured, "predicted": predicted,
                                      "step_times": result["step_times"], "stages": document["stages"]})
            print(f"pass {number + 1}/{args.passes}  {name:<17} m={m:<3} measured {measured * 1e3:8.2f} ms  "
                  f"predicted {predicted * 1e3:8.2f} ms  error {(predicted - measured) / measured:+6.1%}", flush=True)
    rows = []
    for (name, m), runs in trials.items():
        peer = trials[(PEER, m)]
        measured = statistics.median(run["measured"] for run in runs)
        predicted = statistics.median(run["predicted"] for run in runs)
        rows.append({
            "schedule": name, "pp": RANKS, "microbatches": m, "step_time": measured,
            "measured": measured, "predicted": predicted,
            "error": (predicted - measured) / measured,
            # the ratio to 1F1B within each pass, then the median over passes
            "measured_vs_1f1b": statistics.median(run["measured"] / base["measured"]
                                                  for run, base in zip(runs, peer, strict=True)),
            "predicted_vs_1f1b": statistics.median(run["predicted"] / base["predicted"]
                                                   for run, base in zip(runs, peer, strict=True)),
            "passes": runs,
        })
    print()
    print(f"gpt {MODEL}, microbatch size {MICROBATCH_SIZE}, {RANKS} ranks on gloo, {cores} cores, "
          f"median of {args.steps - 1} steps, {args.passes} pass(es)")
    print("| schedule | m | measured (ms) | predicted (ms) | error | measured / 1f1b | predicted / 1f1b |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['schedule']} | {row['microbatches']} | {row['measured'] * 1e3:.2f} | "
              f"{row['predicted'] * 1e3:.2f} | {row['error']:+.1%} | {row['measured_vs_1f1b']:.3f} | "
              f"{row['predicted_vs_1f1b']:.3f} |")
    print(f"\n({time.perf_counter() - started:.0f} s) load average after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps([{**row, "model": MODEL, "cores": cores} for row in rows], indent=2))


if __name__ == "__main__":
    main()
