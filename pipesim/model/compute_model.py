"""Compute models: the seconds each operation of a layer takes on a GPU.

Two models answer the same three questions (a GEMM of a shape, a flash-attention kernel,
bytes through HBM):

- ``KernelModel`` (the default): GEMMs from their shape (``pipesim.model.gemm_model``:
  tile and wave quantisation over the GPU's SMs, short-k overhead, memory and launch
  floors), flash attention from measured throughput by shape
  (``pipesim.model.attention_model``), element-wise kernels at HBM bandwidth;
- ``FixedEfficiency`` (``--mfu``): every GEMM and attention kernel at one fraction of
  peak, whatever its shape — the model to calibrate on a measured step.

Where the kernel figures come from (never from a training run):

- **H100 and H200** (one die, GH100, 132 SMs, same clocks): the GEMM model fitted to the
  H200 table of the four GEMMs of a layer, h 1024-16384, tp 1-8
  (``data/h200_gemm_bf16.csv``; ``H200_GEMM_FIT`` below is ``fit_gemm_model`` of it, which
  the tests re-run); attention interpolated in the measured H200 table
  (``data/h200_attention_bf16.csv``). Their HBM bandwidths differ (3.35 vs 4.8 TB/s), and
  the model's memory terms use each one's own.
- **A100 and B200**: the same shape model on their own SMs, peak and HBM, with the
  efficiency carried over in proportion to their maximum achievable matmul throughput
  (``GpuSpec.matmul_flops``, published measurements): a sustained full-wave GEMM reaches
  the same fraction of the best matmul measured on each part as the H200's did
  (0.7234 x 989 / 794.5 = 0.90). Attention throughput is the H200's scaled by the same
  ratio of matmul throughputs (A100: 0.34x; at 8192 tokens and 16 heads that is 166
  TFLOP/s forward + backward, 53% of peak, inside the 50-73% of peak that Dao 2023,
  "FlashAttention-2", reports for its kernels on an A100).
- A device without a named GPU (a topology file giving only ``peak_flops``) takes the
  H100's model at its own peak and bandwidth.

``pipesim profile --compute-model FILE`` fits the same model on the user's GPU
(``save_compute_model``/``load_compute_model``).

**FP8** (``--fp8``, or a config's FP8 ``quantization_config``): the GEMMs a
``Gemm.fp8`` marks (``pipesim.model.operations``) run their ``k`` loop ``fp8_speedup``
times as fast as in BF16 on the same shape model (``GpuSpec.fp8_matmul_flops /
matmul_flops``: 1.70 on Hopper, from DeepGEMM's measured FP8 throughput; with ``--mfu``
the datasheets' 2), their operands one byte wide and their output BF16. Each tile's fixed prologue and
epilogue (the fitted ``k_overhead``: the epilogue writes the same BF16 output tile) do
not speed up (``GemmModel.mainloop_speedup``), so the FP8 gain grows with ``k``: 1.68 at
16384 cubed, 1.25 at k 256 (m = n = 8192). That is the shape of the published FP8 sweeps
by ``k`` on Hopper (tile-ai/tilelang ``benchmark/matmul_fp8/README.md``, H800, m = n =
8192, k 256-16384: throughput at k 256 is 25-37% of that at 16384 across its two
published runs, the model's 37%, the flat ratio's 49%; tested in ``tests/test_fp8.py``),
and at 8192 cubed the model's 1,143 FP8 TFLOP/s on an H100 is the 1,137 cuBLAS reaches
through ``torch._scaled_mm`` in the benchmark of pytorch/pytorch pull request 155507.
Each also pays its casts, as memory-bound kernels: its input
before the forward and the output's gradient before the backward are read in BF16 and
written in FP8 twice, as is and transposed (Transformer Engine's fused cast-transpose,
``CAST_BYTES`` = 2 + 1 + 1 bytes per element; the scaling factors, one per 1x128 tile in
DeepSeek-V3's recipe, are a 1/128 share and not counted). The weights are cast once per
step, not per microbatch (Megatron-Core hands Transformer Engine ``is_first_microbatch``,
which keeps the FP8 copy), and that pass is not counted. Current scaling
(``ModelSpec.fp8_scaling``, ``--fp8 current``: Transformer Engine's Float8CurrentScaling,
Megatron-Bridge's FP8-CS, torchao's tensorwise dynamic scaling) finds each scale from the
tensor itself, an amax pass before the cast: Transformer Engine's docs ("FP8 Delayed
Scaling") count two reads of the tensor per quantization against delayed scaling's one,
so its casts read the 2-byte element once more (``AMAX_BYTES``, 6 bytes in all). A GPU without FP8 tensor cores
(A100), or a profiled model (which measured BF16), refuses FP8 in one line.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from pipesim.hardware.gpus import DEFAULT_GPU, FP8_GPUS, GPUS, gpu_spec
from pipesim.model import memory_traffic
from pipesim.model.attention_model import AttentionTable, AttentionTableError, AttentionTiming, read_attention_csv
from pipesim.model.errors import ModelSpecError
from pipesim.model.gemm_model import GemmModel
from pipesim.model.operations import UP_PROJECTIONS, FlashAttention, Gemm, MemoryBound, Operation, memory_bound_kernels
from pipesim.model.spec import NORM_MLA_UP, PER_OP, ModelSpec

FILE_FORMAT = 1
# fit_gemm_model over data/h200_gemm_bf16.csv (forward and backward of every row), on the H200's
# 989 TFLOP/s, 4.8 TB/s, 132 SMs; tests/test_compute_model.py re-fits the file and checks these
H200_GEMM_FIT = {"efficiency": 0.7234, "k_overhead": 272.0, "launch_seconds": 25.1e-6}
MEASURED_GPU = "h200"
CAST_BYTES = 4  # an FP8 cast-transpose: reads 2 bytes per element, writes 1 twice (as is, transposed)
AMAX_BYTES = 2  # current scaling's amax pass: the 2-byte element read once more before its cast


class ComputeModelError(ValueError):
    """A compute-model file or option that cannot describe a GPU."""


@dataclass(frozen=True)
class FixedEfficiency:
    """Every GEMM and attention kernel at ``efficiency`` of ``peak_flops`` (``--mfu``);
    element-wise kernels at HBM ``memory_bandwidth``."""

    peak_flops: float
    efficiency: float
    memory_bandwidth: float
    fp8_speedup: float = 0.0  # the FP8 peak over the BF16 peak; 0: no FP8

    @property
    def name(self) -> str:
        return f"fixed efficiency {self.efficiency:g} of peak (--mfu)"

    def gemm_seconds(self, gemm: Gemm, element_bytes: int) -> float:
        speedup = self.fp8_speedup if gemm.fp8 else 1.0
        return gemm.flops / (self.peak_flops * self.efficiency * speedup)

    def attention_seconds(self, attention: FlashAttention) -> tuple[float, float]:
        forward = attention.flops / (self.peak_flops * self.efficiency)
        return forward, 2 * forward  # the old rule: a backward is twice the forward's FLOPs

    def memory_seconds(self, num_bytes: float) -> float:
        return memory_traffic.memory_seconds(num_bytes, self.memory_bandwidth)


@dataclass(frozen=True)
class KernelModel:
    """A GPU's kernels by shape: ``gemm``, and flash ``attention`` throughput measured on
    another GPU scaled by ``attention_scale``."""

    name: str
    gemm: GemmModel
    attention: AttentionTable
    attention_scale: float = 1.0
    fp8_speedup: float = 0.0  # FP8 GEMMs' throughput over BF16's at the same shape; 0: no FP8

    @property
    def peak_flops(self) -> float:
        return self.gemm.peak_flops

    @property
    def memory_bandwidth(self) -> float:
        return self.gemm.memory_bandwidth

    def gemm_seconds(self, gemm: Gemm, element_bytes: int) -> float:
        if gemm.fp8:
            return self.fp8_gemm.seconds(gemm.m, gemm.k, gemm.n, gemm.count, 1, output_bytes=2)  # BF16 out
        return self.gemm.seconds(gemm.m, gemm.k, gemm.n, gemm.count, element_bytes)

    @functools.cached_property
    def fp8_gemm(self) -> GemmModel:
        """The GEMM model with its ``k`` loop ``fp8_speedup`` times as fast (see the module)."""
        return replace(self.gemm, mainloop_speedup=self.fp8_speedup)

    def attention_seconds(self, attention: FlashAttention) -> tuple[float, float]:
        return self.attention.seconds(attention, self.attention_scale)

    def memory_seconds(self, num_bytes: float) -> float:
        return memory_traffic.memory_seconds(num_bytes, self.gemm.memory_bandwidth)

    def on_device(self, peak_flops: float, memory_bandwidth: float) -> KernelModel:
        """The same kernels on a device of another peak or HBM bandwidth (a topology file's
        figures): GEMMs keep their efficiency as a fraction of peak, attention scales with it."""
        if peak_flops == self.gemm.peak_flops and memory_bandwidth == self.gemm.memory_bandwidth:
            return self
        return replace(self, gemm=replace(self.gemm, peak_flops=peak_flops, memory_bandwidth=memory_bandwidth),
                       attention_scale=self.attention_scale * peak_flops / self.gemm.peak_flops)


ComputeModel = FixedEfficiency | KernelModel


@functools.cache
def measured_attention() -> AttentionTable:
    """The H200 flash-attention table shipped with pipesim."""
    with resources.as_file(resources.files("pipesim.model") / "data" / "h200_attention_bf16.csv") as path:
        return read_attention_csv(path)


@functools.cache
def gpu_compute_model(name: str | None) -> KernelModel:
    """The built-in kernel model of a ``pipesim.hardware.gpus`` GPU (``None``: the default
    GPU): the H200 measurements carried over by maximum achievable matmul throughput."""
    gpu, measured = gpu_spec(name), GPUS[MEASURED_GPU]
    sustained = H200_GEMM_FIT["efficiency"] * measured.bf16_flops / measured.matmul_flops
    gemm = GemmModel(gpu.bf16_flops, gpu.memory_bandwidth, gpu.sms,
                     efficiency=sustained * gpu.matmul_flops / gpu.bf16_flops,
                     k_overhead=H200_GEMM_FIT["k_overhead"], launch_seconds=H200_GEMM_FIT["launch_seconds"])
    source = "H200 kernel measurements"
    if gpu.matmul_flops != measured.matmul_flops:
        source += " scaled by " + ("measured matmul throughput" if gpu.matmul_measured
                                   else "a matmul throughput estimated from datasheet peaks")
    return KernelModel(f"{gpu.name} ({source})", gemm, measured_attention(),
                       attention_scale=gpu.matmul_flops / measured.matmul_flops,
                       fp8_speedup=gpu.fp8_matmul_flops / gpu.matmul_flops)


def stage_compute_model(peak_flops: float, memory_bandwidth: float, gpu: str | None = None,
                        mfu: float | None = None, profiled: KernelModel | None = None,
                        fp8: bool = False, comm_sms: int = 0) -> ComputeModel:
    """The model a stage's device runs on: ``--mfu`` if given, else a profiled model
    (``--compute-model``), else its GPU's built-in model at the device's figures;
    ``fp8``: refused unless the GPU has FP8 tensor cores (see the module); ``comm_sms``
    of its SMs kept for communication (``reserve_sms``)."""
    part = gpu_spec(gpu or DEFAULT_GPU)
    if fp8 and not part.fp8_flops:
        raise ModelSpecError(f"--fp8: {part.name} has no FP8 tensor cores; FP8 GEMMs need one of "
                             f"{', '.join(FP8_GPUS)} (--gpu)")
    if isinstance(comm_sms, bool) or not isinstance(comm_sms, int) or not 0 <= comm_sms < part.sms:
        raise ModelSpecError(f"--comm-sms {comm_sms!r}: {part.name} has {part.sms} SMs; keep 0 to "
                             f"{part.sms - 1} of them for communication")
    if mfu is not None:
        model = FixedEfficiency(peak_flops, mfu, memory_bandwidth, part.fp8_peak_over_bf16)
    elif profiled is not None:
        if fp8:
            raise ModelSpecError(f"--fp8 conflicts with --compute-model ({profiled.name}): the profiled model "
                                 f"measured BF16 GEMMs; drop one")
        model = profiled
    else:
        model = gpu_compute_model(part.name).on_device(peak_flops, memory_bandwidth)
    return reserve_sms(model, comm_sms, part.sms)


def reserve_sms(model: ComputeModel, reserved: int, sms: int) -> ComputeModel:
    """``model`` with ``reserved`` of its GPU's ``sms`` kept for communication kernels
    (DeepSeek-V3 gave 20 of an H800's 132 to its all-to-all and pipeline transfers,
    report section 3.2.2): GEMMs tile over the rest, at their share of the peak, and
    attention runs at that share of its throughput; memory-bound kernels keep the whole
    HBM bandwidth (the communication kernels' own traffic is not counted)."""
    if not reserved:
        return model
    share = (sms - reserved) / sms
    if isinstance(model, FixedEfficiency):
        return replace(model, peak_flops=model.peak_flops * share)
    gemm = replace(model.gemm, peak_flops=model.gemm.peak_flops * share,
                   sms=model.gemm.sms - round(reserved * model.gemm.sms / sms))
    return replace(model, name=f"{model.name}, {reserved} of {sms} SMs kept for communication", gemm=gemm,
                   attention_scale=model.attention_scale * share)


# ---------------------------------------------------------------------------------------------
# operations -> seconds


@dataclass(frozen=True)
class OperationTime:
    """Seconds of an operation's forward, and of its backward split into input-gradient
    and weight-gradient work; ``forward_cast``: of the forward, an FP8 GEMM's input cast."""

    forward: float
    input_grad: float
    weight_grad: float = 0.0
    forward_cast: float = 0.0


def _gemm_time(gemm: Gemm, model: ComputeModel, element_bytes: int) -> OperationTime:
    forward = model.gemm_seconds(gemm, element_bytes)
    data_grad = model.gemm_seconds(replace(gemm, k=gemm.n, n=gemm.k), element_bytes)  # m x n by n x k
    other_grad = model.gemm_seconds(replace(gemm, m=gemm.k, k=gemm.m), element_bytes)  # k x m by m x n
    input_cast = 0.0
    if gemm.fp8:  # the input cast before the forward, the output gradient's before the backward
        cast = CAST_BYTES + (AMAX_BYTES if gemm.amax_pass else 0)
        input_cast = model.memory_seconds(cast * gemm.count * gemm.m * gemm.k)
        forward += input_cast
        data_grad += model.memory_seconds(cast * gemm.count * gemm.m * gemm.n)
    if gemm.weighted:
        return OperationTime(forward, data_grad, other_grad, input_cast)
    return OperationTime(forward, data_grad + other_grad, forward_cast=input_cast)  # both operands are activations


def _attention_time(attention: FlashAttention, model: ComputeModel, element_bytes: int) -> OperationTime:
    forward, backward = model.attention_seconds(attention)
    return OperationTime(forward, backward)


def _memory_time(kernel: MemoryBound, model: ComputeModel, element_bytes: int) -> OperationTime:
    forward = model.memory_seconds(kernel.bytes)
    if kernel.backward_bytes is not None:
        return OperationTime(forward, model.memory_seconds(kernel.backward_bytes))
    return OperationTime(forward, memory_traffic.BACKWARD_TRAFFIC * forward)


OPERATION_TIME = {Gemm: _gemm_time, FlashAttention: _attention_time, MemoryBound: _memory_time}


def operation_time(operation: Operation, model: ComputeModel, element_bytes: int = 2) -> OperationTime:
    """Seconds of one operation's forward and backward on ``model``."""
    return OPERATION_TIME[type(operation)](operation, model, element_bytes)


@dataclass(frozen=True)
class BlockTime:
    """Seconds of a group of operations (a layer, the output layer) for one microbatch:
    ``recompute`` is what activation recomputation re-runs inside the backward."""

    forward: float
    input_grad: float
    weight_grad: float
    recompute: float = 0.0


def block_time(operations: tuple[Operation, ...], model: ComputeModel, recompute: str = "none",
               element_bytes: int = 2) -> BlockTime:
    """Sum of ``operations``' times; full recompute re-runs every forward, selective the
    attention core's, per-op every element-wise kernel and the recomputed GEMMs' share,
    norm-mla-up the norms' share of the element-wise kernels and latent attention's
    up-projections (``recomputed_share``)."""
    forward = input_grad = weight_grad = recomputed = 0.0
    for operation in operations:
        time = operation_time(operation, model, element_bytes)
        forward += time.forward
        input_grad += time.input_grad
        weight_grad += time.weight_grad
        recomputed += recomputed_seconds(operation, time, recompute)
    return BlockTime(forward, input_grad, weight_grad, recomputed)


def recomputed_seconds(operation: Operation, time: OperationTime, recompute: str) -> float:
    """Seconds of ``operation``'s forward the backward re-runs: ``recomputed_share`` of it;
    per-op checkpointing also re-runs the FP8 input cast of a product it saves (the cast is
    not a saved op, and the re-run forward runs every op it does not save)."""
    share = recomputed_share(operation, recompute)
    if recompute == PER_OP:
        return share * time.forward + (1 - share) * time.forward_cast
    return share * time.forward


def recomputed_share(operation: Operation, recompute: str) -> float:
    """The share of ``operation``'s forward that the backward re-runs under ``recompute``,
    plus what it re-runs whatever the mode (an element-wise kernel's ``recomputed_bytes``:
    a mixture of experts' activation under FP8 caching)."""
    if recompute == "full" or (recompute == "selective" and operation.attention_core):
        return 1.0
    if recompute == PER_OP:  # pipesim.model.per_op_checkpoint: the attention kernel's output is kept
        if isinstance(operation, MemoryBound):
            return 1.0
        return operation.per_op_recomputed if isinstance(operation, Gemm) else 0.0
    if isinstance(operation, MemoryBound):
        if not operation.bytes:
            return 0.0
        norms = operation.norm_bytes if recompute == NORM_MLA_UP else 0.0
        return (operation.recomputed_bytes + norms) / operation.bytes
    return 1.0 if recompute == NORM_MLA_UP and isinstance(operation, Gemm) and operation.name in UP_PROJECTIONS else 0.0


def layer_memory_seconds(spec: ModelSpec, bandwidth: float, tp: int = 1, sequence_parallel: bool = False,
                         flash_attention: bool = True, recompute: str = "none",
                         layer: int = 0) -> tuple[float, float]:
    """(forward, backward) seconds of layer ``layer``'s memory-bound kernels at
    ``bandwidth`` bytes/s of HBM, the backward with what recompute re-runs: the part of a
    layer's time that is the same under every compute model."""
    kernels = memory_bound_kernels(spec, tp, sequence_parallel, flash_attention, layer)
    time = block_time(kernels, FixedEfficiency(math.inf, 1.0, bandwidth), recompute, spec.dtype_bytes)
    return time.forward, time.input_grad + time.recompute


# ---------------------------------------------------------------------------------------------
# the file pipesim profile --compute-model writes


def save_compute_model(path: str | Path, model: KernelModel, device: str, attention_rows: list[AttentionTiming],
                       measurements: dict | None = None) -> None:
    """Write ``model`` (fitted on ``device``) with the attention timings it interpolates."""
    document = {
        "compute_model": FILE_FORMAT,
        "device": device,
        "peak_flops": model.gemm.peak_flops,
        "memory_bandwidth": model.gemm.memory_bandwidth,
        "sms": model.gemm.sms,
        "gemm": {"efficiency": model.gemm.efficiency, "k_overhead": model.gemm.k_overhead,
                 "launch_seconds": model.gemm.launch_seconds},
        "attention": [{"seq": row.seq, "heads": row.heads, "head_dim": row.head_dim, "batch": row.batch,
                       "fwd_s": row.forward_seconds, "fwd_bwd_s": row.forward_backward_seconds}
                      for row in attention_rows],
        "measurements": measurements or {},
    }
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def _positive(document: dict, key: str, where: str, integer: bool = False) -> float:
    value = document.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 \
            or (integer and value != int(value)):
        kind = "a whole number" if integer else "a finite number"
        raise ComputeModelError(f"{where}: {key} must be {kind} > 0, got {value!r}")
    return value


def load_compute_model(path: str | Path) -> KernelModel:
    """The model in a file ``pipesim profile --compute-model`` wrote."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"compute model {path} does not exist")
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ComputeModelError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(document, dict) or document.get("compute_model") != FILE_FORMAT:
        raise ComputeModelError(f"{path}: not a compute model (pipesim profile --compute-model writes one, with "
                                f'"compute_model": {FILE_FORMAT})')
    gemm_fields = document.get("gemm")
    if not isinstance(gemm_fields, dict):
        raise ComputeModelError(f"{path}: 'gemm' must be an object with efficiency, k_overhead, launch_seconds")
    efficiency = _positive(gemm_fields, "efficiency", f"{path}: gemm")
    if efficiency > 1:
        raise ComputeModelError(f"{path}: gemm: efficiency is a fraction of peak in (0, 1], got {efficiency}")
    k_overhead = gemm_fields.get("k_overhead")
    if isinstance(k_overhead, bool) or not isinstance(k_overhead, (int, float)) or not 0 <= k_overhead < math.inf:
        raise ComputeModelError(f"{path}: gemm: k_overhead must be a finite number >= 0, got {k_overhead!r}")
    gemm = GemmModel(_positive(document, "peak_flops", str(path)), _positive(document, "memory_bandwidth", str(path)),
                     int(_positive(document, "sms", str(path), integer=True)), efficiency, float(k_overhead),
                     _positive(gemm_fields, "launch_seconds", f"{path}: gemm"))
    rows = document.get("attention")
    if not isinstance(rows, list) or not rows:
        raise ComputeModelError(f"{path}: 'attention' must be a non-empty list of timings")
    timings = []
    for index, row in enumerate(rows):
        where = f"{path}: attention[{index}]"
        if not isinstance(row, dict):
            raise ComputeModelError(f"{where} must be an object")
        timings.append(AttentionTiming(*(int(_positive(row, key, where, integer=True))
                                         for key in ("seq", "heads", "head_dim", "batch")),
                                       _positive(row, "fwd_s", where), _positive(row, "fwd_bwd_s", where)))
    try:
        attention = AttentionTable.from_timings(timings, str(path))
    except AttentionTableError as error:
        raise ComputeModelError(str(error)) from None
    return KernelModel(f"profiled on {document.get('device', 'an unnamed device')} ({path.name})", gemm, attention)
