"""GPU models: what a device brings to a plan (compute, memory) and to its node (NVLink).

Figures are the vendors' datasheet numbers for the SXM parts in HGX/DGX systems
(sources in docs/cluster-model.md):

- ``bf16_flops``: dense BF16 tensor-core peak (no 2:4 sparsity), the denominator of MFU;
- ``memory_bytes``: HBM capacity; ``memory_bandwidth``: HBM bandwidth (bytes/s), which
  sets the pace of the memory-bound kernels (``pipesim.model.memory_traffic``);
- ``nvlink_bandwidth``: NVLink bandwidth per GPU per direction through NVSwitch (half of
  the bidirectional figure datasheets quote);
- ``nic_bandwidth``: the per-GPU InfiniBand port of the vendor's reference system of that
  generation (DGX A100: HDR 200 Gb/s; DGX H100/H200/B200: NDR 400 Gb/s), used by the
  multi-node presets;
- ``sms``: streaming multiprocessors, over which a GEMM's tiles run in waves
  (``pipesim.model.gemm_model``): A100 108, H100/H200 SXM 132 (NVIDIA's architecture
  whitepapers), B200 148 (two dies of 74);
- ``matmul_flops``: the largest BF16 matmul throughput measured on the part ("maximum
  achievable matmul FLOPS", a brute-force search over shapes; S. Bekman, *Machine
  Learning Engineering*, compute/accelerator, MAMF table: A100 SXM 271.2, H100 SXM 794.5
  with "H200 is the same", B200 SXM 1745.0 TFLOP/s). It carries the shape model measured on
  one GPU over to the others (``pipesim.model.compute_model``).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


class GpuError(ValueError):
    """An unknown GPU name."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's datasheet figures."""

    name: str
    bf16_flops: float
    memory_bytes: float
    nvlink_generation: int
    nvlink_bandwidth: float
    nic_bandwidth: float
    memory_bandwidth: float
    sms: int
    matmul_flops: float


GPUS: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec("a100-40gb", 312e12, 40 * GB, 3, 300 * GB, 25 * GB, 1555 * GB, 108, 271.2e12),
    "a100-80gb": GpuSpec("a100-80gb", 312e12, 80 * GB, 3, 300 * GB, 25 * GB, 2039 * GB, 108, 271.2e12),
    "h100": GpuSpec("h100", 989e12, 80 * GB, 4, 450 * GB, 50 * GB, 3350 * GB, 132, 794.5e12),
    "h200": GpuSpec("h200", 989e12, 141 * GB, 4, 450 * GB, 50 * GB, 4800 * GB, 132, 794.5e12),
    "b200": GpuSpec("b200", 2250e12, 180 * GB, 5, 900 * GB, 50 * GB, 8000 * GB, 148, 1745.0e12),
}

DEFAULT_GPU = "h100"


def gpu_spec(name: str | None) -> GpuSpec:
    """The named GPU (``None``: the presets' default, H100 SXM)."""
    spec = GPUS.get(DEFAULT_GPU if name is None else str(name).lower())
    if spec is None:
        raise GpuError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}")
    return spec
