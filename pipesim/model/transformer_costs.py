"""A ``ModelSpec`` split over pipeline stages, turned into per-stage ``Costs``, and the
training figures people quote for a simulated step (tokens/s, TFLOP/s per GPU, MFU).

Time of a compute action = its FLOPs on one tp rank / (device peak x efficiency) + the
bytes its memory-bound kernels move / HBM bandwidth (``pipesim.model.memory_traffic``): one
efficiency number for every GEMM and attention kernel (``--mfu``, calibrated against a
measured or published step; see benchmarks/published.py).

Per stage holding layers ``[first, stop)``, on one of ``t`` tensor-parallel ranks (layers
differ: dense or mixture-of-experts MLP, so each figure is a sum over the stage's layers,
``ModelSpec.sum_over_layers``; ``/ t`` below is each layer's share on one tp rank,
``pipesim.model.weights``):

    F = sum of layer_flops / t                 (+ logits on the last stage)
    B = 2F + recompute                          full: sum of layer_flops / t,
                                                selective: sum of attention cores / t
    W = sum of layer GEMM FLOPs / t            (+ logits: the head has weights)
    params = sum of the layers' parameters on one tp rank (whole numbers: norms and
             row-parallel biases whole on every rank, replicated key-value heads counted
             on each rank that holds them), every expert included

so a split backward puts the recomputed forward and the attention core's backward in
``I = B - W``. With full recompute the re-run forward also repeats its two tensor-parallel
collectives per layer (``recompute_layers``).
"""

from __future__ import annotations

from pipesim.model.activations import first_stage_extra_bytes, last_stage_extra_bytes, layer_stash_bytes
from pipesim.model.costs import Costs, StageCost
from pipesim.model.layout import check_layout
from pipesim.model.memory_traffic import layer_memory_seconds, optimizer_step_seconds
from pipesim.model.spec import ModelSpec, ModelSpecError, check_recompute, finite_peak, split_layers

H100_BF16_FLOPS = 989e12  # used when a device has no peak (the ideal topology) and no --gpu
H100_HBM_BANDWIDTH = 3.35e12


def device_memory_bandwidth(topology, device: str) -> float:
    """HBM bytes/s of ``device`` in ``topology``; 0 (unknown) when the topology does not say."""
    return topology.device_figure(device, "memory_bandwidth", 0.0)


def model_costs(
    spec: ModelSpec,
    num_stages: int,
    stage_peak_flops: list[float],
    tp: int = 1,
    mfu: float = 0.5,
    sequence_parallel: bool = False,
    layers_per_stage: list[int] | None = None,
    recompute: str = "none",
    flash_attention: bool = True,
    fallback_peak: float = H100_BF16_FLOPS,
    stage_memory_bandwidth: list[float] | None = None,
    fallback_memory_bandwidth: float = H100_HBM_BANDWIDTH,
    optimizer_state_bytes: float = 16.0,
    stage_ranks: list[int] | None = None,
) -> Costs:
    """Per-stage ``Costs`` of ``spec`` split over ``num_stages`` stages, on devices whose
    peak FLOP/s are ``stage_peak_flops[stage]``, reaching ``mfu`` of peak, and whose HBM
    moves ``stage_memory_bandwidth[stage]`` bytes/s (the fallbacks where unknown).

    The optimizer step (``step_overhead``) reads and writes ``optimizer_state_bytes`` per
    parameter (weights + gradients + optimizer state on the device); it is the slowest
    rank's, ranks being ``stage_ranks[stage]`` (default: one stage per rank)."""
    if not 0 < mfu <= 1:
        raise ModelSpecError(f"--mfu is a fraction of peak in (0, 1], got {mfu}")
    if tp < 1:
        raise ModelSpecError(f"--tp must be >= 1, got {tp}")
    check_recompute(recompute)
    check_layout(spec, tp, sequence_parallel=sequence_parallel)
    counts = split_layers(spec.layers, num_stages, layers_per_stage)
    stages = []
    step_seconds: dict[int, float] = {}
    per_kind: dict[tuple[bool, float], tuple] = {}

    def layer_figures(layer: int, bandwidth: float) -> tuple:
        """(FLOPs, weight-GEMM FLOPs, recomputed FLOPs, params, stash bytes, memory-bound
        forward and backward seconds) of one layer on one tp rank, once per kind of layer."""
        key = (spec.is_moe_layer(layer), bandwidth)
        if key not in per_kind:
            per_kind[key] = (
                spec.layer_flops(layer, tp, sequence_parallel), spec.layer_gemm_flops(layer, tp, sequence_parallel),
                spec.layer_recompute_flops(layer, recompute, tp, sequence_parallel), spec.layer_params(layer, tp),
                layer_stash_bytes(spec, tp, sequence_parallel, recompute, flash_attention, layer),
                *layer_memory_seconds(spec, bandwidth, tp, sequence_parallel, flash_attention, recompute, layer))
        return per_kind[key]

    stop = 0
    for stage, count in enumerate(counts):
        first, stop = stop, stop + count
        rate = finite_peak(stage_peak_flops[stage], fallback_peak) * mfu
        bandwidth = finite_peak(stage_memory_bandwidth[stage] if stage_memory_bandwidth else 0.0,
                                fallback_memory_bandwidth)
        sums = [0] * 7  # params stay a whole number
        for layer, alike in spec.layer_groups(first, stop):
            for index, value in enumerate(layer_figures(layer, bandwidth)):
                sums[index] += alike * value
        flops, weight_flops, recompute_flops, params, stash, memory_fwd, memory_bwd = sums
        if stage == 0:
            params += spec.embedding_params(tp)
            stash += first_stage_extra_bytes(spec, tp, sequence_parallel)
        if stage == num_stages - 1:
            params += spec.head_params(tp)
            flops += spec.logits_flops() / tp
            weight_flops += spec.logits_flops() / tp
            stash += last_stage_extra_bytes(spec, tp, sequence_parallel)
        fwd = flops / rate
        rank = stage_ranks[stage] if stage_ranks else stage
        step_seconds[rank] = step_seconds.get(rank, 0.0) + optimizer_step_seconds(params, optimizer_state_bytes,
                                                                                  bandwidth)
        stages.append(StageCost(
            fwd=fwd + memory_fwd,
            bwd=2 * fwd + recompute_flops / rate + memory_bwd,
            wgrad=weight_flops / rate,
            act_bytes=spec.boundary_bytes(tp, sequence_parallel) if stage < num_stages - 1 else 0.0,
            stash_bytes=stash,
            param_bytes=params * spec.dtype_bytes,
            params=params,
            layers=count if tp > 1 else 0,
            tp_message_bytes=spec.tp_message_bytes(first) if tp > 1 else 0.0,  # alike in every layer
            recompute_layers=count if tp > 1 and recompute == "full" else 0,
        ))
    meta = {
        "model": spec.name, "layers_per_stage": counts, "tp": tp, "mfu": mfu, "total_params": spec.total_params(),
        "active_params": spec.active_params(),
        "recompute": recompute, "flash_attention": flash_attention,
    }
    return Costs(stages=tuple(stages), sequence_parallel=sequence_parallel, meta=meta,
                 step_overhead=max(step_seconds.values()))


def training_figures(spec: ModelSpec, recompute: str, makespan: float, microbatches: int, dp: int, gpus: int,
                     peak_flops: float) -> dict:
    """What a training log reports for one step of ``microbatches`` per replica on ``gpus``
    devices of ``peak_flops``:

    - ``tokens_per_second``: ``microbatches * dp * b * s / makespan``;
    - ``model_tflops_per_gpu``: Megatron's figure, FLOPs per step including the
      recomputed forward (Narayanan et al. 2021, eq. 3: ``96 B s l h^2 (1 + s/6h +
      V/16lh)`` with full recompute, i.e. 4 passes over the layers and 3 over the logits)
      per second per GPU;
    - ``mfu``: model FLOPs without recompute (3 passes) over peak (PaLM's definition)."""
    sequences = microbatches * dp
    model_flops = sequences * 3 * spec.forward_flops()
    counted_flops = model_flops + sequences * spec.recompute_flops(recompute)
    if makespan <= 0:
        return {"tokens_per_second": None, "model_tflops_per_gpu": None, "mfu": None}
    return {
        "tokens_per_second": sequences * spec.tokens / makespan,
        "model_tflops_per_gpu": counted_flops / makespan / gpus / 1e12,
        "mfu": model_flops / makespan / gpus / peak_flops,
    }
