"""Activation memory of one transformer layer: what a microbatch's forward keeps for its
backward, on one tensor-parallel rank (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4, Table 2).

The paper's count for a GPT layer in 16-bit (s sequence, b microbatch, h hidden, a
heads, t tensor-parallel ranks), per layer:

    no parallelism                      sbh (34 + 5as/h)
    tensor parallel                     sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel          sbh (34/t + 5as/(ht))
    tensor parallel, selective          sbh (10 + 24/t)
    tensor + sequence, selective        sbh (34/t)
    full recompute                      2 sbh            (the layer's input only)

where the 34 is, per token, in bytes: the two LayerNorm inputs (4h), the QKV input (2h),
Q and K (4h), V (2h), the output projection's input (2h) and its dropout mask (h); the MLP
input (2h), GeLU input and output (8h + 8h) and dropout mask (h). The ``10`` of those that
tensor parallelism does not split are the norm inputs, the QKV and MLP inputs and the two
masks; sequence parallelism splits them too. ``5as/h`` is the attention scores: softmax
output (2as), its dropout mask (as) and dropout output (2as).

Here the same inventory is written per architecture, so that GQA (K and V of width
``kv_width``), a SwiGLU MLP (gate and up outputs and the product: ``3f`` elements instead
of GeLU's ``2f``), no dropout (no masks) and other dtypes come out right; for GPT-3 it is
the paper's formula term for term. Per layer, since layers differ:

- **Norms**: one input kept per norm (``norms_per_layer``: gemma-2 has four), one for both
  norms of a parallel block (GPT-NeoX: they read the same input); Falcon-7B's one norm
  hands the same output to the attention's and the MLP's GEMMs, kept once.
- **Grouped-query attention on more tp ranks than key-value heads**: a rank keeps the K
  and V of the one head it holds (``kv_heads_per_shard``).
- **Latent attention (MLA)**: the compressed query and key-value latents before and after
  their norms (``2 q_lora_rank + 2 kv_lora_rank + qk_rope_head_dim``), left whole by tp
  like the other norm inputs, then per head Q and K (``a (d_nope + d_rope)`` each), V and
  the attention output (``a d_v`` each), split by tp.
- **Mixture of experts**: per routed slot (``k``, times the capacity factor), a copy of
  the token going in (``h``, the dispatcher's permuted input) and the expert's output
  coming back (``h``, which the probability-weighted combine needs for its gradient),
  kept whole on every tp rank since the dispatcher gathers the tp group's tokens (under
  parallel folding the expert tensor-parallel group's: ``etp / tp`` of them), plus
  the expert's MLP intermediates (``3 f_expert`` gated) split by tp; the shared experts'
  intermediates as a dense MLP's; the router's scores in fp32 (``4E`` bytes).

**Flash attention** (the default) never materialises the ``s x s`` scores: its backward
recomputes them from Q, K, V and the output, so the ``5as/h`` term is gone (the
per-row softmax statistics it keeps, ``4a`` bytes per token, are left out: under 0.1% of
the rest). Selective recompute then saves nothing more, since what it recomputes is
exactly that term. With sequence parallelism, full recompute keeps the sequence-sharded
input, ``2sbh/t`` (the paper's table lists ``2sbh`` for tensor parallelism without it).

**Recomputing the norms and latent attention's up-projections** (``--recompute
norm-mla-up``, DeepSeek-V3's, report section 3.2.3): every norm's output is recomputed
from its input in the backward, so a layer keeps its norms' inputs but not the QKV and
MLP inputs (the norms' outputs) nor MLA's latents after their norms; with latent
attention the up-projections are recomputed from the latents, so of Q, K, V and the
attention output only the output is kept. The backward re-runs the norms (their share
of the element-wise traffic) and the up-projection GEMMs' forwards.

**Per-op checkpointing** (``--recompute per-op``, torchtitan's SelectiveAC): the block's
input and the outputs of the matrix products it saves (Q, V, the attention kernel's
output, the gate and down projections' for Llama 3); its inventory and rule are in
``pipesim.model.per_op_checkpoint``.

**FP8 caching** (under ``--fp8``, as Transformer Engine and DeepSeek-V3 run FP8, section
3.3.3): the input a weight GEMM keeps for its weight gradient is the FP8 copy its forward
read, ``1 + 4/128`` bytes per element with the 1x128 tile's FP32 scale; the attention
kernel's Q, K, V and output, the norms' inputs and the router's scores keep their 16-bit
or FP32 precision. A dense MLP keeps its activation's inputs in 16-bit and the down
projection's input in FP8. A mixture of experts keeps each routed copy's dispatched
input in FP8 (DeepSeek-V3 dispatches it in FP8; after a BF16 dispatch, ``--ep-dispatch
bf16``, the up-projection's input cast keeps the same FP8 copy) and, of its routed and shared experts,
only the activation's inputs, in FP8, recomputing the activation's output in the
backward with the routing weight applied inside it (Megatron-Core's weighted SwiGLU with
``fp8_input_store``), so the combine keeps no expert output; every backward re-runs
that activation (``pipesim.model.memory_traffic.recomputed_activation_bytes``). (DeepSeek keeps the
attention output in a 12-bit E5M6 format; it is counted at 16 bits here.)
"""

from __future__ import annotations

from pipesim.model.loss_traffic import cross_entropy_bytes, cross_entropy_transient_bytes
from pipesim.model.per_op_checkpoint import PER_OP, stash_bytes_per_token
from pipesim.model.quantization import FP8_TILE_BYTES
from pipesim.model.saved_tensors import (
    KERNELS,
    SavedTensors,
    first_stage_extra,
    last_stage_extra,
    layer_extra_bytes,
    regathered_inputs,
)
from pipesim.model.spec import NORM_MLA_UP, ModelSpec, check_recompute
from pipesim.model.weights import kv_heads_per_shard

MASK_BYTES = 1  # a dropout mask is one byte per element
FP8_CACHED_BYTES = FP8_TILE_BYTES  # an FP8 element and its share of its 1x128 tile's FP32 scale
ROUTER_SCORE_BYTES = 4  # router scores are kept in fp32


def layer_stash_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                      flash_attention: bool = True, layer: int = 0, saved: SavedTensors = KERNELS,
                      cp: int = 1, ep: int = 1) -> float:
    """Bytes one microbatch keeps for layer ``layer`` until its backward, on one tp rank
    (the inventory of the module, with ``--recompute norm-mla-up`` and FP8 caching as it
    says; ``--recompute per-op``'s is ``pipesim.model.per_op_checkpoint``'s), plus what an
    implementation keeps beyond it (``saved``: ``pipesim.model.saved_tensors``; none by
    default). ``spec`` is what one rank computes on (``ModelSpec.context_shard``); ``cp``
    says how many context-parallel ranks share each sequence (the implementation's
    attention over them keeps its own tensors), ``ep`` how many expert-parallel ranks
    share the routed experts (what an implementation keeps per expert, e.g. autocast's
    weight copies, is of the rank's own)."""
    check_recompute(recompute)
    h, d = spec.hidden, spec.dtype_bytes
    extra = layer_extra_bytes(spec, saved, tp, sequence_parallel, recompute, flash_attention, layer, cp, ep)
    if recompute == "full":
        return spec.tokens * h * d / (tp if sequence_parallel else 1) + extra
    if recompute == PER_OP:
        return spec.tokens * stash_bytes_per_token(spec, tp, sequence_parallel) + extra
    mask = MASK_BYTES if spec.dropout else 0
    norm_output = 0 if recompute == NORM_MLA_UP else gemm_input_bytes(spec)
    # per token: the part tensor parallelism leaves whole (norm inputs, QKV and MLP inputs, masks)
    # a parallel block's two norms read the same input; Falcon-7B's one norm feeds Q, K, V and the MLP
    # one tensor (its FP8 casts are each GEMM's own)
    gemm_inputs = 1 if spec.parallel_residual and spec.norms_per_layer == 1 and not spec.fp8 else 2
    replicated = (spec.norm_inputs_kept * h * d + gemm_inputs * h * norm_output + 2 * h * mask
                  + latent_bytes(spec, norm_output))
    sharded = attention_bytes(spec, tp, recompute == NORM_MLA_UP, layer) + mlp_stash_bytes(spec, layer) / tp
    whole = 0.0
    if spec.is_moe_layer(layer):
        # the routed copies of the tokens the expert tensor-parallel group gathered: every token's
        # when it is the tp group, a 1 / tp share each of its etp ranks' under parallel folding
        whole = (routed_copies_bytes(spec) * spec.expert_shards(tp) / tp
                 + ROUTER_SCORE_BYTES * spec.moe.experts)
    per_token = replicated / (tp if sequence_parallel else 1) + sharded + whole
    if not flash_attention and recompute in ("none", NORM_MLA_UP):
        per_token += attention_scores_bytes(spec) / tp
    return spec.tokens * per_token + extra


def gemm_input_bytes(spec: ModelSpec) -> float:
    """Bytes per element of a weight GEMM's input kept for its weight gradient: the
    activation dtype, or under FP8 the FP8 copy the forward GEMM already read, with its
    share of the 1x128 tile's FP32 scale (Transformer Engine keeps that copy; DeepSeek-V3
    report, section 3.3.3)."""
    return FP8_CACHED_BYTES if spec.fp8 else spec.dtype_bytes


def mlp_stash_bytes(spec: ModelSpec, layer: int) -> float:
    """Per token, before tp: what the MLP keeps. In 16-bit, the activation's inputs and
    output (``3f`` gated, ``2f`` not). Under FP8 a dense MLP keeps the down projection's
    input as FP8 (a GEMM input) and the activation's inputs in 16-bit; a mixture of
    experts' routed and shared experts keep only the activation's inputs, in FP8, and
    recompute its output in the backward (DeepSeek-V3's SwiGLU caching, section 3.3.3;
    Megatron-Core's ``fp8_input_store``). In 16-bit with Megatron-Core's ``moe_act``
    recompute (``--recompute-moe-act``) the routed experts keep their activation's inputs
    alone too, and every backward re-runs it (output-discarding checkpointing: the down
    projection's input is dropped after the forward and rebuilt before its backward); the
    shared experts keep theirs (their own recompute module is another)."""
    width, d = spec.mlp_width(layer), spec.dtype_bytes
    if not spec.fp8:
        if spec.moe_act_recompute and spec.is_moe_layer(layer):
            return (spec.mlp_matrices * width - spec.moe.routed_width()) * d
        return spec.mlp_matrices * width * d
    inputs = (spec.mlp_matrices - 1) * width
    if spec.is_moe_layer(layer):
        return inputs * FP8_CACHED_BYTES
    return inputs * d + width * FP8_CACHED_BYTES


def routed_copies_bytes(spec: ModelSpec) -> float:
    """Per token, whole: a mixture of experts' routed copies. In 16-bit, each slot's
    dispatched input and the expert output the weighted combine needs for the routing
    weight's gradient. Under FP8 the dispatched input alone, in FP8 (DeepSeek-V3 dispatches
    it so, section 3.3.3; a BF16 dispatch's copy is cast to FP8 for the GEMM, which keeps
    that, so the dispatch's precision changes no stash): the routing weight is applied inside the cached activation
    (Megatron-Core's weighted SwiGLU keeps its input and the weights), whose recomputed
    output gives that gradient, so no expert output is kept."""
    slots, h = spec.moe.routed_slots(), spec.hidden
    if spec.fp8:
        return slots * h * FP8_CACHED_BYTES
    return 2 * slots * h * spec.dtype_bytes


def wgrad_stash_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False, layer: int = 0) -> float:
    """Bytes one microbatch keeps for layer ``layer`` between its input-gradient backward
    (``I``) and its weight-gradient backward (``W``), on one tp rank: each weight GEMM's
    input and output gradient (``W`` computes ``dW = X^T dY``), ``m (k + n)`` elements of
    every ``m x k`` by ``k x n`` product the layer runs (``pipesim.model.operations``).
    For GPT-3 that is ``16h`` elements per token, the ``32h`` bytes of Qi et al. 2024,
    Table 1; everything else of the stash (norm inputs, attention's Q, K, V and scores,
    masks, the MLP's intermediates but the down projection's input) is freed by ``I``."""
    from pipesim.model.operations import weight_gemms
    from pipesim.model.weights import layer_weights

    gemms = weight_gemms(layer_weights(spec, spec.is_moe_layer(layer)), spec, tp, sequence_parallel)
    return sum(gemm.count * gemm.m * (gemm.k + gemm.n) for gemm in gemms) * spec.dtype_bytes


def rebuilt_until_weight_grad_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                                    recompute: str = "none", flash_attention: bool = True, layer: int = 0,
                                    saved: SavedTensors = KERNELS) -> float:
    """Bytes of layer ``layer`` that ``--recompute norm-mla-up`` dropped after the forward,
    rebuilt in a split backward's ``I`` and, where the implementation holds the stash
    whole until ``W`` (``saved.whole_stash_until_weight_grad``: the executor refills the
    dropped storages once, in ``I``, and ``W`` reads them, ``executor.rebuilt_activations``),
    held until ``W``: what the recompute saved, ``layer_stash_bytes`` without it less
    with it. So too the routed experts' activation output that ``--recompute-moe-act``
    dropped (``executor.architectures.layers.FeedForward``, rebuilt in ``I``, read by the
    down projection's ``W``). 0 for any other recompute or implementation."""
    if not saved.whole_stash_until_weight_grad:
        return 0.0
    held = 0.0
    if spec.moe_act_recompute and spec.is_moe_layer(layer):
        held += spec.tokens * spec.moe.routed_width(padded=False) * spec.dtype_bytes / tp
    if recompute != NORM_MLA_UP:
        return held
    return held + (layer_stash_bytes(spec, tp, sequence_parallel, "none", flash_attention, layer, saved)
                   - layer_stash_bytes(spec, tp, sequence_parallel, recompute, flash_attention, layer, saved))


def regathered_until_weight_grad_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                                       recompute: str = "none", saved: SavedTensors = KERNELS,
                                       layer: int = 0) -> float:
    """Bytes of layer ``layer``'s gathered sublayer inputs that a split backward's ``I``
    gathers again and holds until ``W`` (``regathered_inputs``: the executor under
    sequence parallelism), whole, one a sublayer. Under ``--recompute norm-mla-up`` the
    rebuild makes the gathered copy straight from the recomputed norm, so the norms'
    shards ``rebuilt_until_weight_grad_bytes`` counts are not held: taken off here."""
    copies = regathered_inputs(saved, tp, sequence_parallel, recompute)
    if not copies:
        return 0.0
    whole = copies * spec.tokens * spec.hidden * spec.dtype_bytes
    if recompute == NORM_MLA_UP and saved.whole_stash_until_weight_grad:
        gemm_inputs = 1 if spec.parallel_residual and spec.norms_per_layer == 1 else copies
        whole -= gemm_inputs * spec.tokens * spec.hidden * spec.dtype_bytes / tp
    return whole


def output_grad_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False, layer: int = 0,
                      saved: SavedTensors = KERNELS) -> float:
    """Bytes of the gradients a split backward's ``I`` finds for the outputs of layer
    ``layer``'s parameter-owning modules and holds until its ``W`` (which multiplies them
    by the modules' inputs), where the implementation keeps them beside a stash held whole
    (``saved.output_grads_until_weight_grad``: the executor's split backward,
    ``executor.split_backward``); 0 otherwise (the kernels' inventory counts them in
    ``wgrad_stash_bytes``). Each weight GEMM's output, ``m x n`` of it on one tp rank
    (routed experts over the copies routed to them, unpadded: the executor runs no
    capacity padding), and each norm's output, ``h`` a token (``/ tp`` under sequence
    parallelism; latent attention's norms over its latents too), in the residual stream's
    element type. For the toy GPT that is ``11h`` a token: QKV ``3h``, the output
    projection ``h``, the MLP ``4h + h``, two norms."""
    if not saved.output_grads_until_weight_grad:
        return 0.0
    from pipesim.model.operations import weight_gemms
    from pipesim.model.weights import layer_weights

    gemms = weight_gemms(layer_weights(spec, spec.is_moe_layer(layer)), spec, tp, sequence_parallel, padded=False)
    outputs = sum(gemm.count * gemm.m * gemm.n for gemm in gemms) * spec.dtype_bytes
    # the layer's norms, and latent attention's over its latents (whole on every tp rank)
    width = spec.norms_per_layer * spec.hidden + (spec.mla.kv_lora_rank + (spec.mla.q_lora_rank or 0) if spec.mla
                                                   else 0)
    norms = spec.tokens * width / (tp if sequence_parallel else 1)
    return outputs + norms * (saved.residual_bytes or spec.dtype_bytes)


def end_output_grad_bytes(spec: ModelSpec, tp: int, sequence_parallel: bool, first_stage: bool, last_stage: bool,
                          saved: SavedTensors = KERNELS) -> float:
    """``output_grad_bytes`` of what the first and the last stage hold beyond their layers:
    the embedding's output (``h`` a token; learned positions add their own, ``h`` a
    position, shared by the microbatch's sequences), the final norm's (``h``) and the
    output layer's logits (``V / tp``)."""
    if not saved.output_grads_until_weight_grad:
        return 0.0
    residual = saved.residual_bytes or spec.dtype_bytes
    held = 0.0
    if first_stage:
        held += (spec.tokens + (spec.seq_len if spec.learned_positions else 0)) * spec.hidden * residual
    if last_stage:
        held += (spec.tokens * spec.hidden / (tp if sequence_parallel else 1) * residual
                 + spec.tokens * spec.vocab / tp * spec.dtype_bytes)
    return held


def wgrad_stash_share(stash: float, kept: float) -> float:
    """The share of a ``stash`` that ``kept`` bytes are, at most all of it (a stash of
    the layer's input alone, under full recompute, is held whole until ``W``)."""
    return min(1.0, kept / stash) if stash > 0 else 1.0


def attention_bytes(spec: ModelSpec, tp: int, up_recomputed: bool = False, layer: int = 0) -> float:
    """Per token on one tp rank: Q, K, V and the output projection's input (GPT: ``2h +
    2k`` elements, / tp), and the query and key norms' inputs where the model has them
    (Qwen3, OLMoE, Gemma 3: Q and K once more), all in 16-bit (the attention kernel's inputs and output keep
    their precision under FP8: DeepSeek-V3 report, section 3.3.1). Latent attention with
    its up-projections recomputed (``up_recomputed``) keeps the output alone: Q, K and V
    come back from the latents in the backward."""
    d = spec.dtype_bytes
    if spec.mla is not None:
        if up_recomputed:
            return spec.v_width * d / tp
        return (2 * spec.q_width + 2 * spec.v_width) * d / tp
    kv = spec.head_size * kv_heads_per_shard(spec, tp)
    norm_inputs = spec.q_width / tp + kv if spec.has_qk_norm(layer) else 0.0  # query and key norms keep their inputs
    return (spec.q_width / tp + 2 * kv + spec.v_width / tp + norm_inputs) * d


def key_value_bytes(spec: ModelSpec, tp: int = 1) -> float:
    """Per token on one tp rank, the keys and values attention reads: what ring
    attention passes from rank to rank under context parallelism. Grouped-query attention:
    the rank's key-value heads (one replicated head when tp exceeds them); latent
    attention: every head's key (``d_nope + d_rope``) and value (``d_v``), up-projected."""
    d = spec.dtype_bytes
    if spec.mla is not None:
        return spec.heads / tp * (spec.mla.qk_head_dim + spec.mla.v_head_dim) * d
    return 2 * spec.head_size * kv_heads_per_shard(spec, tp) * d


def latent_bytes(spec: ModelSpec, norm_output: float | None = None) -> float:
    """Per token, whole: MLA's latents before their norms and the rotary key in 16-bit,
    and after their norms (the up-projections' inputs) at ``norm_output`` bytes per
    element (default the activation dtype; 0 when the norms are recomputed)."""
    if spec.mla is None:
        return 0.0
    mla = spec.mla
    after = spec.dtype_bytes if norm_output is None else norm_output
    latents = (mla.q_lora_rank or 0) + mla.kv_lora_rank
    return (latents + mla.qk_rope_head_dim) * spec.dtype_bytes + latents * after


def attention_scores_bytes(spec: ModelSpec) -> float:
    """Per token, whole: the ``s x s`` scores kept without flash attention: softmax
    output, and with dropout its mask and output (``5as`` bytes in 16-bit); soft-capped
    scores (Gemma 2) keep their tanh's output too; with attention sinks (gpt-oss) the
    softmax's output has the sink's column besides the keys'."""
    d = spec.dtype_bytes
    capped = d if spec.attention_softcap is not None else 0  # the tanh's output, before the softmax
    per_element = d + capped + ((MASK_BYTES + d) if spec.dropout else 0)
    sink = d if spec.attention_sinks else 0
    return spec.heads * (spec.seq_len * per_element + sink)


def first_stage_extra_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                            saved: SavedTensors = KERNELS) -> float:
    """The embedding's dropout mask (``sbh`` bytes with dropout), on the first stage, and
    what an implementation keeps beyond it (``saved``: its token ids)."""
    ids = first_stage_extra(spec, saved)
    if not spec.dropout:
        return ids
    return spec.tokens * spec.hidden * MASK_BYTES / (tp if sequence_parallel else 1) + ids


def last_stage_extra_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                           saved: SavedTensors = KERNELS) -> float:
    """The final norm's and output layer's inputs and the logits the loss keeps, fp32 (its
    softmax) unless ``spec.cross_entropy`` keeps them in their own type
    (``pipesim.model.loss_traffic``): ``4sbh/t (1 + V/h)`` with sequence parallelism and
    fp32 logits (Korthikanti et al., section 4.3); the two inputs are whole on every rank
    without it. Plus what an implementation keeps beyond them (``saved``: the norm's
    statistics, wider logits, the targets)."""
    inputs = 2 * spec.tokens * spec.hidden * spec.dtype_bytes / (tp if sequence_parallel else 1)
    logits = cross_entropy_bytes(spec.cross_entropy, spec.dtype_bytes)[2] * spec.tokens * spec.vocab / tp
    return inputs + logits + last_stage_extra(spec, saved, tp, sequence_parallel)


def loss_workspace_bytes(spec: ModelSpec, tp: int = 1) -> float:
    """What the loss holds for a moment on the last stage beyond what it keeps (a stage's
    ``workspace_bytes``): ``cross_entropy_transient_bytes`` of each of a microbatch's
    ``s x V / tp`` logits on a rank (``pipesim.model.loss_traffic``: the logits beside
    their FP32 copy under Megatron-Core's loss, 2 bytes in BF16; 8 in the backward of
    torch's ``F.cross_entropy``, 17 GB for Llama 3's 128,256 columns at 16,384 tokens, 12
    over tp's vocabulary shards)."""
    return (cross_entropy_transient_bytes(spec.cross_entropy, spec.dtype_bytes, tp)
            * spec.tokens * spec.vocab / tp)


def recompute_workspace_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                              flash_attention: bool = True, layer: int = 0, saved: SavedTensors = KERNELS,
                              cp: int = 1, ep: int = 1) -> float:
    """What a fully recomputed layer holds for a moment inside its backward beyond its kept
    input (a stage's ``workspace_bytes`` under ``--recompute full``): the backward re-runs
    the layer's forward and holds everything that forward saves until the layer's backward
    has used it (Megatron-Core's ``CheckpointFunction``, torch's ``checkpoint``), one
    layer at a time: the layer's stash without recompute less its stash with it."""
    return (layer_stash_bytes(spec, tp, sequence_parallel, "none", flash_attention, layer, saved, cp, ep)
            - layer_stash_bytes(spec, tp, sequence_parallel, "full", flash_attention, layer, saved, cp, ep))
