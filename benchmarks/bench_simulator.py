"""Simulator speed against torch.distributed.pipelining's own dry run.

For interleaved 1F1B at (p=32, m=128, v=2) and (p=64, m=512, v=2):

1. Like with like: both walk the same lowered programs. pipesim's timed simulation
   (durations, an InfiniBand cluster's links, NCCL rendezvous semantics, a Trace of
   every action), on its own event kernel and on SimPy (the reference it is tested
   against, ``tests/test_engine_fast.py``), beside torch's
   unit-step ``_simulate_comms_compute`` given the very same programs as torch
   ``_Action`` lists (P2P groups flattened in program order). Reported as lowered
   actions per second; the programs and their conversion are built before the clock
   starts, so neither side pays for the other's input.
2. End to end, apart: what ``pipesim simulate`` does (generate + lower + simulate +
   metrics; validation, which ``run_simulation`` also runs, in its own column) beside
   torch's generate + lower (``_add_send_recv``) + dry run.

Each figure is the best of ``--repeats`` runs, in CPU seconds of this process
(``time.process_time``): the machine is shared, and CPU time is what the work costs on
a core of its own. ``--profile`` prints cProfile's top functions of pipesim's
simulation of the largest case.

Run: ``python benchmarks/bench_simulator.py`` (``--quick``: the small case only).
Targets: throughput ratio >= 2x; p=64 m=512 v=2 end to end <= 1 s.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from torch.distributed.pipelining import schedules as torch_schedules

from pipesim.cluster.presets import ib
from pipesim.model.costs import uniform_costs
from pipesim.sim.engine import simulate
from schedules import generate, lower
from schedules.metrics import step_metrics
from schedules.validate import validate

CASES = ((32, 128, 2), (64, 512, 2))


def torch_order(schedule) -> dict[int, list]:
    """Our lowered programs as torch ``_Action`` lists, keyed by rank."""
    parse = torch_schedules._Action.from_str
    return {rank: [parse(str(action)) for action in program] for rank, program in enumerate(schedule.programs)}


def torch_generate(pp: int, microbatches: int, chunks: int) -> dict[int, list]:
    """torch's interleaved 1F1B compute order, without building real pipeline stages."""
    generator = torch_schedules.ScheduleInterleaved1F1B.__new__(torch_schedules.ScheduleInterleaved1F1B)
    generator.pp_group_size = pp
    generator.n_local_stages = chunks
    generator._n_microbatches = microbatches
    generator.number_of_rounds = max(1, microbatches // pp)
    generator.microbatches_per_round = microbatches // generator.number_of_rounds
    return {rank: generator._calculate_single_rank_operations(rank) for rank in range(pp)}


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


def bench_case(pp: int, microbatches: int, chunks: int, repeats: int) -> dict:
    lowered = lower(generate("interleaved-1f1b", pp, microbatches, chunks))
    costs = uniform_costs(lowered.num_stages, 10e-3, 20e-3, act_bytes=64e6, virtual_stages=chunks)
    topology = ib(max(1, pp // 8))
    simulate(lowered, costs, topology)  # routes cached, as a planner reusing the cluster has them
    order = torch_order(lowered)
    ours_sim = best_of(repeats, simulate, lowered, costs, topology)
    simpy_sim = best_of(repeats, lambda: simulate(lowered, costs, topology, kernel="simpy"))
    torch_sim = best_of(repeats, torch_dry_run, order, pp, lowered.num_stages)

    def ours_end_to_end():
        fresh = lower(generate("interleaved-1f1b", pp, microbatches, chunks))
        step_metrics(simulate(fresh, costs, topology), chunks)

    def torch_end_to_end():
        compute = torch_generate(pp, microbatches, chunks)
        lowered_order = torch_schedules._add_send_recv(compute, lambda stage: stage % pp, pp * chunks)
        torch_dry_run(lowered_order, pp, pp * chunks)

    return {
        "case": f"p={pp} m={microbatches} v={chunks}",
        "actions": lowered.num_actions,
        "ours_rate": lowered.num_actions / ours_sim,
        "simpy_rate": lowered.num_actions / simpy_sim,
        "torch_rate": lowered.num_actions / torch_sim,
        "ours_e2e": best_of(repeats, ours_end_to_end),
        "validate": best_of(repeats, validate, lowered),
        "torch_e2e": best_of(repeats, torch_end_to_end),
    }


def profile(pp: int, microbatches: int, chunks: int) -> None:
    lowered = lower(generate("interleaved-1f1b", pp, microbatches, chunks))
    costs = uniform_costs(lowered.num_stages, 10e-3, 20e-3, act_bytes=64e6, virtual_stages=chunks)
    topology = ib(max(1, pp // 8))
    profiler = cProfile.Profile()
    profiler.runcall(simulate, lowered, costs, topology)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small case")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure, best kept (default: 3)")
    parser.add_argument("--profile", action="store_true", help="cProfile pipesim's simulation of the largest case")
    args = parser.parse_args()
    cases = CASES[:1] if args.quick else CASES
    print("1. simulation of the same lowered programs (lowered actions per second)")
    header = (f"{'case':<18} {'actions':>8} {'pipesim act/s':>14} {'on SimPy':>9} {'torch act/s':>12} "
              f"{'ratio':>6} {'on SimPy':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    for pp, microbatches, chunks in cases:
        row = bench_case(pp, microbatches, chunks, args.repeats)
        rows.append(row)
        print(f"{row['case']:<18} {row['actions']:>8} {row['ours_rate']:>14,.0f} {row['simpy_rate']:>9,.0f} "
              f"{row['torch_rate']:>12,.0f} {row['ours_rate'] / row['torch_rate']:>5.1f}x "
              f"{row['simpy_rate'] / row['torch_rate']:>8.1f}x", flush=True)
    print("\n2. end to end (CPU seconds): pipesim generate + lower + simulate + metrics; "
          "torch generate + lower + dry run")
    header = f"{'case':<18} {'pipesim s':>10} {'+ validate s':>13} {'torch s':>8} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['case']:<18} {row['ours_e2e']:>10.2f} {row['validate']:>13.2f} {row['torch_e2e']:>8.2f} "
              f"{row['torch_e2e'] / row['ours_e2e']:>5.1f}x")
    print("ratios: pipesim's throughput over torch's; torch's end-to-end time over pipesim's (higher is better).")
    print("targets: throughput ratio >= 2x; p=64 m=512 v=2 end to end <= 1 s.")
    if args.profile:
        profile(*cases[-1])


if __name__ == "__main__":
    main()
