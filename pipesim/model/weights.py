"""Every weight matrix of a transformer layer, written once, and what follows from that
one list: parameters (the whole layer, the part one token uses, the part one
tensor-parallel rank holds) and the forward FLOPs of its GEMMs on one tensor-parallel rank.

A layer is its attention's matrices and its MLP's. How tensor parallelism (Megatron-LM,
Shoeybi et al. 2019) splits each one:

- ``COLUMN``: outputs split over the tp ranks (Q, the up and gate projections, MLA's
  up-projections); weight and bias / tp.
- ``ROW``: inputs split (the attention output, the down projection); the weight / tp,
  the bias whole on every rank (it is added once, after the reduction).
- ``KV``: the K and V projections, split by key-value head; with more tp ranks than
  key-value heads (tp a multiple of them) each head is replicated on ``tp / kv_heads``
  ranks, as Megatron-LM does, so a rank holds and computes one whole head.
- ``WHOLE``: held and run whole on every rank: MLA's down-projections to the latents and
  the MoE router. With sequence parallelism a rank runs them on its ``1/tp`` of the
  tokens.

Norm weights are held whole on every rank. A mixture-of-experts layer's routed experts
are a *stack* of alike matrices: the layer holds all of them (memory counts every
parameter) and a token runs ``k`` of them (FLOPs and active parameters count ``k``),
``k`` times the capacity factor for the time an expert spends on its padded capacity
(``pipesim.model.experts``). A multiply-add is 2 FLOPs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipesim.model.errors import ModelSpecError

if TYPE_CHECKING:
    from pipesim.model.spec import ModelSpec

COLUMN, ROW, KV, WHOLE = "column", "row", "kv", "whole"


@dataclass(frozen=True)
class Weight:
    """One weight matrix (``fan_in x fan_out``, optionally with a bias), or ``stack`` alike
    ones side by side; ``routed``: a token uses ``experts_per_token`` of the stack."""

    name: str
    fan_in: int
    fan_out: int
    split: str
    bias: bool = False
    stack: int = 1
    routed: bool = False

    @property
    def params(self) -> int:
        """Parameters of one matrix of the stack."""
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)


def attention_weights(spec: ModelSpec) -> tuple[Weight, ...]:
    """Q, K, V and output projections, or MLA's down- and up-projections."""
    h, out_bias = spec.hidden, spec.attention_has_bias
    if spec.mla is not None:
        mla, heads = spec.mla, spec.heads
        query = ((Weight("query down", h, mla.q_lora_rank, WHOLE, out_bias),
                  Weight("query up", mla.q_lora_rank, heads * mla.qk_head_dim, COLUMN))
                 if mla.q_lora_rank else (Weight("query", h, heads * mla.qk_head_dim, COLUMN),))
        return (*query,
                Weight("key-value down", h, mla.kv_lora_rank + mla.qk_rope_head_dim, WHOLE, out_bias),
                Weight("key-value up", mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), COLUMN),
                Weight("output", spec.v_width, h, ROW, out_bias))
    qkv_bias = out_bias or spec.qkv_bias
    return (Weight("query", h, spec.q_width, COLUMN, qkv_bias),
            Weight("key", h, spec.kv_width, KV, qkv_bias),
            Weight("value", h, spec.kv_width, KV, qkv_bias),
            Weight("output", spec.v_width, h, ROW, out_bias))


def mlp_matrices(spec: ModelSpec, width: int, label: str, stack: int = 1, routed: bool = False,
                 bias: bool = False) -> tuple[Weight, ...]:
    """A dense MLP of ``width``: gate and up (gated: SwiGLU, GeGLU) or up alone, then down."""
    h = spec.hidden
    inputs = ("gate", "up") if spec.gated_mlp else ("up",)
    return (*(Weight(f"{label} {name}", h, width, COLUMN, bias, stack, routed) for name in inputs),
            Weight(f"{label} down", width, h, ROW, bias, stack, routed))


def mlp_weights(spec: ModelSpec, moe_layer: bool) -> tuple[Weight, ...]:
    """The MLP's matrices: dense, or the router, the routed experts and the shared ones."""
    if not moe_layer:
        return mlp_matrices(spec, spec.ffn, "mlp", bias=spec.mlp_has_bias)
    moe = spec.moe
    weights = (Weight("router", spec.hidden, moe.experts, WHOLE),
               *mlp_matrices(spec, moe.expert_ffn, "expert", stack=moe.experts, routed=True, bias=spec.mlp_has_bias))
    if moe.shared_ffn:
        weights += mlp_matrices(spec, moe.shared_ffn, "shared expert", bias=spec.mlp_has_bias)
    if moe.shared_expert_gate:
        weights += (Weight("shared expert gate", spec.hidden, 1, WHOLE),)
    return weights


@functools.lru_cache(maxsize=256)
def layer_weights(spec: ModelSpec, moe_layer: bool) -> tuple[Weight, ...]:
    """Every weight matrix of a layer (dense MLP, or mixture of experts when ``moe_layer``)."""
    return attention_weights(spec) + mlp_weights(spec, moe_layer)


def norm_params(spec: ModelSpec) -> int:
    """Norm weights of one layer: its ``norms_per_layer`` norms (RMSNorm: a scale;
    LayerNorm: a scale and a shift) and MLA's norms on its latents."""
    per_element = 1 if spec.rms_norm else 2
    latents = 0
    if spec.mla is not None:
        latents = (spec.mla.q_lora_rank or 0) + spec.mla.kv_lora_rank
    return per_element * (spec.norms_per_layer * spec.hidden + latents)


def kv_heads_per_shard(spec: ModelSpec, tp: int) -> int:
    """Key-value heads one tp rank holds: ``kv_heads / tp``, or one (replicated) when tp
    is a multiple of them."""
    kv_heads = spec.num_kv_heads
    if kv_heads % tp == 0:
        return kv_heads // tp
    if tp % kv_heads == 0:
        return 1
    raise ModelSpecError(f"--tp {tp} neither divides the {kv_heads} key-value heads of {spec.name} nor is a "
                         f"multiple of them")


def _split(value: int, tp: int, spec: ModelSpec, name: str) -> int:
    if value % tp:
        raise ModelSpecError(f"--tp {tp} does not divide the {value} columns of {spec.name}'s {name} matrix")
    return value // tp


def shard(weight: Weight, spec: ModelSpec, tp: int) -> tuple[int, int]:
    """(matrix entries, bias entries) of one matrix of ``weight``'s stack on one of ``tp`` ranks."""
    bias = weight.fan_out if weight.bias else 0
    if tp == 1 or weight.split == WHOLE:
        return weight.fan_in * weight.fan_out, bias
    if weight.split == ROW:  # inputs split; the bias is added after the reduction, whole on every rank
        return _split(weight.fan_in, tp, spec, weight.name) * weight.fan_out, bias
    if weight.split == KV:
        columns = weight.fan_out // spec.num_kv_heads * kv_heads_per_shard(spec, tp)
    else:
        columns = _split(weight.fan_out, tp, spec, weight.name)
    return weight.fan_in * columns, columns if weight.bias else 0


def layer_params(spec: ModelSpec, moe_layer: bool, tp: int = 1) -> int:
    """Parameters of a layer on one of ``tp`` ranks (all of it at ``tp=1``): every expert."""
    return sum(weight.stack * sum(shard(weight, spec, tp)) for weight in layer_weights(spec, moe_layer)) \
        + norm_params(spec)


def layer_active_params(spec: ModelSpec, moe_layer: bool) -> int:
    """Parameters a token's forward pass uses: the top-k routed experts of the stack."""
    top_k = spec.moe.experts_per_token if moe_layer else 0
    return sum((top_k if weight.routed else weight.stack) * weight.params
               for weight in layer_weights(spec, moe_layer)) + norm_params(spec)


def layer_gemm_flops_per_token(spec: ModelSpec, moe_layer: bool, tp: int = 1, sequence_parallel: bool = False,
                               padded: bool = True) -> float:
    """Forward FLOPs per token of a layer's weight GEMMs on one of ``tp`` ranks: 2 per
    multiply-add of each matrix a token passes through, ``k`` routed experts (times the
    capacity factor when ``padded``); whole matrices on every rank, over ``1/tp`` of the
    tokens with sequence parallelism."""
    routed = spec.moe.routed_slots(padded) if moe_layer else 0.0
    flops = 0.0
    for weight in layer_weights(spec, moe_layer):
        uses = routed if weight.routed else weight.stack
        matmul, _ = shard(weight, spec, tp)
        share = 1 / tp if weight.split == WHOLE and sequence_parallel else 1.0
        flops += 2 * uses * matmul * share
    return flops

