"""GPU models: what a device brings to a plan (compute, memory) and to its node (NVLink).

Figures are the vendors' datasheet numbers for the SXM parts in HGX/DGX systems
(sources in docs/cluster-model.md):

- ``bf16_flops``: dense BF16 tensor-core peak (no 2:4 sparsity), the denominator of MFU;
- ``memory_bytes``: HBM capacity as the driver reports it (``nvidia-smi``'s total,
  what ``torch.cuda.mem_get_info`` counts and PyTorch can allocate from), not the
  marketing "80 GB": an "80 GB" part carries 80 GiB. A100 SXM 80 GB 81920 MiB and 40 GB
  40960 MiB, H100 SXM 81559 MiB (modal-labs/modal-client pull request 2797 lists the
  totals nvidia-smi reports on each; NVIDIA/nccl issue 1264 shows an HGX H100's), H200
  SXM 143771 MiB (nvidia-smi on HGX H200 nodes, as public reports of it print), B200
  183359 MiB (NVIDIA/TensorRT-LLM issue 10278, an 8 x B200 node). The H800 is taken to
  carry the H100's 80 GB HBM3 (no reading of its own found), the GB200 its datasheet's 186 GB
  HBM3e (GB200 NVL72 datasheet; no driver reading found: the B200's reading is 7% above its
  datasheet's 180 GB, so this is on the low side). ``memory_bandwidth``: HBM
  bandwidth (bytes/s), which
  sets the pace of the memory-bound kernels (``pipesim.model.memory_traffic``);
- ``nvlink_bandwidth``: NVLink bandwidth per GPU per direction through NVSwitch (half of
  the bidirectional figure datasheets quote; the H800, H100's export variant, has 400
  GB/s bidirectional where the H100 has 900, and DeepSeek-V3's report measured 160 GB/s
  of its 200 one way);
- ``nic_bandwidth``: the per-GPU InfiniBand port of the vendor's reference system of that
  generation (DGX A100: HDR 200 Gb/s; DGX H100/H200/B200: NDR 400 Gb/s; DGX GB200: one
  ConnectX-7 at 400 Gb/s a GPU), used by the multi-node presets;
- ``sms``: streaming multiprocessors, over which a GEMM's tiles run in waves
  (``pipesim.model.gemm_model``): A100 108, H100/H200 SXM 132 (NVIDIA's architecture
  whitepapers), B200 and GB200 148 (two dies of 74);
- ``matmul_flops``: the largest BF16 matmul throughput measured on the part ("maximum
  achievable matmul FLOPS", a brute-force search over shapes; S. Bekman, *Machine
  Learning Engineering*, compute/accelerator, MAMF table: A100 SXM 271.2, H100 SXM 794.5
  with "H200 is the same", B200 SXM 1745.0 TFLOP/s). It carries the shape model measured on
  one GPU over to the others (``pipesim.model.compute_model``). No measurement of the
  GB200's is published: it is the B200's scaled by the two parts' datasheet peaks (2500
  over 2250 TFLOP/s: the same two dies, allowed 1200 W where HGX B200 has 1000 W), 1939
  TFLOP/s, an assumption the docs say;
- ``fp8_flops``: dense FP8 tensor-core peak (H100/H200 SXM 1979 TFLOP/s, half the
  datasheets' 3958 "with sparsity"; B200 4500; GB200 5000), 0 where the part has no FP8 tensor cores
  (A100). ``fp8_matmul_flops``: the FP8 matmul throughput reached, ``matmul_flops`` times
  ``FP8_MATMUL_OVER_BF16``: DeepGEMM's 1350 FP8 TFLOP/s on Hopper (DeepSeek's release of
  its fine-grained-scaling FP8 GEMMs, February 2025: "1350+ FP8 TFLOPS") over Hopper's
  794.5 BF16, so a large FP8 GEMM runs 1.70x its BF16 time, not the datasheets' 2x.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
MiB = 2**20


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
    fp8_flops: float = 0.0
    matmul_measured: bool = True  # False: matmul_flops estimated, no measurement published (GB200)

    @property
    def fp8_matmul_flops(self) -> float:
        """FP8 matmul throughput reached (0: no FP8 tensor cores): see the module."""
        return self.matmul_flops * FP8_MATMUL_OVER_BF16 if self.fp8_flops else 0.0

    @property
    def fp8_peak_over_bf16(self) -> float:
        """The FP8 peak over the BF16 peak (2 on Hopper and Blackwell; 0: no FP8)."""
        return self.fp8_flops / self.bf16_flops


FP8_MATMUL_OVER_BF16 = 1350e12 / 794.5e12  # DeepGEMM on Hopper over Hopper's measured BF16 matmul

GPUS: dict[str, GpuSpec] = {
    "a100-40gb": GpuSpec("a100-40gb", 312e12, 40960 * MiB, 3, 300 * GB, 25 * GB, 1555 * GB, 108, 271.2e12),
    "a100-80gb": GpuSpec("a100-80gb", 312e12, 81920 * MiB, 3, 300 * GB, 25 * GB, 2039 * GB, 108, 271.2e12),
    "h100": GpuSpec("h100", 989e12, 81559 * MiB, 4, 450 * GB, 50 * GB, 3350 * GB, 132, 794.5e12, 1979e12),
    # H800 SXM: H100's compute and memory, NVLink cut to 400 GB/s bidirectional (the part DeepSeek-V3 trained on)
    "h800": GpuSpec("h800", 989e12, 81559 * MiB, 4, 200 * GB, 50 * GB, 3350 * GB, 132, 794.5e12, 1979e12),
    "h200": GpuSpec("h200", 989e12, 143771 * MiB, 4, 450 * GB, 50 * GB, 4800 * GB, 132, 794.5e12, 1979e12),
    "b200": GpuSpec("b200", 2250e12, 183359 * MiB, 5, 900 * GB, 50 * GB, 8000 * GB, 148, 1745.0e12, 4500e12),
    # GB200 (a Blackwell GPU of a GB200 NVL72 rack): its datasheet's figures; the matmul
    # throughput the B200's measured one scaled by the two datasheet peaks (see the module)
    "gb200": GpuSpec("gb200", 2500e12, 186 * GB, 5, 900 * GB, 50 * GB, 8000 * GB, 148, 1745.0e12 * 2500 / 2250,
                     5000e12, matmul_measured=False),
}

DEFAULT_GPU = "h100"
FP8_GPUS = tuple(name for name, gpu in GPUS.items() if gpu.fp8_flops)


def gpu_spec(name: str | None) -> GpuSpec:
    """The named GPU (``None``: the presets' default, H100 SXM)."""
    spec = GPUS.get(DEFAULT_GPU if name is None else str(name).lower())
    if spec is None:
        raise GpuError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}")
    return spec
