"""BF16 and FP8 GEMMs measured on this GPU against pipesim's compute model of it.

pipesim's FP8 GEMMs (``pipesim.model.compute_model``, "FP8") are its BF16 shape model
with the ``k`` loop ``fp8_speedup`` times as fast, built from published Hopper
measurements (``benchmarks/fp8_gemms.py``), never from a GPU of ours. This script times
the GEMMs of transformer layers on the GPU it runs on, in BF16 (``torch.matmul``) and in
FP8 (``torch._scaled_mm``: e4m3 operands, one scale per tensor, BF16 output, fast
accumulation: the kernel current-scaling recipes call; casts not timed), and prints the
measured and the predicted TFLOP/s of each, and the FP8-over-BF16 speedup both ways.

    python benchmarks/gpu_gemms.py                 # on a GPU; --gpu names pipesim's model (default h200)
    python benchmarks/gpu_gemms.py --json out.json

Each time is the median of 20 calls after 5 warm-up calls, with CUDA events around each
call. The peer is pipesim's model of the same shapes on ``--gpu``. The BF16 model was
fitted to an H200 table of these layers' GEMMs (``pipesim/model/data/h200_gemm_bf16.csv``),
so on an H200 its BF16 rows are in-sample; the FP8 rows are held out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (label, m tokens, k, n): a layer's GEMMs (QKV, attention output, MLP up, MLP down) at a
# few hidden sizes and tensor-parallel splits, and k sweeps at m = n = 8192
SHAPES: list[tuple[str, int, int, int]] = []
for hidden, ffn, tp in ((4096, 14336, 1), (4096, 14336, 4), (8192, 28672, 8), (16384, 53248, 8)):
    for name, k, n in (("qkv", hidden, (hidden + hidden // 4) // tp), ("out", hidden // tp, hidden),
                       ("up", hidden, 2 * ffn // tp), ("down", ffn // tp, hidden)):
        SHAPES.append((f"h{hidden} tp{tp} {name}", 8192, k, n))
for k in (256, 1024, 4096, 16384):
    SHAPES.append((f"k sweep {k}", 8192, k, 8192))


def timed(function, repeats: int = 20, warmup: int = 5) -> float:
    import torch

    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="h200", help="pipesim's GPU to predict with (default h200)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    import torch

    from pipesim.cli.files import UserFileError, check_outputs
    from pipesim.model.compute_model import gpu_compute_model
    from pipesim.model.errors import ModelSpecError
    from pipesim.model.operations import Gemm

    try:
        check_outputs(args)
        model = gpu_compute_model(args.gpu)
    except (UserFileError, ModelSpecError, ValueError) as error:
        parser.error(str(error))
    if not torch.cuda.is_available():
        print("gpu_gemms: no CUDA device is visible", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; predicted with pipesim's {args.gpu}")
    print(f"{'GEMM':<22} {'m':>6} {'k':>6} {'n':>6} | {'BF16 meas':>9} {'pred':>6} {'err':>6} | "
          f"{'FP8 meas':>8} {'pred':>6} {'err':>6} | {'FP8/BF16 meas':>13} {'pred':>5}   (TFLOP/s)")
    rows, errors = [], {"bf16": [], "fp8": []}
    for label, m, k, n in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16 = timed(lambda a=a, w=w: torch.matmul(a, w.t()))
        a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device="cuda")
        try:
            fp8 = timed(lambda a8=a8, w8=w8, one=one: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one,
                                                                       out_dtype=torch.bfloat16,
                                                                       use_fast_accum=True))
        except RuntimeError as error:  # a GPU without FP8 tensor cores
            print(f"FP8 not timed: {error}", file=sys.stderr)
            fp8 = float("nan")
        flops = 2 * m * k * n
        predicted_bf16 = model.gemm_seconds(Gemm("mlp_in", m, k, n), 2)
        predicted_fp8 = model.gemm_seconds(Gemm("mlp_in", m, k, n, fp8=True), 2) if model.fp8_speedup else float("nan")
        row = {"label": label, "m": m, "k": k, "n": n, "bf16": bf16, "fp8": fp8,
               "predicted_bf16": predicted_bf16, "predicted_fp8": predicted_fp8}
        rows.append(row)
        error_bf16, error_fp8 = predicted_bf16 / bf16 - 1, predicted_fp8 / fp8 - 1
        errors["bf16"].append(error_bf16)
        errors["fp8"].append(error_fp8)
        print(f"{label:<22} {m:>6} {k:>6} {n:>6} | {flops / bf16 / 1e12:>9.0f} {flops / predicted_bf16 / 1e12:>6.0f} "
              f"{error_bf16:>+6.1%} | {flops / fp8 / 1e12:>8.0f} {flops / predicted_fp8 / 1e12:>6.0f} "
              f"{error_fp8:>+6.1%} | {bf16 / fp8:>13.2f} {predicted_bf16 / predicted_fp8:>5.2f}", flush=True)
        del a, w, a8, w8
    for kind, values in errors.items():
        finite = [abs(value) for value in values if value == value]
        if finite:
            print(f"{kind}: median |time error| {statistics.median(finite):.1%}, worst {max(finite):.1%} "
                  f"over {len(finite)} GEMMs (error = predicted time / measured - 1)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
