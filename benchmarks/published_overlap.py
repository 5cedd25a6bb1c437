"""Predicted against published throughput of today's stacks, which overlap communication.

NVIDIA's NeMo / Megatron-Bridge performance summaries and torchtitan's async-TP benchmark
publish measured tokens per second per GPU of current Megatron-Core and torch stacks on
H100 with every layout field (tp, pp, cp, virtual stages, FSDP, global and micro batch,
sequence, precision). Each row here is one ``pipesim simulate`` command, with no
calibration and the stack's defaults: gradient reduce-scatter beside the backward and
the parameter all-gather beside the next forwards (Megatron-Core's distributed optimizer
with ``--overlap-grad-reduce --overlap-param-gather``, ``--zero 1``; FSDP2's prefetch,
``--zero 3``), tensor-parallel collectives beside the GEMMs with sequence parallelism
(``--tp-comm-overlap``, torch's async TP) unless the row says vanilla TP
(``--no-tp-overlap``), FP8 GEMMs where the row says FP8 (``--fp8 delayed`` for NeMo 24.07,
whose Transformer Engine had only delayed scaling; ``--fp8 current`` for Megatron-Bridge's
FP8-CS, as 26.02's rows are taken to be, and torchtitan's tensorwise float8, all current
scaling), the row's
activation recomputation (none unless it says), flash attention, the InfiniBand preset
(NDR 400 Gb/s per GPU, as DGX H100 and Grand Teton have).

The comparison is of tokens per second per GPU, the one figure measured: the relative
error is the MFU's under any one FLOP count (NeMo's model TFLOP/s and torchtitan's MFU
count FLOPs their own ways; both are printed beside it for reference, not compared).

Sources (the figures transcribed from each file at the commit named):

- ``nemo-24.07``: NVIDIA/NeMo ``docs/source/performance/performance_summary.md``
  (commit 070a0bb168d4), "Pretraining", container NeMo 24.07, DGX-H100, FP8.
- ``bridge-25.11``: NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary.md``
  (commit 00b7660be025), "25.11 NeMo Container", DGX-H100 (FSDP column: 1 = FSDP).
- ``bridge-26.02``: NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary-archive.md``
  (commit 0a25f911b2ed), "26.02 NeMo Container", DGX-H100.
- ``bridge-25.09``, ``bridge-26.02.01``, ``bridge-26.04``, ``bridge-26.04.01``,
  ``bridge-26.06``: the same archive file at commit 067f987df, every dense DGX-H100 row of
  those containers: the three layouts above published again (``later_containers``). 25.09's
  table names no precision; its rows are taken as 25.11's FP8-CS. The same layout's figure
  moves between containers with the software alone, so the Megatron-Core summary is also
  printed with each layout counted once, at its newest container.
- ``b200-bridge``: the same archive at 067f987df, the dense DGX-B200 rows of 25.09 and
  25.11 (Llama 3 8B on 8 GPUs, Llama 3.1 405B on 128), FP8-CS, simulated with ``--gpu
  b200`` and summarised apart from the H100 rows (``blackwell``).
- ``gb200-bridge``: the same archive at 067f987df, the dense DGX-GB200 rows of 25.09 to
  26.06 (Llama 3 8B on 8 GPUs, Llama 3 70B on 64 under FSDP, Llama 3.1 405B on 256),
  FP8-CS, simulated with ``--gpu gb200 --topology nvl72`` and summarised apart
  (``grace_blackwell``; ``grace_blackwell_lines`` sets them beside the B200 rows).
- ``torchtitan-asynctp``: pytorch/torchtitan
  ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (commit 5ecb74e54b8d), Llama
  3.1 8B and 70B, vanilla and async TP, BF16 and float8 tensorwise; the layouts from its
  commands (sequence 8192 from the train configs). Its H100s are Grand Teton's 96 GB HBM2e
  parts at 2.4 TB/s and a 500 W power limit, simulated as pipesim's ``h100`` (SXM, 3.35
  TB/s, 700 W): a hardware gap the table keeps in view rather than corrects for.

Not used: Megatron-LM's README weak-scaling study (H100, 2B-462B) is published as a
picture (its layouts and MFU are not in text); NeMo's Nemotron rows (squared-ReLU MLPs
whose exact sizes the table does not give) and the mixture-of-experts rows (their
published figures force-balance the routing; a separate question).

In-sample and held out, decided before any row was run: the rows marked ``in-sample``
were run while the model was changed (the channel rings of
``pipesim.cluster.collectives``, found on the GPT3-20B row); the ``held out`` rows were
first run after that change and no choice of the model was made with them on screen until
the two FP8 changes (FP8 GEMMs' k-loop rule, ``benchmarks/fp8_gemms.py``; current
scaling's amax pass), made with every row seen but with no number taken from a row. The
rows of the other containers (``later_containers``) were added after every change, held out.

Run: ``PYTHONPATH=. python benchmarks/published_overlap.py`` (prints the table, each
row's command, the median and worst error over all rows and over the held-out rows, and
the trend across model sizes within each source).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from dataclasses import dataclass, replace

from pipesim.cluster.presets import nodes_for

ARCHIVE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @067f987"
MOE_SOURCE = "bridge-moe"  # the archive's mixture-of-experts rows, every container (in each row's label)
B200_SOURCE = "b200-bridge"  # the archive's dense DGX-B200 rows, both containers (in each row's label)
GB200_SOURCE = "gb200-bridge"  # the archive's dense DGX-GB200 rows, every container (in each row's label)
ZOO_SOURCE = "moe-modelzoo"  # the Megatron-Core MoE team's own Qwen3-235B-A22B layouts on 256 H100s
SOURCES = {
    "nemo-24.07": "NVIDIA/NeMo docs/source/performance/performance_summary.md @070a0bb (NeMo 24.07, DGX-H100, FP8)",
    "bridge-25.09": f"{ARCHIVE} (25.09 container, DGX-H100; precision not named: taken as 25.11's FP8-CS)",
    "bridge-25.11": "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @00b7660 (25.11 container, DGX-H100)",
    "bridge-26.02": "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @0a25f91 (26.02 container, "
                    "DGX-H100)",
    "bridge-26.02.01": f"{ARCHIVE} (26.02.01 container, DGX-H100)",
    "bridge-26.04": f"{ARCHIVE} (26.04 container, DGX-H100)",
    "bridge-26.04.01": f"{ARCHIVE} (26.04.01 container, DGX-H100)",
    "bridge-26.06": f"{ARCHIVE} (26.06 container, DGX-H100)",
    MOE_SOURCE: f"{ARCHIVE} (25.11 to 26.06 containers, DGX-H100, mixture of experts; force-balanced routing)",
    B200_SOURCE: f"{ARCHIVE} (25.09 and 25.11 containers, DGX-B200, FP8-CS; 25.09's precision not named: taken "
                 f"as 25.11's)",
    GB200_SOURCE: f"{ARCHIVE} (25.09 to 26.06 containers, DGX-GB200, FP8-CS; 26.02 on prints it 'FP8', 25.09 "
                  f"names none: taken as 25.11's)",
    "torchtitan-asynctp": "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @5ecb74e "
                          "(Grand Teton H100 96 GB HBM2e, 500 W)",
    ZOO_SOURCE: "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md @e865051 (first published 2025-05-27, "
                "8017e11; commands examples/qwen3/run_235b.sh; 256 H100, BF16, DeepEP, force-balanced routing)",
}

# Architectures the presets do not hold, as simulate's field flags on a preset of the family
GPT3 = "--model gpt3-175b"  # NeMo's GPT3 configs: GELU MLP 4h, learned positions, tied embeddings
GPT3_5B = f"{GPT3} --layers 24 --hidden 4096 --heads 32 --ffn-hidden 16384"
GPT3_20B = f"{GPT3} --layers 44 --hidden 6144 --heads 48 --ffn-hidden 24576"
LLAMA2 = "--model llama3-70b --vocab 32000"  # Llama 2: Llama 3's layer, a 32k vocabulary
LLAMA2_7B = f"{LLAMA2} --layers 32 --hidden 4096 --heads 32 --kv-heads 32 --ffn-hidden 11008"
LLAMA2_13B = f"{LLAMA2} --layers 40 --hidden 5120 --heads 40 --kv-heads 40 --ffn-hidden 13824"
LLAMA2_70B = LLAMA2  # 80 layers, 8192 hidden, 64 heads, 8 kv heads, 28672 MLP: Llama 3 70B's


@dataclass(frozen=True)
class PublishedRun:
    """One published row: its layout (``tp``, ``pp``, ``cp``, ``vp`` chunks per rank,
    ``fsdp``), batch (``global_batch`` sequences of ``seq_len`` in microbatches of
    ``microbatch_size``), precision, recompute and TP overlap, and what was measured
    (tokens/s per GPU; the source's TFLOP/s per GPU, shown only)."""

    label: str
    source: str
    params_b: float  # the size the source names, for the trend
    model: str  # simulate's model flags
    gpus: int
    global_batch: int
    microbatch_size: int
    seq_len: int
    tp: int
    pp: int
    tokens_per_gpu: float
    tflops_per_gpu: float | None = None
    cp: int = 1
    vp: int = 1
    fsdp: bool = False
    fp8: bool = True
    fp8_scaling: str = "delayed"  # how its FP8 casts find their scale (pipesim.model.spec.FP8_SCALINGS)
    recompute: str = "none"
    tp_overlap: bool = True
    in_sample: bool = False
    ep: int = 1  # expert-parallel ranks (a mixture of experts; cut from dp, as Megatron-Core does)
    etp: int = 0  # the experts' own tensor parallelism under Megatron-Core's parallel folding; 0: tp
    ep_overlap: bool = False  # Megatron-Core's combined 1F1B (overlap_moe_expert_parallel_comm)
    delay_wgrad: bool = False  # and in its pairs the experts' weight gradient delayed (delay_wgrad_compute)
    flags: str = ""  # further simulate flags the source's command sets (dispatcher, layer split)
    # the loss's kernels (pipesim.model.loss_traffic): Megatron-Bridge's performance scripts set Transformer Engine's
    # (_set_common_perf_overrides), as do the MoE team's configs; NeMo 24.07's Llama configs the native fusion
    cross_entropy: str = "unfused"
    gpu: str = "h100"  # simulate's --gpu: the DGX's part
    topology: str = "ib"  # simulate's --topology preset: 8-GPU nodes on InfiniBand, or GB200 NVL72 racks

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.microbatch_size)

    def argv(self) -> list[str]:
        """The ``pipesim simulate`` flags of the row."""
        schedule = f"--schedule interleaved-1f1b -v {self.vp}" if self.vp > 1 else "--schedule 1f1b"
        flags = [self.model, f"--seq-len {self.seq_len} --microbatch-size {self.microbatch_size}",
                 f"{schedule} --pp {self.pp} -m {self.microbatches} --tp {self.tp} --dp {self.dp}",
                 f"--topology {self.topology} --nodes {nodes_for(self.topology, self.gpus, 8)} --gpu {self.gpu}",
                 f"--zero {3 if self.fsdp else 1} --recompute {self.recompute}"]
        if self.tp > 1:
            flags.append("--sequence-parallel" + ("" if self.tp_overlap else " --no-tp-overlap"))
        if self.cp > 1:
            flags.append(f"--cp {self.cp}")
        if self.ep > 1:
            flags.append(f"--ep {self.ep}")
        if self.etp:
            flags.append(f"--etp {self.etp}")
        if self.ep_overlap:
            flags.append("--ep-overlap" + (" --delay-wgrad" if self.delay_wgrad else ""))
        if self.flags:
            flags.append(self.flags)
        if self.fp8:
            flags.append(f"--fp8 {self.fp8_scaling}")
        if self.cross_entropy != "unfused":
            flags.append(f"--cross-entropy {self.cross_entropy}")
        return " ".join(flags).split()


def runs() -> list[PublishedRun]:
    """The rows, in source order (see the module for each source)."""
    nemo, bridge, bridge2602, titan = "nemo-24.07", "bridge-25.11", "bridge-26.02", "torchtitan-asynctp"
    rows = [
        # NeMo 24.07, DGX-H100, FP8: (label, params, model, GPUs, GBS, MBS, seq, tp, pp, cp, vp, tokens/s/GPU, TFLOP/s)
        PublishedRun("GPT3-5B", nemo, 5, GPT3_5B, 64, 2048, 4, 2048, 1, 1, 22521, 736, in_sample=True),
        PublishedRun("GPT3-20B", nemo, 20, GPT3_20B, 64, 256, 2, 2048, 2, 1, 5851, 750, in_sample=True),
        PublishedRun("GPT3-175B 128 GPUs", nemo, 175, GPT3, 128, 256, 1, 2048, 4, 8, 726, 782, vp=6,
                     in_sample=True),
        PublishedRun("GPT3-175B 512 GPUs", nemo, 175, GPT3, 512, 2048, 2, 2048, 4, 8, 782, 842, vp=6),
        PublishedRun("LLAMA2-7B", nemo, 7, LLAMA2_7B, 8, 128, 1, 4096, 1, 1, 16847, 776, in_sample=True,
                     cross_entropy="fused"),
        PublishedRun("LLAMA2-13B", nemo, 13, LLAMA2_13B, 16, 128, 1, 4096, 1, 4, 8646, 754, vp=10,
                     cross_entropy="fused"),
        PublishedRun("LLAMA2-70B", nemo, 70, LLAMA2_70B, 64, 128, 1, 4096, 4, 4, 1707, 759, vp=20,
                     cross_entropy="fused"),
        PublishedRun("LLAMA3-8B cp2", nemo, 8, "--model llama3-8b", 8, 128, 1, 8192, 1, 1, 12036, 697, cp=2,
                     cross_entropy="fused"),
        PublishedRun("LLAMA3-70B cp2", nemo, 70, "--model llama3-70b", 64, 128, 1, 8192, 4, 4, 1533, 738, cp=2,
                     vp=5, cross_entropy="fused"),
        # Megatron-Bridge 25.11, DGX-H100, FP8-CS (current scaling)
        PublishedRun("LLAMA3_8B FSDP", bridge, 8, "--model llama3-8b", 8, 128, 1, 8192, 1, 1, 14451, 744,
                     fsdp=True, fp8_scaling="current", in_sample=True, cross_entropy="te"),
        PublishedRun("LLAMA3_70B", bridge, 70, "--model llama3-70b", 64, 128, 1, 8192, 4, 8, 1602, 719, vp=5,
                     fp8_scaling="current", in_sample=True, cross_entropy="te"),
        PublishedRun("LLAMA3.1_405B", bridge, 405, "--model llama3-405b", 1024, 512, 1, 8192, 8, 8, 292, 737, cp=2,
                     vp=8, fp8_scaling="current", cross_entropy="te"),
        # Megatron-Bridge 26.02, DGX-H100, "FP8" (the scaling not named: taken as 25.11's FP8-CS)
        PublishedRun("LLAMA3_70B GBS256", bridge2602, 70, "--model llama3-70b", 64, 256, 1, 8192, 4, 8, 1621, 728,
                     vp=5, fp8_scaling="current", cross_entropy="te"),
        PublishedRun("LLAMA3.1_405B GBS1536", bridge2602, 405, "--model llama3-405b", 1024, 1536, 1, 8192, 8, 8,
                     311, 784, cp=2, vp=8, fp8_scaling="current", cross_entropy="te"),
    ]
    rows += later_containers(rows)
    rows += blackwell()
    rows += grace_blackwell()
    rows += mixture_of_experts()
    rows += model_zoo()
    # torchtitan, June 2025: FSDP2 x TP 8, torch.compile; 8B per-op selective AC, local batch 12 on 64 GPUs;
    # 70B full AC, local batch 16 on 256 GPUs; (precision, vanilla TP tokens/s, async TP tokens/s)
    for params, gpus, local, recompute, figures in (
            (8, 64, 12, "per-op", (("bf16", 4378, 4809.4), ("float8", 5078.1, 5570.1))),
            (70, 256, 16, "full", (("bf16", 597.3, 652.4), ("float8", 809.8, 942.4)))):
        for precision, vanilla, async_tp in figures:
            for overlap, tokens in ((False, vanilla), (True, async_tp)):
                label = f"Llama3.1-{params}B {precision} {'async' if overlap else 'vanilla'} TP"
                rows.append(PublishedRun(label, titan, params, f"--model llama3-{params}b", gpus, gpus // 8 * local,
                                         local, 8192, 8, 1, tokens, fsdp=True, fp8=precision == "float8",
                                         fp8_scaling="current", recompute=recompute, tp_overlap=overlap))
    return rows


# The three Megatron-Bridge layouts above as other containers published them: (the row above, container,
# tokens/s/GPU, TFLOP/s; None where the TFLOP/s disagrees with the FLOPs per token of the same layout in every
# other container: 26.04.01's 70B, 2.2% lower)
LATER_CONTAINERS = (
    ("LLAMA3_8B FSDP", "25.09", 14079, 725), ("LLAMA3_70B", "25.09", 1619, 727),
    ("LLAMA3_70B GBS256", "26.02.01", 1639, 736), ("LLAMA3_70B GBS256", "26.04", 1633, 734),
    ("LLAMA3_70B GBS256", "26.04.01", 1664, None), ("LLAMA3.1_405B", "25.09", 302, 763),
    ("LLAMA3.1_405B GBS1536", "26.04.01", 328, 827), ("LLAMA3.1_405B GBS1536", "26.06", 326, 822),
)


def later_containers(rows: list[PublishedRun]) -> list[PublishedRun]:
    """The Megatron-Bridge layouts of ``rows`` as published by the containers before and
    after them (the archive's DGX-H100 rows of 25.09, 26.02.01, 26.04, 26.04.01 and 26.06;
    no other dense H100 rows are in it): each the same job as its row, with its own figures.
    A layout's prediction is the same in every container; the published figure is not,
    which shows how far the software moved under one layout. All held out: first run after
    the model was last changed."""
    by_label = {run.label: run for run in rows}
    return [replace(by_label[layout], label=f"{layout} ({container})", source=f"bridge-{container}",
                    tokens_per_gpu=tokens, tflops_per_gpu=tflops, in_sample=False)
            for layout, container, tokens, tflops in LATER_CONTAINERS]


def blackwell() -> list[PublishedRun]:
    """The archive's dense DGX-B200 rows (source ``b200-bridge``, the container in each
    label): Megatron-Bridge's FP8-CS figures (25.11 prints FP8-MX's beside them, not used;
    25.09 names no precision, taken as 25.11's), each layout as its release line's B200
    recipe sets it (v0.2.0, ``scripts/performance/configs/llama3`` and ``llama31``
    ``workload_base_configs.py``: 8B micro_batch_size=2 under DDP with the distributed
    optimizer; 405B tp 4, pp 8, cp 2, vp 8, global batch 64), simulated as 8 B200s a node
    (``--gpu b200``: its compute model is the H200 kernel table scaled by measured matmul
    throughput) on the InfiniBand preset (400 Gb/s a GPU, as DGX B200 has). Kept out of
    the H100 figures issue 30's target is held to, and summarised apart. Held out: first
    run once written; the one change made since (ring attention's merges, built for the
    H100 cp rows) moved the 405B rows by their share of its step."""
    rows = []
    # (label, params, model, GPUs, GBS, MBS, tp, pp, cp, vp, container, tokens/s/GPU, TFLOP/s)
    for label, params, model, gpus, global_batch, micro, tp, pp, cp, vp, container, tokens, tflops in (
            ("LLAMA3_8B", 8, "--model llama3-8b", 8, 128, 2, 1, 1, 1, 1, "25.09", 29994, 1544),
            ("LLAMA3_8B", 8, "--model llama3-8b", 8, 128, 2, 1, 1, 1, 1, "25.11", 30624, 1576),
            ("LLAMA3.1_405B", 405, "--model llama3-405b", 128, 64, 1, 4, 8, 2, 8, "25.09", 664, 1676),
            ("LLAMA3.1_405B", 405, "--model llama3-405b", 128, 64, 1, 4, 8, 2, 8, "25.11", 661, 1667)):
        rows.append(PublishedRun(f"{label} B200 ({container})", B200_SOURCE, params, model, gpus, global_batch, micro,
                                 8192, tp, pp, tokens, tflops, cp=cp, vp=vp, fp8_scaling="current",
                                 cross_entropy="te", gpu="b200"))
    return rows


def grace_blackwell() -> list[PublishedRun]:
    """The archive's dense DGX-GB200 rows (source ``gb200-bridge``, the container in each
    label): Megatron-Bridge's FP8-CS figures on GB200 NVL72 racks, three layouts (Llama 3
    8B on 8 GPUs under DDP with the distributed optimizer, micro_batch_size 2, as on
    DGX-B200; Llama 3 70B on 64 GPUs under FSDP, micro_batch_size 2; Llama 3.1 405B on 256
    GPUs, tp 4, pp 16, vp 4), each in every container that prints it (25.09's 70B and
    405B rows are other layouts, left out). Simulated with ``--gpu gb200 --topology
    nvl72``: the GB200's compute model is the B200's scaled by the datasheet peaks (no
    matmul measurement of the part is published) and a rack is one NVLink domain of 72.
    Kept out of the H100 figures issue 30's target is held to, and summarised apart. Held
    out: the rows were transcribed after ``gb200`` and ``nvl72`` were written, and first
    run once written; nothing was changed after."""
    rows = []
    layouts = {"LLAMA3_8B": (8, "--model llama3-8b", 8, 128, 2, 1, 1, 1, False),
               "LLAMA3_70B": (70, "--model llama3-70b", 64, 256, 2, 1, 1, 1, True),
               "LLAMA3.1_405B": (405, "--model llama3-405b", 256, 1536, 1, 4, 16, 4, False)}
    # (layout, container, tokens/s/GPU, TFLOP/s; None where the TFLOP/s disagrees with the FLOPs per token of the
    # same layout in every other container: 26.04.01's 405B, 1.7% lower, as that container's H100 70B row)
    for label, container, tokens, tflops in (
            ("LLAMA3_8B", "25.09", 31357, 1614), ("LLAMA3_8B", "25.11", 31508, 1622),
            ("LLAMA3_70B", "25.11", 4312, 1937), ("LLAMA3_70B", "26.02", 4040, 1815),
            ("LLAMA3_70B", "26.02.01", 4357, 1956), ("LLAMA3_70B", "26.04", 4143, 1861),
            ("LLAMA3_70B", "26.04.01", 4224, 1892),
            ("LLAMA3.1_405B", "25.11", 813, 2053), ("LLAMA3.1_405B", "26.02", 793, 2004),
            ("LLAMA3.1_405B", "26.02.01", 818, 2063), ("LLAMA3.1_405B", "26.04", 842, 2126),
            ("LLAMA3.1_405B", "26.04.01", 864, None), ("LLAMA3.1_405B", "26.06", 843, 2129)):
        params, model, gpus, global_batch, micro, tp, pp, vp, fsdp = layouts[label]
        rows.append(PublishedRun(f"{label} GB200 ({container})", GB200_SOURCE, params, model, gpus, global_batch,
                                 micro, 8192, tp, pp, tokens, tflops, vp=vp, fsdp=fsdp, fp8_scaling="current",
                                 cross_entropy="te", gpu="gb200", topology="nvl72"))
    return rows


QWEN3_30B = "--model qwen3-30b-a3b"
QWEN3_235B = "--model qwen3-235b-a22b"
GPT_OSS_120B = "--model gpt-oss-120b"


def mixture_of_experts() -> list[PublishedRun]:
    """The archive's DGX-H100 mixture-of-experts rows that pipesim can express (source
    ``bridge-moe``, the container in each label). NVIDIA force-balances the routing in
    these benchmarks ("we force-balance the token distribution among experts and all
    benchmarks are token-dropless"), which is what pipesim's router assumes. Qwen3-30B-A3B
    in FP8 (current scaling); gpt-oss-120b in BF16 with its recipe's selective recompute
    of the norms and the experts' activation (``layernorm, moe_act``: ``--recompute
    norm-mla-up --recompute-moe-act``). Qwen3-235B-A22B in FP8 (current scaling)
    on 256 GPUs, ep 32 folded over tp 2 x dp 16 with the experts at etp 1 (``--etp``: the
    recipe's ``expert_tensor_parallel_size = 1``, its base recipe's), tensor-parallel
    overlap off (``tp_comm_overlap=False``) and combined 1F1B on (``--ep-overlap``:
    ``overlap_moe_expert_parallel_comm``) with its ``delay_wgrad_compute`` (``--delay-wgrad``,
    the experts' weight gradient beside the backward's dispatch). Not here:
    DeepSeek-V3 on H100 (25.09 only, its FP8 recipe and MTP unnamed), 25.09's
    token-dropping rows. Held out when first run; the token permutations
    (``pipesim.model.operations.token_permutations``, from Megatron-Core's dispatcher code,
    no number taken from a row) and ``--ep-dispatcher`` were added with the Qwen3-30B-A3B
    and gpt-oss rows on screen, so those are no longer unseen by those two changes. The
    Qwen3-235B-A22B rows were first run once ``--etp`` was built, with the all-to-alls
    exposed (-9.9% to -16.2%); ``--ep-overlap`` was then built for the recipe's combined
    1F1B with them on screen (no number taken from them), so they are seen by that change."""
    rows = []
    # Qwen3-30B-A3B, 16 GPUs, 4096 tokens: (container, GBS, MBS, pp, vp, ep, tokens/s/GPU, TFLOP/s)
    for container, global_batch, micro, pp, vp, ep, tokens, tflops in (
            ("25.11", 512, 2, 2, 24, 8, 5275, 121), ("26.02", 1024, 1, 2, 12, 8, 5113, 118),
            ("26.02.01", 1024, 1, 2, 12, 8, 9058, 208), ("26.04", 1024, 1, 1, 1, 16, 8901, 205),
            ("26.04.01", 1024, 1, 1, 1, 16, 8960, 206), ("26.06", 1024, 1, 1, 1, 16, 8826, 203)):
        rows.append(PublishedRun(f"Qwen3-30B-A3B ep{ep} pp{pp} ({container})", MOE_SOURCE, 30, QWEN3_30B, 16,
                                 global_batch, micro, 4096, 1, pp, tokens, tflops, vp=vp, ep=ep,
                                 fp8_scaling="current", cross_entropy="te"))
    # gpt-oss-120b, 64 GPUs, BF16, pp 4, ep 8, 4096 tokens: (container, GBS, MBS, tokens/s/GPU). Its published
    # TFLOP/s (153-163) are not kept: they count 0.79 of the FLOPs per token of the config's layers, which is
    # its routed experts' gated MLP counted as two matrices instead of three (the experts are 63% of the FLOPs;
    # 1 - 0.63 / 3 = 0.79), a count, not the architecture (the config's gate_up_proj is 2 x 2880 wide).
    # 25.11's row runs one sequence a microbatch, not the four its table prints: its MBS and GA cells (4, 2)
    # are the DGX-B200 row's above it (dp 64: 512 / (64 x 4) = 2), where every other 25.11 row's GA is its
    # GBS / (dp x MBS) and this layout's (dp 16) would be 8 at MBS 4; the H100 recipe of the 25.11 release
    # line (Megatron-Bridge v0.2.0, scripts/performance/configs/gpt_oss/workload_base_configs.py) is the base
    # config's micro_batch_size=1 with pp 4 and the layernorm + moe_act recompute, as the later rows run it
    for container, global_batch, micro, tokens in (
            ("25.11", 512, 1, 5630), ("26.02", 1280, 1, 5993), ("26.02.01", 1280, 1, 5984),
            ("26.04", 1280, 1, 5810), ("26.04.01", 1280, 1, 5824)):
        rows.append(PublishedRun(f"gpt-oss-120b ({container})", MOE_SOURCE, 117, GPT_OSS_120B, 64, global_batch,
                                 micro, 4096, 1, 4, tokens, ep=8, fp8=False, recompute="norm-mla-up",
                                 flags="--recompute-moe-act", cross_entropy="te"))
    # Qwen3-235B-A22B, 256 GPUs, FP8-CS, MBS 1, 4096 tokens, tp 2 pp 8 vp 4 ep 32 (etp 1):
    # (container, GBS, tokens/s/GPU, TFLOP/s)
    for container, global_batch, tokens, tflops in (
            ("25.11", 2048, 1575, 233), ("26.02", 8192, 1633, 242), ("26.02.01", 8192, 1611, 238),
            ("26.04", 8192, 1686, 250), ("26.04.01", 8192, 1712, 253)):
        rows.append(PublishedRun(f"Qwen3-235B-A22B ep32 etp1 ({container})", MOE_SOURCE, 235, QWEN3_235B, 256,
                                 global_batch, 1, 4096, 2, 8, tokens, tflops, vp=4, ep=32, etp=1,
                                 fp8_scaling="current", tp_overlap=False, ep_overlap=True, delay_wgrad=True,
                                 cross_entropy="te"))
    return rows


# Megatron-Core's split for the zoo's 94 layers over pp 8 x v 4 chunks, the embedding and the loss counted as a
# layer each (--account-for-embedding/loss-in-pipeline-split, 96 / 32 = 3 a chunk): 2, 3 x 30, 2
ZOO_SPLIT = ",".join(["2", *["3"] * 30, "2"])


def model_zoo() -> list[PublishedRun]:
    """The Megatron-Core MoE team's Qwen3-235B-A22B layouts on 256 H100s (source
    ``moe-modelzoo``; BF16, 4096 tokens, global batch 2048, microbatch 1, DeepEP's
    dispatch, experts at etp 1, the distributed optimizer with its overlaps, sequence
    parallelism, no tensor-parallel overlap or CUDA graphs at that date): each row's step
    time as published, as tokens/s per GPU. The layouts differ in ways a planner chooses
    between (ep 32 over tp 2 x dp 16 or ep 8 beside tp 4; combined 1F1B on or off), so the
    rows test the ranking as well as the figures. Recompute as the commands set it:
    ``moe_act layernorm`` is ``--recompute norm-mla-up --recompute-moe-act``. Left out: the FSDP row (its table and its
    command disagree on tp), the row labelled A2A (its command's config then hard-coded
    DeepEP, so the dispatcher is unknown) and the long-context table (its recompute of
    whole MoE blocks is not a pipesim mode). Held out: first run after ``--etp``,
    ``--ep-overlap`` and every other change of this model, nothing changed since."""
    rows = []
    # (label, tp, ep, recompute, combined 1F1B, step seconds, TFLOP/s); dp is what tp x pp 8 leaves
    for label, tp, ep, recompute, overlap, seconds, tflops in (
            ("tp2 ep32", 2, 32, "norm-mla-up", False, 19.7, 245),
            ("tp2 ep32 combined 1F1B", 2, 32, "norm-mla-up", True, 17.6, 276),
            ("tp4 ep8", 4, 8, "none", False, 29.0, 167)):
        tokens = 2048 * 4096 / (seconds * 256)
        rows.append(PublishedRun(f"Qwen3-235B-A22B {label} (zoo)", ZOO_SOURCE, 235, QWEN3_235B, 256, 2048, 1, 4096,
                                 tp, 8, tokens, tflops, vp=4, ep=ep, etp=1, fp8=False, recompute=recompute,
                                 tp_overlap=False, ep_overlap=overlap, cross_entropy="te",
                                 flags=f"--ep-dispatcher deepep --layers-per-stage {ZOO_SPLIT}"
                                 + (" --recompute-moe-act" if recompute == "norm-mla-up" else "")))
    return rows


def ep_overlap_lines(rows: list[PublishedRun], predictions: dict[str, Prediction]) -> list[str]:
    """The zoo's pair of one layout with and without combined 1F1B: its speedup,
    published against predicted; and the Megatron-Bridge rows whose recipe runs combined
    1F1B predicted without it (how they came out when first run)."""
    lines = []
    for run in rows:
        if run.source != ZOO_SOURCE or not run.ep_overlap:
            continue
        alone = next(other for other in rows if other.source == run.source and layout_key(other) ==
                     layout_key(replace(run, ep_overlap=False)))
        published = run.tokens_per_gpu / alone.tokens_per_gpu
        predicted = predictions[run.label].tokens_per_gpu / predictions[alone.label].tokens_per_gpu
        lines.append(f"{alone.label}: combined 1F1B over the all-to-alls exposed {published:.3f} published, "
                     f"{predicted:.3f} predicted")
    exposed = [error(run, predict(replace(run, ep_overlap=False)))
               for run in rows if run.source == MOE_SOURCE and run.ep_overlap]
    if exposed:  # the recipe's rows as first run, before --ep-overlap existed
        lines.append(f"{MOE_SOURCE} rows run with combined 1F1B, predicted with the all-to-alls exposed instead: "
                     f"{min(exposed):+.1%} to {max(exposed):+.1%}")
    return lines


def memory_lines(rows: list[PublishedRun], predictions: dict[str, Prediction]) -> list[str]:
    """The mixture-of-experts rows, which ran, against what their devices leave: each one
    put over its device, and the tightest of the others (the dense rows fit with room)."""
    moe = [run for run in rows if run.source in (MOE_SOURCE, ZOO_SOURCE)]
    if not moe:
        return []

    def fullest(run: PublishedRun) -> str:
        prediction = predictions[run.label]
        return (f"{prediction.peak_bytes / 1e9:.1f} GB at its fullest rank against "
                f"{prediction.usable_bytes / 1e9:.1f} usable")

    over = [run for run in moe if predictions[run.label].peak_bytes > predictions[run.label].usable_bytes]
    lines = [f"{run.label}: out of memory, {fullest(run)}" for run in over]
    fits = [run for run in moe if run not in over]
    if fits:
        tightest = max(fits, key=lambda run: predictions[run.label].peak_bytes / predictions[run.label].usable_bytes)
        which = f"the other {len(fits)}" if over else f"all {len(fits)}"
        lines.append(f"{which} mixture-of-experts rows fit, the tightest {tightest.label} with {fullest(tightest)}")
    return lines


def layout_key(run: PublishedRun) -> tuple:
    """What makes two rows the same job: every field but the label, the source and the figures."""
    return (run.model, run.gpus, run.global_batch, run.microbatch_size, run.seq_len, run.tp, run.pp, run.cp, run.vp,
            run.ep, run.etp, run.ep_overlap, run.delay_wgrad, run.flags, run.fsdp, run.fp8, run.fp8_scaling,
            run.recompute, run.tp_overlap, run.cross_entropy, run.gpu, run.topology)


@dataclass(frozen=True)
class Prediction:
    """What ``pipesim simulate`` gives a row: tokens/s per GPU, MFU, the step and the
    share of it the busiest rank computes (the rest: bubble and exposed communication)."""

    tokens_per_gpu: float
    mfu: float
    step_seconds: float
    compute_share: float
    seconds: float  # wall time of the simulation
    peak_bytes: float = 0.0  # the fullest rank's peak (the one nearest its usable memory) ...
    usable_bytes: float = 0.0  # ... and what the headroom rule leaves it


@functools.cache  # a row is frozen: a test session's checks share each row's simulation
def predict(run: PublishedRun, extra: tuple[str, ...] = ()) -> Prediction:
    """Parse the row's flags (and ``extra`` ones, a sensitivity) with ``pipesim
    simulate``'s own parser and simulate the job, so the command printed is the one
    predicted."""
    from pipesim.cli import build_parser
    from pipesim.job import Job, simulate_job, throughput_figures

    started = time.perf_counter()
    job = Job.from_namespace(build_parser("simulate").parse_args(["simulate", *run.argv(), *extra]))
    result = simulate_job(job)
    figures = throughput_figures(job, result)
    makespan = result.metrics.makespan
    busiest = max(rank.busy for rank in result.metrics.ranks)
    fullest = max(result.memory, key=lambda memory: memory.peak_bytes / memory.usable_bytes)
    return Prediction(figures["tokens_per_second"] / run.gpus, figures["mfu"], makespan, busiest / makespan,
                      time.perf_counter() - started, fullest.peak_bytes, fullest.usable_bytes)


def error(run: PublishedRun, prediction: Prediction) -> float:
    """Relative error of the predicted throughput (and so of MFU) against the published."""
    return prediction.tokens_per_gpu / run.tokens_per_gpu - 1


def summary(name: str, errors: list[float]) -> str:
    return f"{name}: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(errors)} runs"


def trend_lines(rows: list[PublishedRun], predictions: dict[str, Prediction]) -> list[str]:
    """Within each source, MFU across model sizes (smallest first), published against
    predicted: the published MFU is the predicted one scaled by the measured over the
    predicted throughput (one FLOP count for both); and the change from the smallest
    model's MFU to the largest's, published and predicted."""
    lines = []
    for source in SOURCES:
        for fp8 in (True, False):
            chosen = sorted((run for run in rows if run.source == source and run.tp_overlap and run.fp8 == fp8),
                            key=lambda run: (run.params_b, run.gpus))
            if len({run.params_b for run in chosen}) < 2:
                continue
            predicted = [predictions[run.label].mfu for run in chosen]
            published = [mfu * run.tokens_per_gpu / predictions[run.label].tokens_per_gpu
                         for run, mfu in zip(chosen, predicted, strict=True)]
            pairs = ", ".join(f"{run.label} {mfu:.1%}/{model:.1%}"
                              for run, mfu, model in zip(chosen, published, predicted, strict=True))
            lines.append(f"{source} ({'FP8' if fp8 else 'BF16'}): MFU by size, published/predicted: {pairs}; "
                         f"smallest to largest: published {100 * (published[-1] - published[0]):+.1f} points, "
                         f"predicted {100 * (predicted[-1] - predicted[0]):+.1f}")
    return lines


def tp_overlap_lines(rows: list[PublishedRun], predictions: dict[str, Prediction]) -> list[str]:
    """torchtitan's pairs: async TP's speedup over vanilla TP, published against predicted."""
    lines = []
    for run in rows:
        if run.source != "torchtitan-asynctp" or not run.tp_overlap:
            continue
        vanilla = next(other for other in rows if other.source == run.source and not other.tp_overlap
                       and other.label == run.label.replace("async", "vanilla"))
        published = run.tokens_per_gpu / vanilla.tokens_per_gpu
        predicted = predictions[run.label].tokens_per_gpu / predictions[vanilla.label].tokens_per_gpu
        lines.append(f"{run.label.replace(' async TP', '')}: async TP over vanilla TP {published:.3f} published, "
                     f"{predicted:.3f} predicted")
    return lines


def fp8_over_bf16_lines(rows: list[PublishedRun], predictions: dict[str, Prediction]) -> list[str]:
    """torchtitan's pairs of one layout in float8 and in BF16: FP8's end-to-end speedup,
    published against predicted (the FP8 model on its own, communication alike in both)."""
    lines = []
    for run in rows:
        if run.source != "torchtitan-asynctp" or not run.fp8:
            continue
        bf16 = next((other for other in rows if other.label == run.label.replace("float8", "bf16")), None)
        if bf16 is None:
            continue
        published = run.tokens_per_gpu / bf16.tokens_per_gpu
        predicted = predictions[run.label].tokens_per_gpu / predictions[bf16.label].tokens_per_gpu
        lines.append(f"{run.label.replace('float8 ', '')}: float8 over bf16 {published:.3f} published, "
                     f"{predicted:.3f} predicted")
    return lines


def by_layout(rows: list[PublishedRun]) -> dict[tuple, list[PublishedRun]]:
    """Rows grouped by layout, each group oldest source first (``SOURCES`` is in release order)."""
    order = list(SOURCES)
    groups: dict[tuple, list[PublishedRun]] = {}
    for run in rows:
        groups.setdefault(layout_key(run), []).append(run)
    return {key: sorted(group, key=lambda run: order.index(run.source)) for key, group in groups.items()}


def dense_megatron(run: PublishedRun) -> bool:
    """A NeMo or Megatron-Bridge row of a dense model: the rows issue 30's target is held to."""
    return run.source.startswith(("nemo-", "bridge-")) and run.source != MOE_SOURCE


def container_of(run: PublishedRun) -> str:
    """The release a row was published by: in its label's parentheses, else its source's."""
    if run.label.endswith(")") and " (" in run.label:
        return run.label.rsplit(" (", 1)[1][:-1]
    return run.source.removeprefix("bridge-").removeprefix("nemo-")


def newest_of_each_layout(rows: list[PublishedRun]) -> list[PublishedRun]:
    """Each layout once, as its newest source published it."""
    return [group[-1] for group in by_layout(rows).values()]


def drift_lines(rows: list[PublishedRun], predictions: dict[str, Prediction]) -> list[str]:
    """One line per layout published by more than one container: the lowest and highest
    published figure, how far apart they are, and the one prediction."""
    lines = []
    for group in by_layout(rows).values():
        if len(group) < 2:
            continue
        low, high = min(group, key=lambda run: run.tokens_per_gpu), max(group, key=lambda run: run.tokens_per_gpu)
        figures = ", ".join(f"{run.tokens_per_gpu:,.0f} ({container_of(run)})" for run in group)
        lines.append(f"{group[0].label.split(' (')[0]}: published {figures}; highest over lowest "
                     f"{high.tokens_per_gpu / low.tokens_per_gpu - 1:+.1%}; predicted "
                     f"{predictions[group[0].label].tokens_per_gpu:,.0f} ({error(high, predictions[high.label]):+.1%} "
                     f"against the highest)")
    return lines


UNSCALED_GB200 = """
import dataclasses, sys
from pipesim.hardware import gpus
gpus.GPUS["gb200"] = dataclasses.replace(gpus.GPUS["gb200"], matmul_flops=gpus.GPUS["b200"].matmul_flops)
from benchmarks.published_overlap import error, predict, runs
rows = {run.label: run for run in runs()}
print(" ".join(f"{error(rows[label], predict(rows[label])):+.4f}" for label in sys.argv[1:]))
"""


def unscaled_gb200_errors(labels: list[str]) -> list[str]:
    """``labels``' errors with the GB200 given the B200's measured matmul throughput, in a
    process of its own whose figure is changed before anything reads it (the kernel
    models and stage costs are kept per GPU name once computed, here and in the plan's
    workers), so this process's predictions stay as the preset makes them."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", UNSCALED_GB200, *labels], capture_output=True, text=True,
                          check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    return [f"{label} {float(value):+.1%}" for label, value in zip(labels, done.stdout.split(), strict=True)]


def grace_blackwell_lines(rows: list[PublishedRun], predictions: dict[str, Prediction]) -> list[str]:
    """The GB200 rows against the B200 ones at the same layout and container (the part's
    published speed-up beside the predicted one and the datasheet peaks'), and, as a
    sensitivity the preset does not adopt, the GB200 rows with the B200's measured matmul
    throughput unscaled (``pipesim.hardware.gpus``: the GB200's is estimated)."""
    from pipesim.hardware.gpus import GPUS  # noqa: PLC0415

    grace = [run for run in rows if run.source == GB200_SOURCE]
    peaks = GPUS["gb200"].bf16_flops / GPUS["b200"].bf16_flops
    lines = []
    for run in grace:
        twin = next((other for other in rows if other.source == B200_SOURCE  # the same job, container, other part
                     and container_of(other) == container_of(run)
                     and layout_key(replace(other, gpu=run.gpu, topology=run.topology)) == layout_key(run)), None)
        if twin is not None:
            published = run.tokens_per_gpu / twin.tokens_per_gpu
            predicted = predictions[run.label].tokens_per_gpu / predictions[twin.label].tokens_per_gpu
            lines.append(f"{run.label} over {twin.label}: published {published - 1:+.1%}, predicted "
                         f"{predicted - 1:+.1%} (datasheet BF16 peaks {peaks - 1:+.1%})")
    newest = newest_of_each_layout(grace)
    if not newest:
        return lines
    unscaled = unscaled_gb200_errors([run.label for run in newest])
    lines.append("sensitivity, not adopted: with the B200's measured matmul throughput unscaled, "
                 + ", ".join(unscaled))
    return lines


def table(rows: list[PublishedRun], extra: tuple[str, ...] = ()) -> tuple[list[str], dict[str, Prediction]]:
    lines = ["| run | source | GPUs | tp pp cp vp dp | m | published tokens/s/GPU | predicted | error | "
             "predicted MFU | compute share of the step | sample |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    predictions = {}
    for run in rows:
        prediction = predictions[run.label] = predict(run, extra)
        sample = "in-sample" if run.in_sample else "held out"
        lines.append(f"| {run.label} | {run.source} | {run.gpus} | {run.tp} {run.pp} {run.cp} {run.vp} {run.dp} | "
                     f"{run.microbatches} | {run.tokens_per_gpu:,.0f} | {prediction.tokens_per_gpu:,.0f} | "
                     f"{error(run, prediction):+.1%} | {prediction.mfu:.1%} | {prediction.compute_share:.1%} | "
                     f"{sample} |")
    return lines, predictions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="rows whose label contains this text")
    parser.add_argument("--commands", action="store_true", help="print every row's simulate command")
    parser.add_argument("--extra-flags", default="", metavar="FLAGS",
                        help="sensitivity: simulate flags added to every row, e.g. \"--overlap-slowdown 0\" or "
                        "--extra-flags=--no-tp-overlap (default: none, the stacks' defaults)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = [run for run in runs() if args.only is None or args.only in run.label]
    if not rows:
        parser.error(f"--only {args.only!r}: no row's label contains it (labels: "
                     f"{', '.join(run.label for run in runs())})")
    try:
        lines, predictions = table(rows, tuple(args.extra_flags.split()))
    except ValueError as problem:  # a flag simulate refuses (the rows' own are checked by the tests)
        parser.error(f"--extra-flags {args.extra_flags!r}: {problem}")
    print("\n".join(lines) + "\n")
    for run in rows if args.commands else rows[:1]:
        command = " ".join([*run.argv(), *args.extra_flags.split()])
        print(f"equivalent command ({run.label}): `pipesim simulate {command}`")
    print()
    for key, source in SOURCES.items():
        print(f"{key}: {source}")
    print()
    for line in trend_lines(rows, predictions) + tp_overlap_lines(rows, predictions) + \
            fp8_over_bf16_lines(rows, predictions) + ep_overlap_lines(rows, predictions) + \
            memory_lines(rows, predictions) + grace_blackwell_lines(rows, predictions):
        print(line)
    print()
    print("the same layout in several containers:")
    for line in drift_lines(rows, predictions):
        print(f"- {line}")
    print()
    errors = {run.label: abs(error(run, predictions[run.label])) for run in rows}
    held_out = [errors[run.label] for run in rows if not run.in_sample]
    megatron_rows = [run for run in rows if dense_megatron(run)]
    megatron = [errors[run.label] for run in megatron_rows]
    moe = [run for run in rows if run.source == MOE_SOURCE]
    blackwell_rows = [run for run in rows if run.source == B200_SOURCE]
    grace_rows = [run for run in rows if run.source == GB200_SOURCE]
    print(summary("all rows", list(errors.values())))
    if megatron:
        print(summary("Megatron-Core dense rows (NeMo, Megatron-Bridge)", megatron))
        print(summary("Megatron-Core dense layouts, each once at its newest container",
                      [errors[run.label] for run in newest_of_each_layout(megatron_rows)]))
        bridge = [run for run in megatron_rows if run.source.startswith("bridge-")]
        if bridge:
            print(summary("Megatron-Bridge layouts (2025-2026 containers), each once at its newest",
                          [errors[run.label] for run in newest_of_each_layout(bridge)]))
    if blackwell_rows:
        print(summary("Megatron-Bridge on DGX-B200, each layout once at its newest",
                      [errors[run.label] for run in newest_of_each_layout(blackwell_rows)]))
    if grace_rows:
        print(summary("Megatron-Bridge on DGX-GB200 (NVL72), each layout once at its newest",
                      [errors[run.label] for run in newest_of_each_layout(grace_rows)]))
    if moe:
        print(summary("mixture-of-experts layouts (Megatron-Bridge), each once at its newest",
                      [errors[run.label] for run in newest_of_each_layout(moe)]))
    zoo = [errors[run.label] for run in rows if run.source == ZOO_SOURCE]
    if zoo:
        print(summary("mixture-of-experts layouts (Megatron-MoE-ModelZoo)", zoo))
    if held_out:
        print(summary("held out", held_out))
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
