"""torchtitan's per-op selective activation checkpointing (``--recompute per-op``).

torchtitan's ``SelectiveAC`` (0.3, ``--activation_checkpoint.selective_ac_option=op``;
``torchtitan/distributed/activation_checkpoint.py``) wraps every transformer block in
non-reentrant ``torch.utils.checkpoint`` with a per-op policy
(``create_selective_checkpoint_contexts``, ``early_stop=False``): the outputs of the ops
in its save list are kept, every other op of the block's forward runs again in the
backward. Not Megatron's selective recompute (``--recompute selective``, the attention
core re-run): here the attention kernel is the one thing surely kept.

The policy, as written there:

- **Saved**: the outputs of torch's compute-intensive ops (``mm``, ``addmm``, ``bmm``, the
  SDPA flash/efficient/cuDNN kernels: ``torch._functorch.partitioners.get_default_op_list``),
  ``aten.linear``, ``max``, ``topk`` and the communication ops ``reduce_scatter_tensor``
  and ``all_to_all_single``;
- **except every second matrix product**: a counter per block call counts the forward's
  ``mm`` (a bias-less ``nn.Linear``); odd counts are saved, even counts recomputed. A
  linear with a bias runs as ``addmm``, which is saved and not counted;
- **recomputed**: everything else, norms, rotary, the activation and the gated MLP's
  product, residual adds, and the all-gathers and all-reduces of tensor parallelism.
  The checkpoint keeps the block's input.

**Which matrices** (``recomputed_matrices``): the layer's matrix products in forward order
(``forward_products``: the order ``pipesim.model.weights`` lists the matrices in, Q, K, V,
output; gate, up, down, torchtitan's ``w2(silu(w1(x)) * w3(x))`` running ``w1`` before
``w3``); every second bias-less product is recomputed. The products are counted as the
model builds its linears (``ModelSpec.fused_qkv``, ``--qkv``):

- ``separate`` Q, K and V (torchtitan's as its published per-op runs had them, Hugging
  Face's, the executor's default): seven products; Llama 3 (no biases) recomputes K, the
  output projection and the MLP's up projection (``w3``) and saves Q, V, the gate (``w1``)
  and down (``w2``) projections;
- ``fused``, one ``wqkv`` (torchtitan 0.3's own Llama 3 configs, ``fuse_qkv=True``): five
  products, ``wqkv`` saved whole (K's output kept too, K's GEMM not re-run), the output
  projection recomputed, ``w1`` saved, ``w3`` recomputed, ``w2`` saved.

GPT's (every matrix biased): none either way. ``tests/test_per_op_torchtitan.py`` holds
both forms to torchtitan's own block and policy. Where pipesim times matrices as one GEMM
(Q, K and V; gate and up) the backward re-runs the recomputed ones' share of its columns
(``Gemm.per_op_recomputed``): Llama 3's QKV GEMM ``kv / (q + 2 kv)`` of itself with
separate projections, none of it fused; its gate-and-up GEMM half either way.

**Time** (``pipesim.model.compute_model.recomputed_share``): those GEMMs' forwards and
every element-wise kernel's forward again in the backward; never the attention kernel.
**Tensor parallelism**: the re-run forward repeats the collectives whose outputs are not
saved. With sequence parallelism that is the two all-gathers in front of the QKV and MLP
GEMMs (the reduce-scatters' outputs are saved): one all-gather and reduce-scatter pair's
time per layer, as the two are priced alike; without it the two all-reduces, two pairs
(``recomputed_tp_pairs``; charged in ``pipesim.sim.parallel.tp_collective_seconds``).
Which products are saved does not change them (a fused ``wqkv`` neither): torch re-runs
the whole block (``early_stop`` off), handing back a saved product's output without
computing it, and runs again every op it does not save, an all-gather in front of a saved
product and the all-reduce behind one included.

**Memory, per token on one tp rank** (``stash_bytes_per_token``, ``d`` the dtype's bytes):

    block input                          h d          (/ tp with sequence parallelism)
    each saved matrix's output           its columns on the rank x d (a row-parallel
                                         matrix's output is the full-width partial sum,
                                         h, before its reduction)
    the attention kernel's output        v_width / tp x d
    reduce-scatter outputs (seq. par.)   2 h d / tp

Llama 3 at tp 1: ``h + q + kv + v_out + f + h`` elements (block input; Q; V, ``kv`` wide;
attention output; gate; down), nothing of K, the norms' outputs, the up projection or the SwiGLU
product; with a fused ``wqkv`` ``kv`` more (K's output). The kernel's log-sum-exp (4
bytes per head) is left out as for the other modes (``pipesim.model.saved_tensors`` adds
it for the executor's count).

**FP8** (torchao's float8 linears, as torchtitan runs them), taken to be seen by the
policy as the same ``mm`` calls on float8 tensors (a dispatch mode runs before the tensor
subclass that turns the call into ``_scaled_mm``; not checked against torchao here, which
the cached torchtitan environment does not install): the same matrices counted and saved,
their outputs in 16-bit; the casts are not saved ops (only their ``max``, one scalar), so
the re-run forward repeats every FP8 GEMM's input cast, the saved products' too
(``pipesim.model.compute_model.recomputed_seconds``).

**Refused** (``per_op_refusal``), one line naming why: mixture-of-experts layers (the
router gate is force-recomputed by shape, the experts run grouped GEMMs the counter does
not see), latent attention (its own order of low-rank matrices) and attention without
the fused kernel (the ``bmm`` scores would be kept, the softmax re-run): not derived here.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING

from pipesim.model.errors import ModelSpecError
from pipesim.model.weights import QKV_GEMM, Weight, layer_weights, shard

if TYPE_CHECKING:
    from pipesim.model.spec import ModelSpec

PER_OP = "per-op"
# the attention output's and the down projection's reduce-scatters under sequence parallelism
ROW_PARALLEL_REDUCTIONS = 2


def per_op_refusal(spec: ModelSpec, flash_attention: bool = True) -> str | None:
    """Why ``--recompute per-op`` is not modelled for ``spec``, or None when it is."""
    if spec.moe is not None:
        return (f"{spec.name} has mixture-of-experts layers, whose per-op checkpointing (router gate force-"
                f"recomputed, experts' grouped GEMMs) is not modelled; use none, selective or full")
    if spec.mla is not None:
        return (f"{spec.name} has latent attention (MLA), whose per-op checkpointing order is not modelled; "
                f"use none, selective, norm-mla-up or full")
    if not flash_attention and spec.scores_beyond_mask:
        written = "attention sinks" if spec.attention_sinks else "soft-capped attention scores"
        return (f"{spec.name}'s {written} are written out here, not run by a fused attention kernel, and per-op "
                f"checkpointing is modelled over the fused (flash) kernel; use none, selective or full")
    if not flash_attention:
        return "per-op checkpointing is modelled over the fused (flash) attention kernel; drop --no-flash-attention"
    return None


def check_per_op(spec: ModelSpec, recompute: str, flash_attention: bool = True) -> None:
    """Raise ``ModelSpecError`` when ``recompute`` is per-op and ``spec`` is refused."""
    if recompute != PER_OP:
        return
    reason = per_op_refusal(spec, flash_attention)
    if reason:
        raise ModelSpecError(f"--recompute {PER_OP}: {reason}")


def forward_products(spec: ModelSpec) -> tuple[tuple[Weight, ...], ...]:
    """A dense layer's matrix products in forward order, each the matrices one linear
    holds: one matrix each, or Q, K and V together when ``spec.fused_qkv`` (one ``wqkv``,
    one ``mm``, its output kept or re-run whole)."""
    products: list[list[Weight]] = []
    for weight in layer_weights(spec, False):
        fused = spec.fused_qkv and weight.gemm == QKV_GEMM and products and products[-1][0].gemm == QKV_GEMM
        if fused:
            products[-1].append(weight)
        else:
            products.append([weight])
    return tuple(tuple(product) for product in products)


@functools.lru_cache(maxsize=256)
def recomputed_matrices(spec: ModelSpec) -> frozenset[str]:
    """Names of a dense layer's weight matrices whose products per-op checkpointing re-runs:
    every second bias-less product in forward order (biased ones run as ``addmm``: saved,
    not counted), all of a fused product's matrices together. Empty for a model it
    refuses (``per_op_refusal``)."""
    if spec.moe is not None or spec.mla is not None:
        return frozenset()
    counted = [product for product in forward_products(spec) if not product[0].bias]
    return frozenset(weight.name for product in counted[1::2] for weight in product)


def fusing_qkv_changes_per_op(spec: ModelSpec) -> bool:
    """Whether fusing Q, K and V into one linear changes what per-op keeps and re-runs
    for ``spec`` (it does for bias-less projections: one product fewer to count)."""
    if spec.mla is not None:
        return False
    return recomputed_matrices(replace(spec, fused_qkv=False)) != recomputed_matrices(replace(spec, fused_qkv=True))


def stash_bytes_per_token(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes per token one layer keeps on one tp rank under per-op checkpointing (the
    inventory of the module)."""
    d, h = spec.dtype_bytes, spec.hidden
    split = tp if sequence_parallel else 1
    recomputed = recomputed_matrices(spec)
    saved_outputs = sum(shard(weight, spec, tp)[1] for weight in layer_weights(spec, False)
                        if weight.name not in recomputed)
    reduced = ROW_PARALLEL_REDUCTIONS * h / tp if sequence_parallel and tp > 1 else 0.0
    return (h / split + saved_outputs + spec.v_width / tp + reduced) * d


def recomputed_tp_pairs(recompute: str, sequence_parallel: bool) -> float:
    """Tensor-parallel collective pairs (``pipesim.sim.parallel._tp_pair``: an all-reduce,
    or an all-gather and a reduce-scatter) a layer's backward repeats under ``recompute``:
    full recompute both of the forward's; per-op checkpointing the two all-gathers (one
    pair's time) with sequence parallelism, the two all-reduces without; no other mode
    re-runs a collective."""
    if recompute == "full":
        return 2.0
    if recompute == PER_OP:
        return 1.0 if sequence_parallel else 2.0
    return 0.0
