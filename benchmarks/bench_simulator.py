"""Simulator speed against torch.distributed.pipelining's own dry run.

For interleaved 1F1B at (p=32, m=128, v=2) and (p=64, m=512, v=2):

1. Like with like: both time the same lowered programs. pipesim's side is what a caller
   waits for from a lowered schedule it has not simulated before: reading the programs
   into arrays and compiling them for the engine (a fresh copy of the schedule each run,
   so nothing is cached on it), the timed simulation (durations, an InfiniBand cluster's
   links, NCCL rendezvous semantics) and the Trace of every action. torch's side is
   ``_simulate_comms_compute`` given the very same programs as torch ``_Action`` lists
   (P2P groups flattened in program order), which it walks in unit steps (no durations,
   no links, no trace). Both are built before the clock starts, so neither side pays for
   the other's input. Reported as lowered actions per second; the SimPy model of the
   engine's rules (``schedules.engine_reference``, the specification and the fallback
   without a compiler) alongside.
2. The whole command, apart: ``pipesim simulate`` as a user runs it (a new process:
   Python's start, imports of modules compiled as an install compiles them
   (``installed.py``), generate, lower, validate, simulate, metrics, the printed
   summary) beside a new process that imports torch's pipelining, generates its order,
   lowers it (``_add_send_recv``) and dry-runs it. Wall seconds of each process.

Part 1 figures are the best of ``--repeats`` runs in CPU seconds of this process
(``time.process_time``: the machine is shared, and CPU time is what the work costs on a
core of its own); part 2 is wall time, the best of ``--repeats``. ``--profile`` prints
cProfile's top functions of the whole ``simulate`` command at the largest case.

Run: ``python benchmarks/bench_simulator.py`` (``--quick``: the small case only).
Targets: throughput ratio >= 2x at both sizes; p=64 m=512 v=2 as a command <= 1.5 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
import time

from installed import installed_env
from torch.distributed.pipelining import schedules as torch_schedules

from pipesim.cluster.presets import ib
from pipesim.model.costs import uniform_costs
from pipesim.sim.engine import rank_devices_of, simulate, step_timing
from schedules import engine, generate, lower
from schedules.engine_reference import run_reference

CASES = ((32, 128, 2), (64, 512, 2))


def torch_order(schedule) -> dict[int, list]:
    """Our lowered programs as torch ``_Action`` lists, keyed by rank."""
    parse = torch_schedules._Action.from_str
    return {rank: [parse(str(action)) for action in program] for rank, program in enumerate(schedule.programs)}


def torch_dry_run(order: dict[int, list], pp: int, num_stages: int) -> None:
    # the dry run consumes its input lists, so it gets copies
    torch_schedules._simulate_comms_compute({rank: list(actions) for rank, actions in order.items()},
                                            lambda stage: stage % pp, num_stages)


def best_of(repeats: int, function, *args) -> float:
    """Fewest CPU seconds ``function(*args)`` took over ``repeats`` runs."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.process_time()
        function(*args)
        best = min(best, time.process_time() - start)
    return best


def fresh(schedule):
    """The same schedule as a new object: nothing compiled or kept with it yet."""
    return dataclasses.replace(schedule)


def reference_step(lowered, costs, topology) -> None:
    """The SimPy model's run of the same step (compiled program given, as the engine's is)."""
    program = engine.compile_program(lowered, "rendezvous")
    timing = step_timing(lowered, costs, topology, rank_devices_of(lowered, topology, None))
    seconds, hold = engine.compute_costs(program, timing)
    run_reference(program, seconds, hold, engine.wire_arrays(timing.wires, program.arrays), 0.0)


COMMAND = ["-m", "pipesim", "simulate", "--schedule", "interleaved-1f1b", "--pp", "{pp}", "-m", "{m}", "-v", "{v}",
           "--topology", "ib", "--nodes", "{nodes}", "--act-bytes", "1e7"]
TORCH_COMMAND = """
from torch.distributed.pipelining import schedules as s
pp, m, v = {pp}, {m}, {v}
g = s.ScheduleInterleaved1F1B.__new__(s.ScheduleInterleaved1F1B)
g.pp_group_size, g.n_local_stages, g._n_microbatches = pp, v, m
g.number_of_rounds = max(1, m // pp)
g.microbatches_per_round = m // g.number_of_rounds
compute = {{rank: g._calculate_single_rank_operations(rank) for rank in range(pp)}}
lowered = s._add_send_recv(compute, lambda stage: stage % pp, pp * v)
s._simulate_comms_compute(lowered, lambda stage: stage % pp, pp * v)
"""


def wall_of(repeats: int, argv: list[str]) -> float:
    """The best wall seconds of a new process running ``argv``, pipesim's modules compiled
    as an install compiles them (``installed.py``; torch's are, being installed)."""
    best = float("inf")
    with tempfile.TemporaryDirectory() as folder:
        env = installed_env(folder)
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            subprocess.run([sys.executable, *argv], check=True, stdout=subprocess.DEVNULL, env=env)
            best = min(best, time.perf_counter() - start)
    return best


def bench_case(pp: int, microbatches: int, chunks: int, repeats: int) -> dict:
    lowered = lower(generate("interleaved-1f1b", pp, microbatches, chunks))
    costs = uniform_costs(lowered.num_stages, 10e-3, 20e-3, act_bytes=64e6, virtual_stages=chunks)
    topology = ib(max(1, pp // 8))
    simulate(fresh(lowered), costs, topology)  # routes cached on the cluster, as a planner reusing it has them
    order = torch_order(lowered)
    ours = best_of(repeats, lambda: simulate(fresh(lowered), costs, topology))
    spec = best_of(1, reference_step, fresh(lowered), costs, topology)
    theirs = best_of(repeats, torch_dry_run, order, pp, lowered.num_stages)
    fields = {"pp": pp, "m": microbatches, "v": chunks, "nodes": max(1, pp // 8)}
    return {
        "case": f"p={pp} m={microbatches} v={chunks}",
        "actions": lowered.num_actions,
        "ours_rate": lowered.num_actions / ours,
        "reference_rate": lowered.num_actions / spec,
        "torch_rate": lowered.num_actions / theirs,
        "command": wall_of(repeats, [part.format(**fields) for part in COMMAND]),
        "torch_command": wall_of(repeats, ["-c", TORCH_COMMAND.format(**fields)]),
    }


def profile(pp: int, microbatches: int, chunks: int) -> None:
    import cProfile
    import pstats

    from pipesim.cli import main

    argv = [part.format(pp=pp, m=microbatches, v=chunks, nodes=max(1, pp // 8)) for part in COMMAND[2:]]
    profiler = cProfile.Profile()
    profiler.runcall(main, argv)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small case")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure, best kept (default: 3)")
    parser.add_argument("--profile", action="store_true", help="cProfile the simulate command at the largest case")
    args = parser.parse_args()
    cases = CASES[:1] if args.quick else CASES
    print("1. the same lowered programs, compilation counted (lowered actions per CPU second)")
    header = (f"{'case':<18} {'actions':>8} {'pipesim act/s':>14} {'SimPy model':>12} {'torch act/s':>12} "
              f"{'ratio':>6}")
    print(header)
    print("-" * len(header))
    rows = []
    for pp, microbatches, chunks in cases:
        row = bench_case(pp, microbatches, chunks, args.repeats)
        rows.append(row)
        print(f"{row['case']:<18} {row['actions']:>8} {row['ours_rate']:>14,.0f} {row['reference_rate']:>12,.0f} "
              f"{row['torch_rate']:>12,.0f} {row['ours_rate'] / row['torch_rate']:>5.1f}x", flush=True)
    print("\n2. the whole command, a new process each (wall seconds): `pipesim simulate` (generate, lower, validate, "
          "simulate, metrics, summary) vs torch (generate, lower, dry run)")
    header = f"{'case':<18} {'pipesim s':>10} {'torch s':>8} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['case']:<18} {row['command']:>10.2f} {row['torch_command']:>8.2f} "
              f"{row['torch_command'] / row['command']:>5.1f}x")
    print("ratios: pipesim's throughput over torch's; torch's time over pipesim's (higher is better).")
    print("pipesim times durations, links and NCCL's rendezvous and records a Trace; torch's dry run walks unit "
          "steps with neither. targets: throughput ratio >= 2x; p=64 m=512 v=2 command <= 1.5 s.")
    if args.profile:
        profile(*cases[-1])


if __name__ == "__main__":
    main()
