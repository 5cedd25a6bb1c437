"""The cluster table in docs/cluster-model.md: one model on nvlink, pcie and ib for
GPipe, 1F1B and interleaved 1F1B, with step time, bubble (fraction, and seconds a
rank waited for its producers), exposed communication by kind and peak memory.
Every number comes from the same path as ``pipesim simulate``.

Run: ``PYTHONPATH=. python benchmarks/cluster_table.py`` (prints a Markdown table).
"""

from __future__ import annotations

import argparse

from pipesim.cluster.files import load_topology
from pipesim.cluster.mapping import map_ranks
from pipesim.model.spec import model_costs, model_spec
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from schedules.generators import generate

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))
# (topology, nodes, dp, tp): 8 GPUs in one box; on ib, a second replica on a second
# node, so the pipeline (tp innermost, then dp, then pp) crosses InfiniBand.
CLUSTERS = (("nvlink", 1, 1, 2), ("pcie", 1, 1, 2), ("ib", 2, 2, 2))


def table(model: str, pp: int, microbatches: int) -> str:
    spec = model_spec(model)
    lines = [
        f"{spec.name} (seq {spec.seq_len}, microbatch {spec.microbatch_size}), pp={pp}, "
        f"{microbatches} microbatches, MFU 0.5, bf16 + Adam (16 B/param), ring collectives, DDP overlap on",
        "",
        "| topology | dp x tp | schedule | step time (s) | bubble | bubble (s) | exposed p2p (s) | tp (s) "
        "| exposed dp (s) | peak memory (GB) | fits 80 GB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, nodes, dp, tp in CLUSTERS:
        topology = load_topology(name, nodes)
        for schedule_name, chunks in SCHEDULES:
            schedule = generate(schedule_name, pp, microbatches, chunks)
            devices = map_ranks(topology, dp, pp, tp).pipeline()
            peaks = [topology.device_peak_flops(devices[schedule.placement[stage]])
                     for stage in range(schedule.num_stages)]
            costs = model_costs(spec, schedule.num_stages, peaks, tp=tp, mfu=0.5)
            result = run_simulation(schedule, costs, topology, parallel=ParallelConfig(dp=dp, tp=tp))
            comm = result.comm
            worst = max(result.memory, key=lambda rank: rank.peak_bytes)
            label = f"{schedule_name} v={chunks}" if chunks > 1 else schedule_name
            lines.append(
                f"| {name}{f' x{nodes}' if nodes > 1 else ''} | {dp} x {tp} | {label} "
                f"| {result.metrics.makespan:.3f} | {result.metrics.bubble_fraction:.1%} "
                f"| {max(rank.bubble for rank in result.metrics.ranks):.3f} "
                f"| {max(rank['p2p']['exposed'] for rank in comm):.3f} "
                f"| {max(rank['tp']['exposed'] for rank in comm):.3f} "
                f"| {max(rank['dp']['exposed'] for rank in comm):.3f} "
                f"| {worst.peak_bytes / 1e9:.1f} (rank {worst.rank}) | {'no' if result.oom else 'yes'} |"
            )
    lines.append("")
    lines.append("bubble (s), exposed p2p / tp / dp and peak memory: the largest over the pipeline's ranks. "
                 "Bubble: waiting for a peer (data not sent yet, or a send not yet matched by its receive), "
                 "or idle while the pipeline fills and drains; exposed p2p: waiting while the data was in flight.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-13b")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    args = parser.parse_args()
    print(table(args.model, args.pp, args.microbatches))


if __name__ == "__main__":
    main()
