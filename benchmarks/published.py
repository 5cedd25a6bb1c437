"""Predicted against published step times of large training runs, two ways.

- **No calibration**: ``pipesim simulate`` as a user runs it before any run exists,
  compute timed by the GPU's compute model (``pipesim.model.compute_model``: kernels by
  shape, from kernel measurements and published matmul throughput, never from these
  runs). Every row is predicted.
- **Calibrated**: one compute-efficiency number (the fraction of the GPU's dense BF16
  peak that every GEMM and attention kernel reaches, ``--mfu``) is calibrated so that the
  step time of ONE configuration of the study is reproduced (marked ``calibrated``);
  every other configuration is predicted with that same number (``held out``).

Everything else comes from the model: FLOPs and shapes of the architecture,
tensor-parallel collectives on NVLink, pipeline bubble and P2P over InfiniBand, the
data-parallel gradient reduction, recompute.

Sources (figures transcribed from the papers' tables):

- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21 (arXiv:2104.04473), Table 1: weak scaling of GPT models 1.7B-1T on
  up to 3072 A100s (Selene: DGX A100, 8 HDR InfiniBand ports per node), sequence 2048,
  vocabulary 51,200, full activation recomputation, achieved TFLOP/s per GPU counted by
  their eq. 3. The step time is that FLOP count over (GPUs x achieved FLOP/s). Not in the
  table, assumed here: microbatch size 1, the non-interleaved 1F1B schedule, and the
  gradient all-reduce after the pipeline flush (Megatron-LM of 2021 did not overlap it).
- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  MLSys 2023 (arXiv:2205.05198), Tables 3 and 5: GPT 22B/175B/530B/1T on 8/64/280/512
  A100s (tp 8; pp 1/8/35/64; one data-parallel replica), end-to-end iteration time with
  full recompute and with selective recompute + sequence parallelism. Assumed: microbatch
  size 1 (for 22B, pp=1, the global batch of 4 as 4 accumulated microbatches), 1F1B.
- Dubey et al., "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4: Llama 3 405B at
  sequence 8192 on 8,192 and 16,384 H100s (tp 8, pp 16, dp 64 / 128, 32 / 16 sequences
  per data-parallel group), 430 / 400 TFLOP/s per GPU, BF16 MFU 43% / 41%; and at
  sequence 131,072 on 16,384 H100s (tp 8, cp 16, pp 16, dp 8, 16 sequences per group),
  380 TFLOP/s, 38%. The comparison is of MFU, with the attention counted causal (half
  the scores; docs/cluster-model.md says why that is Meta's count). From the paper's
  text: interleaved pipeline schedule whose chunks hold one layer each, the first chunk
  only the embedding and the last only the output layer; no activation recomputation at
  8K; FSDP-style sharding of optimizer state and gradients; context parallelism by
  all-gathering the keys and values (load-balanced chunks); rank order [TP, CP, PP, DP].
  The chunks per rank follow from that text (a layer taken off the first and last stages
  leaves the first chunk only the embedding: one layer a chunk, v 8,
  ``META_VIRTUAL_STAGES``). Meta publishes neither the microbatch group N of its schedule
  (the paper's flexible N, Megatron-Core's
  ``--microbatch-group-size-per-virtual-pipeline-stage``) nor its order, and ran every row
  without recomputation: each row takes ``interleaved-auto`` within each GPU's usable
  memory (``--memory-limit device``), Megatron's order (N = pp) where it fits and else the
  fastest order found that does. The schedule lines set beside it Megatron's order at v
  2, 4 and 8 and every N in Megatron's range, with their MFU and whether they fit.
  Sequence parallelism with tp; ZeRO-1 for the sharding; flash attention; and
  tensor-parallel collectives exposed (``--no-tp-overlap``): the paper's account of its
  parallelism names no tensor-parallel overlap; with it (pipesim's default) the rows come
  out at 52.7%, 49.4% and 41.8% MFU (+22.6%, +20.5%, +10.0%).

- DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv:2412.19437): tokens/s per GPU and
  peak memory of the report's layout, printed after the tables (``benchmarks/deepseek_v3.py``
  has the sources and assumptions).

In-sample and held out: the compute model's figures come from kernel measurements (H200
GEMMs and attention) and published matmul throughput (``pipesim.hardware.gpus``), not from
these rows; but the rows of the first two studies were printed by this benchmark (with
the calibrated column) while the model was built, so their no-calibration errors are
in-sample for choices of model structure; docs/cluster-model.md says which rows were
first run after the model was fixed.

Where a study reports layouts that ran (Meta's), its table has their memory too: the
fullest rank's peak against what the device leaves, and a "memory (GB)" line per row with
the parts, the layers' activations held, 1F1B's peak and the most a layer may keep to fit
(docs/cluster-model.md reads them).

Run: ``PYTHONPATH=. python benchmarks/published.py`` (prints a table per study and the
median / worst error over the held-out rows).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo's root

from benchmarks import deepseek_v3  # noqa: E402  DeepSeek-V3 as trained
from pipesim.cluster.files import load_topology
from pipesim.cluster.mapping import DEFAULT_ORDER, map_ranks
from pipesim.model import memory_traffic
from pipesim.model.activations import layer_stash_bytes
from pipesim.model.spec import PRESETS, ModelSpec
from pipesim.model.transformer_costs import (
    attention_flops_counted,
    device_memory_bandwidth,
    model_costs,
    training_figures,
)
from pipesim.sim.cost_aware import cost_shell
from pipesim.sim.memory import BytesPerParam, headroom_words, optimizer_step_bytes_per_param
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.stash_budget import build_within
from pipesim.sim.step import run_simulation
from schedules.generators import COST_AWARE, generate
from schedules.generators.interleaved import valid_microbatch_groups

A100_PEAK = 312e12
H100_PEAK = 989e12


@dataclass(frozen=True)
class Run:
    """One published configuration and its step time."""

    label: str
    spec: ModelSpec
    tp: int
    pp: int
    dp: int
    global_batch: int
    step_seconds: float
    recompute: str = "full"
    sequence_parallel: bool = False
    microbatch_size: int = 1
    gpu: str = "a100-80gb"
    schedule: str = "1f1b"
    overlap_dp: bool = True
    flash_attention: bool = False  # neither Megatron paper used it (2021, 2022)
    virtual_stages: int = 1
    microbatch_group: int | None = None  # interleaved-1f1b's N (None: the schedule's own)
    layers_per_stage: tuple[int, ...] | None = None
    zero: int = 0
    rank_order: str = DEFAULT_ORDER
    published_mfu: float | None = None  # where the study reports MFU rather than a step time
    tp_overlap: bool = True  # Megatron-Core's --tp-comm-overlap (2021-2022 Megatron had none)
    cp: int = 1
    cp_comm: str = "p2p"
    attention_flops: str = "causal"  # how the study's MFU counts attention (Meta's: causal)
    memory_limit: str | None = None  # a cost-aware schedule's --memory-limit (Meta's rows: "device")
    # whether the model's choices were made with this row's error on screen (every row so far:
    # see the module); a row added after the model is fixed and first run as it stands is held out
    in_sample: bool = True

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.microbatch_size)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


def gpt(name: str, layers: int, hidden: int, heads: int, microbatch_size: int = 1) -> ModelSpec:
    """Megatron's GPT of the papers: vocabulary 51,200, sequence 2048, tied embeddings."""
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=51200,
                     microbatch_size=microbatch_size)


def narayanan_eq3_flops(spec: ModelSpec, batch: int) -> float:
    """FLOPs per iteration with full recompute, Narayanan et al. eq. 3."""
    s, layers, h, vocab = spec.seq_len, spec.layers, spec.hidden, spec.vocab
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def narayanan_2021() -> list[Run]:
    # (params B, heads, hidden, layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU)
    table = [
        (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
        (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
        (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
        (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
        (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
        (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
        (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
        (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
        (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
        (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    ]
    runs = []
    for params, heads, hidden, layers, tp, pp, gpus, batch, tflops in table:
        spec = gpt(f"gpt-{params}b", layers, hidden, heads)
        seconds = narayanan_eq3_flops(spec, batch) / (gpus * tflops * 1e12)
        runs.append(Run(f"{params}B t{tp} p{pp} d{gpus // (tp * pp)} B{batch}", spec, tp, pp, gpus // (tp * pp),
                        batch, seconds, overlap_dp=False, tp_overlap=False))
    return runs


def korthikanti_2022() -> list[Run]:
    # (name, heads, hidden, layers, pp, global batch, full-recompute s, selective + sp s)
    table = [
        ("22B", 64, 6144, 48, 1, 4, 1.42, 1.10),
        ("175B", 96, 12288, 96, 8, 64, 18.13, 13.75),
        ("530B", 128, 20480, 105, 35, 280, 49.05, 37.83),
        ("1T", 160, 25600, 128, 64, 512, 94.42, 71.49),
    ]
    runs = []
    for name, heads, hidden, layers, pp, batch, full, selective in table:
        spec = gpt(f"gpt-{name}", layers, hidden, heads)
        runs.append(Run(f"{name} full", spec, 8, pp, 1, batch, full, recompute="full", tp_overlap=False))
        runs.append(Run(f"{name} selective+sp", spec, 8, pp, 1, batch, selective, recompute="selective",
                        sequence_parallel=True, tp_overlap=False))
    return runs


def llama3_2024() -> list[Run]:
    """Llama 3 405B's three rows (Dubey et al. 2024, Table 4): two at sequence 8192, one at
    131,072 with context parallelism 16; compared on MFU, the attention counted causal
    (half the scores), as Meta's figures count it (docs/cluster-model.md). Each row takes
    the chunks the paper's text gives (``META_VIRTUAL_STAGES``) and its order from
    interleaved-auto within each GPU's usable memory (``--memory-limit device``): Megatron's
    interleaved order where that fits, else the fastest order found that does, as Meta ran
    every layout without activation recomputation."""
    spec = PRESETS["llama3-405b"]
    pp, virtual_stages = 16, META_VIRTUAL_STAGES
    layout = meta_layers_per_stage(spec.layers, pp, virtual_stages)
    runs = []
    # (GPUs, cp, dp, sequence, sequences per data-parallel group, TFLOP/s per GPU, BF16 MFU)
    for gpus, cp, dp, seq_len, per_replica, mfu in ((8192, 1, 64, 8192, 32, 0.43), (16384, 1, 128, 8192, 16, 0.41),
                                                  (16384, 16, 8, 131072, 16, 0.38)):
        model = replace(spec, seq_len=seq_len)
        step = dp * per_replica * training_flops(model, "causal") / (gpus * H100_PEAK * mfu)
        runs.append(Run(f"405B {gpus} GPUs t8 c{cp} p16 d{dp} s{seq_len}", model, 8, pp, dp, dp * per_replica,
                        step, recompute="none", sequence_parallel=True, gpu="h100", schedule="interleaved-auto",
                        flash_attention=True, virtual_stages=virtual_stages, layers_per_stage=layout, zero=1,
                        rank_order="tp-cp-pp-dp" if cp > 1 else "tp-pp-dp", published_mfu=mfu, tp_overlap=False,
                        cp=cp, cp_comm="all-gather", memory_limit="device"))
    return runs


# Meta's rows: the chunks per rank its text gives ("the first model chunk on the first stage has
# only the embedding": one layer a chunk, 8 a rank), and the counts the table also tries
META_VIRTUAL_STAGES = 8
LLAMA_VIRTUAL_STAGES = (2, 4, 8)


def meta_layers_per_stage(layers: int, pp: int, virtual_stages: int) -> tuple[int, ...] | None:
    """Layers per chunk as Meta balanced them (Dubey et al. 2024, section 3.3.2): equal chunks
    with one layer fewer on the first and the last, so at one layer a chunk those hold only
    the embedding and only the output layer; None where that split is not whole."""
    chunks = pp * virtual_stages
    if (layers + 2) % chunks:
        return None
    per = (layers + 2) // chunks
    return (per - 1,) + (per,) * (chunks - 2) + (per - 1,)


@functools.cache
def schedule_candidates(run: Run) -> tuple[tuple[Run, Prediction], ...]:
    """``run`` under Megatron's interleaved order at every (v, N) tried for Meta's rows, with
    its prediction and memory: what the row would be without an order searched to fit."""
    found = []
    for virtual_stages in LLAMA_VIRTUAL_STAGES:
        layout = meta_layers_per_stage(run.spec.layers, run.pp, virtual_stages)
        if layout is None:
            continue
        for group in valid_microbatch_groups(run.pp, run.microbatches):
            candidate = replace(run, schedule="interleaved-1f1b", memory_limit=None, virtual_stages=virtual_stages,
                                layers_per_stage=layout, microbatch_group=group)
            found.append((candidate, predict(candidate, None, with_memory=True)))
    return tuple(found)


def schedule_choice_lines(runs: list[Run]) -> list[str]:
    """Per row, the order it takes (interleaved-auto's: Megatron's or one searched to fit),
    and Megatron's order at each (v, N) tried: its MFU error and its peak against what the
    device leaves."""
    lines = ["", f"schedule (Meta publishes neither v nor N; its text gives one-layer chunks, v {META_VIRTUAL_STAGES}; "
             "each row's order is interleaved-auto's within the GPU's usable memory):"]
    for run in runs:
        chosen = predict(run, None, with_memory=True)
        order = ("Megatron's interleaved order, which fits" if chosen.order == "megatron" else
                 "an order searched to fit: Megatron's does not")
        lines.append(f"- {run.label}: v {run.virtual_stages}, {order}; MFU {chosen.mfu:.1%} "
                     f"({chosen.error(run):+.1%}), peak {chosen.peak_bytes / 1e9:.1f} GB of "
                     f"{chosen.usable_bytes / 1e9:.1f} usable")
        for candidate, prediction in schedule_candidates(run):
            fits = "fits" if prediction.peak_bytes <= prediction.usable_bytes else "over"
            lines.append(f"  - Megatron's order, v {candidate.virtual_stages} N {candidate.microbatch_group}: "
                         f"MFU {prediction.mfu:.1%} ({prediction.error(run):+.1%}), peak "
                         f"{prediction.peak_bytes / 1e9:.1f} GB: {fits} {prediction.usable_bytes / 1e9:.1f} usable")
    return lines


def training_flops(spec: ModelSpec, attention_flops: str) -> float:
    """FLOPs of one sequence's forward and backward (3 forwards), the attention counted as
    ``attention_flops`` says."""
    whole = spec.sum_over_layers(lambda layer: spec.attention_core_flops())
    return 3 * (spec.forward_flops() - whole + attention_flops_counted(spec, attention_flops))


# (study, runs, label of the calibrated run)
STUDIES = (
    ("Narayanan et al. 2021, Table 1 (A100, full recompute)", narayanan_2021, "145.6B"),
    ("Korthikanti et al. 2022, Table 5 (A100, tp 8)", korthikanti_2022, "175B selective+sp"),
    ("Dubey et al. 2024, Table 4 (Llama 3 405B, H100, seq 8192 and 131,072)", llama3_2024, None),
)


@dataclass(frozen=True)
class Prediction:
    """A simulated step of a run: its time and the MFU it implies."""

    step_seconds: float
    mfu: float
    peak_bytes: float = 0.0  # the largest rank's peak memory
    usable_bytes: float = 0.0  # what its device leaves it (less the headroom)
    static_bytes: float = 0.0  # of that rank: parameters, gradients and optimizer state
    buffer_bytes: float = 0.0  # its P2P and gradient-reduction buffers
    stash_bytes: float = 0.0  # its peak of activations held for backwards
    capacity_bytes: float = 0.0  # its device's memory (nvidia-smi's total)
    headroom: str = ""  # what the device keeps back, in words (pipesim.sim.memory.headroom_words)
    order: str = ""  # interleaved-auto's: "megatron" (its order fits) or "greedy" (one searched to fit)

    def error(self, run: Run) -> float:
        """Relative error against the study: of MFU where it reports MFU, else of step time."""
        if run.published_mfu is not None:
            return self.mfu / run.published_mfu - 1
        return self.step_seconds / run.step_seconds - 1


@functools.cache  # a Run is frozen; the tests of one session share each study's predictions
def predict(run: Run, efficiency: float | None, with_memory: bool = False) -> Prediction:
    """What ``pipesim simulate`` predicts for ``run``: at ``efficiency`` of peak for every
    GEMM and attention kernel (``--mfu``), or by the GPU's compute model (None); with
    ``with_memory``, also the fullest rank's peak memory and what its device leaves it."""
    spec = replace(run.spec, microbatch_size=run.microbatch_size)
    topology = load_topology("ib", max(1, math.ceil(run.gpus / 8)), run.gpu)
    cost_aware = run.schedule in COST_AWARE  # its order is built from the costs, within run.memory_limit
    schedule = cost_shell(run.schedule, run.pp, run.microbatches, run.virtual_stages) if cost_aware else \
        generate(run.schedule, run.pp, run.microbatches, run.virtual_stages, microbatch_group=run.microbatch_group)
    devices = map_ranks(topology, run.dp, run.pp, run.tp, run.rank_order, run.cp).pipeline()
    stage_devices = [devices[schedule.placement[stage]] for stage in range(schedule.num_stages)]
    costs = model_costs(spec, schedule.num_stages, [topology.device_peak_flops(device) for device in stage_devices],
                        tp=run.tp, mfu=efficiency, sequence_parallel=run.sequence_parallel, recompute=run.recompute,
                        flash_attention=run.flash_attention, stage_ranks=list(schedule.placement),
                        stage_memory_bandwidth=[device_memory_bandwidth(topology, device) for device in stage_devices],
                        stage_gpus=[topology.device_gpu(device) for device in stage_devices],
                        layers_per_stage=list(run.layers_per_stage) if run.layers_per_stage else None,
                        optimizer_state_bytes=optimizer_step_bytes_per_param(BytesPerParam(), run.dp * run.cp,
                                                                             run.zero), cp=run.cp)
    parallel = ParallelConfig(dp=run.dp, tp=run.tp, overlap_dp=run.overlap_dp, zero=run.zero,
                              rank_order=run.rank_order, cp=run.cp, cp_comm=run.cp_comm, overlap_tp=run.tp_overlap)
    if cost_aware:
        schedule = build_within(run.memory_limit, run.schedule, run.pp, run.microbatches, costs, topology, devices,
                                parallel)[0]
    result = run_simulation(schedule, costs, topology, parallel=parallel, validate=False)
    makespan = result.metrics.makespan
    peak = topology.device_peak_flops(stage_devices[0])
    figures = training_figures(spec, run.recompute, makespan, run.microbatches, run.dp, run.gpus, peak,
                               run.attention_flops)
    order = schedule.meta.get("order", "")
    if not with_memory:
        return Prediction(makespan, figures["mfu"], order=order)
    fullest = max(result.memory, key=lambda rank: rank.peak_bytes)
    return Prediction(makespan, figures["mfu"], fullest.peak_bytes, fullest.usable_bytes, fullest.static_bytes,
                      fullest.buffer_bytes, fullest.peak_stash_bytes, fullest.capacity_bytes,
                      headroom_words(fullest).removesuffix("; "), order)


def layer_activation_bytes(run: Run) -> float:
    """What one microbatch keeps for one transformer layer on one rank of ``run``
    (``pipesim.model.activations.layer_stash_bytes``; context parallelism holds a
    ``1/cp`` share of the sequence)."""
    spec = replace(run.spec, microbatch_size=run.microbatch_size, seq_len=run.spec.seq_len // run.cp)
    return layer_stash_bytes(spec, run.tp, run.sequence_parallel, run.recompute, run.flash_attention)


def megatron_layer_estimate(run: Run) -> float:
    """Megatron-LM's own estimate of one layer's activations on one tp rank, for comparison
    with pipesim's inventory: ``sbh (18 + 4 ffn/h) / t`` bytes
    (``megatron/training/theoretical_memory_usage.py``, ``compute_activation_memory``:
    Korthikanti et al.'s Table 2 with selective recompute and sequence parallelism, the MLP
    term scaled by its width; it counts neither GQA nor a gated MLP's third matrix)."""
    spec = run.spec
    tokens = spec.seq_len // run.cp * run.microbatch_size
    return tokens * spec.hidden * (18 + 4 * spec.ffn / spec.hidden) / run.tp


def memory_gap(run: Run, prediction: Prediction) -> str:
    """Why a published layout does (not) fit: its fullest rank's parts, how many layers'
    activations it holds at its peak, what 1F1B (the order of least activation memory
    that keeps the first rank busy: Korthikanti et al. 2022, section 4.2.3) would hold,
    and the most a layer could keep for the layout to fit what the device leaves. The
    layers held are the stash over one layer's: whole layers where the fullest rank keeps
    no embedding or logits (a middle rank, as in Meta's layouts)."""
    layer = layer_activation_bytes(run)
    layers_held = prediction.stash_bytes / layer
    plain = predict(replace(run, schedule="1f1b", virtual_stages=1, layers_per_stage=None, microbatch_group=None), None,
                    with_memory=True)
    room = prediction.usable_bytes - prediction.static_bytes - prediction.buffer_bytes
    return (f"{run.label}: fullest rank {prediction.static_bytes / 1e9:.1f} GB static + "
            f"{prediction.buffer_bytes / 1e9:.1f} buffers + {prediction.stash_bytes / 1e9:.1f} stash "
            f"({layers_held:.0f} layers' activations of {layer / 1e9:.3f} GB; Megatron-LM's estimator "
            f"{megatron_layer_estimate(run) / 1e9:.3f}); under 1F1B "
            f"{plain.peak_bytes / 1e9:.1f} GB ({plain.stash_bytes / layer:.0f} layers, MFU {plain.mfu:.1%}); to fit "
            f"{prediction.usable_bytes / 1e9:.1f} GB here (the {prediction.capacity_bytes / 1e9:.2f} GB device less "
            f"{prediction.headroom}) a layer may keep {room / layers_held / 1e9:.3f} GB "
            f"({room / layers_held / layer:.0%} of the count)")


def simulate_step(run: Run, efficiency: float | None) -> float:
    """The step time ``pipesim simulate`` predicts for ``run`` (see ``predict``)."""
    return predict(run, efficiency).step_seconds


def calibrate(run: Run, low: float = 0.05, high: float = 1.0, tolerance: float = 1e-4) -> float:
    """The efficiency at which the simulated step equals the published one (bisection:
    the step time falls as efficiency rises)."""
    if simulate_step(run, high) > run.step_seconds:
        return high
    while high - low > tolerance:
        middle = (low + high) / 2
        if simulate_step(run, middle) > run.step_seconds:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def command_line(run: Run, efficiency: float | None) -> str:
    """The ``pipesim simulate`` call that gives the same prediction."""
    spec = run.spec
    preset = PRESETS.get(spec.name)  # --seq-len and --microbatch-size are given below
    same = preset is not None and replace(preset, seq_len=spec.seq_len, microbatch_size=spec.microbatch_size) == spec
    model = f"--model {spec.name}" if same else (
        f"--model gpt3-175b --layers {spec.layers} --hidden {spec.hidden} --heads {spec.heads} --vocab {spec.vocab}")
    flags = [
        model,
        f"--seq-len {spec.seq_len} --microbatch-size {run.microbatch_size}",
        f"--schedule {run.schedule} --pp {run.pp} -m {run.microbatches} --tp {run.tp} --dp {run.dp}",
        f"--topology ib --nodes {max(1, math.ceil(run.gpus / 8))} --gpu {run.gpu}",
        f"--recompute {run.recompute}",
    ]
    if efficiency is not None:
        flags.append(f"--mfu {efficiency:.4f}")
    if run.virtual_stages > 1:
        flags.append(f"-v {run.virtual_stages}")
    if run.microbatch_group is not None:
        flags.append(f"--microbatch-group {run.microbatch_group}")
    if run.memory_limit is not None:
        flags.append(f"--memory-limit {run.memory_limit}")
    if run.layers_per_stage:
        flags.append("--layers-per-stage " + ",".join(map(str, run.layers_per_stage)))
    if run.zero:
        flags.append(f"--zero {run.zero}")
    if run.rank_order != DEFAULT_ORDER:
        flags.append(f"--rank-order {run.rank_order}")
    if not run.flash_attention:
        flags.append("--no-flash-attention")
    if run.sequence_parallel:
        flags.append("--sequence-parallel")
        if not run.tp_overlap:
            flags.append("--no-tp-overlap")
    if run.cp > 1:
        flags.append(f"--cp {run.cp} --cp-comm {run.cp_comm}")
    if run.attention_flops != "causal":
        flags.append(f"--attention-flops {run.attention_flops}")
    if not run.overlap_dp:
        flags.append("--no-dp-overlap")
    return "pipesim simulate " + " ".join(flags)


def study_table(title: str, runs: list[Run],
                calibrated_label: str | None) -> tuple[list[str], list[float], list[float]]:
    """The study's table and its errors: (lines, no-calibration errors of every run,
    held-out errors of the calibrated column)."""
    anchor = next((run for run in runs if calibrated_label and run.label.startswith(calibrated_label)), None)
    efficiency = calibrate(anchor) if anchor else None
    by_mfu = any(run.published_mfu is not None for run in runs)
    published = "published MFU" if by_mfu else "published step (s)"
    header = f"{title}: no calibration (the GPU's compute model)"
    if anchor:
        header += f"; calibrated: efficiency {efficiency:.3f} of peak on {anchor.label}"
    lines = [header, ""]
    columns = f"| run | GPUs | m | {published} | no calibration | error | sample |"
    rule = "|---|---:|---:|---:|---:|---:|---|"
    if by_mfu:  # the layouts a study reports are ones that ran: do they fit?
        columns += " peak / usable memory (GB) |"
        rule += "---:|"
    if anchor:
        columns += " calibrated | error | |"
        rule += "---:|---:|---|"
    lines += [columns, rule]
    uncalibrated, held_out, gaps = [], [], []
    for run in runs:
        plain = predict(run, None, with_memory=by_mfu)
        if by_mfu:
            gaps.append(memory_gap(run, plain))
        error = plain.error(run)
        uncalibrated.append(abs(error))
        shown = (f"{plain.mfu:.1%}" if by_mfu else f"{plain.step_seconds:.3f}")
        target = f"{run.published_mfu:.0%}" if by_mfu else f"{run.step_seconds:.3f}"
        sample = "in-sample" if run.in_sample else "held out"
        line = f"| {run.label} | {run.gpus} | {run.microbatches} | {target} | {shown} | {error:+.1%} | {sample} |"
        if by_mfu:
            line += f" {plain.peak_bytes / 1e9:.1f} / {plain.usable_bytes / 1e9:.1f} |"
        if anchor:
            fitted = predict(run, efficiency)
            fitted_error = fitted.error(run)
            role = "calibrated" if run is anchor else "held out"
            if run is not anchor:
                held_out.append(abs(fitted_error))
            line += f" {fitted.step_seconds:.3f} | {fitted_error:+.1%} | {role} |"
        lines.append(line)
    if gaps:
        lines += ["", "memory (GB):"] + [f"- {gap}" for gap in gaps]
    if any(run.schedule == "interleaved-auto" for run in runs):
        lines += schedule_choice_lines(runs)
    lines += ["", f"equivalent command (no calibration, {runs[0].label}): `{command_line(runs[0], None)}`"]
    if runs[-1].cp > 1:  # a layout of its own: its command too
        lines.append(f"equivalent command (no calibration, {runs[-1].label}): `{command_line(runs[-1], None)}`")
    if anchor:
        lines.append(f"equivalent command (calibrated run): `{command_line(anchor, efficiency)}`")
    return lines + [""], uncalibrated, held_out


def attention_count_check(runs: list[Run]) -> list[str]:
    """What each attention count makes of a study's long-sequence row against its row of
    the same GPUs at the short sequence: the ratio of their tokens per second that the
    published MFUs imply, counted whole and causal, beside the simulated ratio (which
    no count changes). The count under which the published figures match the
    simulation's is the study's."""
    long = [run for run in runs if run.cp > 1]
    if not long:
        return []
    (long_run,) = long
    (short,) = [run for run in runs if run.cp == 1 and run.gpus == long_run.gpus]

    def tokens_per_second(run: Run, seconds: float) -> float:
        return run.global_batch * run.spec.tokens / seconds

    simulated = (tokens_per_second(long_run, predict(long_run, None).step_seconds)
                 / tokens_per_second(short, predict(short, None).step_seconds))
    implied = {count: (long_run.published_mfu / training_flops(long_run.spec, count) * long_run.spec.tokens)
               / (short.published_mfu / training_flops(short.spec, count) * short.spec.tokens)
               for count in ("whole", "causal")}
    return [f"tokens/s at sequence {long_run.spec.seq_len} over {short.spec.seq_len} on {long_run.gpus} GPUs: "
            f"published MFU counted whole implies {implied['whole']:.2f}, counted causal {implied['causal']:.2f}; "
            f"simulated {simulated:.2f}"]


def every_anchor(runs: list[Run]) -> list[str]:
    """Held-out median and worst error with each run of a study as the calibration point:
    how much the result depends on which run was chosen."""
    lines = ["| calibrated on | efficiency | held-out median | worst |", "|---|---:|---:|---:|"]
    for anchor in runs:
        efficiency = calibrate(anchor)
        errors = [abs(simulate_step(run, efficiency) / run.step_seconds - 1) for run in runs if run is not anchor]
        lines.append(f"| {anchor.label} | {efficiency:.3f} | {statistics.median(errors):.1%} | {max(errors):.1%} |")
    return lines


def summary(name: str, errors: list[float]) -> str:
    return f"{name}: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(errors)} runs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every-anchor", action="store_true",
                        help="also calibrate on each run in turn and report the held-out errors (slow)")
    parser.add_argument("--backward-traffic", type=float, default=memory_traffic.BACKWARD_TRAFFIC,
                        help="sensitivity: backward/forward bytes of the memory-bound kernels "
                        f"(model: {memory_traffic.BACKWARD_TRAFFIC})")
    parser.add_argument("--hbm-efficiency", type=float, default=memory_traffic.HBM_EFFICIENCY,
                        help=f"sensitivity: fraction of HBM bandwidth reached (model: {memory_traffic.HBM_EFFICIENCY})")
    args = parser.parse_args()
    memory_traffic.BACKWARD_TRAFFIC = args.backward_traffic
    memory_traffic.HBM_EFFICIENCY = args.hbm_efficiency
    started = time.perf_counter()
    megatron_uncalibrated, all_held_out = [], []
    for title, runs, anchor in STUDIES:
        lines, uncalibrated, held_out = study_table(title, runs(), anchor)
        print("\n".join(lines))
        print(summary("no calibration", uncalibrated))
        if held_out:
            print(summary("calibrated, held out", held_out))
            megatron_uncalibrated += uncalibrated
            all_held_out += held_out
        for line in attention_count_check(runs()):
            print(line)
        print()
        if args.every_anchor and anchor:
            print("\n".join(every_anchor(runs())) + "\n")
    print("\n".join(deepseek_v3.report_lines()) + "\n")
    print(summary("Narayanan + Korthikanti, no calibration", megatron_uncalibrated))
    print(summary("Narayanan + Korthikanti, calibrated, held out", all_held_out)
          + f" ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
