"""pipesim's H100 GEMMs against published H100 (and H200) kernel measurements.

pipesim times an H100's GEMMs with the shape model fitted to the H200 table
(``pipesim.model.compute_model``): the same die (GH100, 132 SMs, the same clocks and 700 W
limit), so the same kernels, each part's own HBM bandwidth in the memory terms. This script
puts that choice next to every published H100 measurement of a GEMM with its shape that
was found, and the H200 measurements of the same benchmarks, so the question "is an H100
slower than an H200 on compute-bound GEMMs?" is answered by measurements and not by the
model. None of these was used to build the model; they were looked at after the
training-run tables (``benchmarks/published*.py``) had been, so those tables stay in-sample.

Sources (throughput = the GEMMs' FLOPs over the published time; ``m x k`` by ``k x n``):

- ``mamf``: S. Bekman, *Machine Learning Engineering*, ``compute/accelerator/README.md``
  (stas00/ml-engineering, commit 744d01e18b79), "Maximum Achievable Matmul FLOPS
  comparison table": the best of a brute-force search over shapes, mean of 100 calls.
  BF16: H100 SXM 794.5 TFLOP/s at M x N x K 2048 x 2048 x 13312 (torch 2.7.0+cu126),
  noted "H200 is the same". FP8 (``float8_e4m3fn``): H100 SXM 1402.6 at 1024 x 9216 x
  14336, H200 SXM 1453.4 at 1280 x 4096 x 12032.
- ``zzc0721``: zzc0721/torch-performance-test-data (commit 9d8282763726), one script
  (``test.py``: square ``torch.matmul`` of ``randn`` tensors, 1024-10240, 10 warm-up
  and 30 timed calls) run by its users on their own machines. Issue 79: "NVIDIA H100
  80GB HBM3" (the SXM part's name; torch 2.7.0+cu128), BF16 at each size. ``database.md``:
  the best BF16 of the five sizes on another "NVIDIA H100 80GB HBM3" (bare metal) 783.66
  and on an "NVIDIA H200" 790.29, the size not given (compared with pipesim's best of
  the same five sizes).
- ``fast.cu``: pranjalssh/fast.cu ``README.md`` (commit 38eb642e0c08), cuBLAS on square
  BF16 matrices on an H100: 716 TFLOP/s at 4096, 795 at 8192; its issue 13, another
  user's H100 (CUDA 12.4): cuBLAS 518.6 at 8192.
- ``pytorch-100850``: pytorch/pytorch issue 100850 (May 2023, cuBLAS 12.0, a demo H100):
  ``torch.bmm`` in BF16 of the script's default sequence 2048 and hidden 8192, batch 1,
  2 and 4: 742.7, 549.5, 542.9 TFLOP/s (the issue reports the batched calls as a
  cuBLAS/PyTorch dispatch problem; kept, as measured).
- ``torchao-2185``: pytorch/ao pull request 2185 (``benchmarks/fp8_gemms.py``): forward
  and backward of a BF16 ``nn.Linear`` at Llama 3 70B's tp-8 shapes, 16,384 tokens, on
  an H100 not named further (Meta's fleet has 500 W HBM2e H100s, like the Grand Teton
  parts of ``benchmarks/published_overlap.py``'s torchtitan rows).
- ``pytorch-155507``: pytorch/pytorch pull request 155507, cuBLAS FP8 through
  ``torch._scaled_mm`` at 8192 cubed on an H100, 1,136.9 TFLOP/s (``benchmarks/fp8_gemms.py``).
- ``h200-table``: ``pipesim/model/data/README.md``, the machine the shipped H200 table was
  measured on: "dense bf16 matmul peak measured on the same machine at 8192³: ~790
  TFLOP/s" (the table's own layer GEMMs, which the model is fitted to, settle at 650-715).
- ``te-h200-nvl``: NVIDIA/TransformerEngine ``docs/examples/gemm_profiling/gemm_profiling.rst``,
  "Worked Example: 5B Model on H200": a layer's twelve BF16 GEMMs (hidden 4096, MLP 16384,
  15,872 tokens) in 32.014 ms on an H200 NVL (the 600 W part), against pipesim's h200 (SXM).

Found and not compared: pytorch/ao pull request 3342 and the H100 PCIe rows of
zzc0721's database (the PCIe part: 114 SMs, 756 TFLOP/s, 350 W, a different GPU); flash
attention on H100 (the FlashAttention-3 paper's figures; pytorch/benchmark pull request
2391's FA3 and Triton rows, 430-621 and 329-477 TFLOP/s forward at head dim 128), which
time other kernels (FA2, FA3, cuDNN), mostly without the causal mask, where pipesim's
attention is the causal torch SDPA kernel measured on the H200 and no same-kernel H100
figure was found.

Run: ``PYTHONPATH=. python benchmarks/h100_kernels.py``.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo's root

from benchmarks.fp8_gemms import CUBLAS_FP8_8192, TE_LAYER_GEMMS, TE_LAYER_TOKENS, TORCHAO_H100_LINEARS  # noqa: E402
from pipesim.model.compute_model import gpu_compute_model  # noqa: E402
from pipesim.model.gemm_model import KERNEL_BOUND, backward_shapes  # noqa: E402
from pipesim.model.operations import Gemm  # noqa: E402

Shape = tuple[int, int, int]  # (m, k, n)
SQUARES = (1024, 2048, 4096, 8192, 10240)  # zzc0721's test.py sizes


@dataclass(frozen=True)
class KernelMeasurement:
    """A published throughput of GEMMs of known shapes: ``timed`` the GEMMs run together
    (a linear's forward and backward, a batched call as ``count``); where the source gives
    only the best of several shapes, ``timed`` lists each (one GEMM each) and the best is
    compared."""

    source: str
    part: str  # the GPU as the source names it
    gpu: str  # the pipesim GPU it is compared with
    label: str
    timed: tuple[tuple[Shape, ...], ...]
    tflops: float
    count: int = 1
    fp8: bool = False
    sxm_at_full_power: bool = False  # the source states an SXM part (700 W); others may be capped

    def flops(self, shapes: tuple[Shape, ...]) -> float:
        return sum(2.0 * m * k * n * self.count for m, k, n in shapes)


def launch_bound(measurement: KernelMeasurement) -> bool:
    """Whether pipesim times the GEMMs at under ``KERNEL_BOUND`` launch floors a call, the
    rule its fit keeps timings by: its 25.1 us floor is one call's host launch, measured a
    call at a time, which a benchmark timing calls back to back hides. Such rows say
    nothing about the GPU and are left out of the summaries."""
    model = gpu_compute_model(measurement.gpu)
    return all(sum(model.gemm_seconds(Gemm("mlp_in", m, k, n, measurement.count, fp8=measurement.fp8), 2)
                   for m, k, n in shapes) < KERNEL_BOUND * model.gemm.launch_seconds * len(shapes)
               for shapes in measurement.timed)


def predicted_tflops(measurement: KernelMeasurement) -> float:
    """pipesim's throughput of the measured GEMMs on its model of ``measurement.gpu``
    (FP8: the kernel alone, its operands already cast, as the sources time it)."""
    model = gpu_compute_model(measurement.gpu)
    best = 0.0
    for shapes in measurement.timed:
        seconds = sum(model.gemm_seconds(Gemm("mlp_in", m, k, n, measurement.count, fp8=measurement.fp8), 2)
                      for m, k, n in shapes)
        best = max(best, measurement.flops(shapes) / seconds / 1e12)
    return best


def error(measurement: KernelMeasurement) -> float:
    """pipesim's throughput over the measured one, less 1 (positive: pipesim is faster)."""
    return predicted_tflops(measurement) / measurement.tflops - 1


def linear(m: int, k: int, n: int) -> tuple[Shape, ...]:
    """A linear's forward and its two backward GEMMs."""
    return ((m, k, n), *backward_shapes(m, k, n))


def square(size: int) -> tuple[tuple[Shape, ...], ...]:
    return (((size, size, size),),)


H100_SXM = "H100 SXM 80 GB"
H100_HBM3 = "H100 80GB HBM3"
H100_UNNAMED = "H100 (not named further)"


def measurements() -> list[KernelMeasurement]:
    """Every published measurement of the module docstring, in its order."""
    rows = [
        KernelMeasurement("mamf", H100_SXM, "h100", "best matmul 2048 x 13312 x 2048", (((2048, 13312, 2048),),),
                          794.5, sxm_at_full_power=True),
        KernelMeasurement("mamf", H100_SXM, "h100", "best FP8 matmul 1024 x 14336 x 9216",
                          (((1024, 14336, 9216),),), 1402.6, fp8=True, sxm_at_full_power=True),
        KernelMeasurement("mamf", "H200 SXM", "h200", "best FP8 matmul 1280 x 12032 x 4096",
                          (((1280, 12032, 4096),),), 1453.4, fp8=True, sxm_at_full_power=True),
    ]
    issue_79 = {1024: 176.62, 2048: 676.59, 4096: 788.72, 8192: 797.51, 10240: 719.72}
    rows += [KernelMeasurement("zzc0721 #79", H100_HBM3, "h100", f"matmul {size} cubed", square(size), tflops,
                               sxm_at_full_power=True) for size, tflops in issue_79.items()]
    best_square = tuple(((size, size, size),) for size in SQUARES)
    rows += [
        KernelMeasurement("zzc0721 db", H100_HBM3, "h100", "best of the five squares", best_square, 783.66,
                          sxm_at_full_power=True),
        KernelMeasurement("zzc0721 db", "H200", "h200", "best of the five squares", best_square, 790.29),
        KernelMeasurement("fast.cu", "H100", "h100", "cuBLAS 4096 cubed", square(4096), 716.0),
        KernelMeasurement("fast.cu", "H100", "h100", "cuBLAS 8192 cubed", square(8192), 795.0),
        KernelMeasurement("fast.cu #13", "H100", "h100", "cuBLAS 8192 cubed", square(8192), 518.6),
    ]
    rows += [KernelMeasurement("pytorch-100850", "H100 (2023 demo)", "h100", f"bmm {batch} x 2048 x 8192 x 8192",
                               (((2048, 8192, 8192),),), tflops, count=batch)
             for batch, tflops in ((1, 742.7), (2, 549.5), (4, 542.9))]
    for (m, k, n), (bf16_seconds, _) in TORCHAO_H100_LINEARS.items():
        shapes = linear(m, k, n)
        rows.append(KernelMeasurement("torchao-2185", H100_UNNAMED, "h100", f"linear fwd+bwd {m} x {k} x {n}",
                                      (shapes,), sum(2.0 * a * b * c for a, b, c in shapes) / bf16_seconds / 1e12))
    rows.append(KernelMeasurement("pytorch-155507", "H100", "h100", "FP8 cuBLAS 8192 cubed", square(8192),
                                  CUBLAS_FP8_8192 / 1e12, fp8=True))
    rows.append(KernelMeasurement("h200-table", "H200 SXM", "h200", "matmul 8192 cubed (about)", square(8192), 790.0,
                                  sxm_at_full_power=True))
    layer = tuple(shape for _, k, n in TE_LAYER_GEMMS for shape in linear(TE_LAYER_TOKENS, k, n))
    rows.append(KernelMeasurement("te-h200-nvl", "H200 NVL (600 W)", "h200", "layer's 12 GEMMs, hidden 4096",
                                  (layer,), sum(2.0 * m * k * n for m, k, n in layer) / 32.014e-3 / 1e12))
    return rows


def same_script_h100_over_h200(rows: list[KernelMeasurement]) -> dict[str, float]:
    """H100 over H200 where one benchmark measured both (the evidence the model rests on):
    MAMF's FP8 searches (its BF16 table gives the H200 no figure of its own: "H200 is the
    same"), and zzc0721's best square on each H100 (issue 79's best of its five sizes; the
    database's other H100) over its H200."""
    def tflops(source: str, gpu: str, fp8: bool = False) -> list[float]:
        return [row.tflops for row in rows if row.source == source and row.gpu == gpu and row.fp8 == fp8]

    h200_square = tflops("zzc0721 db", "h200")[0]
    return {"mamf FP8": tflops("mamf", "h100", True)[0] / tflops("mamf", "h200", True)[0],
            "zzc0721 best square, issue 79's H100": max(tflops("zzc0721 #79", "h100")) / h200_square,
            "zzc0721 best square, the database's H100": tflops("zzc0721 db", "h100")[0] / h200_square}


def summary(label: str, errors: list[float]) -> str:
    """Median and worst |error| of a group of rows."""
    absolute = [abs(value) for value in errors]
    return (f"{label}: median |error| {statistics.median(absolute):.1%}, worst {max(absolute):.1%} "
            f"over {len(errors)} rows (signed: {min(errors):+.1%} to {max(errors):+.1%})")


def main() -> None:
    rows = measurements()
    print("| source | part | pipesim GPU | GEMMs | published TFLOP/s | pipesim | error |")
    print("|---|---|---|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row.source} | {row.part} | {row.gpu} | {row.label} | {row.tflops:,.1f} | "
              f"{predicted_tflops(row):,.1f} | {error(row):+.1%} |")
    print()
    bf16 = [row for row in rows if not row.fp8 and not launch_bound(row)]
    print(summary("BF16 on SXM parts at full power (H100 and H200)",
                  [error(row) for row in bf16 if row.sxm_at_full_power]))
    print(summary("BF16 on parts not named further or power-capped",
                  [error(row) for row in bf16 if not row.sxm_at_full_power]))
    print(summary("FP8", [error(row) for row in rows if row.fp8]))
    print("left out as launch-bound in pipesim (one call's host launch): "
          + ", ".join(f"{row.source} {row.label}" for row in rows if launch_bound(row)))
    print("H100 over H200 in the same benchmark: " + ", ".join(
        f"{name} {ratio:.3f}" for name, ratio in same_script_h100_over_h200(rows).items())
          + '; MAMF BF16: "H200 is the same"')


if __name__ == "__main__":
    main()
