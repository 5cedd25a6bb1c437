"""How fast `pipesim plan` searches, against an analytic pass over the same layouts.

Both sides get the same layouts of the same job. The analytic side computes, per layout,
the per-stage costs and a lower bound on the step time (the busiest pipeline rank's
compute plus its fill and drain), as analytic planners do; it models no schedule order,
no links, no contention and no memory. The simulated side runs the event simulation of
each layout (schedule order, P2P semantics, links, tp/dp collectives, memory), first
exhaustively (every layout simulated), then as `plan` searches (best bound first,
stopping once no remaining bound can reach the top 10).

    python benchmarks/bench_plan.py                  # the issue's example: llama3-70b, 1024 GPUs
    python benchmarks/bench_plan.py --gpus 64 --model gpt3-13b --global-batch 256
"""

from __future__ import annotations

import argparse
import time

from pipesim.cli import build_parser
from pipesim.cli import plan as plan_command
from pipesim.model.spec import model_spec
from pipesim.plan.search import SearchSpace, default_workers, enumerate_layouts, search
from schedules.generators import SCHEDULE_NAMES


def no_bound(layout) -> float:
    """A bound that prunes nothing (module level: the workers receive it by name)."""
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--topology", default="ib")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()

    spec = model_spec(args.model)
    simulate_flags = plan_command._simulate_flags(build_parser())
    recompute = list(simulate_flags["--recompute"].choices) if "--recompute" in simulate_flags else ["none"]
    zero = [int(z) for z in simulate_flags["--zero"].choices] if "--zero" in simulate_flags else [0]
    space = SearchSpace(gpus=args.gpus, gpus_per_node=8, global_batch=args.global_batch, layers=spec.layers,
                        heads=spec.heads, kv_heads=getattr(spec, "kv_heads", None) or spec.heads,
                        schedules=SCHEDULE_NAMES, recompute=recompute, zero=zero)
    layouts, rejected = enumerate_layouts(space)
    base = ["simulate", "--model", args.model, "--topology", args.topology, "--nodes", str(max(1, args.gpus // 8)),
            "--seq-len", str(args.seq_len), "--gpu", args.gpu]
    plan_command._init_worker(base)
    print(f"{args.model}, {args.gpus} GPUs, global batch {args.global_batch}, seq {args.seq_len}, {args.topology}: "
          f"{len(layouts)} layouts ({sum(rejected.values())} dropped by divisibility), {args.workers} workers")

    started = time.perf_counter()
    bounds = {layout.label(): plan_command.lower_bound(layout) for layout in layouts}
    analytic = time.perf_counter() - started

    reject = plan_command.memory_floor_cause
    # each pass starts as `plan` does: a fresh worker state (topology routes, per-layout costs) that it pays for
    plan_command._init_worker(base)
    exhaustive = search(layouts, plan_command.evaluate_layout, no_bound, args.top, args.workers, reject=reject)
    plan_command._init_worker(base)
    searched = search(layouts, plan_command.evaluate_layout, plan_command.lower_bound, args.top, args.workers,
                      reject=reject)

    print()
    print("| side | layouts | seconds | layouts/s | ratio to analytic |")
    print("|---|---|---|---|---|")
    rate_analytic = len(layouts) / analytic
    for name, count, seconds in (("analytic bound only", len(layouts), analytic),
                                 ("simulated, exhaustive (after the memory floor)", exhaustive.simulated,
                                  exhaustive.seconds),
                                 ("plan search (floor + simulated + pruned)", searched.considered, searched.seconds)):
        rate = count / seconds if seconds else float("inf")
        print(f"| {name} | {count} | {seconds:.2f} | {rate:.0f} | {rate / rate_analytic:.2f}x |")
    print(f"\nplan search rejected {searched.screened} by the memory floor, simulated {searched.simulated} "
          f"and pruned {searched.pruned}; "
          f"its top {args.top} equals the exhaustive top {args.top}: "
          f"{[r['layout'] for r in searched.rows[:args.top]] == [r['layout'] for r in exhaustive.rows[:args.top]]}")
    print()
    print("| # | layout | analytic bound (s) | simulated step (s) | simulated / bound |")
    print("|---|---|---|---|---|")
    for index, row in enumerate(exhaustive.rows[:args.top], 1):
        layout_bound = bounds[row["layout"]]
        print(f"| {index} | {row['layout']} | {layout_bound:.3f} | {row['step_time']:.3f} | "
              f"{row['step_time'] / layout_bound:.2f} |")


if __name__ == "__main__":
    main()
