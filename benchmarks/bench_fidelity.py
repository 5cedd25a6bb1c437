"""How well a calibrated prediction matches a separate run: GPipe, 1F1B and interleaved
1F1B, two GPT sizes, 4, 8 and 16 microbatches, 2 ranks on gloo, one torch thread each.

Order of work, as a user would do it, for each config: profile it (``profile``, its own
processes), benchmark the links (``bench-comm``, send/recv), run it (``run``, new
processes, nothing from the profile reused but its costs document) and simulate it with
those costs and links (``simulate --costs --topology``). Each prediction is held against
the median step time of the run. Prints a table and the median and maximum absolute
error.

    PYTHONPATH=. python benchmarks/bench_fidelity.py [--passes 3] [--json fidelity.json]

All of it is done ``--passes`` times (default 3, about 22 minutes on 2 cores; one pass
takes about 7), a pass over all configs at a time, and a row holds the median
prediction and the median measurement with each pass's error beside them: on a shared
VM a slow spell during one run moves a small config's step time by up to 20%, which
no calibration taken minutes earlier can follow (docs/calibration.md).

The links are measured again for each config (``--links once`` measures them once, up
front): on a shared VM gloo's latency drifts with the host's load over minutes, and a
calibration taken minutes before a run describes another machine.

On a CPU machine give each rank its own core (2 ranks on 2 cores): ranks that share a
core slow each other in a way the cluster model does not describe. Other work on the
machine does the same, so before each profile and each run the benchmark waits (up to
``--wait`` seconds) until the CPUs are idle, and records the idle fraction it saw
(``idle_before``), so a row spoiled by a neighbour can be told from a miss of the model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))
# also measured on request (--schedules): the zero-bubble V and DualPipeV, which run the
# split backward (I and W) the costs file now holds as measured
MORE_SCHEDULES = (("zbv", 2), ("dualpipev", 2))
MICROBATCHES = (4, 8, 16)
MICROBATCH_SIZE = 4
MODELS = {  # name: (layers, hidden, seq_len)
    "gpt-small": (4, 128, 32),
    "gpt-large": (8, 256, 32),
    # on request (--models): as small as gpt-small, with a layer for each of pp 4 x 2 chunks
    "gpt-deep": (8, 128, 32),
}
DEFAULT_MODELS = ("gpt-small", "gpt-large")


def config_for(model: str, schedule: str, virtual: int, microbatches: int, steps: int, pp: int = 2):
    from executor.config import RunConfig  # noqa: PLC0415

    layers, hidden, seq_len = MODELS[model]
    return RunConfig(schedule=schedule, pp=pp, microbatches=microbatches, virtual_stages=virtual, model="gpt",
                     layers=layers, hidden=hidden, seq_len=seq_len, vocab=256, heads=4,
                     batch_size=MICROBATCH_SIZE * microbatches, steps=steps, threads=1, backend="gloo")


def cpu_times() -> tuple[float, float]:
    """(idle, total) jiffies of all CPUs since boot (Linux ``/proc/stat``)."""
    fields = [float(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)


def wait_until_idle(limit: float, threshold: float = 0.9) -> float:
    """Wait until the CPUs were ``threshold`` idle over one second, at most ``limit``
    seconds; return the idle fraction last seen (1.0 where /proc/stat is missing)."""
    if not Path("/proc/stat").exists():
        return 1.0
    deadline = time.monotonic() + limit
    while True:
        idle0, total0 = cpu_times()
        time.sleep(1.0)
        idle1, total1 = cpu_times()
        fraction = (idle1 - idle0) / max(total1 - total0, 1.0)
        if fraction >= threshold or time.monotonic() > deadline:
            return fraction


def older_split(document: dict) -> dict:
    """The costs document as ``pipesim profile`` wrote it before a costs file could hold
    ``I`` and ``W`` apart from ``B``: ``wgrad`` the measured ``W``'s share of ``B`` and
    ``I = B - wgrad``; kept to show what the measured split changes."""
    stages = []
    for entry in document["stages"]:
        entry = dict(entry)
        split = entry.pop("igrad", 0.0) + entry["wgrad"]
        entry["wgrad"] = entry["bwd"] * entry["wgrad"] / split if split > 0 else 0.0
        stages.append(entry)
    return {**document, "stages": stages}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=21, help="steps per run; the first is left out (default 21)")
    parser.add_argument("--repeats", type=int, default=20, help="profile repetitions (default 20)")
    parser.add_argument("--min-time", type=float, default=2.0,
                        help="profile each stage and the transfer cost for at least this many seconds (default 2)")
    parser.add_argument("--passes", type=int, default=3,
                        help="profile, benchmark and run every config this many times, a pass over all configs "
                             "at a time; a row holds the median prediction and the median measurement (default 3; "
                             "1 for a quick look)")
    parser.add_argument("--links", choices=("per-config", "once"), default="per-config",
                        help="benchmark send/recv before each run (default) or once up front")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma list of {', '.join(MODELS)} (default {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--schedules", default=",".join(name for name, _ in SCHEDULES),
                        help="comma list of schedules (default: the first three of "
                             f"{', '.join(name for name, _ in SCHEDULES + MORE_SCHEDULES)})")
    parser.add_argument("--pp", default="2", help="comma list of pipeline sizes (default 2)")
    parser.add_argument("--compute-clock", choices=("thread", "wall"), default="thread",
                        help="how the profile times a CPU stage's compute (pipesim profile --compute-clock)")
    parser.add_argument("--microbatches", default=",".join(map(str, MICROBATCHES)),
                        help="comma list of microbatch counts (default 4,8,16)")
    parser.add_argument("--json", help="write every row as JSON")
    parser.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for idle CPUs before each profile and run (default 60)")
    args = parser.parse_args()
    unknown = set(args.models.split(",")) - set(MODELS)
    unknown |= set(args.schedules.split(",")) - {name for name, _ in SCHEDULES + MORE_SCHEDULES}
    if unknown:
        parser.error(f"unknown model or schedule: {', '.join(sorted(unknown))}")
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
    from pipesim.sim.comparison import kept_steps, step_spread  # noqa: PLC0415
    from pipesim.sim.step import run_simulation  # noqa: PLC0415

    print(f"load average before: {os.getloadavg()}  cores: {os.cpu_count()}")
    started = time.perf_counter()

    def measure_links(ranks: int) -> tuple[object, dict]:
        """send/recv on ``ranks`` ranks (one device each in the topology), fitted."""
        bench = bench_comm(ranks, ["sendrecv"], [2**k for k in range(10, 25, 2)], "gloo", 1)
        fits = fits_by_operation(bench)
        return topology_from_dict(topology_document(bench, fits), name="bench-comm"), fits["sendrecv"]

    links_once = measure_links(max(int(pp) for pp in args.pp.split(","))) if args.links == "once" else None
    virtual_of = dict(SCHEDULES + MORE_SCHEDULES)
    configs = [(model, schedule, virtual_of[schedule], int(m), int(pp)) for model in args.models.split(",")
               for pp in args.pp.split(",") for schedule in args.schedules.split(",")
               for m in args.microbatches.split(",")]
    trials: dict[tuple, list[dict]] = {config: [] for config in configs}
    for number in range(args.passes):
        for model, schedule, virtual, m, pp in configs:
            config = config_for(model, schedule, virtual, m, args.steps, pp)
            idle_before_profile = wait_until_idle(args.wait)
            document = profile(config, 3, args.repeats, args.min_time, clock=args.compute_clock)
            topology, link_fit = links_once or measure_links(pp)
            idle_before_run = wait_until_idle(args.wait)
            (result,) = launch(config)
            load = os.getloadavg()[0]
            spread = step_spread(kept_steps(result["step_times"], 1))
            measured = spread["median"]
            lowered = build_schedule(config)
            costs = costs_from_dict(document, lowered.num_stages, name="profile")
            predicted = run_simulation(lowered, costs, topology).metrics.makespan
            older = costs_from_dict(older_split(document), lowered.num_stages, name="profile")
            predicted_older = run_simulation(lowered, older, topology).metrics.makespan
            trial = {"pass": number, "pp": pp, "measured": measured, "predicted": predicted,
                     "error": (predicted - measured) / measured, "step_times": result["step_times"],
                     "predicted_older_split": predicted_older,
                     "error_older_split": (predicted_older - measured) / measured,
                     "relative_spread": spread["relative_spread"], "load_after_run": load,
                     "comm_overhead": document["comm_overhead"], "step_overhead": document["step_overhead"],
                     "link_latency": link_fit["latency"], "link_bandwidth": link_fit["bandwidth"],
                     "idle_before": [round(idle_before_profile, 3), round(idle_before_run, 3)]}
            trials[(model, schedule, virtual, m, pp)].append(trial)
            print(f"pass {number + 1}/{args.passes}  {model:<10} {schedule:<17} pp={pp} m={m:<3} "
                  f"measured {measured * 1e3:8.2f} ms (IQR {spread['relative_spread']:.1%})  "
                  f"predicted {predicted * 1e3:8.2f} ms  error {trial['error']:+6.1%} "
                  f"(I + W squeezed into B: {trial['error_older_split']:+6.1%})  load {load:.1f}  "
                  f"idle before {trial['idle_before']}  "
                  f"per transfer {document['comm_overhead'] * 1e6:.0f} us  "
                  f"link latency {link_fit['latency'] * 1e6:.0f} us", flush=True)
    rows = []
    for (model, schedule, _, m, pp), runs in trials.items():
        measured = statistics.median(run["measured"] for run in runs)
        predicted = statistics.median(run["predicted"] for run in runs)
        rows.append({"model": model, "schedule": schedule, "pp": pp, "microbatches": m, "measured": measured,
                     "predicted": predicted, "error": (predicted - measured) / measured, "passes": runs})
    errors = [abs(row["error"]) for row in rows]
    print()
    print("| model | schedule | pp | m | measured (ms) | predicted (ms) | error | error of each pass "
          "| I + W squeezed into B | load after each run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        each = " ".join(f"{run['error']:+.1%}" for run in row["passes"])
        older = " ".join(f"{run['error_older_split']:+.1%}" for run in row["passes"])
        loads = " ".join(f"{run['load_after_run']:.1f}" for run in row["passes"])
        print(f"| {row['model']} | {row['schedule']} | {row['pp']} | {row['microbatches']} | "
              f"{row['measured'] * 1e3:.2f} | {row['predicted'] * 1e3:.2f} | {row['error']:+.1%} | {each} | "
              f"{older} | {loads} |")
    print(f"\nmedian |error| {statistics.median(errors):.1%}, max |error| {max(errors):.1%} over {len(rows)} configs, "
          f"{args.passes} pass(es) ({time.perf_counter() - started:.0f} s)")
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
