"""How a simulated step grows with the cluster and with the microbatch count.

Each row is one ``pipesim simulate`` of a 3-D parallel step, run in this process
through the command line's own code (preset built, ranks mapped, model costs, tp and
dp collectives on their groups, simulation, metrics and the memory report):

    pipesim simulate --model llama3-70b --dp D --tp 8 --pp 8 -m M --topology ib --nodes D*8

1. GPUs: dp grows from 16 to 2,048 (1,024 to 131,072 GPUs) at m = 16. Beside it, for
   the sizes where it finishes in reasonable time, the same step on the same cluster
   given as a plain graph, whose routes are searched as a topology file's are
   (``pipesim/cluster/graph_routes.py``; before, networkx's shortest path per pair).
2. Microbatches: m grows from 16 to 4,096 on 16,384 GPUs.

Time is the best of ``--repeats`` runs without tracing, in CPU seconds of this process
(``time.process_time``: the machine is shared, and CPU time is what the step costs on a
core of its own); memory is the peak of Python allocations (tracemalloc) in one more,
traced run of the same step.

Run: ``python benchmarks/bench_scale.py`` (``--quick``: the smaller rows only;
``--searched-up-to N``: run the search-based peer up to N GPUs, default 4,096).
Targets: 16,384 GPUs <= 2 s, 131,072 GPUs <= 10 s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
import tracemalloc

from pipesim.cli import main as pipesim_main
from pipesim.cluster import presets
from pipesim.cluster.topology import Topology

TP, PP = 8, 8
DPS = (16, 64, 256, 1024, 2048)
MICROBATCHES = (16, 64, 256, 1024, 4096)


def simulate_argv(dp: int, microbatches: int) -> list[str]:
    return ["simulate", "--model", "llama3-70b", "--dp", str(dp), "--tp", str(TP), "--pp", str(PP),
            "-m", str(microbatches), "--topology", "ib", "--nodes", str(dp * TP * PP // 8)]


def run_step(dp: int, microbatches: int, searched: bool = False) -> float:
    """CPU seconds of one simulated step; ``searched`` swaps the preset for the same cluster
    as a plain graph (routes by shortest-path search)."""
    argv = simulate_argv(dp, microbatches)
    start = time.process_time()
    if searched:
        original = presets.PRESETS["ib"]

        def ib_as_graph(nodes: int, **options) -> Topology:
            structural = original(nodes, **options)
            return Topology("ib", structural.graph, structural.devices, description=structural.description)

        with _preset("ib", ib_as_graph):
            status = _quiet(argv)
    else:
        status = _quiet(argv)
    if status != 0:
        raise SystemExit(f"pipesim {' '.join(argv)} failed with status {status}")
    return time.process_time() - start


@contextlib.contextmanager
def _preset(name, function):
    original = presets.PRESETS[name]
    presets.PRESETS[name] = function
    try:
        yield
    finally:
        presets.PRESETS[name] = original


def _quiet(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return pipesim_main(argv)


def peak_memory(dp: int, microbatches: int) -> float:
    """Peak bytes of Python allocations during the step."""
    tracemalloc.start()
    try:
        run_step(dp, microbatches)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only rows up to 16,384 GPUs and m=256")
    parser.add_argument("--searched-up-to", type=int, default=4096, metavar="GPUS",
                        help="run the shortest-path peer up to this many GPUs (default: 4096)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row, best kept (default: 3)")
    args = parser.parse_args()

    def best(dp: int, microbatches: int) -> float:
        return min(run_step(dp, microbatches) for _ in range(max(1, args.repeats)))

    dps = [dp for dp in DPS if not args.quick or dp <= 256]
    counts = [count for count in MICROBATCHES if not args.quick or count <= 256]
    run_step(2, 4)  # imports and first-use costs out of the first row

    print(f"1. GPUs (dp x tp{TP} x pp{PP}, m=16, llama3-70b on ib)")
    header = f"{'GPUs':>8} {'dp':>5} {'seconds':>8} {'peak MB':>8} {'searched s':>11} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    for dp in dps:
        gpus = dp * TP * PP
        seconds = best(dp, 16)
        memory = peak_memory(dp, 16)
        searched = run_step(dp, 16, searched=True) if gpus <= args.searched_up_to else None
        peer = f"{searched:>11.2f} {searched / seconds:>8.0f}x" if searched else f"{'-':>11} {'-':>9}"
        print(f"{gpus:>8,} {dp:>5} {seconds:>8.2f} {memory / 1e6:>8.1f} {peer}", flush=True)

    print(f"\n2. microbatches (dp256 x tp{TP} x pp{PP} = 16,384 GPUs)")
    header = f"{'m':>6} {'actions':>8} {'seconds':>8} {'peak MB':>8}"
    print(header)
    print("-" * len(header))
    for count in counts:
        seconds = best(256, count)
        memory = peak_memory(256, count)
        actions = 2 * count * PP + 4 * count * (PP - 1)
        print(f"{count:>6} {actions:>8,} {seconds:>8.2f} {memory / 1e6:>8.1f}", flush=True)
    print("targets: 16,384 GPUs <= 2 s, 131,072 GPUs <= 10 s (section 1).")


if __name__ == "__main__":
    main()
