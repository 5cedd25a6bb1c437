"""A ``ModelSpec`` split over pipeline stages, turned into per-stage ``Costs``, and the
training figures people quote for a simulated step (tokens/s, TFLOP/s per GPU, MFU).

A layer is the operations it runs (``pipesim.model.operations``: its GEMMs, attention,
element-wise kernels, with their shapes on one tp rank), and each stage's device prices
them with a compute model (``pipesim.model.compute_model``): by default the kernels of
its GPU by shape; with ``--mfu``, one efficiency for every GEMM and attention kernel.

Per stage holding layers ``[first, stop)`` (layers differ: a dense or a mixture-of-experts
MLP, so each figure is a sum over the stage's layers, one evaluation per kind of layer;
the output layer's operations added on the last stage):

    F = sum of layer forwards
    B = sum of (layer input gradient + weight gradient + what recompute re-runs)
    W = sum of layer weight gradients          (the weighted GEMMs' second backward GEMM)
    params = sum of the layers' parameters on one tp rank (whole numbers: norms and
             row-parallel biases whole on every rank, replicated key-value heads counted
             on each rank that holds them), every expert included: memory holds them all

A mixture-of-experts layer is timed by what its experts compute, padded to the capacity
factor (``pipesim.model.operations``); the model FLOPs behind MFU count the tokens' work
on their top-k experts, unpadded (``ModelSpec.forward_flops``).

Full recompute re-runs every forward operation, selective the attention core (its GEMMs
or kernel, softmax and dropout), so a split backward puts the recomputed forward and the
attention core's backward in ``I = B - W``. With full recompute the re-run forward also
repeats its two tensor-parallel collectives per layer (``recompute_layers``).

Over ``ep`` expert-parallel ranks a rank holds ``E / ep`` of each MoE layer's experts and
computes the tokens its group routes to them; over ``cp`` context-parallel ranks it
computes ``s / cp`` tokens of each sequence, its attention in ``cp`` ring steps
(``pipesim.model.operations``). The communication both add (all-to-all, the K/V ring)
depends on the cluster, so the stage costs carry what prices it (``moe_layers``,
``dispatch_bytes`` and ``combine_bytes``, ``attention_layers``, ``kv_bytes``, the attention core's seconds) and
``pipesim.sim`` charges it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace

from pipesim.model.activations import (
    end_output_grad_bytes,
    first_stage_extra_bytes,
    key_value_bytes,
    last_stage_extra_bytes,
    layer_stash_bytes,
    loss_workspace_bytes,
    output_grad_bytes,
    rebuilt_until_weight_grad_bytes,
    recompute_workspace_bytes,
    regathered_until_weight_grad_bytes,
    wgrad_stash_bytes,
    wgrad_stash_share,
)
from pipesim.model.compute_model import BlockTime, ComputeModel, KernelModel, block_time, stage_compute_model
from pipesim.model.costs import Costs, StageCost
from pipesim.model.layout import check_layout
from pipesim.model.memory_traffic import optimizer_step_seconds
from pipesim.model.operations import Gemm, attention_core, head_operations, layer_operations, mtp_operations
from pipesim.model.per_op_checkpoint import check_per_op, recomputed_tp_pairs
from pipesim.model.saved_tensors import (
    KERNELS,
    SavedTensors,
    async_regathered_inputs,
    mtp_extra,
    regathered_inputs,
)
from pipesim.model.spec import ModelSpec, ModelSpecError, check_recompute, finite_peak
from pipesim.model.stage_split import ends_on_one_rank, split_layers
from pipesim.model.tp_windows import TP_WINDOW_FIELDS, tp_gemm_windows
from pipesim.model.weights import routed_params

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
    mfu: float | None = None,
    sequence_parallel: bool = False,
    layers_per_stage: list[int] | None = None,
    recompute: str = "none",
    flash_attention: bool = True,
    fallback_peak: float = H100_BF16_FLOPS,
    stage_memory_bandwidth: list[float] | None = None,
    fallback_memory_bandwidth: float = H100_HBM_BANDWIDTH,
    optimizer_state_bytes: float = 16.0,
    stage_ranks: list[int] | None = None,
    stage_gpus: list[str | None] | None = None,
    fallback_gpu: str | None = None,
    compute_model: KernelModel | None = None,
    ep: int = 1,
    cp: int = 1,
    layer_hold_seconds: float = 0.0,
    comm_sms: int = 0,
) -> Costs:
    """Per-stage ``Costs`` of ``spec`` split over ``num_stages`` stages, on devices whose
    peak FLOP/s are ``stage_peak_flops[stage]`` and whose HBM moves
    ``stage_memory_bandwidth[stage]`` bytes/s (the fallbacks where unknown).

    Compute is timed by the kernel model of each stage's GPU, ``stage_gpus[stage]``
    (``fallback_gpu`` where unnamed), or by ``compute_model`` (a profiled one) for every
    stage; given ``mfu``, every GEMM and attention kernel reaches that fraction of peak
    instead. ``comm_sms`` of each GPU's SMs are kept for communication kernels, the
    compute running on the rest (``pipesim.model.compute_model.reserve_sms``).

    The optimizer step (``step_overhead``) reads and writes ``optimizer_state_bytes`` per
    parameter (weights + gradients + optimizer state on the device); it is the slowest
    rank's, ranks being ``stage_ranks[stage]`` (default: one stage per rank).

    ``ep`` expert-parallel and ``cp`` context-parallel ranks: see the module.

    Without ``layers_per_stage`` the layers are split so that each stage's time (each
    rank's, where ``stage_ranks`` puts both ends of the model on one rank) is as even as it
    can be (``pipesim.model.stage_split``): a layer's forward and backward, plus
    ``layer_hold_seconds`` of tensor-parallel collectives that hold its rank, against the
    output layer's forward and backward on the last stage."""
    return with_optimizer_step(
        model_stage_costs(spec, num_stages, stage_peak_flops, tp, mfu, sequence_parallel, layers_per_stage,
                          recompute, flash_attention, fallback_peak, stage_memory_bandwidth,
                          fallback_memory_bandwidth, stage_gpus, fallback_gpu, compute_model, ep, cp,
                          layer_hold_seconds, comm_sms,
                          split_ranks=ends_on_one_rank(stage_ranks) if stage_ranks else None),
        optimizer_state_bytes, stage_ranks, stage_memory_bandwidth, fallback_memory_bandwidth)


def model_stage_costs(
    spec: ModelSpec,
    num_stages: int,
    stage_peak_flops: list[float],
    tp: int = 1,
    mfu: float | None = None,
    sequence_parallel: bool = False,
    layers_per_stage: list[int] | None = None,
    recompute: str = "none",
    flash_attention: bool = True,
    fallback_peak: float = H100_BF16_FLOPS,
    stage_memory_bandwidth: list[float] | None = None,
    fallback_memory_bandwidth: float = H100_HBM_BANDWIDTH,
    stage_gpus: list[str | None] | None = None,
    fallback_gpu: str | None = None,
    compute_model: KernelModel | None = None,
    ep: int = 1,
    cp: int = 1,
    layer_hold_seconds: float = 0.0,
    comm_sms: int = 0,
    saved_tensors: SavedTensors = KERNELS,
    split_ranks: Sequence[int] | None = None,
) -> Costs:
    """``model_costs`` without the optimizer step (``step_overhead`` 0): the stages alone,
    which depend on which rank holds which stage only through ``split_ranks`` (where one
    rank holds both ends of the model the default split balances ranks, not stages:
    ``pipesim.model.stage_split.ends_on_one_rank``), so a planner derives them once for
    every placement of as many stages that splits alike (``with_optimizer_step`` adds the
    step).
    ``saved_tensors`` says what the implementation keeps for the backward beyond the
    fused kernels' inventory (``pipesim.model.saved_tensors``; the executor's is
    ``EAGER_TORCH``)."""
    if mfu is not None and not 0 < mfu <= 1:  # NaN fails this too
        raise ModelSpecError(f"--mfu is a fraction of peak in (0, 1], got {mfu}")
    if mfu is not None and compute_model is not None:
        raise ModelSpecError("--mfu conflicts with --compute-model: give one efficiency for every kernel or a "
                             "profiled model, not both")
    if tp < 1:
        raise ModelSpecError(f"--tp must be >= 1, got {tp}")
    check_recompute(recompute)
    check_per_op(spec, recompute, flash_attention)
    check_layout(spec, tp, ep, cp, sequence_parallel=sequence_parallel)
    if cp > 1 and not flash_attention:
        raise ModelSpecError(f"--cp {cp} conflicts with --no-flash-attention: ring attention is built on the fused "
                             "attention kernel (Megatron-Core runs context parallelism in Transformer Engine's); "
                             "drop --no-flash-attention")
    local = spec.context_shard(cp)
    # the first layer of each kind (dense or mixture of experts, attention whole or over a
    # window) stands for its kind: layers of a kind are alike, and every stage then asks
    # layer_time's cache for the same few layers
    kind_layer = {spec.layer_kind(layer): layer for layer, _ in reversed(spec.layer_groups())}

    def bandwidth_of(stage: int) -> float:
        return stage_bandwidth(stage_memory_bandwidth, fallback_memory_bandwidth, stage)

    models_of: dict[tuple, ComputeModel] = {}  # stages on alike devices share one

    def compute_of(stage: int) -> ComputeModel:
        device = (finite_peak(stage_peak_flops[stage], fallback_peak), bandwidth_of(stage),
                  (stage_gpus[stage] if stage_gpus else None) or fallback_gpu)
        if device not in models_of:
            models_of[device] = stage_compute_model(*device, mfu, compute_model, spec.fp8, comm_sms)
        return models_of[device]

    times: dict[tuple[int, int], BlockTime] = {}  # per compute model and kind of layer (-1: the output layer)

    def time_of(compute: ComputeModel, kind: int) -> BlockTime:
        key = (id(compute), kind)  # the models are kept in models_of for the whole call
        if key not in times:
            times[key] = head_time(spec, tp, compute, cp) if kind < 0 else layer_time(
                spec, tp, sequence_parallel, flash_attention, recompute, compute, kind, ep, cp)
        return times[key]

    def end_of(compute: ComputeModel) -> BlockTime:
        """What the last stage runs after its layers: the output layer and the multi-token
        prediction modules (each a block like layer ``spec.layers``, a projection and the
        shared head's logits once more)."""
        head = time_of(compute, -1)
        if not spec.mtp_depth:
            return head
        block = time_of(compute, spec.layers)
        extra = mtp_time(spec, tp, compute, cp)
        return BlockTime(*(getattr(head, part) + spec.mtp_depth * (getattr(block, part) + getattr(extra, part))
                           for part in ("forward", "input_grad", "weight_grad", "recompute")))

    head_extra = 0.0
    if layers_per_stage is None and num_stages > 1:  # the output layer's time in layers, to balance the split
        compute = compute_of(num_stages - 1)
        layer_seconds = spec.sum_over_layers(
            lambda layer: _pass_seconds(time_of(compute, kind_layer[spec.layer_kind(layer)]))
        ) / spec.layers + layer_hold_seconds
        head_extra = _pass_seconds(end_of(compute)) / layer_seconds if layer_seconds > 0 else 0.0
    counts = split_layers(spec.layers, num_stages, layers_per_stage, last_extra=head_extra, ranks=split_ranks)
    stages = []
    models = set()
    per_kind = {layer: (spec.layer_params(layer, tp, ep),
                        layer_stash_bytes(local, tp, sequence_parallel, recompute, flash_attention, layer,
                                          saved_tensors, cp, ep),
                        wgrad_stash_bytes(local, tp, sequence_parallel, layer),
                        output_grad_bytes(local, tp, sequence_parallel, layer, saved_tensors)
                        + rebuilt_until_weight_grad_bytes(local, tp, sequence_parallel, recompute, flash_attention,
                                                          layer, saved_tensors)
                        + regathered_until_weight_grad_bytes(local, tp, sequence_parallel, recompute, saved_tensors,
                                                             layer),
                        regathered_inputs(saved_tensors, tp, sequence_parallel, recompute),
                        async_regathered_inputs(saved_tensors, tp, sequence_parallel, recompute,
                                                spec.is_moe_layer(layer)),
                        recompute_workspace_bytes(local, tp, sequence_parallel, flash_attention, layer, saved_tensors,
                                                  cp, ep) if recompute == "full" else 0.0)
                for layer in kind_layer.values()}
    routed = routed_params(spec, tp, ep)
    # the all-to-all toward the experts in FP8 under DeepSeek-V3's recipe, the one back in BF16
    dispatch = spec.moe.dispatch_bytes(local.tokens / tp, spec.hidden, spec.dispatch_element_bytes) if spec.moe else 0.0
    combine = spec.moe.dispatch_bytes(local.tokens / tp, spec.hidden, spec.dtype_bytes) if spec.moe else 0.0

    def stage_cost(compute: ComputeModel, groups: list[tuple[int, int]], count: int, first_stage: bool,
                   last_stage: bool) -> StageCost:
        fwd = bwd = wgrad = stash = kept = regathers = async_regathers = rebuilt = 0.0
        # what a split backward's I adds to a stash held whole until W (the executor's)
        grads = end_output_grad_bytes(local, tp, sequence_parallel, first_stage, last_stage, saved_tensors)
        params = moe_layers = 0  # whole numbers
        experts = [0.0, 0.0, 0.0]  # the MoE layers' experts: forward, input gradient, weight gradient
        windows = [0.0] * len(TP_WINDOW_FIELDS)  # summed over the stage's layers, then per layer
        for layer, alike in groups:
            kind = kind_layer[spec.layer_kind(layer)]
            if spec.is_moe_layer(layer):
                moe_layers += alike
                experts = _add_experts(experts, alike, experts_time(spec, tp, sequence_parallel, compute, kind, ep, cp))
            time = time_of(compute, kind)
            if tp > 1:
                windows = [total + alike * seconds for total, seconds in zip(
                    windows, tp_gemm_windows(spec, tp, sequence_parallel, flash_attention, compute, kind, ep, cp),
                    strict=True)]
            fwd += alike * time.forward
            bwd += alike * (time.input_grad + time.weight_grad + time.recompute)
            wgrad += alike * time.weight_grad
            params += alike * per_kind[kind][0]
            stash += alike * per_kind[kind][1]
            kept += alike * per_kind[kind][2]
            grads += alike * per_kind[kind][3]
            regathers += alike * per_kind[kind][4]
            async_regathers += alike * per_kind[kind][5]
            rebuilt = max(rebuilt, per_kind[kind][6])  # one layer's forward re-run at a time
        if first_stage:
            params += spec.embedding_params(tp)
            stash += first_stage_extra_bytes(local, tp, sequence_parallel, saved_tensors)
        if last_stage:
            head = end_of(compute)
            params += spec.head_params(tp) + spec.mtp_params(tp, ep)
            fwd += head.forward
            bwd += head.input_grad + head.weight_grad + head.recompute
            wgrad += head.weight_grad
            stash += last_stage_extra_bytes(local, tp, sequence_parallel, saved_tensors)
            kept += local.tokens * (spec.hidden + spec.vocab / tp) * spec.dtype_bytes  # the logits GEMM's
            if spec.mtp_depth:  # each module: its block's stash, its projection's input, its head's
                stash += spec.mtp_depth * (
                    layer_stash_bytes(local, tp, sequence_parallel, recompute, flash_attention, spec.layers,
                                      saved_tensors, cp, ep)
                    + 2 * local.tokens * spec.hidden * spec.dtype_bytes
                    + last_stage_extra_bytes(local, tp, sequence_parallel, saved_tensors)
                    + mtp_extra(local, saved_tensors))
                kept += spec.mtp_depth * wgrad_stash_bytes(local, tp, sequence_parallel, spec.layers)
                mtp_moe = spec.mtp_depth if spec.is_moe_layer(spec.layers) else 0
                regathers += spec.mtp_depth * regathered_inputs(saved_tensors, tp, sequence_parallel, recompute)
                async_regathers += spec.mtp_depth * async_regathered_inputs(saved_tensors, tp, sequence_parallel,
                                                                            recompute, bool(mtp_moe))
                moe_layers += mtp_moe
                if mtp_moe:
                    experts = _add_experts(experts, mtp_moe, experts_time(spec, tp, sequence_parallel, compute,
                                                                          spec.layers, ep, cp))
                count += spec.mtp_depth
                if tp > 1:  # each module's block runs its tp collectives beside its own GEMMs
                    windows = [total + spec.mtp_depth * seconds for total, seconds in zip(
                        windows, tp_gemm_windows(spec, tp, sequence_parallel, flash_attention, compute, spec.layers,
                                                 ep, cp), strict=True)]
        attention = attention_time(spec, tp, flash_attention, compute, cp)
        return StageCost(
            fwd=fwd,
            bwd=bwd,
            wgrad=wgrad,
            act_bytes=0.0 if last_stage else local.boundary_bytes(tp, sequence_parallel),
            stash_bytes=stash,
            workspace_bytes=max(rebuilt, loss_workspace_bytes(local, tp) if last_stage else 0.0),
            param_bytes=params * spec.dtype_bytes,
            params=params,
            layers=count,
            tp_message_bytes=local.tp_message_bytes() if tp > 1 else 0.0,  # alike in every layer
            tp_regathers=regathers / count if count else 0.0,  # per layer, as tp_message_bytes
            tp_async_regathers=async_regathers / count if count else 0.0,
            recompute_layers=count if recompute == "full" else 0,
            # full recompute's re-run collectives are its recompute_layers'
            recomputed_tp_pairs=0.0 if recompute == "full" else count * recomputed_tp_pairs(recompute,
                                                                                            sequence_parallel),
            expert_params=moe_layers * routed,
            moe_layers=moe_layers,
            dispatch_bytes=dispatch if moe_layers else 0.0,
            moe_shared=1.0 if moe_layers and spec.moe.shared_ffn else 0.0,
            combine_bytes=combine if moe_layers else 0.0,
            attention_layers=count,
            kv_bytes=local.tokens * key_value_bytes(spec, tp),
            attention_fwd=attention.forward,
            attention_bwd=attention.input_grad,
            wgrad_stash_share=((stash + grads) / stash if saved_tensors.whole_stash_until_weight_grad and stash > 0
                               else 1.0 if recompute == "full" or saved_tensors.whole_stash_until_weight_grad
                               else wgrad_stash_share(stash, kept)),
            dispatch_node_limit=float(dispatch_node_limit(spec, ep)) if moe_layers else 0.0,
            dispatch_copies=spec.moe.routed_slots(padded=False) if moe_layers else 0.0,
            **{name: total / moe_layers if moe_layers else 0.0
               for name, total in zip(("expert_fwd", "expert_igrad", "expert_wgrad"), experts, strict=True)},
            **{name: total / count if count else 0.0 for name, total in zip(TP_WINDOW_FIELDS, windows, strict=True)},
        )

    # stages on alike devices holding alike layers (most of a deep pipeline) share one cost
    built: dict[tuple, StageCost] = {}
    stop = 0
    for stage, count in enumerate(counts):
        first, stop = stop, stop + count
        compute = compute_of(stage)
        models.add(compute.name)
        groups = spec.layer_groups(first, stop)
        ends = (stage == 0, stage == num_stages - 1)
        key = (id(compute), tuple((spec.layer_kind(layer), alike) for layer, alike in groups), *ends)
        cost = built.get(key)
        if cost is None:
            cost = built[key] = stage_cost(compute, groups, count, *ends)
        stages.append(cost)
    meta = {
        "model": spec.name, "layers_per_stage": counts, "tp": tp, "ep": ep, "cp": cp, "mfu": mfu,
        **_parameter_totals(spec),
        "recompute": recompute, "flash_attention": flash_attention, "compute_model": sorted(models),
    }
    return Costs(stages=tuple(stages), sequence_parallel=sequence_parallel, meta=meta)


def with_embedding_copies(costs: Costs, spec: ModelSpec, stage_ranks: list[int], copies: int = 1,
                          tp: int = 1, shared_on_rank: bool = True) -> Costs:
    """``costs`` with a copy of the token embedding table (a learned position table is
    read by the first stage alone) on each last stage that reads it but holds no first
    stage. A tied model's output layer is the table (Megatron-LM keeps a
    copy on the last stage and sums the two copies' gradients over its embedding group;
    ``pipesim run``'s executor does the same); DeepSeek-V3's multi-token prediction
    modules embed the tokens they predict with the main model's table (report, section
    2.2), on the last stage. A rank that also holds a first stage (one stage; a V-shaped
    placement; DualPipe, whose rank with copy 0's last stage holds copy 1's first:
    "physical sharing", section 3.2.3) reads the one it has; any other keeps a copy,
    counted in its parameters: memory, gradient reduction and optimizer. Without
    ``shared_on_rank`` every such last stage keeps a copy (``pipesim run``'s executor,
    whose stages are separate modules). Each copy's gradient is summed with the first
    stage's table after the step's reductions (``Costs.embedding_sums``: one all-reduce
    of the table's gradient, in the weights' dtype as the gradient reductions count it,
    between the two ranks; none where both stages share a rank)."""
    if not spec.mtp_depth and not spec.tied_embeddings:
        return costs
    per_copy = len(costs.stages) // copies
    firsts = {stage_ranks[copy * per_copy] for copy in range(copies)} if shared_on_rank else set()
    extra = spec.token_table_params(tp)  # a learned position table stays on the first stage
    stages = list(costs.stages)
    sums = []
    for copy in range(copies):
        first, last = copy * per_copy, copy * per_copy + per_copy - 1
        if stage_ranks[last] not in firsts:
            stage = stages[last]
            stages[last] = replace(stage, params=stage.params + extra,
                                   param_bytes=stage.param_bytes + extra * spec.dtype_bytes)
            if stage_ranks[last] != stage_ranks[first]:
                sums.append((first, last, float(extra * spec.dtype_bytes)))
    return replace(costs, stages=tuple(stages), embedding_sums=tuple(sums))


def stage_bandwidth(stage_memory_bandwidth: list[float] | None, fallback: float, stage: int) -> float:
    """HBM bytes/s of ``stage``'s device: the given figure, ``fallback`` where unknown."""
    return finite_peak(stage_memory_bandwidth[stage] if stage_memory_bandwidth else 0.0, fallback)


def with_optimizer_step(costs: Costs, optimizer_state_bytes: float, stage_ranks: list[int] | None,
                        stage_memory_bandwidth: list[float] | None, fallback_memory_bandwidth: float) -> Costs:
    """``costs`` with the optimizer step of ``model_costs``: each rank (``stage_ranks[stage]``,
    default one stage per rank) reads and writes ``optimizer_state_bytes`` per parameter
    of its stages, in stage order, and the slowest rank's step is the step's."""
    step_seconds: dict[int, float] = {}
    stage_seconds: dict[tuple[int, float], float] = {}  # per stage object and device figure: alike stages share
    for stage, cost in enumerate(costs.stages):
        rank = stage_ranks[stage] if stage_ranks else stage
        key = (id(cost), stage_memory_bandwidth[stage] if stage_memory_bandwidth else 0.0)
        seconds = stage_seconds.get(key)
        if seconds is None:
            bandwidth = stage_bandwidth(stage_memory_bandwidth, fallback_memory_bandwidth, stage)
            seconds = stage_seconds[key] = optimizer_step_seconds(cost.params, optimizer_state_bytes, bandwidth)
        step_seconds[rank] = step_seconds.get(rank, 0.0) + seconds
    return costs.with_step_overhead(max(step_seconds.values()))


@functools.lru_cache(maxsize=256)
def _parameter_totals(spec: ModelSpec) -> dict[str, int]:
    """The model's total and active parameters (kept: a plan derives thousands of costs)."""
    return {"total_params": spec.total_params(), "active_params": spec.active_params()}


def _pass_seconds(time: BlockTime) -> float:
    """A block's forward and whole backward (recompute included)."""
    return time.forward + time.input_grad + time.weight_grad + time.recompute


@functools.lru_cache(maxsize=4096)
def layer_time(spec: ModelSpec, tp: int, sequence_parallel: bool, flash_attention: bool, recompute: str,
               compute: ComputeModel, layer: int = 0, ep: int = 1, cp: int = 1) -> BlockTime:
    """Layer ``layer``'s seconds for one microbatch on one rank of ``tp`` tensor-, ``ep``
    expert- and ``cp`` context-parallel ranks, routed experts padded to their capacity
    (kept per distinct input: a plan asks for the same layer on the same GPU for thousands
    of layouts)."""
    return block_time(layer_operations(spec, tp, sequence_parallel, flash_attention, layer, ep=ep, cp=cp), compute,
                      recompute, spec.dtype_bytes)


def dispatch_node_limit(spec: ModelSpec, ep: int) -> int:
    """The most nodes a token's routed copies cross to (0: no limit, one copy per routed
    slot): the model's node-limited routing (DeepSeek-V3's ``topk_group``); under DeepEP's
    dispatch (``ep_dispatcher`` ``deepep``) a copy per node, so at most the ``ep`` ranks'
    nodes whatever the routing (``pipesim.model.experts.node_limited_share`` caps it by the
    nodes the group spans)."""
    if spec.moe.node_limit:
        return spec.moe.node_limit
    return ep if spec.ep_dispatcher == "deepep" else 0


EXPERT_GEMMS = ("expert_", "shared_expert_")  # pipesim.model.weights.mlp_weights' GEMMs of the experts


@functools.lru_cache(maxsize=4096)
def experts_time(spec: ModelSpec, tp: int, sequence_parallel: bool, compute: ComputeModel, layer: int = 0,
                 ep: int = 1, cp: int = 1) -> BlockTime:
    """Layer ``layer``'s experts on one rank (part of ``layer_time``): its routed and
    shared experts' GEMMs, what Megatron-Core's combined 1F1B runs as the layer's ``mlp``
    node between the dispatch and the combine (``pipesim.sim.overlap``); never
    recomputed (combined 1F1B refuses full recompute)."""
    operations = tuple(operation for operation in layer_operations(spec, tp, sequence_parallel, True, layer, ep=ep,
                                                                   cp=cp)
                       if isinstance(operation, Gemm) and operation.name.startswith(EXPERT_GEMMS))
    return block_time(operations, compute, "none", spec.dtype_bytes)


def _add_experts(totals: list[float], layers: int, time: BlockTime) -> list[float]:
    """``totals`` (forward, input gradient, weight gradient) with ``layers`` more MoE layers' experts."""
    return [total + layers * part for total, part in zip(totals, (time.forward, time.input_grad, time.weight_grad),
                                                         strict=True)]



@functools.lru_cache(maxsize=4096)
def head_time(spec: ModelSpec, tp: int, compute: ComputeModel, cp: int = 1) -> BlockTime:
    """The output layer's seconds (never recomputed: Megatron's rule)."""
    return block_time(head_operations(spec, tp, cp), compute, "none", spec.dtype_bytes)


@functools.lru_cache(maxsize=4096)
def mtp_time(spec: ModelSpec, tp: int, compute: ComputeModel, cp: int = 1) -> BlockTime:
    """A multi-token prediction module's projection and head logits (its block is a
    ``layer_time``), never recomputed."""
    return block_time(mtp_operations(spec, tp, cp), compute, "none", spec.dtype_bytes)


@functools.lru_cache(maxsize=4096)
def attention_time(spec: ModelSpec, tp: int, flash_attention: bool, compute: ComputeModel, cp: int = 1) -> BlockTime:
    """One layer's attention core on one rank, all its ring steps (part of ``layer_time``):
    the compute that ring attention's transfers hide under."""
    return block_time(attention_core(spec.context_shard(cp), tp, flash_attention, cp), compute, "none",
                      spec.dtype_bytes)


ATTENTION_FLOPS = ("causal", "whole")  # how the attention core's FLOPs are counted in MFU and TFLOP/s


def check_attention_flops(convention: str) -> str:
    """``convention`` if it names a way to count attention FLOPs; else a one-line error."""
    if convention not in ATTENTION_FLOPS:
        raise ValueError(f"--attention-flops {convention!r}: use causal (half the s x s scores, as a causal mask "
                         f"computes them: Llama 3's figures) or whole (the full square: PaLM's formula)")
    return convention


def attention_flops_counted(spec: ModelSpec, convention: str) -> float:
    """Forward FLOPs of every layer's attention core, one microbatch, as ``convention``
    counts them: the whole ``s x s`` square (PaLM's appendix B formula, 2021's Megatron
    eq. 3, torchtitan) or the half a causal mask leaves (``causal``: Meta's Llama 3
    figures, today's Megatron-LM and MaxText, FlashAttention's benchmarks)."""
    whole = spec.sum_over_layers(lambda layer: spec.attention_core_flops())
    return whole / 2 if check_attention_flops(convention) == "causal" else whole


def training_figures(spec: ModelSpec, recompute: str, makespan: float, microbatches: int, dp: int, gpus: int,
                     peak_flops: float, attention_flops: str = "whole", fp8_peak_flops: float | None = None) -> dict:
    """What a training log reports for one step of ``microbatches`` per replica on ``gpus``
    devices of ``peak_flops``:

    - ``tokens_per_second``: ``microbatches * dp * b * s / makespan``;
    - ``model_tflops_per_gpu``: Megatron's figure, FLOPs per step including the
      recomputed forward (Narayanan et al. 2021, eq. 3: ``96 B s l h^2 (1 + s/6h +
      V/16lh)`` with full recompute, i.e. 4 passes over the layers and 3 over the logits)
      per second per GPU;
    - ``mfu``: model FLOPs without recompute (3 passes) over peak (PaLM's definition),
      the BF16 peak whatever the GEMMs run in, as papers report FP8 runs, so that FP8
      and BF16 steps compare on one scale;
    - ``mfu_fp8_peak``: with FP8 GEMMs, the same FLOPs over ``fp8_peak_flops``.

    Both count each attention core's FLOPs as ``attention_flops`` says
    (``attention_flops_counted``): ``whole``, as the formulas above write them, or
    ``causal``, half of it (in every pass, the recomputed ones too)."""
    sequences = microbatches * dp
    uncounted = spec.sum_over_layers(lambda layer: spec.attention_core_flops()) \
        - attention_flops_counted(spec, attention_flops)
    model_flops = sequences * 3 * (spec.forward_flops() - uncounted)
    recomputed = spec.recompute_flops(recompute)
    # only full and selective recompute re-run the attention core, whose uncounted part comes off
    counted_flops = model_flops + sequences * (recomputed - (uncounted if recompute in ("full", "selective") else 0.0))
    fp8 = spec.fp8 and bool(fp8_peak_flops)
    if makespan <= 0:
        return {"tokens_per_second": None, "model_tflops_per_gpu": None, "mfu": None,
                **({"mfu_fp8_peak": None} if fp8 else {})}
    figures = {
        "tokens_per_second": sequences * spec.tokens / makespan,
        "model_tflops_per_gpu": counted_flops / makespan / gpus / 1e12,
        "mfu": model_flops / makespan / gpus / peak_flops,
    }
    if fp8:
        figures["mfu_fp8_peak"] = model_flops / makespan / gpus / fp8_peak_flops
    return figures
