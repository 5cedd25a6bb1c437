"""The operations a transformer layer runs, with their shapes: what a compute model times.

A layer's time is not its FLOPs over one efficiency: a GEMM's speed depends on its shape
(how its tiles fill the GPU's SMs, how long its inner dimension is), attention's on its
kernel (flash or not, causal) and the element-wise kernels' on bytes, not FLOPs. So a
layer is listed as the operations one tensor-parallel rank runs for one microbatch, and a
compute model (``pipesim.model.compute_model``) prices each one.

Three kinds of operation:

- ``Gemm``: ``count`` products of an ``m x k`` by a ``k x n`` matrix. When the ``k x n``
  operand is a weight, its backward is an input-gradient GEMM (``m x n`` by ``n x k``) and
  a weight-gradient GEMM (``k x m`` by ``m x n``, the ``W`` of a split backward); attention's
  ``QK^T`` and ``PV`` without flash attention have no weights, so both backward GEMMs are
  input gradient.
- ``FlashAttention``: one fused, causal attention kernel (forward; its backward reads the
  same shapes).
- ``MemoryBound``: element-wise kernels priced by the bytes they move
  (``pipesim.model.memory_traffic`` counts them).

``attention_core`` marks what selective recompute re-runs (Korthikanti et al. 2022): the
attention scores' GEMMs or kernel and their softmax and dropout.

A layer is its attention block and its MLP block, each listed by one function below, so a
new layer type replaces one block (a mixture-of-experts MLP, multi-head latent attention)
and keeps the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipesim.model.memory_traffic import layer_traffic_bytes
from pipesim.model.spec import ModelSpec


@dataclass(frozen=True)
class Gemm:
    """``count`` products of an ``m x k`` by a ``k x n`` matrix (dimensions per tp rank,
    fractional where tp does not divide them, as the FLOP counts are)."""

    name: str
    m: float
    k: float
    n: float
    count: float = 1
    weighted: bool = True  # the k x n operand is a parameter: its gradient is W work
    attention_core: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count


@dataclass(frozen=True)
class FlashAttention:
    """A fused causal attention kernel over ``batch`` sequences of ``seq`` tokens and
    ``heads`` query heads of ``head_dim`` on one tp rank. ``flops`` is QK^T and PV counted
    whole, as Megatron and the FLOP counts here count them; the kernel skips the masked
    half, which is the compute model's business."""

    name: str
    batch: int
    heads: float
    seq: int
    head_dim: float
    causal: bool = True
    attention_core: bool = True

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim


@dataclass(frozen=True)
class MemoryBound:
    """Element-wise kernels that move ``bytes`` through HBM in the forward."""

    name: str
    bytes: float
    attention_core: bool = False

    flops = 0.0


Operation = Gemm | FlashAttention | MemoryBound


def attention_block(spec: ModelSpec, tp: int, flash_attention: bool) -> tuple[Operation, ...]:
    """Multi-head (or grouped-query) self-attention, Megatron's tensor-parallel split: the
    QKV projection column-parallel, the output projection row-parallel."""
    h, tokens = spec.hidden, spec.tokens
    head_dim = h / spec.heads
    heads = spec.heads / tp
    qkv = Gemm("qkv", tokens, h, (h + 2 * spec.kv_width) / tp)
    output = Gemm("attention_out", tokens, h / tp, h)
    if flash_attention:
        core: tuple[Operation, ...] = (FlashAttention("attention", spec.microbatch_size, heads, spec.seq_len,
                                                      head_dim),)
    else:
        # batched over the microbatch's sequences and the rank's heads, the whole s x s square (masked after)
        batches = spec.microbatch_size * heads
        core = (Gemm("scores", spec.seq_len, head_dim, spec.seq_len, batches, weighted=False, attention_core=True),
                Gemm("context", spec.seq_len, spec.seq_len, head_dim, batches, weighted=False, attention_core=True))
    return (qkv, *core, output)


def mlp_block(spec: ModelSpec, tp: int) -> tuple[Operation, ...]:
    """The MLP: up (with the gate fused beside it for SwiGLU) column-parallel, down
    row-parallel."""
    h, f, tokens = spec.hidden, spec.ffn, spec.tokens
    up_width = (spec.mlp_matrices - 1) * f
    return (Gemm("mlp_in", tokens, h, up_width / tp), Gemm("mlp_out", tokens, f / tp, h))


def memory_bound_kernels(spec: ModelSpec, tp: int, sequence_parallel: bool,
                         flash_attention: bool) -> tuple[Operation, ...]:
    """Norms, residual adds, activations, rotary; and the scores' softmax and dropout when
    attention is not fused."""
    plain, scores = layer_traffic_bytes(spec, tp, sequence_parallel, flash_attention)
    kernels: tuple[Operation, ...] = (MemoryBound("elementwise", plain),)
    if scores:
        kernels += (MemoryBound("softmax_dropout", scores, attention_core=True),)
    return kernels


def layer_operations(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                     flash_attention: bool = True) -> tuple[Operation, ...]:
    """Every operation of one transformer layer's forward, for one microbatch on one tp rank."""
    return (*attention_block(spec, tp, flash_attention), *mlp_block(spec, tp),
            *memory_bound_kernels(spec, tp, sequence_parallel, flash_attention))


def head_operations(spec: ModelSpec, tp: int = 1) -> tuple[Operation, ...]:
    """The output layer on the last stage: logits over the vocabulary (vocab-parallel)."""
    return (Gemm("logits", spec.tokens, spec.hidden, spec.vocab / tp),)
