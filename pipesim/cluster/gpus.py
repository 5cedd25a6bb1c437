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
  multi-node presets.
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


GPUS: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec("a100-40gb", 312e12, 40 * GB, 3, 300 * GB, 25 * GB, 1555 * GB),
    "a100-80gb": GpuSpec("a100-80gb", 312e12, 80 * GB, 3, 300 * GB, 25 * GB, 2039 * GB),
    "h100": GpuSpec("h100", 989e12, 80 * GB, 4, 450 * GB, 50 * GB, 3350 * GB),
    "h200": GpuSpec("h200", 989e12, 141 * GB, 4, 450 * GB, 50 * GB, 4800 * GB),
    "b200": GpuSpec("b200", 2250e12, 180 * GB, 5, 900 * GB, 50 * GB, 8000 * GB),
}

DEFAULT_GPU = "h100"


def gpu_spec(name: str | None) -> GpuSpec:
    """The named GPU (``None``: the presets' default, H100 SXM)."""
    spec = GPUS.get(DEFAULT_GPU if name is None else str(name).lower())
    if spec is None:
        raise GpuError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}")
    return spec
