"""Time a transformer layer spends in memory-bound kernels, which FLOPs do not see.

Besides its GEMMs, a layer runs element-wise kernels (norms, bias + dropout + residual
adds, the MLP activation, rotary embeddings) and, without flash attention, a softmax and
a dropout over the ``a x s x s`` attention scores. Their time is set by the bytes they
move through HBM, not by FLOPs: for a GPT layer it is a few percent of the step at
h = 25600 and tens of percent at h = 2304 (the score tensors grow with ``a*s`` per token
while the GEMMs grow with ``h``). Every compute model charges them at the GPU's memory
bandwidth (``pipesim.model.compute_model``): without them neither one efficiency nor the
GEMMs' own speed explains small and large models alike (benchmarks/published.py).

Forward traffic per token, in elements of the activation dtype (reads + writes, fused
kernels as Megatron-LM fuses them), plus one byte per dropout-mask element:

    norms                 2 x (read h + write h)                        = 4h
    residual adds         2 x (read 2h + write h)                       = 6h   (+ 2h mask bytes)
    MLP activation        GeLU: read f + write f; SwiGLU: read 2f + write f
                          (a mixture of experts: f = its routed slots' C k f_e + shared width)
    rotary (no learned positions)  read + write Q and K                 = 2(a d + k)
                          (latent attention: only the rotary parts, 2 (a + 1) d_rope)
    scores, no flash      softmax: read + write a*s; dropout: read + write a*s (+ a*s mask)

Norms and residual adds are whole on every tensor-parallel rank unless sequence
parallelism shards them; the rest is split by tp. The backward moves about 1.5x the
forward's bytes (each kernel reads its saved input and the incoming gradient and writes
one gradient), full recompute repeats the forward's, selective recompute the scores'
(applied per operation by ``pipesim.model.compute_model.block_time``). Kernels reach
``HBM_EFFICIENCY`` of the datasheet bandwidth (``memory_seconds``).

The optimizer step is memory-bound too: a fused Adam reads and writes every byte of
state it keeps per parameter (weights, gradients, optimizer state: 16 bytes in mixed
precision, the optimizer's share / dp under ZeRO-1), ``2 x 16 = 32`` bytes per parameter
on the device. It is small next to a large pipeline's step but a few percent of a
one-stage, one-replica step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipesim.model.spec import ModelSpec

BACKWARD_TRAFFIC = 1.5
HBM_EFFICIENCY = 0.85  # streaming element-wise kernels reach ~80-90% of HBM peak


def layer_traffic_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                        flash_attention: bool = True, layer: int = 0) -> tuple[float, float]:
    """(forward bytes of the element-wise kernels outside attention, forward bytes of the
    score softmax and dropout) for layer ``layer`` and one microbatch on one tp rank: the
    MLP activation over the columns a token passes through (its routed experts' in a
    mixture-of-experts layer), rotary over the query and key columns that carry it."""
    h, d = spec.hidden, spec.dtype_bytes
    mask = 1 if spec.dropout else 0
    replicated = (4 * h + 6 * h) * d + 2 * h * mask
    activation = activation_bytes_per_token(spec, layer)
    rotary = 0 if spec.learned_positions else 2 * rotary_columns(spec) * d
    per_token = replicated / (tp if sequence_parallel else 1) + (activation + rotary) / tp
    scores = 0.0
    if not flash_attention:
        per_element = 2 * d + ((2 * d + 1) if spec.dropout else 0)
        scores = spec.heads * spec.seq_len * per_element / tp
    return spec.tokens * per_token, spec.tokens * scores


def activation_bytes_per_token(spec: ModelSpec, layer: int = 0, width: float | None = None) -> float:
    """The MLP activation's forward bytes per token before tp: GeLU reads ``f`` and writes
    ``f``, SwiGLU reads ``2f`` and writes ``f`` (``f`` a mixture of experts' routed slots'
    and shared width, or ``width`` where given: a part of them)."""
    return (3 if spec.gated_mlp else 2) * (spec.mlp_width(layer) if width is None else width) * spec.dtype_bytes


def recomputed_activation_bytes(spec: ModelSpec, tp: int = 1, layer: int = 0) -> float:
    """Of ``layer_traffic_bytes``' element-wise bytes, the MLP activation's when every
    backward re-runs it: a mixture of experts under FP8 caching keeps the activation's
    inputs and recomputes its output, the routed and shared experts' alike; in 16-bit with
    ``moe_act`` recompute the routed experts' (``pipesim.model.activations``); 0 otherwise."""
    if not spec.is_moe_layer(layer):
        return 0.0
    if spec.fp8:
        return spec.tokens * activation_bytes_per_token(spec, layer) / tp
    if spec.moe_act_recompute:
        return spec.tokens * activation_bytes_per_token(spec, layer, spec.moe.routed_width()) / tp
    return 0.0


def norm_traffic_bytes(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Of ``layer_traffic_bytes``' element-wise bytes, the norms' (``4h`` per token, whole
    on every tp rank unless sequence parallelism shards them): what a backward that
    recomputes the norms' outputs moves again."""
    return spec.tokens * 4 * spec.hidden * spec.dtype_bytes / (tp if sequence_parallel else 1)


def rotary_columns(spec: ModelSpec) -> int:
    """Query and key columns rotary embeddings rotate: all of Q and K (``h + k`` for GPT
    shapes), or MLA's rotary parts (``a d_rope`` of the queries, one shared ``d_rope`` key)."""
    if spec.mla is not None:
        return (spec.heads + 1) * spec.mla.qk_rope_head_dim
    return spec.q_width + spec.kv_width


def memory_seconds(num_bytes: float, bandwidth: float) -> float:
    """Seconds to stream ``num_bytes`` through HBM of ``bandwidth`` bytes/s at the
    efficiency streaming kernels reach: the one price of memory-bound work (element-wise
    kernels, the optimizer, a GEMM's own reads and writes)."""
    return num_bytes / (bandwidth * HBM_EFFICIENCY)


def optimizer_step_seconds(params: float, state_bytes_per_param: float, bandwidth: float) -> float:
    """Seconds of one optimizer step over ``params`` parameters that keep
    ``state_bytes_per_param`` bytes each: read and written once, at ``bandwidth``."""
    return memory_seconds(2 * params * state_bytes_per_param, bandwidth)
