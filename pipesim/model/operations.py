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

The weighted GEMMs are not written here: they are read off the layer's list of weight
matrices (``pipesim.model.weights``), one GEMM per group of matrices fused into one kernel,
its ``k x n`` their shard on a tp rank, so what is timed is what is counted as parameters
(each GEMM carries the share of its columns torchtitan's per-op checkpointing re-runs:
``pipesim.model.per_op_checkpoint``).
Their rows ``m`` are the tokens the matrix sees on a rank:

- the microbatch's ``b s`` tokens for column- and row-parallel matrices (sequence
  parallelism gathers them first);
- ``b s / tp`` for matrices held whole on every rank (the router, MLA's down-projections)
  under sequence parallelism, which run on the rank's own shard of the sequence;
- for a mixture of experts' routed experts, a batch of ``E`` GEMMs (one per expert, a
  grouped GEMM) of ``C k T / E`` rows each: ``T`` tokens sent to ``k`` experts each,
  spread evenly over the ``E`` experts and padded to the capacity factor ``C`` (dropless:
  ``C = 1``; ``pipesim.model.experts``). Each expert's GEMM is a small one, so its tiles
  and waves fill the GPU worse than a dense MLP of the same FLOPs: DeepSeek-V3 at 4096
  tokens gives each of its 256 experts 128 rows.

A layer is its attention block (the projections around the attention core: Megatron's
fused QKV, or multi-head latent attention's low-rank projections with its own head
widths) and its MLP block (dense, or router, routed experts and shared experts).

Expert and context parallelism change what one rank runs:

- over ``ep`` expert-parallel ranks a rank holds ``E / ep`` whole experts and receives,
  from the ``ep`` ranks of its group, the tokens routed to them: with a balanced router
  ``E / ep`` GEMMs of ``C k (ep T) / E`` rows each, the same routed rows as without
  expert parallelism in fewer, taller GEMMs (which fill the GPU better);
- over ``cp`` context-parallel ranks a rank holds ``s / cp`` tokens of each sequence
  (``ModelSpec.context_shard``): every GEMM and element-wise kernel runs on them, and its
  attention is ring attention's ``cp`` steps, its queries against one ``s / cp`` block of
  keys and values each. With Megatron-Core's causal load balancing (the sequence cut in
  ``2 cp`` chunks, rank ``i`` holding chunks ``i`` and ``2 cp - 1 - i``) every step does
  the same work, ``(s / cp)^2 / 2`` query-key pairs, the work of a causal kernel over
  ``s / cp`` tokens: so a step is timed as one, and the ``cp`` steps add up to the causal
  work of the whole sequence over ``cp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipesim.model.loss_traffic import cross_entropy_bytes
from pipesim.model.memory_traffic import layer_traffic_bytes, norm_traffic_bytes, recomputed_activation_bytes
from pipesim.model.per_op_checkpoint import recomputed_matrices
from pipesim.model.ring_merge import ring_merge_bytes
from pipesim.model.weights import (
    WHOLE,
    Weight,
    attention_weights,
    kv_heads_per_shard,
    mlp_weights,
    shard,
    stack_on_rank,
)

if TYPE_CHECKING:
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
    fp8: bool = False  # run in FP8 with its casts (pipesim.model.compute_model)
    amax_pass: bool = False  # FP8 with current scaling: each cast's input is read once more first
    per_op_recomputed: float = 0.0  # share of its columns --recompute per-op re-runs (pipesim.model.per_op_checkpoint)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count


@dataclass(frozen=True)
class FlashAttention:
    """A fused causal attention kernel over ``batch`` sequences of ``seq`` tokens and
    ``heads`` query heads on one tp rank, each with queries and keys of ``head_dim`` and
    values of ``value_dim`` (``None``: ``head_dim``; multi-head latent attention's values
    are narrower), run ``steps`` times one after another (ring attention's steps under
    context parallelism, each the same work: see the module). ``flops`` is QK^T and PV
    counted whole, as Megatron and the FLOP counts here count them; the kernel skips the
    masked half, which is the compute model's business."""

    name: str
    batch: int
    heads: float
    seq: int
    head_dim: float
    causal: bool = True
    attention_core: bool = True
    value_dim: float | None = None
    steps: int = 1
    window: int | None = None  # sliding window: a query sees itself and the window - 1 keys before it
    chunk: int | None = None  # chunked attention: a query sees the keys of its own chunk, causally

    @property
    def flops(self) -> float:
        value_dim = self.head_dim if self.value_dim is None else self.value_dim
        return 2.0 * self.batch * self.heads * self.square() * (self.head_dim + value_dim) * self.steps

    def square(self) -> float:
        """Query-key pairs counted: the whole ``s^2`` square; over a window ``w < s``
        ``2 s w - w^2``, twice the ``s w - w^2 / 2`` pairs the kernel computes as ``s^2`` is
        twice a causal kernel's (the count stays Megatron's, and reaches ``s^2`` at ``w = s``);
        in chunks of ``c < s`` each chunk's own square, ``floor(s/c) c^2 + (s mod c)^2``."""
        if self.chunk is not None and self.chunk < self.seq:
            whole, rest = divmod(self.seq, self.chunk)
            return float(whole * self.chunk * self.chunk + rest * rest)
        if self.window is None or self.window >= self.seq:
            return float(self.seq * self.seq)
        return 2.0 * self.seq * self.window - self.window * self.window


@dataclass(frozen=True)
class MemoryBound:
    """Element-wise kernels that move ``bytes`` through HBM in the forward."""

    name: str
    bytes: float
    attention_core: bool = False
    norm_bytes: float = 0.0  # of ``bytes``, what the norms move (what --recompute norm-mla-up re-runs)
    recomputed_bytes: float = 0.0  # of ``bytes``, what every backward re-runs (an activation whose output is not kept)
    backward_bytes: float | None = None  # what its backward moves; None: BACKWARD_TRAFFIC x ``bytes`` (memory_traffic)

    flops = 0.0


Operation = Gemm | FlashAttention | MemoryBound
# latent attention's up-projections: what --recompute norm-mla-up re-runs (pipesim.model.weights);
# without a query latent (DeepSeek-V2-Lite) the query projection, which reads the layer's
# recomputed norm output, is re-run in its place ("query" names no other latent-attention GEMM,
# and norm-mla-up's other models have none: their Q, K and V are one "qkv")
UP_PROJECTIONS = ("query_up", "kv_up", "query")


def precision(spec: ModelSpec, in_fp8: bool = True) -> dict:
    """A weight GEMM's precision fields under ``spec``: FP8 when the model runs FP8 and the
    GEMM is not one kept in BF16, with the amax pass of current scaling (``FP8_SCALINGS``
    in ``pipesim.model.spec``)."""
    fp8 = spec.fp8 and in_fp8
    return {"fp8": fp8, "amax_pass": fp8 and spec.fp8_scaling == "current"}


# GEMMs kept in BF16 when the others run in FP8: the MoE gating (DeepSeek-V3's recipe, section
# 3.3.1: "the embedding module, the output head, MoE gating modules, normalization operators, and
# attention operators" stay in higher precision); the output head's logits are not a weight GEMM here
BF16_GEMMS = ("router", "shared_expert_gate")


def gemm_rows(weight: Weight, spec: ModelSpec, tp: int, sequence_parallel: bool, padded: bool,
              ep: int = 1) -> float:
    """Rows of the GEMMs that multiply by ``weight`` on one tp rank: the tokens each matrix
    of its stack sees (see the module docstring); a routed expert sees the tokens of the
    ``ep`` ranks of its expert-parallel group, each gathered over its expert
    tensor-parallel group: ``s / tp`` a rank under sequence parallelism times the ``etp``
    ranks (``ModelSpec.expert_shards``), the sequence's ``s`` when ``etp`` is ``tp``."""
    if weight.routed:
        return spec.moe.tokens_per_expert(spec.tokens * ep * spec.expert_shards(tp) / tp, padded)
    if weight.split == WHOLE and sequence_parallel:
        return spec.tokens / tp
    return spec.tokens


def weight_gemms(weights: tuple[Weight, ...], spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                 padded: bool = True, ep: int = 1) -> tuple[Gemm, ...]:
    """One GEMM per ``gemm`` named in ``weights``: the matrices fused into it side by side
    (their columns on a tp rank added up), over the rows ``gemm_rows`` gives, one per
    matrix of the stack a rank holds (``E / ep`` routed experts); ``padded``: routed
    experts compute their whole capacity."""
    fused: dict[str, list[Weight]] = {}
    for weight in weights:
        fused.setdefault(weight.gemm, []).append(weight)
    gemms = []
    recomputed = recomputed_matrices(spec)
    for name, members in fused.items():
        first = members[0]
        rows, _ = shard(first, spec, tp)  # fused matrices read the same input
        columns = sum(shard(weight, spec, tp)[1] for weight in members)
        rerun = sum(shard(weight, spec, tp)[1] for weight in members if weight.name in recomputed)
        gemms.append(Gemm(name, gemm_rows(first, spec, tp, sequence_parallel, padded, ep), rows, columns,
                          stack_on_rank(first, ep), **precision(spec, name not in BF16_GEMMS),
                          per_op_recomputed=rerun / columns if columns else 0.0))
    return tuple(gemms)


def attention_core(spec: ModelSpec, tp: int = 1, flash_attention: bool = True, steps: int = 1,
                   layer: int = 0) -> tuple[Operation, ...]:
    """QK^T and PV of a tp rank's ``heads / tp`` heads in layer ``layer``: one flash kernel
    (``steps`` of them for ring attention over a context shard: see the module; over the
    layer's sliding window where it has one), or two batched GEMMs over the whole ``s x s``
    square (masked after, window or not)."""
    heads = spec.heads / tp
    query_dim, value_dim = spec.q_width / spec.heads, spec.v_width / spec.heads
    if flash_attention:
        return (FlashAttention("attention", spec.microbatch_size, heads, spec.seq_len, query_dim,
                               value_dim=None if value_dim == query_dim else value_dim, steps=steps,
                               window=spec.attention_window(layer), chunk=spec.attention_chunk_of(layer)),)
    if steps != 1:
        raise ValueError("ring attention is built on the fused (flash) attention kernel")
    batches = spec.microbatch_size * heads
    return (Gemm("scores", spec.seq_len, query_dim, spec.seq_len, batches, weighted=False, attention_core=True),
            Gemm("context", spec.seq_len, spec.seq_len, value_dim, batches, weighted=False, attention_core=True))


def attention_block(spec: ModelSpec, tp: int = 1, flash_attention: bool = True,
                    sequence_parallel: bool = False, steps: int = 1, layer: int = 0) -> tuple[Operation, ...]:
    """Self-attention: the projections of ``weights.attention_weights`` (Megatron's
    split: QKV column-parallel, the output row-parallel; latent attention's
    down-projections whole) around the attention core (of ``steps`` ring steps)."""
    projections = weight_gemms(attention_weights(spec), spec, tp, sequence_parallel)
    inputs = tuple(gemm for gemm in projections if gemm.name != "attention_out")
    outputs = tuple(gemm for gemm in projections if gemm.name == "attention_out")
    return (*inputs, *attention_core(spec, tp, flash_attention, steps, layer), *outputs)


def mlp_block(spec: ModelSpec, tp: int = 1, layer: int = 0, sequence_parallel: bool = False,
              padded: bool = True, ep: int = 1) -> tuple[Operation, ...]:
    """Layer ``layer``'s MLP, from ``weights.mlp_weights``: up (with the gate fused beside
    it when gated) column-parallel and down row-parallel; in a mixture-of-experts layer the
    router, the routed experts as grouped GEMMs (``E / ep`` of them), the shared experts
    and the permutations around the routed ones (``token_permutations``)."""
    gemms = weight_gemms(mlp_weights(spec, spec.is_moe_layer(layer)), spec, tp, sequence_parallel, padded, ep)
    if not spec.is_moe_layer(layer):
        return gemms
    return (*gemms, token_permutations(spec, tp, sequence_parallel, padded, ep))


def token_permutations(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False, padded: bool = True,
                       ep: int = 1) -> MemoryBound:
    """The copies that put a mixture-of-experts layer's routed tokens in expert order and
    back, as Megatron-Core's all-to-all token dispatcher makes them
    (``MoEAlltoAllTokenDispatcher``): *permutation 1* gathers each of the rank's tokens
    once per routed slot (``k`` of them, times the capacity factor when ``padded``) into
    expert order before the all-to-all (reads and writes ``k`` rows of ``h``),
    *unpermutation 1* weights the ``k`` returned rows by their routing probabilities and
    adds them into the token's one (reads ``k``, writes 1); when a rank holds more than
    one expert and receives from other ranks (``ep`` or ``tp`` above 1), *permutation 2*
    sorts the received rows by local expert after the all-to-all and *unpermutation 2*
    restores their order before the one back (``k`` rows read and written each). All move
    activations in the model's dtype and nothing else, so they are memory-bound kernels
    at HBM bandwidth; their backward runs the inverse copies on the gradients and the
    routing probabilities' gradient (unpermutation 1's saved rows read again), charged as
    the other element-wise kernels' (``memory_traffic.BACKWARD_TRAFFIC``). The rank's own
    tokens are ``s / tp`` of a sequence under sequence parallelism (the received rows are
    gathered over the expert tensor-parallel ranks first, ``etp`` of them, so with ``etp``
    equal to ``tp`` sorting sees every token's copies).

    Under DeepEP's dispatch (``ModelSpec.ep_dispatcher`` ``deepep``, Megatron-Core's flex
    dispatcher) the dispatch kernel reads each copy's row by index and the combine kernel
    weights and adds them, so neither permutation 1 nor the weighted sum is a copy of its
    own; the received rows are permuted into expert order once and back once (``k`` rows
    of every token read and written each)."""
    slots, h, d = spec.moe.routed_slots(padded), spec.hidden, spec.dtype_bytes
    etp = spec.expert_shards(tp)
    received = spec.tokens * etp / tp  # the tokens whose copies the rank's experts gather
    if spec.ep_dispatcher == "deepep":
        return MemoryBound("token_permutations", 2 * (2 * slots * received) * h * d)
    own = spec.tokens / tp if sequence_parallel else spec.tokens
    rows = (2 * slots + (slots + 1)) * own  # permutation 1, unpermutation 1
    if spec.moe.experts / ep > 1 and ep * etp > 1:
        rows += 2 * (2 * slots * received)  # permutation 2 and unpermutation 2
    return MemoryBound("token_permutations", rows * h * d)


def memory_bound_kernels(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                         flash_attention: bool = True, layer: int = 0) -> tuple[Operation, ...]:
    """Norms, residual adds, activations, rotary; and the scores' softmax and dropout when
    attention is not fused."""
    plain, scores = layer_traffic_bytes(spec, tp, sequence_parallel, flash_attention, layer)
    kernels: tuple[Operation, ...] = (MemoryBound("elementwise", plain,
                                                  norm_bytes=norm_traffic_bytes(spec, tp, sequence_parallel),
                                                  recomputed_bytes=recomputed_activation_bytes(spec, tp, layer)),)
    if scores:
        kernels += (MemoryBound("softmax_dropout", scores, attention_core=True),)
    return kernels


def layer_operations(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False,
                     flash_attention: bool = True, layer: int = 0, padded: bool = True, ep: int = 1,
                     cp: int = 1) -> tuple[Operation, ...]:
    """Every operation of layer ``layer``'s forward, for one microbatch on one rank of
    ``tp`` tensor-, ``ep`` expert- and ``cp`` context-parallel ranks (see the module);
    ``padded``: routed experts compute their whole capacity (what takes time; the model
    FLOPs MFU counts are the unpadded ones)."""
    local = spec.context_shard(cp)
    merges = (ring_merge(local, tp, cp),) if cp > 1 and flash_attention and spec.cp_comm == "p2p" else ()
    return (*attention_block(local, tp, flash_attention, sequence_parallel, cp, layer), *merges,
            *mlp_block(local, tp, layer, sequence_parallel, padded, ep),
            *memory_bound_kernels(local, tp, sequence_parallel, flash_attention, layer))


def ring_merge(local: ModelSpec, tp: int, cp: int) -> MemoryBound:
    """Ring attention's merges of its ``cp`` steps on one rank of ``tp``, over the rank's
    ``s / cp`` tokens (``local``): its partial outputs, and in the backward its query and
    key-value gradients (``pipesim.model.ring_merge``), part of the attention core."""
    d = local.dtype_bytes
    if local.mla is not None:
        key_value = local.heads / tp * (local.mla.qk_head_dim + local.mla.v_head_dim) * d
    else:
        key_value = 2 * local.head_size * kv_heads_per_shard(local, tp) * d
    forward, backward = ring_merge_bytes(cp, local.q_width / tp * d, local.v_width / tp * d, key_value)
    return MemoryBound("ring_merge", forward * local.tokens, attention_core=True,
                       backward_bytes=backward * local.tokens)


def mtp_operations(spec: ModelSpec, tp: int = 1, cp: int = 1) -> tuple[Operation, ...]:
    """What one multi-token prediction module adds beside its block (``layer_operations``
    of layer ``spec.layers``): its ``2h -> h`` projection (column-parallel) and the logits
    of the shared output head, for the rank's ``s / cp`` tokens."""
    tokens = spec.context_shard(cp).tokens
    return (Gemm("mtp_projection", tokens, 2 * spec.hidden, spec.hidden / tp, **precision(spec)),
            *head_operations(spec, tp, cp))


def head_operations(spec: ModelSpec, tp: int = 1, cp: int = 1) -> tuple[Operation, ...]:
    """The output layer on the last stage: logits over the vocabulary (vocab-parallel) for
    the rank's ``s / cp`` tokens, and the cross entropy's passes over them
    (``pipesim.model.loss_traffic``, as ``spec.cross_entropy`` runs it)."""
    tokens = spec.context_shard(cp).tokens
    forward, backward, _ = cross_entropy_bytes(spec.cross_entropy, spec.dtype_bytes)
    logits = tokens * spec.vocab / tp
    return (Gemm("logits", tokens, spec.hidden, spec.vocab / tp),
            MemoryBound("cross_entropy", forward * logits, backward_bytes=backward * logits))

