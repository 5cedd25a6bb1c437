"""Every weight matrix of a transformer layer, written once, and what follows from that
one list: parameters (the whole layer, the part one token uses, the part one
tensor-parallel rank holds) and, through ``pipesim.model.operations``, the GEMMs that
multiply by them (their shapes on one tensor-parallel rank, which the compute model
times, and their FLOPs, which MFU counts). Parameters and timed GEMMs are two readings of
this one list, so they cannot disagree on a matrix.

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

Each matrix names the ``gemm`` that multiplies by it: matrices read by one input and
computed as one kernel share it (Megatron-LM's fused QKV projection, the gate and up
projections side by side), and the GEMM's output columns are theirs together.

Norm weights are held whole on every rank. A mixture-of-experts layer's routed experts
are a *stack* of alike matrices: the layer holds all of them (memory counts every
parameter) and a token runs ``k`` of them (FLOPs and active parameters count ``k``),
``k`` times the capacity factor for the time an expert spends on its padded capacity
(``pipesim.model.experts``). Expert parallelism places whole experts: over ``ep``
ranks each holds ``E / ep`` of the stack (``pipesim.cluster.mapping`` says which ranks
form a group), and splits them over tp as a dense MLP (expert tensor parallelism
equal to tp, Megatron-Core's default).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipesim.model.errors import ModelSpecError

if TYPE_CHECKING:
    from pipesim.model.spec import ModelSpec

COLUMN, ROW, KV, WHOLE = "column", "row", "kv", "whole"
QKV_GEMM = "qkv"  # the one GEMM pipesim times Q, K and V as (Megatron-LM's fused projection)


@dataclass(frozen=True)
class Weight:
    """One weight matrix (``fan_in x fan_out``, optionally with a bias), or ``stack`` alike
    ones side by side; ``routed``: a token uses ``experts_per_token`` of the stack;
    ``gemm``: the GEMM that multiplies by it (shared by the matrices fused into one)."""

    name: str
    fan_in: int
    fan_out: int
    split: str
    gemm: str
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
        query = ((Weight("query down", h, mla.q_lora_rank, WHOLE, "query_down", out_bias),
                  Weight("query up", mla.q_lora_rank, heads * mla.qk_head_dim, COLUMN, "query_up"))
                 if mla.q_lora_rank else (Weight("query", h, heads * mla.qk_head_dim, COLUMN, "query"),))
        return (*query,
                Weight("key-value down", h, mla.kv_lora_rank + mla.qk_rope_head_dim, WHOLE, "kv_down", out_bias),
                Weight("key-value up", mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), COLUMN,
                       "kv_up"),
                Weight("output", spec.v_width, h, ROW, "attention_out", out_bias))
    qkv_bias = out_bias or spec.qkv_bias
    return (Weight("query", h, spec.q_width, COLUMN, QKV_GEMM, qkv_bias),
            Weight("key", h, spec.kv_width, KV, QKV_GEMM, qkv_bias),
            Weight("value", h, spec.kv_width, KV, QKV_GEMM, qkv_bias),
            Weight("output", spec.v_width, h, ROW, "attention_out", out_bias))


def mlp_matrices(spec: ModelSpec, width: int, label: str, gemm: str, stack: int = 1, routed: bool = False,
                 bias: bool = False) -> tuple[Weight, ...]:
    """A dense MLP of ``width``: gate and up (gated: SwiGLU, GeGLU) or up alone, then down;
    the gate and up projections one GEMM (``{gemm}_in``), the down projection ``{gemm}_out``."""
    h = spec.hidden
    inputs = ("gate", "up") if spec.gated_mlp else ("up",)
    return (*(Weight(f"{label} {name}", h, width, COLUMN, f"{gemm}_in", bias, stack, routed) for name in inputs),
            Weight(f"{label} down", width, h, ROW, f"{gemm}_out", bias, stack, routed))


def mlp_weights(spec: ModelSpec, moe_layer: bool) -> tuple[Weight, ...]:
    """The MLP's matrices: dense, or the router, the routed experts and the shared ones."""
    if not moe_layer:
        return mlp_matrices(spec, spec.ffn, "mlp", "mlp", bias=spec.mlp_has_bias)
    moe = spec.moe
    weights = (Weight("router", spec.hidden, moe.experts, WHOLE, "router", moe.router_bias),
               *mlp_matrices(spec, moe.expert_ffn, "expert", "expert", stack=moe.experts, routed=True,
                             bias=spec.mlp_has_bias))
    if moe.shared_ffn:
        weights += mlp_matrices(spec, moe.shared_ffn, "shared expert", "shared_expert", bias=spec.mlp_has_bias)
    if moe.shared_expert_gate:
        weights += (Weight("shared expert gate", spec.hidden, 1, WHOLE, "shared_expert_gate"),)
    return weights


@functools.lru_cache(maxsize=256)
def layer_weights(spec: ModelSpec, moe_layer: bool) -> tuple[Weight, ...]:
    """Every weight matrix of a layer (dense MLP, or mixture of experts when ``moe_layer``)."""
    return attention_weights(spec) + mlp_weights(spec, moe_layer)


def norm_params(spec: ModelSpec) -> int:
    """Norm weights of one layer, and the other vectors held whole on every rank: its
    ``norms_per_layer`` norms (RMSNorm: a scale; LayerNorm: a scale and a shift), MLA's
    norms on its latents, the query and key norms (Qwen3 and Gemma 3: one head wide,
    shared by the heads; OLMoE: over the whole Q and K projections) and the attention
    sinks (gpt-oss: one logit per head)."""
    per_element = 1 if spec.rms_norm else 2
    latents = 0
    if spec.mla is not None:
        latents = (spec.mla.q_lora_rank or 0) + spec.mla.kv_lora_rank
    if spec.qk_norm == "head":
        latents += 2 * spec.head_size
    elif spec.qk_norm == "projection":
        latents += spec.q_width + spec.kv_width
    sinks = spec.heads if spec.attention_sinks else 0
    return per_element * (spec.norms_per_layer * spec.hidden + latents) + sinks


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


def _split(value: int, tp: int, spec: ModelSpec, name: str, flag: str = "--tp") -> int:
    if value % tp:
        raise ModelSpecError(f"{flag} {tp} does not divide the {value} columns of {spec.name}'s {name} matrix")
    return value // tp


def shard(weight: Weight, spec: ModelSpec, tp: int) -> tuple[int, int]:
    """(rows, columns) of one matrix of ``weight``'s stack on one of ``tp`` ranks: the
    ``k x n`` operand of its GEMM there. A routed expert's matrices are split over the
    expert tensor-parallel ranks instead (``ModelSpec.expert_shards``: ``tp`` unless
    parallel folding gives the experts their own)."""
    flag = "--tp"
    if weight.routed and spec.expert_tp:
        tp, flag = spec.expert_tp, "--etp"
    if tp == 1 or weight.split == WHOLE:
        return weight.fan_in, weight.fan_out
    if weight.split == ROW:  # inputs split; the bias is added after the reduction, whole on every rank
        return _split(weight.fan_in, tp, spec, weight.name, flag), weight.fan_out
    if weight.split == KV:
        return weight.fan_in, weight.fan_out // spec.num_kv_heads * kv_heads_per_shard(spec, tp)
    return weight.fan_in, _split(weight.fan_out, tp, spec, weight.name, flag)


def shard_params(weight: Weight, spec: ModelSpec, tp: int) -> int:
    """Parameters of one matrix of ``weight``'s stack on one of ``tp`` ranks: its shard and
    the bias of the columns it computes (a row-parallel bias whole, as ``shard`` keeps
    every column)."""
    rows, columns = shard(weight, spec, tp)
    return rows * columns + (columns if weight.bias else 0)


def stack_on_rank(weight: Weight, ep: int = 1) -> int:
    """Matrices of ``weight``'s stack one rank holds: a routed stack split over ``ep``
    expert-parallel ranks (``ep`` divides it: ``pipesim.model.layout``), anything else whole."""
    return weight.stack // ep if weight.routed else weight.stack


@functools.lru_cache(maxsize=1024)
def layer_params(spec: ModelSpec, moe_layer: bool, tp: int = 1, ep: int = 1) -> int:
    """Parameters of a layer on one of ``tp`` tensor-parallel and ``ep`` expert-parallel
    ranks (all of it at ``tp = ep = 1``): its share of every expert."""
    return sum(stack_on_rank(weight, ep) * shard_params(weight, spec, tp)
               for weight in layer_weights(spec, moe_layer)) + norm_params(spec)


@functools.lru_cache(maxsize=1024)
def routed_params(spec: ModelSpec, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one mixture-of-experts layer's routed experts on one rank: the part of
    ``layer_params`` whose gradients are reduced over the expert data-parallel group
    rather than over every replica (``pipesim.cluster.mapping``)."""
    if spec.moe is None:
        return 0
    return sum(stack_on_rank(weight, ep) * shard_params(weight, spec, tp)
               for weight in layer_weights(spec, True) if weight.routed)


@functools.lru_cache(maxsize=1024)
def layer_active_params(spec: ModelSpec, moe_layer: bool) -> int:
    """Parameters a token's forward pass uses: the top-k routed experts of the stack."""
    top_k = spec.moe.experts_per_token if moe_layer else 0
    return sum((top_k if weight.routed else weight.stack) * weight.params
               for weight in layer_weights(spec, moe_layer)) + norm_params(spec)
