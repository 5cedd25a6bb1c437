"""What an implementation keeps for the backward beyond the paper's inventory.

``pipesim.model.activations`` counts a layer's stash as Korthikanti et al. do, for fused
kernels (Megatron-Core, Transformer Engine): a norm keeps its input, attention its Q, K,
V and output, the MLP its activation's inputs and output. Plain torch, run op by op
with autograd (``pipesim run``'s executor), keeps what each op's backward formula
asks for, and that is more: measured with a ``saved_tensors_hooks`` pack hook on the
executor's blocks (float32 and float64, CPU, torch 2.13), per token of one tp rank:

- **Norms**: ``nn.LayerNorm`` keeps its mean and 1/std (2 elements); the executor's
  RMSNorm, written from torch ops (``x * rsqrt(mean(x^2) + eps) * weight``), keeps its
  1/rms (1) and the normalised input it multiplies by its weight (``h``).
- **Attention**: torch's CPU kernel is a flash attention (no ``s x s`` scores kept) that
  keeps the softmax's log-sum-exp, one per head, in fp32 at least. Grouped-query keys and
  values are repeated to every query head before the kernel, so K and V are kept at the
  query heads' width. Where the kernel's output is laid out head by head (the
  architectures' separate Q, K, V projections) joining the heads copies it, and the
  output projection keeps the copy beside the kernel's output, where a rotary turn wrote
  Q head by head; unturned (GPT-2's learned positions, the toy ``gpt``'s packed QKV) the
  kernel's output is laid out token by token and joining the heads is a view. Rotary
  positions keep their cos and sin tables, ``s x d/2`` each, per layer and microbatch,
  in the rotated Q's type (float32 under autocast after a weighted query norm, whose
  float32 weight promotes Q); Llama 4's layers without rotary positions keep their
  per-position query scales instead (``s``, in Q's type), and their kernel's output
  joins its heads as a view. Latent attention's heads are wider for Q and K than
  for V, which the CPU flash kernel does not take: torch's math path keeps the softmax's
  ``s x s`` output (``--no-flash-attention``'s term), Q and K, and V: for a microbatch
  of one sequence as a view of the joint K-nope/V up-projection (its K-nope part kept
  too), of more as the copy its reshape makes; the latents' RMSNorms keep their
  normalised inputs and 1/rms, and so do query and key norms (Qwen3's one head wide, one
  1/rms per head; OLMoE's over the projection). Attention with sinks (gpt-oss) is
  written out, as are Gemma 2's soft-capped scores: it keeps the softmax's ``s x s``
  output as ``--no-flash-attention`` does (with sinks, one column more: the sink's) and
  the boolean ``s x s`` mask its masked fill reads, per layer and microbatch.
- **Gemma's norms**: each offset RMSNorm keeps the ``1 + weight`` it multiplies by (the
  weight's size and type, per layer and microbatch); the two post norms read the
  sublayers' outputs, so under autocast they and what they keep are 16-bit.
- **Gated MLP** (SwiGLU, GeGLU): the product's backward needs ``silu(gate)`` too: ``4f``,
  not the fused kernel's ``3f``; gpt-oss's clamped SwiGLU, written from torch ops, ``7f``
  (the gate and up before their clamps, the clamped gate, its sigmoid, ``up + 1``, their
  product and the down projection's input).
- **Mixture of experts** (dropless; under expert parallelism the dispatch's own, in
  ``expert_parallel_extra``): per routed copy,
  besides the input and expert output the inventory counts, the weighted output the
  combine adds (``h``), its weight (1) and the copy's token and slot indices (two int64:
  ``torch.nonzero``'s output); per token the router's ``k`` chosen experts (int64) and,
  where the weights are rescaled to sum to one, the ``k`` gathered weights and their sum;
  the scores in fp32 at least; with a load-balancing loss, each sequence's expert shares,
  the loss, and a sigmoid router's per-token score sums (``balance_loss_bytes``).
- **Loss**: the log-softmax's output (the logits' size, fp32 at least) and the int64
  targets; the first stage's embedding keeps the int64 token ids.
- **Selective recompute** checkpoints each attention core (torch's kernel and the
  executor's written-out one alike): the checkpoint keeps the core's inputs as handed to
  it, so under autocast Q and K stay float32 where a weighted query norm or latent
  attention's rotary tables made them so (unrecomputed, the kernel keeps its own 16-bit
  casts), and latent attention's V is the view of its joint K-nope/V up-projection.
- **Split backward** (``I`` then ``W``): ``I`` runs autograd with ``retain_graph``, so the
  whole stash is held until ``W``, not only the weight GEMMs' inputs.
- **Sequence parallelism** (torch's ``SequenceParallel`` with DTensor): each sublayer's
  column-parallel linears keep the all-gathered input they multiplied, whole. The executor
  drops that copy after the forward and gathers the kept shard again before the
  sublayer's backward (``executor.rebuilt_activations.read_gathered_shard``), as
  Megatron-Core does, so between ``F`` and ``B`` a layer keeps the inventory's shard; a
  split backward's ``I`` refills the two copies (one a sublayer) and ``W`` reads them,
  so they are held whole from ``I`` until ``W``. Under autocast the shard is cast to
  16 bits before the gather, so the sublayer's linears share that one gathered cast
  (no cast of their own) and it is dropped the same way, a mixture of experts' too (its
  router, its experts' slices and its shared expert read the 16-bit tokens; its combine
  sums in float32).
- **Autocast** (``--dtype bfloat16``, float32 master weights): the residual stream, the
  norms and what they keep stay in float32 (``residual_bytes``); each linear keeps its
  own 16-bit cast of its input (the architectures' separate Q, K and V projections three
  copies, a fused ``wqkv`` one, a gated MLP's gate and up projections two; Falcon-7B's
  one norm output a cast for each sublayer) and the 16-bit copy of its weight it
  multiplied, once per microbatch in flight.

``KERNELS`` (every field off) is the paper's count and the default everywhere;
``EAGER_TORCH`` is the executor's, ``AUTOCAST_TORCH`` the executor's under bf16
autocast. Each field only adds to the inventory, so the default results are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pipesim.model.per_op_checkpoint import PER_OP
from pipesim.model.spec import CLAMPED_SWIGLU, NORM_MLA_UP, ModelSpec
from pipesim.model.weights import kv_heads_per_shard, layer_weights, shard, stack_on_rank

INDEX_BYTES = 8  # torch's int64 indices
FP32_BYTES = 4


@dataclass(frozen=True)
class SavedTensors:
    """What an implementation keeps beyond the fused kernels' inventory (every field
    adds bytes; all off is ``pipesim.model.activations``' count)."""

    layer_norm_statistics: int = 0  # elements per token a LayerNorm keeps beside its input (mean, 1/std)
    rms_norm_statistics: int = 0  # elements per token an RMSNorm keeps beside its input (1/rms)
    rms_norm_normalised: bool = False  # an RMSNorm keeps its normalised input (h), to multiply by its weight
    softmax_statistics: bool = False  # flash attention's log-sum-exp, one per head and token, fp32 at least
    kv_repeated: bool = False  # grouped-query K and V kept at the query heads' width
    attention_output_copy: bool = False  # the heads' output joined into a copy the output projection keeps
    rotary_tables: bool = False  # cos and sin, s x d/2 each, per layer and microbatch
    gated_activation_output: bool = False  # a gated MLP keeps silu(gate) too (4f, not 3f)
    routed_combine: bool = False  # per routed copy its weighted output, weight and indices; the router's picks
    wide_scores: bool = False  # router scores and logits in the activation dtype when wider than fp32
    token_indices: bool = False  # the int64 token ids (first stage) and targets (last stage)
    whole_stash_until_weight_grad: bool = False  # a split backward's I keeps the whole graph until W
    # ... and adds the gradients it found for every parameter-owning module's output, which W needs
    output_grads_until_weight_grad: bool = False
    gathered_gemm_inputs: bool = False  # under sequence parallelism, column-parallel linears keep the gathered input
    # ... or only from a split backward's I until its W: dropped after F, gathered again before the backward
    regathered_gemm_inputs: bool = False
    residual_bytes: int = 0  # bytes of an element of the residual stream and norms, where not the dtype's (autocast)
    input_cast_per_projection: bool = False  # Q, K, V (gate, up) projections each keep their own cast of the input
    weight_copies: bool = False  # each linear keeps its weight cast to the activation dtype, per microbatch
    latent_kv_whole: bool = False  # latent attention's V kept as a slice of the joint K-nope/V up-projection
    written_out_mask: bool = False  # attention written out (sinks, soft-capped scores) keeps its s x s boolean mask
    offset_norm_scales: bool = False  # Gemma's offset RMSNorms keep the 1 + weight they multiply by, per microbatch


KERNELS = SavedTensors()
EAGER_TORCH = SavedTensors(layer_norm_statistics=2, rms_norm_statistics=1, rms_norm_normalised=True,
                           softmax_statistics=True, kv_repeated=True, attention_output_copy=True, rotary_tables=True,
                           gated_activation_output=True, routed_combine=True, wide_scores=True, token_indices=True,
                           whole_stash_until_weight_grad=True, output_grads_until_weight_grad=True,
                           regathered_gemm_inputs=True, latent_kv_whole=True, written_out_mask=True,
                           offset_norm_scales=True)
AUTOCAST_TORCH = replace(EAGER_TORCH, residual_bytes=FP32_BYTES, input_cast_per_projection=True, weight_copies=True,
                         gathered_gemm_inputs=True)
REGATHERED_PER_LAYER = 2  # the attention's and the MLP's gathered inputs
AUTOCAST_DTYPES = ("bfloat16", "float16")  # pipesim run's --dtype values that compute under autocast


def executor_saved_tensors(dtype: str) -> SavedTensors:
    """What ``pipesim run``'s layers keep at ``--dtype dtype``: ``AUTOCAST_TORCH`` where
    they compute under autocast over float32 weights, else ``EAGER_TORCH``."""
    return AUTOCAST_TORCH if dtype in AUTOCAST_DTYPES else EAGER_TORCH


def async_regathered_inputs(saved: SavedTensors, tp: int, sequence_parallel: bool, recompute: str,
                            moe_layer: bool = False) -> int:
    """How many sublayer inputs a layer's backward gathers again as Megatron-Core does,
    beside the input-gradient product it precedes: under sequence parallelism, where the
    implementation keeps the shard as the fused kernels' inventory counts it (neither the
    gathered copy nor the executor's own regather), the attention's and a dense MLP's (a
    mixture of experts' grouped GEMMs keep the routed tokens they were handed); none under
    per-op recompute (torchtitan's, whose linears keep the gathered input). Full recompute
    re-runs the forward, which keeps the shard again."""
    if (saved.gathered_gemm_inputs or saved.regathered_gemm_inputs or not sequence_parallel or tp < 2
            or recompute == PER_OP):
        return 0
    return REGATHERED_PER_LAYER - (1 if moe_layer else 0)


def regathered_inputs(saved: SavedTensors, tp: int, sequence_parallel: bool, recompute: str) -> int:
    """How many gathered inputs a layer's backward all-gathers again
    (``saved.regathered_gemm_inputs``): one a sublayer under sequence parallelism (a
    mixture of experts' too), none where full or per-op recompute re-runs the forward
    inside the backward (its checkpoint keeps what the re-run saves)."""
    if not (saved.regathered_gemm_inputs and sequence_parallel and tp > 1) or recompute in ("full", PER_OP):
        return 0
    return REGATHERED_PER_LAYER


def score_bytes(spec: ModelSpec, saved: SavedTensors) -> float:
    """Bytes of an element kept in fp32 at least (router scores, logits, softmax
    statistics): 4, or the activation dtype's where ``wide_scores`` and it is wider."""
    return max(FP32_BYTES, spec.dtype_bytes) if saved.wide_scores else FP32_BYTES


def norm_extra_elements(spec: ModelSpec, saved: SavedTensors) -> float:
    """Elements per token one norm keeps beside its input."""
    if spec.rms_norm:
        return saved.rms_norm_statistics + (spec.hidden if saved.rms_norm_normalised else 0)
    return saved.layer_norm_statistics


def latent_norm_extra_elements(spec: ModelSpec, saved: SavedTensors) -> float:
    """Elements per token latent attention's RMSNorms (on the query latent, if any, and
    the key-value latent) keep beside their inputs."""
    mla = spec.mla
    norms = 2 if mla.q_lora_rank else 1
    latents = (mla.q_lora_rank or 0) + mla.kv_lora_rank
    return norms * saved.rms_norm_statistics + (latents if saved.rms_norm_normalised else 0)


def qk_norm_extra_elements(spec: ModelSpec, saved: SavedTensors, tp: int = 1) -> float:
    """Elements per token the query and key norms keep beside their inputs, on one tp
    rank: the normalised Q and K, and one 1/rms per head (``head``, ``l2``) or per
    projection."""
    statistics = 2 if spec.qk_norm == "projection" else spec.heads / tp + kv_heads_per_shard(spec, tp)
    # a weighted norm keeps what it multiplies by its weight; Llama 4's weightless one hands its output on
    weighted = saved.rms_norm_normalised and spec.qk_norm != "l2"
    return saved.rms_norm_statistics * statistics + (query_key_width(spec, tp) if weighted else 0.0)


def query_key_width(spec: ModelSpec, tp: int = 1) -> float:
    """Features per token of Q and K together on one tp rank (K at its own heads)."""
    return spec.q_width / tp + spec.head_size * kv_heads_per_shard(spec, tp)


def layer_extra_bytes(spec: ModelSpec, saved: SavedTensors, tp: int = 1, sequence_parallel: bool = False,
                      recompute: str = "none", flash_attention: bool = True, layer: int = 0, cp: int = 1,
                      ep: int = 1) -> float:
    """Bytes one microbatch keeps for layer ``layer`` beyond ``layer_stash_bytes``'
    inventory, on one tp rank (0 for ``KERNELS``). Under full recompute a layer keeps its
    input alone, in any implementation; under per-op checkpointing the input and what the
    policy saves, of which only the attention kernel's log-sum-exp is beyond the inventory
    (``pipesim.model.per_op_checkpoint``)."""
    d, h = spec.dtype_bytes, spec.hidden
    split = tp if sequence_parallel else 1  # what sequence parallelism shards
    wider = max(0, saved.residual_bytes - d)  # the residual stream's bytes beyond the dtype's
    if saved == KERNELS or recompute == "full":
        return spec.tokens * h * wider / split  # the layer's input, from the residual stream
    if recompute == PER_OP:  # autograd's own saved tensors are dropped: the input and the kernel's log-sum-exp
        statistics = spec.heads / tp * score_bytes(spec, saved) if saved.softmax_statistics else 0.0
        return spec.tokens * (h * wider / split + statistics)
    residual = d + wider
    # a weighted query/key norm (not Llama 4's weightless L2 one): its float32 weight makes Q float32 under autocast
    weighted_qk_norm = spec.mla is None and spec.has_qk_norm(layer) and spec.qk_norm != "l2"
    # Gemma's post norms read the sublayers' outputs, in the activation dtype: they and what they keep are not wider
    post = spec.post_norms
    per_token = ((spec.norm_inputs_kept - post) * h * wider + norm_extra_elements(spec, saved)
                 * (spec.norms_per_layer * residual - post * wider)) / split
    if spec.mla is not None and spec.rms_norm:  # the latents' RMSNorms keep theirs too
        per_token += latent_norm_extra_elements(spec, saved) * d
        # with more sequences V is reshaped into a copy, under autocast into a float32 one; norm-mla-up
        # rebuilds the projection; selective's checkpoint keeps the kernel's V as handed to it, the view
        view = (spec.microbatch_size == 1 and not wider) or recompute == "selective"
        if saved.latent_kv_whole and view and recompute != NORM_MLA_UP:
            per_token += spec.heads / tp * spec.mla.qk_nope_head_dim * d
    # sublayers whose shard is cast before the gather and gathered again in the backward (attention first)
    regathered = regathered_inputs(saved, tp, sequence_parallel, recompute)
    cast_split = 1 if saved.gathered_gemm_inputs else split  # a linear's cast of its input: of the gathered copy?
    if saved.input_cast_per_projection:  # K's and V's own casts (latent attention's key-value down's); the MLP's
        # a fused wqkv casts its input once; a regathered sublayer's linears share the one cast gathered
        attention_casts = 0 if spec.fused_qkv or regathered >= 1 else (1 if spec.mla is not None else 2)
        # Falcon-7B's one norm output is one tensor to the inventory, but both sublayers' first linears cast it
        # (norm-mla-up counts each sublayer's first cast below)
        one_norm = spec.parallel_residual and spec.norms_per_layer == 1 and not spec.fp8
        shared_norm = 1 if one_norm and recompute != NORM_MLA_UP else 0
        casts = attention_casts + (mlp_input_casts(spec, layer) + shared_norm if regathered < 2 else 0)
        per_token += casts * h * d / cast_split
    if saved.input_cast_per_projection and recompute == NORM_MLA_UP:
        # the norms' outputs are dropped and rebuilt, but each sublayer's first linear's cast of it stays
        # (latent attention's up-projections' casts of the latents' too)
        latents = (spec.mla.q_lora_rank or 0) + spec.mla.kv_lora_rank if spec.mla is not None else 0
        per_token += ((REGATHERED_PER_LAYER - regathered) * h / cast_split + latents) * d
    if spec.mla is not None and wider:  # autocast: the rotated Q and K are float32 (the rotary tables are)
        if recompute == "selective":  # the checkpointed kernel's inputs: Q and K float32, V the projection's
            # (16-bit where the block reads its input as the 16-bit gathered shard: the tables are 16-bit too)
            per_token += 2 * spec.q_width / tp * wider if regathered == 0 else 0.0
        elif recompute != NORM_MLA_UP:  # torch's math path keeps Q, K and V in float32
            per_token += (2 * spec.q_width + spec.v_width) / tp * wider
        else:  # written out (Q, K and V rebuilt): its products keep their bf16 casts of Q, K and the softmax
            per_token += (2 * spec.q_width + spec.heads * spec.seq_len) / tp * d
        if not flash_attention and recompute != "selective":  # the softmax's output in float32
            per_token += spec.heads / tp * spec.seq_len * wider
    if sequence_parallel and saved.gathered_gemm_inputs:  # QKV and MLP inputs whole, not / tp
        # beyond the inventory's shard; norm-mla-up's inventory drops the shard, the gathered copy stays
        per_token += (REGATHERED_PER_LAYER - regathered) * h * d * (1 - (0 if recompute == NORM_MLA_UP else 1 / tp))
    heads = spec.heads / tp
    # selective recomputes the attention kernel: its outputs are not kept (norm-mla-up keeps them)
    kernel_kept = recompute in ("none", NORM_MLA_UP)
    if saved.softmax_statistics and flash_attention and kernel_kept:
        per_token += heads * score_bytes(spec, saved)
    if spec.has_qk_norm(layer) and spec.mla is None:  # the query and key norms keep theirs too
        per_token += qk_norm_extra_elements(spec, saved, tp) * d
        if recompute == "selective" and weighted_qk_norm:
            # the checkpointed kernel keeps its inputs as handed to it: a weighted norm's float32 weight
            # made Q and K float32 under autocast (unrecomputed, the kernel keeps its own 16-bit casts)
            keys = heads if saved.kv_repeated else kv_heads_per_shard(spec, tp)
            per_token += (heads + keys) * spec.head_size * wider
        elif cp > 1 and weighted_qk_norm and kernel_kept:
            # the ring keeps Q as it came, float32, and the last K and V it was passed, one message that
            # the float32 K makes float32 (the all-gather variant keeps V in 16 bits: 2 B a value less)
            per_token += (heads + 2 * kv_heads_per_shard(spec, tp)) * spec.head_size * wider
    # context parallelism's attention over the cp ranks (executor.context_parallel) takes K and V at their own
    # heads and keeps its output in its float32 (or wider) math, beside the copy the heads join into
    context_attention = cp > 1 and spec.mla is None
    if spec.mla is None and saved.kv_repeated and not context_attention:
        per_token += 2 * spec.head_size * (heads - kv_heads_per_shard(spec, tp)) * d
    # the kernel's output, laid out as the query's features were (token by token), joins the heads as a view;
    # a rotary turn writes Q head by head, so joining them copies (Llama 4's layers without one: a view)
    rotated = not spec.learned_positions and layer not in spec.nope_layers
    if saved.attention_output_copy and kernel_kept and context_attention:
        per_token += spec.v_width / tp * max(d, FP32_BYTES)
    elif saved.attention_output_copy and kernel_kept and flash_attention and rotated:
        per_token += spec.v_width / tp * d
    if saved.gated_activation_output and spec.gated_mlp:
        # gpt-oss's clamped SwiGLU keeps 3f more: the gate before its clamp, up before its clamp and
        # plus one, and the gate times its sigmoid (7f in all)
        # (under --recompute-moe-act the routed experts keep the activation's inputs alone: its
        # checkpoint's, what the inventory counts; the shared experts keep theirs)
        clamped = 3 if spec.mlp_activation == CLAMPED_SWIGLU else 0
        width = spec.mlp_width(layer, padded=False)
        if spec.moe_act_recompute and spec.is_moe_layer(layer):
            width -= spec.moe.routed_width(padded=False)
        per_token += (1 + clamped) * width / tp * d
    if saved.routed_combine and spec.is_moe_layer(layer):
        per_token += routing_bytes(spec, saved, regathered, ep) / (split if routes_shard(spec, ep) else 1)
    extra = spec.tokens * per_token
    if saved.routed_combine and spec.is_moe_layer(layer) and spec.moe.balance_loss > 0:
        extra += balance_loss_bytes(spec, saved)
    if saved.weight_copies:
        extra += weight_copy_bytes(spec, tp, layer, ep)
    if saved.rotary_tables and rotated:
        # cos and sin, s x d/2 each, whatever the microbatch, in the rotated Q's type: latent attention's
        # input's (16-bit where it reads the 16-bit gathered shard), and a weighted query norm's (its float32
        # weight makes Q float32 under autocast)
        float_query = (spec.mla is not None and regathered == 0) or weighted_qk_norm
        extra += spec.seq_len * spec.rotary_width * (residual if float_query else d)
    if saved.rotary_tables and spec.nope_temperature is not None and layer in spec.nope_layers:
        # Llama 4's layers without rotary positions scale the query by position: the scales, s of them in Q's type
        extra += spec.seq_len * d
    if saved.written_out_mask and not flash_attention and spec.scores_beyond_mask and kernel_kept:
        extra += spec.seq_len ** 2  # the boolean mask the written-out attention's masked fill keeps, a byte each
    if saved.offset_norm_scales and spec.rms_norm and spec.norm_offset:  # each norm's 1 + weight, the weight's type
        query_key = (qk_norm_widths(spec, tp) if spec.has_qk_norm(layer) and spec.mla is None else 0)
        extra += (spec.norms_per_layer * h + query_key) * residual
    return extra


def qk_norm_widths(spec: ModelSpec, tp: int = 1) -> float:
    """Features of the query and key norms' weights in use on one tp rank: one head's
    each (``head``), or the projections' on the rank (``projection``)."""
    return query_key_width(spec, tp) if spec.qk_norm == "projection" else 2 * spec.head_size


def mlp_input_casts(spec: ModelSpec, layer: int) -> float:
    """Copies per token of the MLP's input that its linears cast under autocast, each its
    own, beyond the one the inventory counts (the first linear's): a gated MLP's up
    projection's; in a mixture of experts (the router's cast the inventory's) every
    routed copy's second one (an expert's gate and up projections cast its tokens apart;
    the executor's experts are gated), the shared expert's two and its gate's one."""
    if not spec.is_moe_layer(layer):
        return 1.0 if spec.gated_mlp else 0.0
    moe = spec.moe
    shared = (2 if moe.shared_ffn else 0) + (1 if moe.shared_ffn and moe.shared_expert_gate else 0)
    return moe.routed_slots(padded=False) + shared


def balance_loss_bytes(spec: ModelSpec, saved: SavedTensors) -> float:
    """What a layer's load-balancing loss keeps (``executor.architectures.moe``), in the
    scores' type: each sequence's expert shares (``E`` a sequence, the product's other
    factor) and the loss itself; a sigmoid router's normalisation also keeps each
    token's score sum (the scores it divides are the sigmoid's output, kept already)."""
    score = score_bytes(spec, saved)
    sums = spec.tokens * score if spec.moe.gating == "sigmoid" else 0.0
    return spec.microbatch_size * spec.moe.experts * score + score + sums


def routes_shard(spec: ModelSpec, ep: int) -> bool:
    """Whether each tp rank routes its own sequence shard under sequence parallelism
    (``executor.shard_routing``: with parallel folding or expert parallelism), so what
    routing keeps per token is of the shard's tokens; else every tp rank routes the
    gathered sequence."""
    return bool(spec.expert_tp) or ep > 1


def routing_bytes(spec: ModelSpec, saved: SavedTensors, regathered: int, ep: int = 1) -> float:
    """Per routed token, what routing and combining keep beyond the inventory: the
    weighted outputs and their weights in the combine's type, the copies' and picks'
    indices, the rescaled weights, wider scores, and under expert parallelism the
    dispatch's own (``expert_parallel_extra``)."""
    d, h = spec.dtype_bytes, spec.hidden
    slots, k = spec.moe.routed_slots(padded=False), spec.moe.experts_per_token
    # the weighted outputs and their weights in the combine's type (float32 under autocast)
    per_token = slots * ((h + 1) * max(d, saved.residual_bytes) + 2 * INDEX_BYTES) + k * INDEX_BYTES
    if spec.moe.shared_ffn and spec.moe.shared_expert_gate:  # the shared output and its sigmoid gate
        per_token += (h + 1) * d
    tokens = routed_token_bytes(spec, saved, regathered)
    if spec.moe.weighted_input:  # Llama 4: each copy scaled in the tokens' own type
        per_token += slots * h * max(0, tokens - d)
    if spec.moe.normalize_top_k:  # the division by their sum keeps the k weights and the sum
        per_token += (k + 1) * score_bytes(spec, saved)
    per_token += spec.moe.experts * (score_bytes(spec, saved) - FP32_BYTES)  # wider scores than the inventory's
    if ep > 1:
        per_token += slots * expert_parallel_extra(spec, saved, tokens)
    return per_token


def routed_token_bytes(spec: ModelSpec, saved: SavedTensors, regathered: int) -> float:
    """Bytes of an element of the tokens a mixture of experts routes: the residual
    stream's, or the activation dtype's where sequence parallelism casts the shard before
    its gather (``regathered``: ``executor.rebuilt_activations.read_gathered_shard``,
    which the router, the experts' slices and the shared expert read)."""
    return spec.dtype_bytes if regathered else (saved.residual_bytes or spec.dtype_bytes)


def expert_parallel_extra(spec: ModelSpec, saved: SavedTensors, tokens: float) -> float:
    """Per routed copy, what the executor's expert-parallel dispatch keeps beyond running
    every expert in-process (``executor.expert_parallel``): the expert rank writes each
    expert's output into the received rows (``index_copy``, which keeps its source: ``h``
    in the rows' type, the tokens') and keeps each row's index; the sending rank weights
    the returned rows in the combine's type (``max(d, residual)``: float32 under autocast)
    where in-process the product keeps the expert's own output (``d``). The rows are in
    the tokens' type, ``tokens`` bytes an element (``routed_token_bytes``). Counted from
    launched runs' saved tensors under bf16 autocast: a shrunk Mixtral at dp 2 ep 2,
    ``6h + 8`` bytes a copy (``4h + 8`` in float32); Qwen3-30B-A3B at tp 2 with sequence
    parallelism, ``--etp 1``, ep 2, ``4h + 8`` (the expert outputs ``index_copy`` keeps are
    bf16 there)."""
    d, h = spec.dtype_bytes, spec.hidden
    residual = saved.residual_bytes or d
    return h * tokens + h * (max(d, residual) - d) + INDEX_BYTES


def weight_copy_bytes(spec: ModelSpec, tp: int = 1, layer: int = 0, ep: int = 1) -> float:
    """The activation-dtype copies of layer ``layer``'s weight matrices on one tp rank
    (autocast casts each weight in every forward and the GEMM keeps the copy): of the
    routed experts, the ``E / ep`` the rank holds."""
    return spec.dtype_bytes * sum(stack_on_rank(weight, ep) * math.prod(shard(weight, spec, tp))
                                  for weight in layer_weights(spec, spec.is_moe_layer(layer)))


def mtp_extra(spec: ModelSpec, saved: SavedTensors) -> float:
    """Beyond the inventory's MTP module (its block, its projection's input, its head's
    stash), what one module keeps for the backward in an implementation: its two input
    norms' own extras (the embedding norm's input, the embedding's output, too), the
    token ids it embeds and its row of the targets rolled ahead (the executor's
    ``prediction_targets``, which its loss reads)."""
    if saved == KERNELS:
        return 0.0
    d, h = spec.dtype_bytes, spec.hidden
    residual = d + max(0, saved.residual_bytes - d)
    per_token = 2 * norm_extra_elements(spec, saved) * residual + h * residual
    return spec.tokens * (per_token + (2 * INDEX_BYTES if saved.token_indices else 0.0))


def first_stage_extra(spec: ModelSpec, saved: SavedTensors) -> float:
    """The embedding's int64 token ids, where kept."""
    return spec.tokens * INDEX_BYTES if saved.token_indices else 0.0


def last_stage_extra(spec: ModelSpec, saved: SavedTensors, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Beyond ``last_stage_extra_bytes``: the final norm's own extras, the logits wider
    than fp32 and the int64 targets, where kept."""
    if saved == KERNELS:
        return 0.0
    d = spec.dtype_bytes
    wider = max(0, saved.residual_bytes - d)
    norm = (spec.hidden * wider + norm_extra_elements(spec, saved) * (d + wider)) / (tp if sequence_parallel else 1)
    logits = spec.vocab / tp * (score_bytes(spec, saved) - FP32_BYTES)
    if spec.logit_softcap is not None:  # Gemma 2's capped logits: the tanh keeps its output too
        logits += spec.vocab / tp * d  # in the output layer's type
    targets = INDEX_BYTES if saved.token_indices else 0.0
    weight = spec.vocab / tp * spec.hidden * d if saved.weight_copies else 0.0  # the output layer's weight copy
    if saved.offset_norm_scales and spec.rms_norm and spec.norm_offset:  # the final norm's 1 + weight
        weight += spec.hidden * (d + wider)
    return spec.tokens * (norm + logits + targets) + weight
