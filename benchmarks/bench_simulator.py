"""Simulator speed against torch.distributed.pipelining's own dry run.

For interleaved 1F1B at (p=32, m=128, v=2) and (p=64, m=512, v=2):
  1. simulation throughput: lowered actions per second of pipesim's SimPy engine (with
     durations and an InfiniBand cluster's links) beside torch's unit-step
     ``_simulate_comms_compute`` on the same lowered programs;
  2. end to end: ``pipesim simulate``'s work (generate, lower, validate, simulate,
     metrics) beside torch's generate + lower + dry run.

Run: ``python benchmarks/bench_simulator.py`` (add ``--quick`` for the small case only).
"""

from __future__ import annotations

import argparse
import time

from torch.distributed.pipelining import schedules as torch_schedules

from pipesim.costs import uniform_costs
from pipesim.engine import simulate
from pipesim.presets import ib
from pipesim.simulation import run_simulation
from schedules import generate, lower

CASES = ((32, 128, 2), (64, 512, 2))


def torch_order(schedule) -> dict[int, list]:
    """Our programs as torch ``_Action`` lists, keyed by rank."""
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
    torch_schedules._simulate_comms_compute(dict(order), lambda stage: stage % pp, num_stages)


def timed(function, *args):
    start = time.perf_counter()
    value = function(*args)
    return time.perf_counter() - start, value


def bench_case(pp: int, microbatches: int, chunks: int) -> dict:
    schedule = generate("interleaved-1f1b", pp, microbatches, chunks)
    lowered = lower(schedule)
    costs = uniform_costs(lowered.num_stages, 10e-3, 20e-3, act_bytes=64e6, virtual_stages=chunks)
    topology = ib(max(1, pp // 8))
    actions = lowered.num_actions

    ours_sim, _ = timed(simulate, lowered, costs, topology)
    order = torch_order(lowered)
    torch_sim, _ = timed(torch_dry_run, order, pp, lowered.num_stages)

    def ours_end_to_end():
        fresh = generate("interleaved-1f1b", pp, microbatches, chunks)
        return run_simulation(fresh, costs, ib(max(1, pp // 8)))

    def torch_end_to_end():
        compute = torch_generate(pp, microbatches, chunks)
        lowered_order = torch_schedules._add_send_recv(compute, lambda stage: stage % pp, pp * chunks)
        torch_dry_run(lowered_order, pp, pp * chunks)

    ours_e2e, result = timed(ours_end_to_end)
    torch_e2e, _ = timed(torch_end_to_end)
    return {
        "case": f"p={pp} m={microbatches} v={chunks}",
        "actions": actions,
        "ours_rate": actions / ours_sim,
        "torch_rate": actions / torch_sim,
        "ours_e2e": ours_e2e,
        "torch_e2e": torch_e2e,
        "makespan": result.metrics.makespan,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small case")
    args = parser.parse_args()
    cases = CASES[:1] if args.quick else CASES
    print("simulation throughput (lowered actions per second) and end-to-end seconds")
    header = (f"{'case':<20} {'actions':>8} {'pipesim act/s':>14} {'torch act/s':>12} {'ratio':>6} "
              f"{'pipesim e2e s':>14} {'torch e2e s':>12} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for pp, microbatches, chunks in cases:
        row = bench_case(pp, microbatches, chunks)
        print(
            f"{row['case']:<20} {row['actions']:>8} {row['ours_rate']:>14,.0f} {row['torch_rate']:>12,.0f} "
            f"{row['ours_rate'] / row['torch_rate']:>5.1f}x {row['ours_e2e']:>14.2f} {row['torch_e2e']:>12.2f} "
            f"{row['torch_e2e'] / row['ours_e2e']:>5.1f}x",
            flush=True,
        )
    print("ratio: pipesim's throughput over torch's (higher is better); e2e ratio: torch's time over pipesim's.")
    print("targets: throughput ratio >= 5x; p=64 m=512 v=2 end to end < 5 s.")


if __name__ == "__main__":
    main()
