"""The built-in GEMM table timed again in the layouts training runs its linears, and the
GEMM model fitted to it beside the built-in one.

pipesim's H100/H200 GEMM model (``pipesim.model.compute_model``, ``H200_GEMM_FIT``) is
fitted to ``pipesim/model/data/h200_gemm_bf16.csv``: 336 GEMMs of transformer layers
(hidden 1024-16384, tp 1-8, 2,048-16,384 tokens) timed as ``x @ w`` with the weight
stored ``k x n``. ``torch.nn.Linear`` stores it ``n x k`` and runs ``x @ w^T``, its
backward ``dy @ w`` and ``dy^T @ x``, and on an H200 the same shape ran slower so (8192 x
1024 x 4096: 427 TFLOP/s against the table's 558). This script times every row of the
table on this GPU in the linear layer's layouts (``executor.kernel_timing.time_gemms``,
what ``pipesim profile --compute-model`` times), writes a table of the same columns, and
prints per GEMM kind the measured time over the table's, then the model fitted to the new
table (``fit_gemm_model``, the H200's datasheet figures) beside ``H200_GEMM_FIT``.

    python benchmarks/gemm_table.py --out gemm_linear.csv          # on a GPU, about a minute
    python benchmarks/gemm_table.py --limit 4 --device cpu         # the code path, anywhere

The peer is the built-in table, measured on another day: on the same GPU model a
difference of a few percent is the machine's, a consistent one by GEMM kind the layout's.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COLUMNS = ("h", "tp", "tokens", "gemm", "m", "k", "n", "fwd_s", "bwd_s", "fwd_tflops", "bwd_tflops")


def table_rows() -> list[dict]:
    """The built-in table's rows."""
    with resources.as_file(resources.files("pipesim.model") / "data" / "h200_gemm_bf16.csv") as path, \
            open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def timed_rows(rows: list[dict], device, dtype) -> list[dict]:
    """``rows`` with their forward and backward timed here in the linear layer's layouts."""
    from executor.kernel_timing import time_gemms

    timed = []
    for index, row in enumerate(rows):
        m, k, n = int(row["m"]), int(row["k"]), int(row["n"])
        (forward, backward), = time_gemms([(m, k, n)], device, dtype)
        flops = 2.0 * m * k * n
        timed.append({**{key: row[key] for key in COLUMNS[:7]}, "fwd_s": forward, "bwd_s": backward,
                      "fwd_tflops": flops / forward / 1e12, "bwd_tflops": 2 * flops / backward / 1e12})
        if (index + 1) % 48 == 0:
            print(f"  {index + 1} of {len(rows)} GEMMs timed", file=sys.stderr, flush=True)
    return timed


def ratios_by_kind(before: list[dict], after: list[dict]) -> dict[str, tuple[float, float]]:
    """Per GEMM kind, the median of the new time over the table's, forward and backward."""
    kinds: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for old, new in zip(before, after, strict=True):
        kinds[old["gemm"]].append((float(new["fwd_s"]) / float(old["fwd_s"]),
                                   float(new["bwd_s"]) / float(old["bwd_s"])))
    return {kind: (statistics.median(f for f, _ in pairs), statistics.median(b for _, b in pairs))
            for kind, pairs in kinds.items()}


def fitted(rows: list[dict]) -> dict[str, float]:
    """``fit_gemm_model`` of ``rows`` on the H200's datasheet figures, as ``H200_GEMM_FIT``."""
    from pipesim.model.gemm_model import GemmTiming, backward_shapes, fit_gemm_model

    timings = []
    for row in rows:
        m, k, n = int(row["m"]), int(row["k"]), int(row["n"])
        timings += [GemmTiming(((m, k, n),), float(row["fwd_s"])),
                    GemmTiming(backward_shapes(m, k, n), float(row["bwd_s"]))]
    model = fit_gemm_model(timings, 989e12, 4.8e12, 132)
    return {"efficiency": model.efficiency, "k_overhead": model.k_overhead, "launch_seconds": model.launch_seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the new table here (CSV, the built-in table's columns)")
    parser.add_argument("--limit", type=int, help="time only the first N rows (a quick check of the code path)")
    parser.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    args = parser.parse_args(argv)
    import torch

    from pipesim.model.compute_model import H200_GEMM_FIT

    if args.limit is not None and args.limit < 1:
        print(f"gemm_table: --limit must be at least 1, got {args.limit}", file=sys.stderr)
        return 2
    from pipesim.cli.files import UserFileError, check_output_file

    try:  # before minutes of timing: a directory, a missing folder or a read-only place, in one line
        if args.out:
            check_output_file(args.out, "--out")
        device = torch.device(args.device)
    except (UserFileError, RuntimeError) as error:
        print(f"gemm_table: {error}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gemm_table: no CUDA GPU here; --device cpu times the code path on the CPU", file=sys.stderr)
        return 2
    rows = table_rows()[:args.limit]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"timing {len(rows)} GEMMs in nn.Linear's layouts on {name}", file=sys.stderr)
    new = timed_rows(rows, device, torch.bfloat16)
    if args.out:
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(new)
    print("| GEMM | forward: new / table | backward: new / table |")
    print("|---|---:|---:|")
    for kind, (forward, backward) in ratios_by_kind(rows, new).items():
        print(f"| {kind} | {forward:.3f} | {backward:.3f} |")
    if device.type == "cuda" and len(rows) >= 16:
        fit = fitted(new)
        print(f"fitted to the new table: efficiency {fit['efficiency']:.4f}, k overhead {fit['k_overhead']:.1f}, "
              f"launch {fit['launch_seconds'] * 1e6:.1f} us; built in (the table's layout): efficiency "
              f"{H200_GEMM_FIT['efficiency']:.4f}, k overhead {H200_GEMM_FIT['k_overhead']:.1f}, launch "
              f"{H200_GEMM_FIT['launch_seconds'] * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
