"""Transformer architectures: parameters, FLOPs and activation bytes, layer by layer.

A ``ModelSpec`` is a decoder-only transformer with its architecture spelled out, because
Llama-style models differ from GPT-3 in ways that move every number by several percent:
grouped-query attention (``kv_heads`` < ``heads``: K and V projections of
``kv_heads * head_dim`` columns), a gated MLP (SwiGLU, GeGLU: three ``h x ffn`` matrices
instead of two), untied input and output embeddings, RMSNorm, no biases, rotary instead
of learned positions, no dropout; a ``head_dim`` of its own (gemma: 16 heads of 256 on a
hidden size of 3584). Mixture-of-experts MLPs (``pipesim.model.experts``) and multi-head
latent attention (``pipesim.model.latent_attention``) make layers unlike each other, so
every per-layer quantity takes the layer's index and a stage's cost is the sum over the
layers it holds (``sum_over_layers``); the weight matrices behind them are listed once in
``pipesim.model.weights``, and the FLOPs here are those of the operations read off that
list (``pipesim.model.operations``), the ones the compute model times.

Per layer, sequence s, microbatch b, hidden h (a multiply-add counts 2 FLOPs, as the
datasheet peaks do):

- forward FLOPs: 2 per multiply-add of every weight matrix a token passes through (a
  mixture-of-experts layer: the router, its top-k routed experts and the shared ones),
  and the attention core ``2 s b s a (d_qk + d_v)`` (QK^T and PV, counted whole as
  Megatron does; ``4 s^2 b h`` with ``a`` heads of ``h / a``). GPT-3 (2 MLP matrices of
  4h) gives ``sbh(24h + 4s)`` (Narayanan et al. 2021).
- backward: input gradient and weight gradient each cost the forward's GEMMs; the
  attention core has no weights, so its backward (2x its forward) is all input gradient.
- parameters: total (every expert: what memory holds) and active (what a token uses:
  what FLOPs count); per tensor-parallel rank, whole numbers (``pipesim.model.weights``).
- activation stash: ``pipesim.model.activations`` (Korthikanti et al. 2022).

This module holds the architecture; ``pipesim.model.activations`` the activation memory,
``pipesim.model.transformer_costs`` the per-stage costs derived from both,
``pipesim.model.layout`` what tensor, expert and context parallelism may split.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from pipesim.model import operations, weights
from pipesim.model.errors import MAX_LAYERS, ModelSpecError, require_count, require_positive
from pipesim.model.experts import EP_DISPATCHERS, MixtureOfExperts
from pipesim.model.latent_attention import LatentAttention
from pipesim.model.loss_traffic import CROSS_ENTROPY
from pipesim.model.per_op_checkpoint import PER_OP
from pipesim.model.quantization import FP8_TILE_BYTES
from pipesim.model.ring_merge import CP_COMMS
from pipesim.model.rotary import Rope
from schedules.textfile import read_text

# How an FP8 cast finds its scale (Transformer Engine's recipes, its docs' "FP8 Delayed
# Scaling"): "delayed" from the amax history, one read of the tensor (DeepSeek-V3's
# tile-wise scales are found in the same pass); "current" from the tensor itself, an amax
# pass before the cast, two reads (TE's Float8CurrentScaling, torchao's tensorwise dynamic).
FP8_SCALINGS = ("delayed", "current")
# How the attention's input projections are built (``--qkv``): three linears, Q, K and V
# (Meta's Llama reference, Hugging Face, torchtitan before 0.3, pipesim's executor by
# default), or one fused ``wqkv`` (torchtitan 0.3's Llama 3 configs). The same FLOPs and
# the same GEMM timed either way; only per-op checkpointing, which counts the products a
# block runs, tells them apart (pipesim.model.per_op_checkpoint).
QKV_PROJECTIONS = ("separate", "fused")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer and the microbatch it is trained on."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    kv_heads: int | None = None  # None: multi-head attention (kv_heads = heads)
    ffn_hidden: int | None = None  # None: 4 * hidden
    gated_mlp: bool = False  # SwiGLU / GeGLU: gate, up and down matrices
    tied_embeddings: bool = True
    learned_positions: bool = True  # a positions x hidden table (GPT); rotary has none
    bias: bool = True  # every linear layer has a bias (GPT-2); attention_bias / mlp_bias refine it
    rms_norm: bool = False  # RMSNorm: a scale only; LayerNorm: scale and shift
    dropout: bool = True  # dropout masks kept for the backward (1 byte per element)
    microbatch_size: int = 1
    dtype_bytes: int = 2
    head_dim: int | None = None  # None: hidden / heads
    attention_bias: bool | None = None  # Q, K, V and output biases; None: as ``bias``
    mlp_bias: bool | None = None  # MLP (and expert) biases; None: as ``bias``
    qkv_bias: bool = False  # Q, K and V biased even where the output projection is not (Qwen2)
    norms_per_layer: int = 2  # gemma-2: 4 (pre and post norms); Falcon-7B: 1 (parallel attention)
    positions: int | None = None  # rows of the learned position table; None: seq_len
    moe: MixtureOfExperts | None = None
    mla: LatentAttention | None = None
    # norms on queries and keys: RMSNorm "head" (one head wide, Qwen3) or "projection" (all of Q, K: OLMoE),
    # or "l2" (one head wide, no weight, after the rotary turn, on the layers with rotary positions: Llama 4)
    qk_norm: str | None = None
    nope_layers: tuple[int, ...] = ()  # layers without rotary positions (Llama 4's every fourth)
    attention_sinks: bool = False  # gpt-oss: one learned logit per head in each softmax's denominator
    sliding_window: int | None = None  # the keys a query sees in a sliding layer (itself and the w - 1 before)
    sliding_layers: tuple[int, ...] = ()  # indices of the layers that attend over the window
    attention_chunk: int | None = None  # Llama 4: a query sees only the keys of its own chunk of this many tokens
    chunked_layers: tuple[int, ...] = ()  # indices of the layers whose attention is chunked
    fp8: bool = False  # the weight GEMMs in FP8 (Transformer Engine, DeepSeek-V3): pipesim.model.compute_model
    fp8_scaling: str = "delayed"  # how FP8 casts find their scale (FP8_SCALINGS): pipesim.model.compute_model
    fp8_dispatch: bool = False  # the MoE dispatch all-to-alls in FP8 (DeepSeek-V3): dispatch_element_bytes
    # Megatron-Core's recompute module moe_act: the routed experts keep their activation's inputs, not its output,
    # and every backward re-runs it (pipesim.model.activations.mlp_stash_bytes)
    moe_act_recompute: bool = False
    ep_dispatcher: str = "alltoall"  # how the MoE all-to-alls move the routed copies (experts.EP_DISPATCHERS)
    # the loss's kernels over the logits (pipesim.model.loss_traffic.CROSS_ENTROPY): Megatron-Core's default unfused
    cross_entropy: str = "unfused"
    cp_comm: str = "p2p"  # how context-parallel ranks exchange keys and values (--cp-comm; ring_merge.CP_COMMS)
    # the routed experts' tensor-parallel ranks (Megatron-Core's expert tensor parallelism, ETP, under its
    # parallel folding: pipesim.model.layout); 0: the layout's tp, as Megatron-Core's default
    expert_tp: int = 0
    mtp_depth: int = 0  # DeepSeek-V3's multi-token prediction modules (num_nextn_predict_layers), after the head
    fused_qkv: bool = False  # Q, K and V one linear, torchtitan 0.3's wqkv (QKV_PROJECTIONS): per-op's count only
    rope: Rope = Rope()  # rotary base and rescaling (pipesim.model.rotary): the executor's, no count
    # the MLP's (and experts') activation (ACTIVATIONS); None: silu gated (SwiGLU), gelu otherwise
    activation: str | None = None
    activation_limit: float | None = None  # clamped-swiglu: gpt-oss's swiglu_limit (gate <= it, |up| <= it)
    parallel_residual: bool = False  # attention and MLP both read the block's input (GPT-NeoX, Falcon)
    rotary_fraction: float = 1.0  # the share of each head's features turned by position (GPT-NeoX's rotary_pct)
    # Gemma's parts (pipesim run's executor builds them; no count changes):
    norm_offset: bool = False  # RMSNorms scale by 1 + weight, the weight starting at zero
    embedding_scale: bool = False  # the token embeddings times sqrt(hidden) (not the tied output layer)
    query_pre_attn_scalar: float | None = None  # the softmax scale is its -1/2 power, not the head width's
    attention_softcap: float | None = None  # scores become cap * tanh(scores / cap) before the mask (Gemma 2)
    logit_softcap: float | None = None  # the output logits likewise (Gemma 2's final_logit_softcapping)
    local_rope: Rope | None = None  # the sliding layers' rotary positions where they differ (Gemma 3: base 10000)
    # Llama 4: (floor_scale, attn_scale): the layers without rotary positions multiply the query at position p
    # by 1 + attn_scale * ln(floor((p + 1) / floor_scale) + 1) (1 below p = floor_scale - 1)
    nope_temperature: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for what, value, choices in (("FP8 scaling", self.fp8_scaling, FP8_SCALINGS),
                                     ("expert-parallel dispatcher", self.ep_dispatcher, EP_DISPATCHERS),
                                     ("context-parallel exchange", self.cp_comm, CP_COMMS),
                                     ("cross entropy", self.cross_entropy, CROSS_ENTROPY)):
            if value not in choices:
                raise ModelSpecError(f"model {self.name}: {what} {value!r} is not one of {', '.join(choices)}")
        if self.expert_tp < 0:
            raise ModelSpecError(f"model {self.name}: expert_tp {self.expert_tp} must be >= 1 (0: the layout's tp)")
        if self.moe_act_recompute and self.moe is None:
            raise ModelSpecError(f"model {self.name}: moe_act recomputes the routed experts' activation, and the "
                                 f"model has no mixture of experts")
        if self.fp8_dispatch and not self.fp8:
            raise ModelSpecError(f"model {self.name}: an FP8 dispatch feeds the experts' FP8 GEMMs; with BF16 GEMMs "
                                 f"it only loses precision (turn fp8 on, or fp8_dispatch off)")
        for key in ("layers", "hidden", "heads", "seq_len", "vocab", "microbatch_size", "dtype_bytes"):
            require_count(getattr(self, key), f"model {self.name}: {key}")
        for key in ("kv_heads", "ffn_hidden", "head_dim", "positions"):
            if getattr(self, key) is not None:
                require_count(getattr(self, key), f"model {self.name}: {key}")
        require_count(self.norms_per_layer, f"model {self.name}: norms_per_layer", minimum=0)
        require_count(self.layers, f"model {self.name}: layers", maximum=MAX_LAYERS)
        require_count(self.mtp_depth, f"model {self.name}: mtp_depth", minimum=0)
        if self.activation not in (None, *ACTIVATIONS):
            raise ModelSpecError(f"model {self.name}: activation {self.activation!r}: use one of "
                                 f"{', '.join(ACTIVATIONS)}")
        if self.activation == CLAMPED_SWIGLU:
            if not self.gated_mlp:
                raise ModelSpecError(f"model {self.name}: {CLAMPED_SWIGLU} is a gated activation (gate and up "
                                     f"matrices): set gated_mlp")
            require_positive(self.activation_limit, f"model {self.name}: activation_limit")
        elif self.activation_limit is not None:
            raise ModelSpecError(f"model {self.name}: activation_limit {self.activation_limit} clamps only "
                                 f"{CLAMPED_SWIGLU}, not {self.mlp_activation}")
        if isinstance(self.rotary_fraction, bool) or not (isinstance(self.rotary_fraction, (int, float))
                                                            and 0 < self.rotary_fraction <= 1):
            raise ModelSpecError(f"model {self.name}: rotary_fraction must be in (0, 1], got {self.rotary_fraction!r}")
        for key in ("query_pre_attn_scalar", "attention_softcap", "logit_softcap"):
            if getattr(self, key) is not None:
                require_positive(getattr(self, key), f"model {self.name}: {key}")
        if self.qk_norm not in QK_NORMS:
            raise ModelSpecError(f"model {self.name}: qk_norm {self.qk_norm!r}: use one of "
                                 f"{', '.join(map(str, QK_NORMS))}")
        if self.sliding_window is not None:
            require_count(self.sliding_window, f"model {self.name}: sliding_window")
        for layer in self.sliding_layers:
            require_count(layer, f"model {self.name}: each of sliding_layers", minimum=0)
        for layer in self.nope_layers:
            require_count(layer, f"model {self.name}: each of nope_layers", minimum=0)
        if self.attention_chunk is not None:
            require_count(self.attention_chunk, f"model {self.name}: attention_chunk")
        for layer in self.chunked_layers:
            require_count(layer, f"model {self.name}: each of chunked_layers", minimum=0)
        if self.head_dim is None and self.mla is None and self.hidden % self.heads:
            raise ModelSpecError(f"model {self.name}: hidden {self.hidden} is not a multiple of heads {self.heads} "
                                 f"(give head_dim)")
        if self.heads % self.num_kv_heads:
            raise ModelSpecError(
                f"model {self.name}: heads {self.heads} is not a multiple of kv_heads {self.num_kv_heads}")
        if self.fused_qkv and self.mla is not None:
            raise ModelSpecError(f"model {self.name}: latent attention has no Q, K and V projections to fuse; "
                                 f"drop --qkv fused")
        if self.mla is not None and self.kv_heads not in (None, self.heads):
            raise ModelSpecError(f"model {self.name}: latent attention gives every head its own key and value; "
                                 f"kv_heads {self.kv_heads} must be left out")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_size(self) -> int:
        """Width of one head: ``head_dim``, else ``hidden / heads``."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Columns of the Q projection: heads x the query head width."""
        return self.heads * (self.mla.qk_head_dim if self.mla else self.head_size)

    @property
    def kv_width(self) -> int:
        """Columns of the K projection (and of V): ``kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_size

    @property
    def v_width(self) -> int:
        """Width of the attention's output (the output projection's input): heads x value width."""
        return self.heads * (self.mla.v_head_dim if self.mla else self.head_size)

    @property
    def ffn(self) -> int:
        """Width of the dense MLP (of the dense layers of a mixture-of-experts model)."""
        return self.ffn_hidden or 4 * self.hidden

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def attention_has_bias(self) -> bool:
        return self.bias if self.attention_bias is None else self.attention_bias

    @property
    def mlp_has_bias(self) -> bool:
        return self.bias if self.mlp_bias is None else self.mlp_bias

    @property
    def dispatch_element_bytes(self) -> float:
        """Bytes per element of the all-to-all that carries tokens to the experts (the
        forward's dispatch, the backward's combine gradient): 1 and the FP32 scale's share
        of its 1 x 128 tile under an FP8 dispatch (DeepSeek-V3, section 3.3.3), else the
        activations' own. The other all-to-all (the combine, the dispatch's gradient)
        stays in ``dtype_bytes``: "we retain them in BF16"."""
        return FP8_TILE_BYTES if self.fp8_dispatch else self.dtype_bytes

    @property
    def tokens(self) -> int:
        """Tokens in one microbatch: ``b * s``."""
        return self.microbatch_size * self.seq_len

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) routes its tokens to experts."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @property
    def mlp_activation(self) -> str:
        """The MLP's activation: ``activation``, else SwiGLU's silu when gated and GeLU not."""
        return self.activation or ("silu" if self.gated_mlp else "gelu")

    @property
    def norm_inputs_kept(self) -> int:
        """Distinct norm inputs a layer keeps: one per norm, but a parallel block's two
        norms read the same input (GPT-NeoX, Falcon's new decoder)."""
        if self.parallel_residual and self.norms_per_layer == 2:
            return 1
        return self.norms_per_layer

    @property
    def scores_beyond_mask(self) -> bool:
        """Whether the softmax sees more than the masked scores: a sink logit per head in
        its denominator (gpt-oss) or soft-capped scores (Gemma 2). torch's fused kernel
        takes neither, so ``pipesim run``'s executor writes that attention out."""
        return self.attention_sinks or self.attention_softcap is not None

    @property
    def post_norms(self) -> int:
        """Norms a layer applies to its sublayers' outputs before the residual add
        (Gemma 2 and 3's sandwich: two of its four), which read those outputs, not the
        residual stream."""
        return 2 if self.norms_per_layer == 4 else 0

    @property
    def rotary_width(self) -> int:
        """Features of each query and key head turned by position (latent attention: its
        rotary part; GPT-NeoX: ``rotary_pct`` of the head, as Hugging Face rounds it)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_size * self.rotary_fraction)

    def has_qk_norm(self, layer: int = 0) -> bool:
        """Whether layer ``layer`` normalises its queries and keys (Llama 4's L2 norms only
        where it turns them by position)."""
        return self.qk_norm is not None and (self.qk_norm != "l2" or layer not in self.nope_layers)

    def attention_window(self, layer: int = 0) -> int | None:
        """Keys a query of layer ``layer`` attends to at most: the sliding window where the
        layer slides and the window is shorter than the sequence, else ``None`` (causal over
        the whole sequence)."""
        if self.sliding_window is None or self.sliding_window >= self.seq_len or layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def attention_chunk_of(self, layer: int = 0) -> int | None:
        """The chunk layer ``layer``'s queries attend within (Llama 4's chunked attention)
        where it is shorter than the sequence, else ``None``."""
        if self.attention_chunk is None or self.attention_chunk >= self.seq_len or layer not in self.chunked_layers:
            return None
        return self.attention_chunk

    def layer_kind(self, layer: int) -> tuple[bool, int | None, int | None, bool]:
        """What makes layers unlike: a mixture of experts or not, the attention window, the
        attention chunk, and rotary positions or none (what the layer keeps: Llama 4's
        layers without them have no query and key norms). Layers of one kind cost the same."""
        return (self.is_moe_layer(layer), self.attention_window(layer), self.attention_chunk_of(layer),
                layer in self.nope_layers)

    def mlp_width(self, layer: int = 0, padded: bool = True) -> float:
        """MLP columns a token's activations pass through in ``layer``: the dense width, or
        its routed experts' (``k`` of them, times the capacity factor when ``padded``) plus
        the shared ones'."""
        if not self.is_moe_layer(layer):
            return self.ffn
        return self.moe.routed_width(padded) + self.moe.shared_ffn

    def layer_groups(self, first: int = 0, stop: int | None = None) -> list[tuple[int, int]]:
        """Layers ``[first, stop)`` grouped by kind (dense, mixture of experts): ``(a layer of
        the kind, how many)`` pairs. Layers of one kind are alike, so a stage's cost is one
        evaluation per kind times its count, however many layers it holds (a plan asks
        for thousands of stages)."""
        stop = self.layers if stop is None else stop
        if stop <= first:
            return []
        if self.moe is None and not self.sliding_layers and not self.chunked_layers and not self.nope_layers:
            return [(first, stop - first)]
        kinds: dict[tuple[bool, int | None, int | None, bool], list[int]] = {}
        for layer in range(first, stop):
            kinds.setdefault(self.layer_kind(layer), []).append(layer)
        return [(members[0], len(members)) for members in kinds.values()]

    def sum_over_layers(self, quantity: Callable[[int], float], first: int = 0, stop: int | None = None) -> float:
        """``sum(quantity(layer) for layer in range(first, stop))``, one evaluation per kind."""
        return sum(count * quantity(layer) for layer, count in self.layer_groups(first, stop))

    # parameters -------------------------------------------------------------------
    def layer_params(self, layer: int = 0, tp: int = 1, ep: int = 1) -> int:
        """Parameters of layer ``layer`` on one of ``tp`` tensor-parallel ranks (the whole
        layer at ``tp=1``), its share of every expert (all of them at ``ep=1``): what
        memory holds."""
        return weights.layer_params(self, self.is_moe_layer(layer), tp, ep)

    def layer_active_params(self, layer: int = 0) -> int:
        """Parameters of layer ``layer`` one token uses: its top-k routed experts only."""
        return weights.layer_active_params(self, self.is_moe_layer(layer))

    def norm_params(self) -> int:
        """One norm's weights: ``h`` (RMSNorm) or ``2h`` (LayerNorm)."""
        return self.hidden if self.rms_norm else 2 * self.hidden

    def token_table_params(self, tp: int = 1) -> int:
        """The token table (or an untied output layer, its shape) on one of ``tp`` ranks,
        split by vocabulary rows: ``ceil(V / tp)`` each, the last padded."""
        return -(-self.vocab // tp) * self.hidden

    def embedding_params(self, tp: int = 1) -> int:
        """Token (and learned position) embedding on one of ``tp`` ranks, on the first
        stage: the token table's shard, the position table whole on every rank."""
        rows = self.positions or self.seq_len
        return self.token_table_params(tp) + (rows * self.hidden if self.learned_positions else 0)

    def head_params(self, tp: int = 1) -> int:
        """Final norm and, when untied, the output projection (split by vocabulary rows),
        on the last stage."""
        return self.norm_params() + (0 if self.tied_embeddings else self.token_table_params(tp))

    def total_params(self) -> int:
        """Every parameter of the model, every expert included (a tied output head counted once)."""
        return self.sum_over_layers(self.layer_params) + self.embedding_params() + self.head_params()

    def mtp_params(self, tp: int = 1, ep: int = 1) -> int:
        """Parameters of the multi-token prediction modules on one of ``tp`` (and ``ep``)
        ranks, outside ``total_params`` as the published counts keep them (DeepSeek-V3's
        671B is the main model; README_WEIGHTS: "11.5B unique parameters" of MTP). Each of
        the ``mtp_depth`` modules (DeepSeek-V3 report, section 2.2) is a transformer block
        like the layer after the last (an MoE layer), a projection ``M`` of the normalised
        hidden state and next token's embedding, ``2h -> h`` (column-parallel), and three
        RMSNorms (the two inputs', its head's); the embedding and output head are the main
        model's, shared."""
        if not self.mtp_depth:
            return 0
        return self.mtp_depth * (self.layer_params(self.layers, tp, ep) + 2 * self.hidden * self.hidden // tp
                                 + 3 * self.norm_params())

    def active_params(self) -> int:
        """Parameters one token uses: the total less the routed experts it is not sent to.
        The embedding table counts whole, as the published figures count it (Mixtral's
        12.9B; DeepSeek-V3's 36.7B "including 0.9B for Embedding and 0.9B for the output
        Head"); FLOPs count only the matrices a token is multiplied by."""
        return self.sum_over_layers(self.layer_active_params) + self.embedding_params() + self.head_params()

    # FLOPs, per microbatch, forward ---------------------------------------------
    def attention_core_flops(self, layer: int = 0) -> float:
        """QK^T and PV of layer ``layer``, whole: ``2 s b s a (d_qk + d_v)`` (``4 s^2 b h``
        with heads of ``h / a``; the whole square, as Megatron counts; over a sliding window
        ``w`` twice the pairs it computes, ``2 s w - w^2`` for ``s^2``): the attention core's
        operations' FLOPs (``pipesim.model.operations``)."""
        return sum(operation.flops for operation in operations.attention_core(self, layer=layer))

    def layer_gemm_flops(self, layer: int = 0, tp: int = 1, sequence_parallel: bool = False,
                         padded: bool = True) -> float:
        """Forward FLOPs of layer ``layer``'s weight GEMMs on one of ``tp`` ranks (all of
        them at ``tp=1``): 2 per multiply-add of each matrix a token passes through (``k``
        routed experts, times the capacity factor when ``padded``), summed over the GEMMs
        the compute model times (``pipesim.model.operations.weight_gemms``)."""
        matrices = weights.layer_weights(self, self.is_moe_layer(layer))
        return sum(gemm.flops for gemm in operations.weight_gemms(matrices, self, tp, sequence_parallel, padded))

    def layer_flops(self, layer: int = 0, tp: int = 1, sequence_parallel: bool = False,
                    padded: bool = True) -> float:
        """Forward FLOPs of layer ``layer`` on one of ``tp`` ranks: its GEMMs and its
        attention core (split by heads)."""
        return self.layer_gemm_flops(layer, tp, sequence_parallel, padded) + self.attention_core_flops(layer) / tp

    def logits_flops(self) -> float:
        """Forward FLOPs of the output projection: ``2 s b h V``."""
        return sum(operation.flops for operation in operations.head_operations(self))

    def forward_flops(self) -> float:
        """Model FLOPs of the whole forward for one microbatch: what the tokens need,
        not the padding of expert capacity; the multi-token prediction modules' included
        (each a block, its projection and the shared head's logits once more)."""
        main = self.sum_over_layers(lambda layer: self.layer_flops(layer, padded=False)) + self.logits_flops()
        return main + self.mtp_depth * self.mtp_module_flops()

    def mtp_module_flops(self) -> float:
        """Forward FLOPs of one multi-token prediction module for one microbatch: its
        block, its ``2h -> h`` projection and the logits of the shared head."""
        return (self.layer_flops(self.layers, padded=False) + 2 * self.tokens * 2 * self.hidden * self.hidden
                + self.logits_flops())

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3x forward, no recompute): the
        numerator of MFU (Chowdhery et al. 2022, PaLM, appendix B, with the attention
        term counted as Megatron counts it)."""
        return 3 * self.forward_flops() / self.tokens

    def layer_recompute_flops(self, layer: int, recompute: str, tp: int = 1, sequence_parallel: bool = False,
                              padded: bool = True) -> float:
        """Forward FLOPs re-run in the backward of layer ``layer`` on one of ``tp`` ranks:
        the layer's forward (full), its attention core (selective), the recomputed share of
        its weight GEMMs (per-op: ``pipesim.model.per_op_checkpoint``) or latent attention's
        up-projections (norm-mla-up; the norms have no FLOPs)."""
        check_recompute(recompute)
        if recompute == "full":
            return self.layer_flops(layer, tp, sequence_parallel, padded)
        if recompute == "selective":
            return self.attention_core_flops(layer) / tp
        if recompute == PER_OP:
            matrices = weights.layer_weights(self, self.is_moe_layer(layer))
            return sum(gemm.per_op_recomputed * gemm.flops
                       for gemm in operations.weight_gemms(matrices, self, tp, sequence_parallel, padded))
        if recompute == NORM_MLA_UP:
            return sum(operation.flops for operation in operations.attention_block(self, tp, True, sequence_parallel,
                                                                                   layer=layer)
                       if operation.name in operations.UP_PROJECTIONS)
        return 0.0

    def recompute_flops(self, recompute: str) -> float:
        """Forward FLOPs re-run in the backward of one microbatch, whole model: every
        layer's forward (full), attention core (selective), recomputed GEMMs (per-op) or
        latent attention's up-projections (norm-mla-up); the output layer never."""
        check_recompute(recompute)
        return self.sum_over_layers(lambda layer: self.layer_recompute_flops(layer, recompute, padded=False))

    def tp_message_bytes(self, layer: int = 0) -> float:
        """Bytes of each of layer ``layer``'s tensor-parallel collectives (two in its
        forward, two in its input-gradient backward): the whole ``s b h`` activation, in a
        mixture-of-experts layer too (its experts' output is reduced over tp as a dense
        MLP's is)."""
        return self.tokens * self.hidden * self.dtype_bytes

    def boundary_bytes(self, tp: int = 1, sequence_parallel: bool = False) -> float:
        """Bytes of the activation passed between pipeline stages (and of its gradient)."""
        full = self.tokens * self.hidden * self.dtype_bytes
        return full / tp if sequence_parallel else full

    def expert_shards(self, tp: int) -> int:
        """Tensor-parallel ranks each routed expert is split over in a layout of ``tp``:
        ``expert_tp``, or ``tp`` when it is 0 (Megatron-Core's default)."""
        return self.expert_tp or tp

    def context_shard(self, cp: int) -> ModelSpec:
        """What one of ``cp`` context-parallel ranks computes on: ``s / cp`` tokens of each
        sequence (the learned position table keeps its rows; ``cp`` divides the sequence:
        ``pipesim.model.layout``). Its attention runs ``cp`` ring steps against the whole
        sequence's keys and values (``pipesim.model.operations.attention_core``)."""
        if cp == 1:
            return self
        return replace(self, seq_len=self.seq_len // cp, positions=self.positions or self.seq_len)

    def with_capacity_factor(self, factor: float | None) -> ModelSpec:
        """This model with each routed expert computing ``factor`` times its balanced share
        of token slots (``None``: dropless)."""
        if self.moe is None:
            raise ModelSpecError(f"--capacity-factor {factor}: {self.name} has no routed experts (the capacity "
                                 f"factor applies to mixture-of-experts models)")
        return replace(self, moe=replace(self.moe, capacity_factor=factor))

    def describe(self) -> dict:
        """The architecture and its derived sizes, for ``--json``."""
        document = {field.name: getattr(self, field.name) for field in fields(self)}
        document.update(
            kv_heads=self.num_kv_heads, ffn_hidden=self.ffn, head_dim=self.head_size,
            moe=asdict(self.moe) if self.moe else None, mla=asdict(self.mla) if self.mla else None,
            rope=asdict(self.rope), local_rope=asdict(self.local_rope) if self.local_rope else None,
            params=self.total_params(), active_params=self.active_params(), flops_per_token=self.flops_per_token(),
            mtp_params=self.mtp_params(),
        )
        return document


# norm-mla-up: DeepSeek-V3's (report, section 3.2.3): every RMSNorm's output and latent
# attention's up-projections recomputed in the backward (pipesim.model.activations)
NORM_MLA_UP = "norm-mla-up"
# per-op: torchtitan's SelectiveAC, per-op selective checkpointing of every block
# (pipesim.model.per_op_checkpoint)
RECOMPUTE = ("none", "selective", PER_OP, NORM_MLA_UP, "full")
QK_NORMS = (None, "head", "projection", "l2")
# MLP activations (a gated MLP applies it to the gate): SwiGLU's silu, GeLU exact or by its tanh
# approximation (GPT-2's gelu_new, Gemma's gelu_pytorch_tanh), ReLU, and gpt-oss's clamped SwiGLU,
# (up + 1) * gate * sigmoid(1.702 gate) with the gate clamped at most and up within the limit
CLAMPED_SWIGLU = "clamped-swiglu"
ACTIVATIONS = ("silu", "gelu", "gelu-tanh", "relu", CLAMPED_SWIGLU)


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ModelSpecError(f"--recompute {recompute!r}: use one of {', '.join(RECOMPUTE)}")


def moe_act_conflict(recompute: str) -> str | None:
    """Why Megatron-Core's ``moe_act`` recompute (``--recompute-moe-act``) cannot go beside
    ``--recompute recompute``, or None where it can: full recompute re-runs the whole layer
    already, and per-op runs no mixture of experts. The one rule ``simulate``, ``plan``
    and ``run`` refuse by."""
    if recompute == "full":
        return "full recompute already re-runs the whole layer"
    if recompute == PER_OP:
        return "per-op recompute does not run mixture-of-experts models"
    return None


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=50257)


LLAMA3_ROPE = Rope(theta=500000.0)
# Llama 3.1's rescaling (its config.json), the only release with a 405B model
LLAMA31_ROPE = Rope(theta=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_positions=8192)


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int, rope: Rope = LLAMA3_ROPE) -> ModelSpec:
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, seq_len=8192, vocab=128256, kv_heads=8,
                     ffn_hidden=ffn, gated_mlp=True, tied_embeddings=False, learned_positions=False, bias=False,
                     rms_norm=True, dropout=False, rope=rope)


def _deepseek(name: str, layers: int, hidden: int, heads: int, vocab: int, ffn: int, mla: LatentAttention,
              moe: MixtureOfExperts) -> ModelSpec:
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, seq_len=4096, vocab=vocab, ffn_hidden=ffn,
                     gated_mlp=True, tied_embeddings=False, learned_positions=False, bias=False, rms_norm=True,
                     dropout=False, mla=mla, moe=moe)


# GPT-3: Brown et al. 2020, Table 2.1 (1.3B with 16 heads of 128, as Megatron-LM's configs;
# GPT-2 lineage: tied embeddings, learned positions, biases, LayerNorm, dropout).
# Llama 3: Meta's model cards / config.json (GQA with 8 KV heads, SwiGLU, untied, RMSNorm).
# Mixtral-8x7B: Jiang et al. 2024 and its config.json (Mistral-7B's attention, every MLP 8
# SwiGLU experts of 14336, top 2; 32k context, trained here on 8192 as the Llama presets;
# its config.json's router_aux_loss_coef 0.02, DeepSeek's aux_loss_alpha 0.001).
# DeepSeek-V3 and V2-Lite: the technical reports and config.json (MLA; the first 3 / 1
# layers dense, the rest 256 experts top 8 + 1 shared / 64 top 6 + 2 shared; V3's routing
# limited to 4 of 8 expert groups, its weights times 2.5; pre-trained on 4K-token
# sequences). DeepSeek-V3's multi-token-prediction module (14B more) is not part of
# the 671B main model, nor of this preset (nor of the model Hugging Face builds).
PRESETS: dict[str, ModelSpec] = {
    "gpt3-1.3b": _gpt3("gpt3-1.3b", 24, 2048, 16),
    "gpt3-13b": _gpt3("gpt3-13b", 40, 5120, 40),
    "gpt3-175b": _gpt3("gpt3-175b", 96, 12288, 96),
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248, LLAMA31_ROPE),
    "mixtral-8x7b": replace(_llama3("mixtral-8x7b", 32, 4096, 32, 14336, Rope(theta=1e6)), vocab=32000,
                            moe=MixtureOfExperts(experts=8, experts_per_token=2, expert_ffn=14336,
                                                 balance_loss=0.02)),
    "deepseek-v3": _deepseek(
        "deepseek-v3", 61, 7168, 128, 129280, 18432,
        LatentAttention(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        MixtureOfExperts(experts=256, experts_per_token=8, expert_ffn=2048, shared_experts=1, dense_layers=(0, 1, 2),
                         gating="sigmoid", node_limit=4, expert_groups=8, group_scoring="top2-sum",
                         routed_scaling=2.5, balance_loss=0.001)),
    "deepseek-v2-lite": _deepseek(
        "deepseek-v2-lite", 27, 2048, 16, 102400, 10944,
        LatentAttention(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        MixtureOfExperts(experts=64, experts_per_token=6, expert_ffn=1408, shared_experts=2, dense_layers=(0,),
                         normalize_top_k=False, balance_loss=0.001)),
}


# config.json files of current Hugging Face families, shipped with pipesim so that
# ``--model qwen3-30b-a3b`` needs no download: each the keys of the model repository's
# public file that pipesim reads (the decoders' ``text_config`` for Llama 4; gpt-oss's
# without its MXFP4 ``quantization_config``, which training dequantizes), checked against
# the published parameter counts in tests/test_hf_config.py and test_hf_current_families.py
BUNDLED_CONFIGS = Path(__file__).parent / "data" / "hf_configs"


@functools.cache  # package data: one look at the folder a process (every command's --help lists them)
def bundled_models() -> dict[str, Path]:
    """The shipped config.json files by name (the file name without ``.json``), but those
    a preset of the same name shadows (``deepseek-v3``, ``mixtral-8x7b``, ...: their files
    stay readable by path)."""
    return {path.stem: path for path in sorted(BUNDLED_CONFIGS.glob("*.json")) if path.stem not in PRESETS}


def model_names() -> list[str]:
    """Every name ``--model`` takes: the presets, then the shipped config.json files."""
    return [*PRESETS, *bundled_models()]


def load_model(name_or_path: str, seq_len: int | None = None) -> ModelSpec:
    """A preset by name, a shipped config.json by name (``bundled_models``), or a
    Hugging Face style ``config.json`` by path."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    bundled = bundled_models().get(name_or_path)
    if bundled is not None:
        return replace(read_config(bundled, seq_len), name=name_or_path)
    path = Path(name_or_path)
    if path.suffix.lower() == ".json" or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"model config {path} does not exist")
        return read_config(path, seq_len)
    typed = name_or_path.lower()
    near = ([name for name in model_names() if name.startswith(typed)][:2]
            or difflib.get_close_matches(typed, model_names(), n=2, cutoff=0.75))
    guess = f" (did you mean {' or '.join(near)}?)" if near else ""
    raise ModelSpecError(f"unknown model {name_or_path!r}{guess}: use one of {', '.join(model_names())} "
                         f"or a config.json")


def read_config(path: Path, seq_len: int | None = None) -> ModelSpec:
    """The ``ModelSpec`` of the Hugging Face style ``config.json`` at ``path``."""
    try:
        data = json.loads(read_text(path, "model config (config.json)"))
    except json.JSONDecodeError as error:
        raise ModelSpecError(f"{path}: not valid JSON ({error})") from error
    from pipesim.model.hf_config import spec_from_hf_config

    return spec_from_hf_config(data, str(path), seq_len)


def model_spec(name: str, **overrides: int | None) -> ModelSpec:
    """A preset (or config.json) with any of its fields replaced (``None`` leaves a field
    as it is)."""
    spec = load_model(name, overrides.get("seq_len"))
    changes = {key: value for key, value in overrides.items() if value is not None}
    for key, value in changes.items():
        require_count(value, f"model field {key}")
    return replace(spec, **changes)


def finite_peak(peak: float, fallback: float) -> float:
    """A device's peak FLOP/s, or ``fallback`` where the topology does not say (ideal)."""
    return peak if math.isfinite(peak) and peak > 0 else fallback


def model_costs(spec: ModelSpec, num_stages: int, stage_peak_flops: list[float], **options):
    """Per-stage costs of ``spec``: ``pipesim.model.transformer_costs.model_costs`` (kept importable
    from here, where it used to live)."""
    from pipesim.model.transformer_costs import model_costs as derive

    return derive(spec, num_stages, stage_peak_flops, **options)
