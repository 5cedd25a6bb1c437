"""pipesim's FP8 GEMMs against published FP8 measurements on Hopper (no calibration).

The FP8 GEMM model (``pipesim.model.compute_model``, "FP8"): the BF16 shape model with
its ``k`` loop at 1350 / 794.5 = 1.70 times the rate and each tile's fitted prologue and
epilogue as in BF16, plus the casts as memory-bound kernels. Three published checks, none
used to build it:

- ``TILELANG_FP8_BY_K``: tile-ai/tilelang ``benchmark/matmul_fp8/README.md``, FP8 TFLOP/s
  of m = n = 8192 by k on an H800 SXM (H100's compute); the repository has published two
  runs of the table (both are here). Compared as throughput relative to k = 16384, the
  shape of the gain with k, beside the flat ratio (the whole kernel 1.70 times as fast).
- ``CUBLAS_FP8_8192``: cuBLAS through ``torch._scaled_mm`` at 8192 cubed, 1,136.9 TFLOP/s
  (pytorch/pytorch pull request 155507, its benchmark's ``aten`` row).
- ``TE_H200_LAYER``: NVIDIA/TransformerEngine ``docs/examples/gemm_profiling/
  gemm_profiling.rst``, "Worked Example: 5B Model on H200": a layer's twelve GEMMs
  (hidden 4096, MLP 16384, 15,872 tokens) in FP8 with Transformer Engine's quantization
  over BF16, 1.58x with current scaling and 1.69x with delayed scaling.
- ``TORCHAO_H100_LINEARS``: pytorch/ao pull request 2185's microbenchmark on an H100
  (Llama 3 70B's linears at tp 8, 16,384 tokens): the forward and backward of a BF16
  ``nn.Linear`` and of torchao's float8 one (tensorwise dynamic scaling: current scaling,
  an amax pass before each cast; torch.compile, fast accumulation), in seconds. The part
  is not named beyond "H100"; Meta's are often Grand Teton's 500 W HBM2e H100s.

Run: ``PYTHONPATH=. python benchmarks/fp8_gemms.py``.
"""

from __future__ import annotations

from dataclasses import replace

from pipesim.model.compute_model import KernelModel, gpu_compute_model, operation_time
from pipesim.model.operations import Gemm

TILELANG_FP8_BY_K = {256: (569, 376), 512: (858, 622), 1024: (1129, 927), 2048: (1343, 1174),
                     4096: (1467, 1378), 8192: (1507, 1461), 16384: (1541, 1523)}
CUBLAS_FP8_8192 = 1136.9e12
TE_H200_LAYER = {"current scaling": 1.58, "delayed scaling": 1.69}
TE_LAYER_TOKENS = 15872
# (m, k, n) of the forward: (BF16 seconds, float8 seconds), forward and backward
TORCHAO_H100_LINEARS = {(16384, 8192, 1280): (0.001954, 0.001757), (16384, 1024, 8192): (0.001701, 0.001193),
                        (16384, 8192, 7168): (0.009871, 0.005707), (16384, 3584, 8192): (0.005192, 0.003034)}
TE_LAYER_GEMMS = (("qkv", 4096, 12288), ("attn_out", 4096, 4096), ("mlp_in", 4096, 16384), ("mlp_out", 16384, 4096))


def fp8_flops(model: KernelModel, m: int, k: int, n: int) -> float:
    """FLOP/s of one FP8 ``m x k`` by ``k x n`` GEMM on ``model`` (the kernel, no casts)."""
    return 2 * m * k * n / model.gemm_seconds(Gemm("mlp_in", m, k, n, fp8=True), 2)


def flat_ratio_flops(model: KernelModel, m: int, k: int, n: int) -> float:
    """The same with the whole kernel ``fp8_speedup`` times as fast (the earlier rule)."""
    flat = replace(model.gemm, peak_flops=model.gemm.peak_flops * model.fp8_speedup)
    return 2 * m * k * n / flat.seconds(m, k, n, 1, 1)


def relative_by_k(flops_of, m: int = 8192, n: int = 8192) -> dict[int, float]:
    """Throughput at each of the sweep's k over that at k 16384."""
    longest = flops_of(m, 16384, n)
    return {k: flops_of(m, k, n) / longest for k in TILELANG_FP8_BY_K}


def layer_speedup(model: KernelModel, scaling: str = "delayed") -> float:
    """BF16 time over FP8 time (casts included, with ``scaling``'s reads) of Transformer
    Engine's H200 layer."""
    def layer(fp8: bool) -> float:
        times = [operation_time(Gemm(name, TE_LAYER_TOKENS, k, n, fp8=fp8, amax_pass=fp8 and scaling == "current"),
                                model) for name, k, n in TE_LAYER_GEMMS]
        return sum(time.forward + time.input_grad + time.weight_grad for time in times)
    return layer(False) / layer(True)


def linear_seconds(model: KernelModel, m: int, k: int, n: int, fp8: bool, scaling: str = "current") -> float:
    """Forward and backward of one linear (its three GEMMs, and under FP8 their casts)."""
    time = operation_time(Gemm("mlp_in", m, k, n, fp8=fp8, amax_pass=fp8 and scaling == "current"), model)
    return time.forward + time.input_grad + time.weight_grad


def main() -> None:
    h100 = gpu_compute_model("h100")
    shaped = relative_by_k(lambda m, k, n: fp8_flops(h100, m, k, n))
    flat = relative_by_k(lambda m, k, n: flat_ratio_flops(h100, m, k, n))
    print("FP8 throughput by k (m = n = 8192), relative to k = 16384: tilelang's two published runs (H800), "
          "pipesim (h100), the flat ratio")
    print("|     k | published | pipesim | flat ratio | pipesim FP8 over BF16 |")
    print("|------:|----------:|--------:|-----------:|----------------------:|")
    for k, runs in TILELANG_FP8_BY_K.items():
        published = sorted(value / TILELANG_FP8_BY_K[16384][index] for index, value in enumerate(runs))
        bf16 = h100.gemm_seconds(Gemm("mlp_in", 8192, k, 8192), 2)
        over = bf16 / h100.gemm_seconds(Gemm("mlp_in", 8192, k, 8192, fp8=True), 2)
        print(f"| {k:5d} | {published[0]:.2f}-{published[1]:.2f} | {shaped[k]:7.2f} | {flat[k]:10.2f} | "
              f"{over:21.2f} |")
    print(f"8192 cubed on h100: {fp8_flops(h100, 8192, 8192, 8192) / 1e12:,.0f} FP8 TFLOP/s; cuBLAS "
          f"(torch._scaled_mm) {CUBLAS_FP8_8192 / 1e12:,.0f}")
    cube = Gemm("mlp_in", 16384, 16384, 16384)
    over = h100.gemm_seconds(cube, 2) / h100.gemm_seconds(replace(cube, fp8=True), 2)
    print(f"16384 cubed on h100: FP8 over BF16 {over:.2f}")
    print("torchao's H100 linears, forward + backward (ms), published / pipesim (h100, FP8 with current scaling):")
    for (m, k, n), (bf16, float8) in TORCHAO_H100_LINEARS.items():
        model_bf16, model_fp8 = linear_seconds(h100, m, k, n, False), linear_seconds(h100, m, k, n, True)
        print(f"  {m} x {k} x {n}: BF16 {bf16 * 1e3:.3f} / {model_bf16 * 1e3:.3f}, float8 {float8 * 1e3:.3f} / "
              f"{model_fp8 * 1e3:.3f}, speedup {bf16 / float8:.2f} / {model_bf16 / model_fp8:.2f}")
    h200 = gpu_compute_model("h200")
    for recipe, published in TE_H200_LAYER.items():
        predicted = layer_speedup(h200, recipe.split()[0])
        print(f"Transformer Engine's H200 layer (hidden 4096, {TE_LAYER_TOKENS:,} tokens), FP8 over BF16 with casts, "
              f"{recipe}: pipesim {predicted:.2f}x, published {published:.2f}x")


if __name__ == "__main__":
    main()
