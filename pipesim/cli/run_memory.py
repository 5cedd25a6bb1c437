"""The simulator's prediction of each rank's whole peak memory beside ``pipesim run``'s
measured one (CPU: the tensors the executor tracks, ``executor.memory``; GPU: the CUDA
caching allocator's peak, which also holds what lives inside an action, see
``allocator_extras`` and ``action_peaks``).

The prediction is the simulator's memory model (``pipesim.sim.memory.memory_report``)
of the same model, split and schedule, told what the executor's layers keep for their
backward (``pipesim.model.saved_tensors.EAGER_TORCH``, ``AUTOCAST_TORCH`` under bf16
autocast; in the run's dtype, without dropout) and taken over the schedule's program
order (``program_order_trace``), plus what a run does differently from the steady state
the model assumes:

- gradients: the executor frees them between steps (``zero_grad(set_to_none=True)``),
  so a stage's gradients exist from the end of its first weight-gradient action
  (``B``, or ``W`` when split) on; the model's static part holds them all step;
- the optimizer's state exists from the first step on, so the prediction is of a step
  after the first (``--steps 2`` or more);
- tp splits the blocks only (``with_whole_ends``); ZeRO-3's gathered working set lives
  inside an action, not at the action boundaries where the executor counts;
- a dropless router sends an expert-parallel rank what the data asks for, not the
  balanced share: where the run counted its experts' rows (``executor.routed_rows``),
  each rank is also predicted at its own (``routed_peaks``).

Parameters, gradients and optimizer state are the model's per-parameter bytes (the
master weights' dtype, AdamW's two moments), sharded as ZeRO says; buffers are the
model's two boundary activations per P2P peer. Not predicted: float16 autocast (not
measured), the ``mlp`` toy and a user's own model (no transformer spec).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from executor.architectures.build import is_architecture, run_spec, stage_layers
from executor.config import RunConfig, build_schedule, even_layout
from executor.copies import copy_of
from pipesim.job import DTYPE_BYTES
from pipesim.model.activations import last_stage_extra_bytes
from pipesim.model.costs import Costs
from pipesim.model.saved_tensors import SavedTensors, executor_saved_tensors
from pipesim.model.spec import ModelSpec
from pipesim.model.transformer_costs import model_stage_costs, with_embedding_copies
from pipesim.sim.memory import (
    BytesPerParam,
    RankMemory,
    memory_report,
    program_order_trace,
    reduction_buffer_bytes,
    static_bytes_per_param,
)
from schedules.action import WEIGHT_GRAD_DONE_KINDS, ActionKind
from schedules.trace import Trace

# the activations' bytes per element (bf16: autocast's), simulate's --dtype table less float16
# autocast, whose saved tensors are not described
ELEMENT_BYTES = {name: size for name, size in DTYPE_BYTES.items() if name != "float16"}
MIB = 2**20
# a factor per (stage, microbatch) on each microbatch's stash (predicted_peaks' stash_scale)
StashScale = Callable[[np.ndarray, np.ndarray], np.ndarray]


def microbatch_weights(config: RunConfig, schedule):
    """``weight(stage, microbatch)``: each microbatch's size over the largest, the share of
    the spec's stash it keeps (activations grow with the sequences of a microbatch). The
    run cuts its replica's batch with ``torch.tensor_split``, the first ``batch mod m``
    microbatches one sequence larger, and DualPipe's copy ``c`` takes the ``c``-th share of
    them (``executor.copies.data_index``)."""
    batch, count = config.replica_batch_size, config.microbatches
    sizes = np.array([batch // count + (index < batch % count) for index in range(count)], dtype=float)
    sizes /= sizes.max()
    offsets = np.array([copy_of(schedule, stage) * schedule.microbatches for stage in range(schedule.num_stages)])
    return lambda stages, microbatches: sizes[offsets[stages] + microbatches]


def scaled(weight, scale: StashScale | None):
    """``weight`` times ``scale`` per (stage, microbatch); ``weight`` alone without one."""
    if scale is None:
        return weight
    return lambda stages, microbatches: weight(stages, microbatches) * scale(stages, microbatches)


def routed_share(config: RunConfig) -> np.ndarray:
    """Per stage, the share of a microbatch's stash that its routed copies keep (their
    inputs, their activations' inputs and outputs): what a rank's routed load scales.
    The stash is linear in the routed slots, so the routed part is the stash at two
    slots a copy less the stash at one (a capacity of 2 and of 1, unpadded here)."""
    spec, saved = executor_spec(config)
    stash = np.array([stage.stash_bytes for stage in executor_costs(config, spec, saved).stages])

    def at(capacity: float) -> np.ndarray:
        moe = replace(spec, moe=replace(spec.moe, capacity_factor=capacity))
        return np.array([stage.stash_bytes for stage in executor_costs(config, moe, saved).stages])

    share = np.divide(at(2.0) - at(1.0), stash, out=np.zeros_like(stash), where=stash > 0)
    return np.tile(share, build_schedule(config).copies)  # DualPipe: each copy's stages as the model's


def routed_stash_scales(config: RunConfig, rows: list[list[list[float]]]) -> tuple[list[StashScale], float]:
    """Per rank, ``stash_scale`` for ``predicted_peaks`` at the run's own routing:
    ``1 + share x (rows / balanced - 1)`` for each (stage, microbatch), ``rows`` the
    routed copies the rank's experts ran in that forward (``executor.routed_rows``) and
    ``balanced`` their mean over the ranks that hold the stage. A dropless router sends
    every copy somewhere, so that mean is the balanced share the model prices. Also the
    largest ``rows / balanced`` of any rank and forward."""
    share = routed_share(config)
    table = np.array(rows, dtype=float)  # rank x stage x microbatch
    pp_index = np.array([pipeline_rank(config, rank) for rank in range(len(table))])
    placement = np.array(build_schedule(config).placement)
    balanced = np.zeros(table.shape[1:])
    for stage in range(min(len(placement), table.shape[1])):
        balanced[stage] = table[pp_index == placement[stage], stage].mean(axis=0)
    ratio = np.divide(table, balanced, out=np.ones_like(table), where=balanced > 0)

    def scale_of(rank: int):
        return lambda stages, microbatches: 1 + share[stages] * (ratio[rank][stages, microbatches] - 1)
    return [scale_of(rank) for rank in range(len(table))], float(ratio.max())


def pipeline_rank(config: RunConfig, rank: int) -> int:
    """The pipeline rank (the stages) of global rank ``rank``."""
    from executor.mesh import MeshPosition  # noqa: PLC0415 - loads torch (run has already)

    return MeshPosition.of_rank(rank, config.dp, config.pp, config.tp, config.cp).pp_index


def executor_spec(config: RunConfig) -> tuple[ModelSpec, SavedTensors] | None:
    """The model ``config`` runs as a ``ModelSpec`` (a microbatch of the run's size, its
    activations' dtype, no dropout) and what its layers keep beyond the kernels'
    inventory; ``None`` for what has no spec (the ``mlp`` toy) or is not predicted
    (float16 autocast)."""
    if config.dtype not in ELEMENT_BYTES or config.model == "mlp":
        return None
    # the largest microbatch, as compare's and run_costs' predictions take it: a batch m does
    # not divide is cut as torch.tensor_split cuts it, the first (batch mod m) one sample
    # larger, and each microbatch's stash is then scaled to its own size (microbatch_weights)
    sizes = {"microbatch_size": -(-config.replica_batch_size // config.microbatches),
             "dtype_bytes": ELEMENT_BYTES[config.dtype], "dropout": False}
    saved = executor_saved_tensors(config.dtype)  # float16 is refused above
    spec = replace(run_spec(config), **sizes)
    if config.folded:  # parallel folding: the routed experts whole on every rank (--etp 1)
        spec = replace(spec, expert_tp=config.expert_tp)
    if config.recompute_moe_act:  # the routed experts keep their activation's inputs (executor.recompute)
        spec = replace(spec, moe_act_recompute=True)
    if is_architecture(config.model):
        return spec, saved
    # the toy gpt's packed QKV is one projection (one cast of its input) and lays the
    # attention's output out token by token: joining the heads is a view
    return spec, replace(saved, attention_output_copy=False, input_cast_per_projection=False)


def flash_kernel(spec: ModelSpec, config: RunConfig) -> bool:
    """Whether torch's CPU attention runs its flash kernel (no ``s x s`` scores kept):
    only for heads as wide for Q and K as for V, not latent attention's (context
    parallelism's ring attention keeps no scores either way), and not with attention
    sinks or soft-capped scores, which the executor writes out."""
    if spec.scores_beyond_mask:  # written out (layers.attend): scores kept
        return False
    return spec.mla is None or spec.mla.qk_head_dim == spec.mla.v_head_dim or config.cp > 1


def stage_split(spec: ModelSpec, config: RunConfig) -> list[int]:
    """Layers per stage as the executor builds them: the toy's even split, an
    architecture's by the simulator's own split (``stage_layers``)."""
    if is_architecture(config.model):
        return stage_layers(spec, config.num_stages, config.layout, config.tp, config.sequence_parallel,
                            config.split_ranks)
    return list(config.layout or even_layout(config.layers, config.num_stages))


def executor_costs(config: RunConfig, spec: ModelSpec, saved: SavedTensors) -> Costs:
    """The model's per-stage costs (memory only) as the executor builds its stages. The
    loss's temporaries (a stage's ``workspace_bytes``) are left out: the executor's loss
    runs inside an action, where the tracked bytes never look, and on CUDA its backward's
    are ``AllocatorExtras.loss_backward_bytes``."""
    costs = model_stage_costs(spec, config.num_stages, [math.nan] * config.num_stages, tp=config.tp,
                              sequence_parallel=config.sequence_parallel, layers_per_stage=stage_split(spec, config),
                              recompute=config.recompute, flash_attention=flash_kernel(spec, config), ep=config.ep,
                              cp=config.cp, saved_tensors=saved)
    costs = replace(costs, stages=tuple(replace(stage, workspace_bytes=0.0) for stage in costs.stages))
    return with_whole_ends(costs, spec, config.tp, config.sequence_parallel, saved)


def predicted_peaks(config: RunConfig, cuda_capability: tuple[int, int] | None = None,
                    stash_scale: StashScale | None = None) -> list[dict] | None:
    """Per pipeline rank: the predicted peak bytes and, apart, the most activations held
    at once (``predicted_peak``, ``predicted_activations``); ``None`` when not predicted.

    With ``cuda_capability`` (a run on a GPU of that generation) the peak is the CUDA
    caching allocator's (``max_memory_allocated``), which also sees what lives inside an
    action and what torch keeps beside the model (``allocator_extras``); without it, the
    tensors the executor counts at action boundaries on a CPU. ``stash_scale(stage,
    microbatch)`` multiplies each microbatch's stash beyond its size's share (a rank's
    routed load against the balanced one: ``routed_stash_scales``)."""
    predict = peak_predictor(config, cuda_capability)
    return None if predict is None else predict(stash_scale)


def peak_predictor(config: RunConfig, cuda_capability: tuple[int, int] | None = None
                   ) -> Callable[[StashScale | None], list[dict]] | None:
    """``predicted_peaks`` of ``config`` as a function of the stash's scale: the model's
    costs, the schedule's order and the gradients' arrivals built once, so a run predicted
    at each rank's own routing (``routed_peaks``) walks only the memory timeline per rank."""
    described = executor_spec(config)
    if described is None:
        return None
    spec, saved = described
    element = ELEMENT_BYTES[config.master_dtype]  # weights, gradients and optimizer state: the master type
    costs = executor_costs(config, spec, saved)
    schedule = build_schedule(config)
    if schedule.copies > 1:  # DualPipe: every copy's stages as the model's (executor.copies)
        costs = replace(costs, stages=costs.stages * schedule.copies)
    # a tied model's last stage keeps its copy of the table, even beside the table itself
    # (executor.tied_embeddings: the stages are separate modules), whole on every tp rank as the
    # table is (with_whole_ends)
    costs = with_embedding_copies(costs, spec, list(schedule.placement), schedule.copies, shared_on_rank=False)
    trace = program_order_trace(schedule)
    holders = config.gradient_holders  # ZeRO shards over them (with DualPipe, both copies' holders)
    # the routed experts' over their expert data-parallel group (executor.expert_parallel; folded,
    # tp / etp times as many ranks hold each expert)
    expert_holders = max(1, holders * config.tp // (config.expert_tp * config.ep))
    weights_only = BytesPerParam(element, 0.0, 0.0)  # the static part's weights; gradients and state added below
    sizes = microbatch_weights(config, schedule)
    moments = 2 * element if config.optimizer == "adamw" else 0.0

    def per_param(bytes_per_param: BytesPerParam, cost) -> float:
        """``bytes_per_param`` less the weights, over a stage's parameters as ZeRO shards them."""
        def share(group: int) -> float:
            return (static_bytes_per_param(bytes_per_param, group, config.zero)
                    - static_bytes_per_param(weights_only, group, config.zero))
        experts = cost.expert_params if config.ep > 1 or config.folded else 0.0
        return (cost.params - experts) * share(holders) + experts * share(expert_holders)

    grads_from = gradient_arrivals(trace, costs, lambda cost: per_param(BytesPerParam(element, element, 0.0), cost))

    def predict(stash_scale: StashScale | None) -> list[dict]:
        report = memory_report(trace, costs, schedule.placement, ["cpu"] * config.pp, [math.inf] * config.pp,
                               weights_only, dp=holders, zero=config.zero, expert_dp=expert_holders, tp=config.tp,
                               cp=config.cp, ep=config.ep, microbatch_weight=scaled(sizes, stash_scale))
        return [rank_peak(rank) for rank in report]

    def rank_peak(rank) -> dict:
        mine = [cost for stage, cost in enumerate(costs.stages) if schedule.placement[stage] == rank.rank]
        params = sum(cost.params for cost in mine)
        state = sum(per_param(BytesPerParam(element, 0.0, moments), cost) for cost in mine)
        # ZeRO-3's gathered working set lives inside an action (FSDP gathers a block's
        # weights before its forward or backward and frees them after): not held at the
        # action boundaries where the executor counts, but allocated inside the action
        inside = reduction_buffer_bytes(costs, schedule.placement, rank.rank, weights_only, 0.0, config.zero) \
            if holders > 1 and config.zero == 3 else 0.0
        arrivals = grads_from.get(rank.rank, [])
        peak = max(held + grads_at(arrivals, moment) for moment, held in rank.timeline)
        end = rank.timeline[-1][1] + sum(amount for _, amount in arrivals)
        if cuda_capability is None:
            predicted = state + max(peak, end) - inside
        else:
            # the timeline holds ZeRO-3's gathered working set: inside actions, not between them
            extras = allocator_extras(config, spec, cuda_capability, params * element / (holders if config.zero else 1))
            inside_actions = max(action_peaks(trace, costs, rank, arrivals, extras.loss_backward_bytes,
                                              schedule.last_stages), default=0.0)
            predicted = state + extras.workspace_bytes + max(peak - inside, end - inside + extras.optimizer_bytes,
                                                             inside_actions)
        return {"rank": rank.rank, "predicted_peak": predicted, "predicted_activations": rank.peak_stash_bytes}

    return predict


# torch's cuBLAS workspace per (handle, stream), taken from the caching allocator
# (ATen/cuda/CublasHandlePool.cpp, the default CUBLAS_WORKSPACE_CONFIG): ":4096:8", 32 MiB,
# on Hopper (compute capability 9) and newer; ":4096:2:16:8", 8.125 MiB, before
CUBLAS_WORKSPACE_BYTES = {9: 32 * MIB, 0: (2 * 4096 + 8 * 16) * 1024}
# handles, one per thread using cuBLAS: the forward and the optimizer on the main thread,
# the backward on autograd's device thread (measured on an H200: 63-70 MiB allocated at
# action boundaries beyond the tensors the executor counts, benchmarks/gpu_memory.py)
CUBLAS_THREADS = 2


@dataclass(frozen=True)
class AllocatorExtras:
    """What a CUDA run allocates beyond the tensors counted at action boundaries."""

    workspace_bytes: float  # cuBLAS workspaces, held from the first GEMM on
    loss_backward_bytes: float  # inside the loss's backward: the logits' softmax and their gradient
    optimizer_bytes: float  # inside the optimizer's step: a foreach temporary the size of its parameters


def allocator_extras(config: RunConfig, spec: ModelSpec, cuda_capability: tuple[int, int],
                     stepped_bytes: float) -> AllocatorExtras:
    """``AllocatorExtras`` of ``config`` on a GPU of ``cuda_capability``, whose optimizer
    steps ``stepped_bytes`` of parameters (this rank's, or its ZeRO shard)."""
    workspace = CUBLAS_WORKSPACE_BYTES[9 if cuda_capability[0] >= 9 else 0] * CUBLAS_THREADS
    # the loss is taken in the master type (executor.precision): cross-entropy's backward
    # makes the softmax of a microbatch's logits and their gradient, each tokens x vocab
    tokens = spec.microbatch_size * spec.seq_len // config.cp
    loss = 2 * tokens * spec.vocab * ELEMENT_BYTES[config.master_dtype]
    # torch's foreach AdamW takes the square root of the second moments out of place
    # (one tensor per parameter at once), foreach SGD with weight decay adds the decay to
    # the gradients out of place; tp runs step parameter by parameter (no foreach)
    out_of_place = config.optimizer == "adamw" or config.decay > 0
    optimizer = stepped_bytes if out_of_place and config.tp == 1 else 0.0
    return AllocatorExtras(workspace, loss, optimizer)


def action_peaks(trace: Trace, costs: Costs, rank: RankMemory, arrivals: list[tuple[float, float]],
                 loss_backward_bytes: float, loss_stages: frozenset[int] | None = None) -> Iterator[float]:
    """Per compute action of ``rank`` (``program_order_trace``: action ``i`` from ``2i``
    to ``2i + 1``), the most it holds inside the action, parameters and optimizer state
    aside: the stash held when it starts (a forward's own included), the gradients made
    before it and, when it is the stage's first weight-gradient action, that stage's
    gradients too (autograd allocates them before the microbatch's stash is freed at the
    action's end), plus the loss's backward on the stages that take the loss
    (``loss_stages``: ``Schedule.last_stages``, each copy's; default the last stage)."""
    columns = trace.columns
    last = frozenset({len(costs.stages) - 1}) if loss_stages is None else loss_stages
    moments = [moment for moment, _ in rank.timeline]
    input_gradient = {columns.kinds.index(kind) for kind in (ActionKind.B, ActionKind.I)}
    made_at: dict[float, float] = {}  # a first weight-gradient action's end -> the gradients it makes
    for arrived, amount in arrivals:
        made_at[arrived] = made_at.get(arrived, 0.0) + amount
    for index in np.flatnonzero(columns.rank == rank.rank):
        start, end = float(columns.start[index]), float(columns.end[index])
        held = rank.timeline[max(bisect.bisect_right(moments, start) - 1, 0)][1]
        loss = loss_backward_bytes if int(columns.stage[index]) in last and \
            int(columns.kind[index]) in input_gradient else 0.0
        yield held + grads_at(arrivals, start) + made_at.get(end, 0.0) + loss


def with_whole_ends(costs: Costs, spec: ModelSpec, tp: int, sequence_parallel: bool, saved: SavedTensors) -> Costs:
    """``costs`` with the executor's tensor parallelism: it splits the blocks only
    (``executor.tensor_parallel``), so the embedding, the final norm, the output layer
    and the loss are whole on every tp rank (parameters and stash as at tp 1). The
    activation passed between stages is the model's: whole without sequence parallelism,
    this rank's sequence shard with it (as Megatron-Core sends it)."""
    if tp == 1:
        return costs
    stages = list(costs.stages)
    embedding = spec.embedding_params() - spec.embedding_params(tp)
    stages[0] = replace(stages[0], params=stages[0].params + embedding,
                        param_bytes=stages[0].param_bytes + embedding * spec.dtype_bytes)
    head = spec.head_params() - spec.head_params(tp)
    stash = last_stage_extra_bytes(spec, saved=saved) - last_stage_extra_bytes(spec, tp, sequence_parallel, saved)
    stages[-1] = replace(stages[-1], params=stages[-1].params + head,
                         param_bytes=stages[-1].param_bytes + head * spec.dtype_bytes,
                         stash_bytes=stages[-1].stash_bytes + stash)
    return replace(costs, stages=tuple(stages))


def gradient_arrivals(trace, costs, grad_bytes) -> dict[int, list[tuple[float, float]]]:
    """Per rank, ``(moment, bytes)``: each of its stages' gradients (``grad_bytes(cost)``
    of them), made by the stage's first weight-gradient action of the step (the executor
    frees them between steps)."""
    columns = trace.columns
    first: dict[int, tuple[int, float]] = {}
    for index in range(len(columns)):
        kind = columns.kinds[int(columns.kind[index])]
        stage = int(columns.stage[index])
        if kind in WEIGHT_GRAD_DONE_KINDS and stage not in first:
            first[stage] = (int(columns.rank[index]), float(columns.end[index]))
    arrivals: dict[int, list[tuple[float, float]]] = {}
    for stage, (rank, moment) in first.items():
        arrivals.setdefault(rank, []).append((moment, grad_bytes(costs.stages[stage])))
    return arrivals


def grads_at(arrivals: list[tuple[float, float]], moment: float) -> float:
    """Gradient bytes a rank holds at ``moment``."""
    return sum(amount for arrived, amount in arrivals if arrived <= moment)


def not_predicted(config: RunConfig) -> str:
    """Why ``predicted_peaks`` has nothing for ``config`` (what ``executor_spec`` leaves out)."""
    if config.dtype not in ELEMENT_BYTES:
        return "float16 autocast is not described"
    return f"--model {config.model} has no transformer spec"


def routed_peaks(config: RunConfig, rows: list[dict], predict: Callable[[StashScale | None], list[dict]]
                 ) -> tuple[list[dict], float] | None:
    """Per rank, ``predicted_peak`` and ``predicted_activations`` at the run's own routing
    (``routed_stash_scales``), and the most rows a rank's experts ran in one forward over
    the balanced share; ``None`` unless the run counted routed rows (expert parallelism on
    a CPU) of a dropless mixture of experts (a capacity pads every expert to its share);
    ``predict`` is the run's ``peak_predictor``."""
    if "routed_rows" not in rows[0] or config.capacity_factor is not None:
        return None
    scales, most = routed_stash_scales(config, [row["routed_rows"] for row in rows])
    predictions = [predict(scale)[pipeline_rank(config, row["rank"])] for row, scale in zip(rows, scales, strict=True)]
    return [{key: value for key, value in peak.items() if key != "rank"} for peak in predictions], most


def peak_lines(document: dict, config: RunConfig) -> list[str]:
    """Add ``predicted_peak`` and ``predicted_activations`` to each tracked memory row and
    return the lines to print: predicted against measured peak and activations, per rank."""
    rows = document.get("memory") or []
    if not rows or rows[0]["source"] not in ("tracked", "cuda"):
        return []
    on_gpu = rows[0]["source"] == "cuda"
    predict = peak_predictor(config, tuple(rows[0]["cuda_capability"]) if on_gpu else None)
    if predict is None:
        return [f"peak memory not predicted: {not_predicted(config)}"]
    peaks = predict(None)
    model = "the simulator's memory model of the executor's layers"
    lines = [f"peak memory, measured (torch.cuda.max_memory_allocated) vs predicted ({model}, with the allocator's "
             "cuBLAS workspaces, loss and optimizer temporaries):" if on_gpu
             else f"peak memory, measured vs predicted ({model}):"]
    routed = routed_peaks(config, rows, predict) if not on_gpu else None
    if routed is not None:
        lines.append(f"  (dropless routing: each rank predicted at the copies its experts ran in each forward, up to "
                     f"{routed[1]:.2f}x the balanced share; the balanced prediction, what simulate and plan price, "
                     "in brackets)")
    for index, row in enumerate(rows):
        row.update({key: value for key, value in peaks[pipeline_rank(config, row["rank"])].items() if key != "rank"})
        balanced = ""
        if routed is not None:
            row["predicted_peak_balanced"] = row["predicted_peak"]
            row["predicted_activations_balanced"] = row["predicted_activations"]
            row.update(routed[0][index])
            even = row["predicted_peak_balanced"]
            balanced = f" [{even / MIB:.3f} MiB, {row['peak'] / even - 1:+.1%}]"
        error = row["peak"] / row["predicted_peak"] - 1  # measured over predicted, as the chart's (viz.measured_memory)
        activations = "" if on_gpu else (f"; activations measured {row['activations_peak'] / MIB:.3f} MiB, predicted "
                                         f"{row['predicted_activations'] / MIB:.3f} MiB")
        lines.append(f"  rank {row['rank']}: peak measured {row['peak'] / MIB:.3f} MiB, predicted "
                     f"{row['predicted_peak'] / MIB:.3f} MiB ({error:+.1%}){balanced}{activations}")
    if config.steps < 2:
        lines.append("  (predicted for a step after the first: the first holds no optimizer state yet)")
    return lines
