"""``pipesim bench-comm``: time send/recv and the collectives over a range of message
sizes on this machine's backend, fit latency and bandwidth, write a topology file.

Bandwidths follow nccl-tests (``pipesim.cluster.comm_fit``); the measurement runs in
``executor.bench_comm`` (torch, imported only in the handler).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from executor.config import BACKENDS  # plain data, no torch import
from pipesim.cluster.comm_fit import bench_table, fits_by_operation, measured_collectives, topology_document

UNITS = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30}
DEFAULT_OPERATIONS = "sendrecv,all_reduce,all_gather,reduce_scatter"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench-comm", help="benchmark send/recv and collectives; fit alpha-beta; write a topology file",
        description="Time send/recv, all-reduce, all-gather and reduce-scatter on local ranks (gloo on CPU, "
                    "NCCL on GPUs), report time, algbw and busbw (nccl-tests definitions), fit latency and "
                    "bandwidth and write a topology file for simulate --topology.",
    )
    parser.add_argument("--ranks", type=int, default=2, help="local processes (default 2)")
    parser.add_argument("--sizes", default="1KB..64MB",
                        help="message sizes: LOW..HIGH doubling by 4 (e.g. 1KB..64MB) or a list 4KB,1MB")
    parser.add_argument("--ops", default=DEFAULT_OPERATIONS,
                        help=f"operations (default {DEFAULT_OPERATIONS}; also all_to_all and ring_exchange, the "
                             "collectives the executor runs for --ep and --cp, timed over groups of --group ranks)")
    parser.add_argument("--group", type=int, metavar="N",
                        help="ranks in each all_to_all or ring_exchange group, consecutive ranks cut into groups "
                             "that all exchange at once, as a run's ep or cp groups (default: all --ranks)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: nccl with CUDA, else gloo (default auto)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--verbose", action="store_true", help="show every rank's output and tracebacks")
    parser.add_argument("--out", metavar="PATH", help="write the topology file (JSON) with the fitted links")
    parser.add_argument("--json", metavar="PATH", help="write every timing, bandwidth and fit as JSON")
    parser.add_argument("--html", metavar="PATH", help="write a chart of time and bus bandwidth against size")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress lines (they are shown only when stderr is a terminal)")
    parser.set_defaults(handler=handle)


def parse_size(text: str) -> int:
    """``"64MB"`` -> 67108864 (binary units, like nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise ValueError(f"size {text!r} must be a number with an optional unit B, KB, MB or GB, e.g. 64MB")
    unit = match.group(2)
    return int(float(match.group(1)) * UNITS[unit + "B" if unit in ("K", "M", "G") else unit])


def parse_sizes(text: str) -> list[int]:
    """``"1KB..64MB"`` (every 4x step, both ends included) or ``"4KB,1MB"``."""
    if ".." in text:
        low_text, high_text = text.split("..", 1)
        low, high = parse_size(low_text), parse_size(high_text)
        if not 0 < low <= high:
            raise ValueError(f"--sizes {text!r}: need 0 < LOW <= HIGH")
        sizes = []
        size = low
        while size < high:
            sizes.append(size)
            size *= 4
        return [*sizes, high]
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"--sizes {text!r}: every message size must be at least 1 byte")
    return sizes


def format_table(rows: list[dict]) -> list[str]:
    lines = [f"{'operation':<15}{'bytes':>12}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for row in rows:
        name = f"{row['operation']}/{row['group']}" if "group" in row else row["operation"]  # over groups of N
        lines.append(f"{name:<15}{row['bytes']:>12}{row['seconds'] * 1e6:>12.1f}"
                     f"{row['algbw'] / 1e9:>12.3f}{row['busbw'] / 1e9:>12.3f}")
    return lines


def measure(ranks: int, sizes: list[int], operations: list[str], backend: str, threads: int,
            verbose: bool = False, group: int | None = None) -> dict:
    """Run the benchmark (torch) and return the raw result."""
    from executor.bench_comm import GROUPED, bench_comm  # noqa: PLC0415 - loads torch

    groups = {name: group for name in GROUPED} if group is not None else None
    return bench_comm(ranks, operations, sizes, backend, threads, verbose=verbose, groups=groups)


def handle(args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.sizes)
    operations = [name.strip() for name in args.ops.split(",") if name.strip()]
    from executor.spawn import SpawnError  # noqa: PLC0415 - loads torch
    from pipesim.cli.progress import progress_from_args  # noqa: PLC0415

    try:
        with progress_from_args("bench-comm", args).phase(
                f"measuring {', '.join(operations)} at {len(sizes)} sizes on {args.ranks} ranks"):
            result = measure(args.ranks, sizes, operations, args.backend, args.threads, args.verbose, args.group)
    except SpawnError as error:
        print(f"pipesim bench-comm: failed: {error}", file=sys.stderr)
        return 1
    rows = bench_table(result)
    fits = fits_by_operation(result)
    print(f"{result['world']} ranks, {result['backend']} on {result['device']}")
    print("\n".join(format_table(rows)))
    for name, fit in fits.items():
        print(f"fit {name}: latency {fit['latency'] * 1e6:.1f} us per hop, "
              f"bus bandwidth {fit['bandwidth'] / 1e9:.3f} GB/s")
    for entry in measured_collectives(fits):
        print(f"measured {entry['operation']} over groups of {entry['ranks']}: {entry['latency'] * 1e6:.1f} us + "
              f"bytes / {entry['bandwidth'] / 1e9:.3f} GB/s (what simulate --topology charges it)")
    for row in result["rows"]:
        if row.get("seconds") is None:
            print(f"note: {row['operation']} skipped: {row.get('note', 'not supported on this backend')}")
    if args.out:
        Path(args.out).write_text(json.dumps(topology_document(result, fits), indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "rows": rows, "fits": fits}, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.html:
        from viz.comm_bench import write_comm_bench_html  # noqa: PLC0415

        write_comm_bench_html(rows, fits, args.html, f"bench-comm: {result['world']} ranks, {result['backend']}",
                              plotly=args.plotly)
        print(f"wrote {args.html}")
    return 0
