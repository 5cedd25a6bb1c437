"""``pipesim profile --compute-model FILE``: fit the compute model on this GPU.

The built-in compute model of a GPU (``pipesim.model.compute_model``) was measured on
one H200 and carried over to the other parts by published matmul throughput; a user's
own GPU, driver, library versions and clocks can differ. This measures, with torch on
this device, the GEMMs of the transformer the flags describe (its layer at ``--tp`` and
at one rank) plus a fixed spread of shapes (short and long ``k``, full and partial waves
of tiles), fits the GEMM model to them (``pipesim.model.gemm_model.fit_gemm_model``, the
fit the shipped H200 figures come from), times causal attention on a grid of sequence
lengths and heads that includes the model's, and writes the file ``simulate
--compute-model`` reads. It needs a CUDA GPU: the model's units (tiles over SMs, HBM
bandwidth) describe one; the same code runs on a CPU in the tests, on tiny shapes.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass

from pipesim.model.attention_model import AttentionTable, AttentionTiming
from pipesim.model.compute_model import KernelModel, save_compute_model
from pipesim.model.gemm_model import GemmTiming, backward_shapes, fit_gemm_model
from pipesim.model.operations import Gemm, layer_operations
from pipesim.model.spec import ModelSpec

# the spread beside the model's own shapes: a GPT layer at these widths, tp and tokens
SPREAD_HIDDEN, SPREAD_TP, SPREAD_TOKENS = (1024, 4096, 8192), (1, 8), (2048, 8192)
ATTENTION_SEQS, ATTENTION_HEADS = (1024, 2048, 4096, 8192), (8, 16, 32, 64)


@dataclass(frozen=True)
class KernelProfile:
    """What a profile measured and the model fitted to it."""

    model: KernelModel
    gemm_timings: list[GemmTiming]
    attention_timings: list[AttentionTiming]

    def gemm_errors(self) -> list[float]:
        """|predicted / measured - 1| of every GEMM timing, under the fitted model."""
        return [abs(sum(self.model.gemm.seconds(*shape) for shape in timing.shapes) / timing.seconds - 1)
                for timing in self.gemm_timings]


def layer_gemm_shapes(spec: ModelSpec, tp: int) -> list[tuple[int, int, int]]:
    """The weighted GEMMs of one layer of ``spec`` on one of ``tp`` ranks, as whole numbers."""
    return [(math.ceil(op.m), math.ceil(op.k), math.ceil(op.n)) for op in layer_operations(spec, tp)
            if isinstance(op, Gemm) and op.weighted]


def profile_shapes(spec: ModelSpec, tp: int) -> list[tuple[int, int, int]]:
    """The model's GEMMs at ``tp`` and at one rank, and the spread; each shape once."""
    shapes = layer_gemm_shapes(spec, tp) + layer_gemm_shapes(spec, 1)
    for hidden in SPREAD_HIDDEN:
        for tokens in SPREAD_TOKENS:
            for shards in SPREAD_TP:
                shapes += [(tokens, hidden, 3 * hidden // shards), (tokens, hidden // shards, hidden),
                           (tokens, hidden, 4 * hidden // shards), (tokens, 4 * hidden // shards, hidden)]
    return list(dict.fromkeys(shapes))


def attention_shapes(spec: ModelSpec, tp: int) -> list[tuple[int, int, int, int]]:
    """(batch, heads, seq, head_dim) on the grid of ``ATTENTION_SEQS`` and ``ATTENTION_HEADS``
    with the model's sequence and heads per rank added."""
    seqs = sorted(set(ATTENTION_SEQS) | {spec.seq_len})
    heads = sorted(set(ATTENTION_HEADS) | {max(1, spec.heads // tp)})
    head_dim = spec.hidden // spec.heads
    return [(1, count, seq, head_dim) for seq in seqs for count in heads]


def profile_compute_model(gemm_shapes: list[tuple[int, int, int]],
                          attention_grid: list[tuple[int, int, int, int]], device, dtype, peak_flops: float,
                          memory_bandwidth: float, sms: int, name: str, warmup: int = 3,
                          repeats: int = 10) -> KernelProfile:
    """Time ``gemm_shapes`` and ``attention_grid`` on ``device`` (torch) and fit the model
    of a GPU of ``peak_flops``, ``memory_bandwidth`` and ``sms``."""
    from executor.kernel_timing import time_attention, time_gemms  # noqa: PLC0415 - loads torch

    element_bytes = dtype.itemsize
    gemm_timings = []
    for (m, k, n), (forward, backward) in zip(gemm_shapes, time_gemms(gemm_shapes, device, dtype, warmup, repeats),
                                              strict=True):
        gemm_timings += [GemmTiming(((m, k, n),), forward), GemmTiming(backward_shapes(m, k, n), backward)]
    gemm = fit_gemm_model(gemm_timings, peak_flops, memory_bandwidth, sms, element_bytes)
    attention_timings = [
        AttentionTiming(seq, heads, head_dim, batch, forward, forward_backward)
        for (batch, heads, seq, head_dim), (forward, forward_backward)
        in zip(attention_grid, time_attention(attention_grid, device, dtype, warmup, repeats), strict=True)]
    attention = AttentionTable.from_timings(attention_timings, f"attention measured on {name}")
    return KernelProfile(KernelModel(f"profiled on {name}", gemm, attention), gemm_timings, attention_timings)


def write_profile(path: str, profile: KernelProfile, device_name: str) -> None:
    """The compute-model file, with every timing kept."""
    measurements = {"gemm": [{"shapes": [list(shape) for shape in timing.shapes], "seconds": timing.seconds}
                             for timing in profile.gemm_timings]}
    save_compute_model(path, profile.model, device_name, profile.attention_timings, measurements)


def describe(profile: KernelProfile) -> list[str]:
    """What was fitted and how well it explains its own timings."""
    gemm, errors = profile.model.gemm, profile.gemm_errors()
    return [f"GEMMs: {len(profile.gemm_timings)} timings; efficiency {gemm.efficiency:.3f} of peak, k overhead "
            f"{gemm.k_overhead:g}, launch floor {gemm.launch_seconds * 1e6:.1f} us; fit error median "
            f"{statistics.median(errors):.1%}, worst {max(errors):.1%}",
            f"attention: {len(profile.attention_timings)} timings on {len(profile.model.attention.seqs)} sequence "
            f"lengths x {len(profile.model.attention.heads)} head counts"]


GPU_NAMES = (("A100", "80GB", "a100-80gb"), ("A100", "", "a100-40gb"), ("H100", "", "h100"), ("H200", "", "h200"),
             ("GB200", "", "gb200"), ("B200", "", "b200"))


def gpu_from_device_name(device_name: str) -> str | None:
    """The ``pipesim.hardware.gpus`` name of a CUDA device torch names, when it is one we know."""
    upper = device_name.upper()
    for part, detail, name in GPU_NAMES:
        if part in upper and detail in upper:
            return name
    return None


def handle_compute_model(args: argparse.Namespace) -> int:
    """Profile this machine's GPU and write ``args.compute_model``."""
    import torch  # noqa: PLC0415

    from executor.options import DEFAULT_MICROBATCHES, batch_size  # noqa: PLC0415
    from pipesim.hardware.gpus import gpu_spec  # noqa: PLC0415
    from pipesim.job import executor_gpt_spec  # noqa: PLC0415

    if not torch.cuda.is_available():
        raise ValueError("--compute-model needs a CUDA GPU: it fits the kernels of the GPU it runs on and torch sees "
                         "none here; without one, simulate uses the built-in model of --gpu")
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    gpu = args.gpu or gpu_from_device_name(properties.name)
    if gpu is None:
        raise ValueError(f"--compute-model: cannot tell which GPU {properties.name!r} is; name the nearest with --gpu "
                         "(its datasheet peak and HBM bandwidth are the model's units)")
    figures = gpu_spec(gpu)
    microbatches = args.microbatches or DEFAULT_MICROBATCHES  # run's default, as the stage profile's
    samples = batch_size(args, microbatches)
    spec = executor_gpt_spec(layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len,
                             vocab=args.vocab, microbatch_size=max(1, -(-samples // microbatches)),
                             dtype_bytes=2)
    profile = profile_compute_model(profile_shapes(spec, args.tp), attention_shapes(spec, args.tp), device,
                                    torch.bfloat16, figures.bf16_flops, figures.memory_bandwidth,
                                    properties.multi_processor_count, properties.name, args.warmup, args.repeats)
    write_profile(args.compute_model, profile, properties.name)
    print("\n".join(describe(profile)))
    print(f"wrote {args.compute_model} (pipesim simulate --model ... --compute-model {args.compute_model})")
    return 0
