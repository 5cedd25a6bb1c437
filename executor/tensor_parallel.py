"""Tensor parallelism: Megatron column/row splits of the gpt blocks and of the dense
blocks of an architecture (``executor.architectures.transformer``), and timing of the collectives
they issue.

Each block's attention and MLP become a column-parallel GEMM followed by a row-parallel
one (``torch.distributed.tensor.parallel``): ``qkv`` and ``fc1`` are split by output
features (ColwiseParallel), ``proj`` and ``fc2`` by input features (RowwiseParallel),
so each pair needs one all-reduce in the forward (after the row-parallel GEMM) and one
in the backward (the input gradient of the column-parallel GEMM). The ``qkv`` output is
laid out head by head (``executor.models.Block``), so a contiguous column split hands
each tp rank whole heads. Norms, embeddings and the head stay replicated; without
sequence parallelism the activations between stages are full (replicated) plain
tensors: every tp rank sends its copy to the same tp rank of the next stage, so
pipeline shapes do not change with tp.

With ``sequence_parallel`` the norms run on sequence shards (SequenceParallel) and the
all-reduces become an all-gather before each column-parallel GEMM and a reduce-scatter
after each row-parallel one: Megatron-Core's four collectives a block and pass, and in
the backward two more, each sublayer's input gathered again from the sequence shard the
forward kept in place of the gathered copy (``executor.rebuilt_activations``). The
residual stream stays sequence-sharded between blocks and between stages
(``shard_residual_stream``): each tp rank holds, and sends to the same tp rank of the
next stage, its ``batch x seq/tp x hidden`` shard (``RunConfig.boundary_sequence_split``
gives the pipeline's buffers that shape); the sequence is cut once after the embedding
and gathered once before the head.

The collectives run inside DTensor redistributions; ``TpTimer`` times them by wrapping
the functional collectives DTensor calls (``all_reduce``, ``all_gather_single``,
``reduce_scatter_single``) and their ``wait_tensor`` for the duration of a step, so each
collective is timed from its issue to the wait DTensor does anyway: it is never made to
wait earlier than it would.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from executor.architectures.latent_attention import LatentAttention
from executor.models import Block
from executor.shard_routing import TIMED_COLLECTIVES, RowsOverTp, SequenceShardRouting, sum_grad_over_tp


def block_plan(sequence_parallel: bool) -> dict:
    """The Megatron plan of one ``Block`` (module name -> parallel style)."""
    if not sequence_parallel:
        return {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    return {
        "norm1": SequenceParallel(), "qkv": ColwiseParallel(input_layouts=Shard(1)),
        "proj": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def transformer_block_plan(block: nn.Module, sequence_parallel: bool, route_shards: bool = False) -> dict:
    """The Megatron plan of a ``TransformerBlock`` (torchtitan's for Llama): the query,
    key and value projections and each MLP's gate and up projections split by columns
    (whole query heads and whole key/value heads per rank, since both counts are
    multiples of tp), the output and down projections by rows. A mixture of experts
    splits every expert (and the shared one) so (``split_experts``), its router
    replicated: every tp rank routes the same tokens, its experts return this rank's
    partial sums, and the layer's output is reduced once (an all-reduce; with sequence
    parallelism a reduce-scatter to the sequence shards), as Megatron-Core reduces its
    experts' output. Each sublayer hands all of its column-parallel projections one input
    (``PrepareModuleInput``: with sequence parallelism, where the norms run on sequence
    shards, the gathered sequence), so their input gradients are summed before one
    collective: an all-reduce (a reduce-scatter with sequence parallelism) a sublayer in
    the backward, Megatron's copy to the tensor-parallel region, where each projection
    wrapping its input apart would reduce each gradient on its own (Q, K and V: three).

    With ``route_shards`` (sequence parallelism, and parallel folding or expert
    parallelism: ``RunConfig.routes_shards``) the mixture of experts takes the norm's
    sequence shard as it is and routes it (``executor.shard_routing``): only its shared
    expert, split over tp as a dense MLP, gathers the sequence and reduce-scatters its
    output, Megatron-Core's ``SharedExpertMLP`` on the tp group."""
    plan = attention_plan(block.attention)
    experts = getattr(block.feed_forward, "experts", None)
    # Latent attention's replicated down-projections take plain tensors: its input is local.
    local = isinstance(block.attention, LatentAttention)
    if experts is None:
        plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                     "feed_forward.w2": RowwiseParallel()})
    if not sequence_parallel:
        whole = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                   use_local_output=False)
        if not local:
            plan["attention"] = whole
        plan["feed_forward"] = whole if experts is None else PrepareModuleOutput(  # the experts' partial sums
            output_layouts=(Partial(),), desired_output_layouts=(Replicate(),), use_local_output=True)
        return plan
    gather = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    plan.update({"attention_norm": SequenceParallel(),
                 "attention": PrepareModuleInput(**gather, use_local_output=local),
                 "attention.wo": RowwiseParallel(output_layouts=Shard(1))})
    if block.ffn_norm is not None:  # Falcon-7B's one norm a layer feeds both
        plan["ffn_norm"] = SequenceParallel()
    if block.post_attention_norm is not None:  # Gemma 2/3: on the sublayers' reduce-scattered outputs,
        # handing the residual add a plain shard as the row-parallel layers do
        plan.update({"post_attention_norm": SequenceParallel(use_local_output=True),
                     "post_ffn_norm": SequenceParallel(use_local_output=True)})
    if experts is None:
        plan.update({"feed_forward": PrepareModuleInput(**gather),
                     "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    elif route_shards:
        if block.feed_forward.shared is not None:  # split as a dense MLP is
            plan.update({"feed_forward.shared": PrepareModuleInput(**gather),
                         "feed_forward.shared.w1": ColwiseParallel(), "feed_forward.shared.w3": ColwiseParallel(),
                         "feed_forward.shared.w2": RowwiseParallel(output_layouts=Shard(1))})
    else:  # the experts' partial sums, reduce-scattered to this rank's sequence shard
        plan["feed_forward"] = PrepareModuleInputOutput(**gather, use_local_input=True, output_layouts=(Partial(),),
                                                        desired_output_layouts=(Shard(1),))
    return plan


def route_own_shards(moe: nn.Module, tp_mesh: DeviceMesh, folded: bool) -> None:
    """Each tp rank routes its own sequence shard (``executor.shard_routing``). Folded
    (Megatron-Core's ``--expert-tensor-parallel-size 1``) the routed experts stay whole,
    over ep groups cut from every rank of the stage (``executor.expert_parallel``), with
    no tp collective; otherwise they are split over tp (``shard_expert_weights``, the
    shared expert left to the block's plan) and the rows each rank received are gathered over
    tp around them (``RowsOverTp``). The router's weights and the shared expert's gate,
    whole on every rank and fed its shard, sum their gradients over tp; the shared expert
    is split over tp as a dense MLP is (``transformer_block_plan``)."""
    shard = SequenceShardRouting(tp_mesh)
    moe.sequence_shard = moe.router.sequence_shard = shard
    sum_grad_over_tp(moe.router.gate, shard.group)
    if moe.shared_gate is not None:
        sum_grad_over_tp(moe.shared_gate, shard.group)
    if not folded:
        experts = moe.experts.values() if isinstance(moe.experts, nn.ModuleDict) else moe.experts
        shard_expert_weights(experts, tp_mesh)
        moe.expert_tp = RowsOverTp(tp_mesh)


def split_experts(moe: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split a mixture of experts' routed and shared experts over tp as Megatron-Core
    does (``shard_expert_weights``; unbiased experts: gpt-oss's biased ones stay on one
    tp rank, as its attention sinks do), every tp rank routing the same (gathered)
    tokens: the layer's output is reduced once
    (``transformer_block_plan``), and the gradients that only the whole output gives
    (the experts' inputs', the routing weights', the shared expert's gate's) are summed
    over tp where the layer hands them back (``ReduceGradFrom``: one all-reduce each in
    the backward, where a per-expert split would reduce each expert's input gradient)."""
    experts = moe.experts.values() if isinstance(moe.experts, nn.ModuleDict) else moe.experts
    shard_expert_weights([*experts, *([moe.shared] if moe.shared is not None else [])], tp_mesh)
    moe.tp_sum_grad = lambda tensor: ReduceGradFrom.apply(tensor, 0, tp_mesh)


def shard_expert_weights(experts: Iterable[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Each of ``experts`` split over tp as Megatron-Core splits an expert: ``w1`` and
    ``w3`` by output features, ``w2`` by input features, computing on this rank's shards
    with no collective of its own (``LocalShardLinear``)."""
    for expert in experts:
        if expert.w2.bias is not None:  # gpt-oss's: its attention sinks keep it off tp (check_tensor_parallel)
            raise ValueError("biased experts are not split over tp (gpt-oss runs at --tp 1)")
        distribute_module(expert, tp_mesh, _expert_shards)
        for linear in (expert.w1, expert.w2, expert.w3):
            linear.__class__ = LocalShardLinear  # as FSDP2 swaps a module's class: the module and its hooks stay


class LocalShardLinear(nn.Linear):
    """A linear whose weight is this rank's tp shard (a DTensor), multiplied as the local
    tensor it is, with no collective: an expert's ``w1`` and ``w3`` give this rank's output
    features, its ``w2`` this rank's partial sum of the output (``split_experts``). A
    module still, so that what records module calls (the split backward's weight
    gradients, FSDP2's gathers) sees it as any linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to_local())


def _expert_shards(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """``distribute_module``'s partition: an expert's linears' shards (see ``split_experts``)."""
    if name in ("w1", "w2", "w3"):
        placement = Shard(1) if name == "w2" else Shard(0)
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight.data, mesh, [placement])))


def attention_plan(attention: nn.Module) -> dict:
    """Grouped-query attention: Q, K and V (or the fused ``wqkv``) by columns, the output by rows. Latent
    attention (Megatron-LM's split): the up-projections to the heads (the query's, the
    keys' and values') by columns, the output by rows, the down-projections to the
    latents held whole on every rank (``reduce_rope_key_grad`` completes the gradient
    of the one they do not all pass through a column split)."""
    if isinstance(attention, LatentAttention):
        query = "attention.wq_b" if attention.sizes.q_lora_rank else "attention.wq"
        return {query: ColwiseParallel(), "attention.wkv_b": ColwiseParallel(), "attention.wo": RowwiseParallel()}
    if attention.wqkv is not None:  # laid out group by group: a contiguous split keeps whole key/value groups
        return {"attention.wqkv": ColwiseParallel(), "attention.wo": RowwiseParallel()}
    return {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel()}


class ReduceGradFrom(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient's features from ``start`` on
    over ``group`` (Megatron's copy to the tensor-parallel region, on a slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: object) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        head, tail = grad[..., :ctx.start], grad[..., ctx.start:].contiguous()
        return torch.cat((head, funcol.all_reduce(tail, "sum", ctx.group).wait()), dim=-1), None, None


def reduce_rope_key_grad(attention: LatentAttention, tp_mesh: DeviceMesh) -> None:
    """The shared rotary key comes out of the replicated ``wkv_a`` beside the latent and
    meets only this rank's heads, so its gradient here is this rank's share: sum it over
    tp (the latent's gradient is whole already, through ``wkv_b``'s column split)."""
    start = attention.sizes.kv_lora_rank

    def hook(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        return ReduceGradFrom.apply(output, start, tp_mesh)

    attention.wkv_a.register_forward_hook(hook)


def sum_weight_grad_over_tp(attention: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Query and key norms one head wide (Qwen3, Gemma 3) normalise only this rank's heads
    with a weight every head shares: each rank's weight gradient is its heads' share, so
    the weight enters the product through ``ReduceGradFrom`` (identity forward, the
    gradient summed over tp in the backward), as Megatron's copy to the tensor-parallel
    region; every rank then holds the whole gradient, as for any weight tp leaves whole."""
    for norm in (attention.q_norm, attention.k_norm):
        norm.weight_in_use = lambda weight: ReduceGradFrom.apply(weight, 0, tp_mesh)


def plan_of(module: nn.Module, sequence_parallel: bool, route_shards: bool = False) -> dict | None:
    """The tp plan of a block the executor splits, ``None`` for any other module."""
    from executor.architectures.transformer import TransformerBlock  # noqa: PLC0415 - it imports models, as this module does

    if isinstance(module, Block):
        return block_plan(sequence_parallel)
    if isinstance(module, TransformerBlock):
        return transformer_block_plan(module, sequence_parallel, route_shards)
    return None


def parallelize_stage(stage: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                      fold_experts: bool = False, shard_routing: bool = False) -> nn.Module:
    """Split every block of ``stage`` (a gpt ``Block``, a ``TransformerBlock``, its
    experts by ``split_experts``) across ``tp_mesh`` in place; with ``sequence_parallel`` keep its residual stream
    sequence-sharded (``shard_residual_stream``); with ``shard_routing``
    (``RunConfig.routes_shards``) each rank routes its own sequence shard, the routed
    experts whole with ``fold_experts`` (parallel folding, ``--etp 1``), else split over
    tp (``route_own_shards``); return the stage."""
    for module in list(stage.modules()):
        plan = plan_of(module, sequence_parallel, shard_routing)
        if plan is not None:
            parallelize_module(module, tp_mesh, plan)
            moe = getattr(module, "feed_forward", None)
            if getattr(moe, "experts", None) is not None:
                if shard_routing:
                    route_own_shards(moe, tp_mesh, fold_experts)
                else:
                    split_experts(moe, tp_mesh)
            attention = getattr(module, "attention", None)
            if isinstance(attention, LatentAttention):
                reduce_rope_key_grad(attention, tp_mesh)
            elif getattr(attention, "qk_norm", None) == "head":
                sum_weight_grad_over_tp(attention, tp_mesh)
    if sequence_parallel:
        shard_residual_stream(stage, tp_mesh)
        shard_prediction_blocks(stage, tp_mesh)
    return stage


def shard_prediction_blocks(stage: nn.Module, tp_mesh: DeviceMesh) -> None:
    """DeepSeek-V3's multi-token prediction blocks (``executor.architectures.mtp``) run
    after the head has gathered the sequence: each block takes this rank's sequence
    shard of its whole input (a slice; its backward all-gathers the gradient) and hands
    on the whole sequence again (an all-gather; its backward keeps this rank's slice),
    as the model's blocks take and return shards inside the sequence-parallel region."""
    from executor.architectures.mtp import prediction_blocks  # noqa: PLC0415 - it imports the architectures

    for block in prediction_blocks(stage):
        parallelize_module(block, tp_mesh, PrepareModuleInputOutput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))


def shard_residual_stream(stage: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-Core's sequence-parallel region: the blocks take and return this tp
    rank's sequence shard (``batch x seq/tp x hidden``), so nothing between two blocks,
    or between two stages, is held or sent whole. The first stage's embedding output is
    cut to the shard (a local slice; its backward all-gathers the gradient, as
    Megatron's ``scatter_to_sequence_parallel_region``, so the replicated embedding's
    gradient is whole on every rank); the last stage gathers the sequence once before
    its head (final norm and output layer, replicated: its backward keeps this rank's
    slice of the gradient, no collective)."""
    embed, head = getattr(stage, "embed", None), getattr(stage, "head", None)
    if embed is not None:
        parallelize_module(embed, tp_mesh, PrepareModuleOutput(
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True))
    if head is not None:
        parallelize_module(head, tp_mesh, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))


def storage_key(tensor) -> int:
    """The address of a tensor's storage: the same for the result of a collective and
    every view of it."""
    return tensor.untyped_storage().data_ptr()


class TpTimer:
    """Records ``(action, start, end)`` of every tp collective issued while ``timing()``
    is active, in the marks of the runtime's clock (``executor.clock``).

    It never makes a collective wait: the start is marked when DTensor issues the
    collective, the end when DTensor itself first waits for the result (the
    ``wait_tensor`` that ``AsyncCollectiveTensor`` calls at first use), right after
    that wait. On a GPU both marks are CUDA events on the compute stream: the
    collective's stream starts after the first (NCCL orders it after the work queued
    before it) and the second completes only once the compute stream has waited for the
    collective, so the interval is the collective unless the compute stream had other
    work before its use. On a CPU they are host times around gloo's wait. While the
    rank waits, its progress line says so (``executor.progress``)."""

    def __init__(self, current_action: Callable[[], object], mark: Callable[[], object] = time.perf_counter,
                 progress: object | None = None) -> None:
        self.current_action = current_action
        self.mark = mark
        self.progress = progress
        self.intervals: list[tuple[object, object, object]] = []
        self.in_flight: dict[int, tuple[object, object, object]] = {}  # storage -> (action, start, result)

    def wrap(self, original: Callable) -> Callable:
        def issued(*args, **kwargs):
            action, start = self.current_action(), self.mark()
            result = original(*args, **kwargs)
            if isinstance(result, funcol.AsyncCollectiveTensor):
                self.in_flight[storage_key(result.elem)] = (action, start, result.elem)
            else:  # already waited for (e.g. while tracing)
                self.intervals.append((action, start, self.mark()))
            return result

        return issued

    def wrap_wait(self, original: Callable) -> Callable:
        def waited(tensor):
            # A view of the result (DTensor reshapes it before use) shares its storage.
            issued = self.in_flight.pop(storage_key(tensor), None)
            if issued is None:
                return original(tensor)
            if self.progress is not None:
                self.progress.waiting(f"action {issued[0]} (in a tp collective)")
            result = original(tensor)
            self.intervals.append((issued[0], issued[1], self.mark()))
            if self.progress is not None:
                self.progress.running()
            return result

        return waited

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Wrap the functional collectives and their wait for the duration of the block."""
        originals = {name: getattr(funcol, name) for name in (*TIMED_COLLECTIVES, "wait_tensor")}
        for name, function in originals.items():
            setattr(funcol, name, self.wrap_wait(function) if name == "wait_tensor" else self.wrap(function))
        try:
            yield
        finally:
            for name, function in originals.items():
                setattr(funcol, name, function)

    def take(self) -> list[tuple[object, object, object]]:
        """The intervals recorded since the last call (collectives never waited for
        through ``wait_tensor`` are left out: their end is unknown)."""
        intervals, self.intervals = self.intervals, []
        self.in_flight.clear()
        return intervals
