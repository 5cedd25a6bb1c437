"""Can the model be split so? Checked before any work, one rule per parallelism.

- **Tensor parallelism** (``--tp``) splits attention by heads and the MLP by columns
  (Megatron-LM): tp must divide the attention heads and every MLP width (dense, routed
  expert, shared expert). Key-value heads are split too when tp divides them; when tp is
  a multiple of them (GQA with fewer key-value heads than tp ranks, e.g. 8 of them on
  tp 16) each key-value head is *replicated* on ``tp / kv_heads`` ranks, as Megatron-LM
  does, and a rank holds one whole head's K and V weights
  (``pipesim.model.weights.kv_heads_per_shard``). Any other tp is refused.
  With sequence parallelism tp must also divide the (per context-parallel rank) sequence.
- **Expert parallelism** (``ep``) places whole routed experts on ranks: ep must divide
  them, and a dense model has none to place. With tensor parallelism it needs sequence
  parallelism, as Megatron-LM requires of a mixture of experts with tp > 1: its
  all-to-all dispatcher sends each tp rank's shard of the sequence.
- **Expert tensor parallelism** (``--etp``, Megatron-Core's parallel folding) splits the
  routed experts over their own tensor-parallel ranks instead of tp: etp must divide the
  expert MLP width (which tp then need not) and tp (etp above tp, which Megatron-Core
  allows, is not modelled), and with tp above 1 an etp other than tp
  needs sequence parallelism (each rank dispatches its own shard of the sequence). How
  etp and ep fold into the ranks is ``pipesim.cluster.mapping``'s rule.
- **Context parallelism** (``cp``) splits the sequence into ``2 cp`` chunks, rank ``i``
  holding chunks ``i`` and ``2 cp - 1 - i`` so that every rank does the same share of the
  causal attention (Megatron-Core's load balancing): ``2 cp`` must divide the sequence.
  A model with sliding-window layers is refused: ring attention's steps over a window
  (most of them skipped) are not modelled.

Every error names the flag, the model's number it clashes with and values that work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipesim.model.errors import ModelSpecError

if TYPE_CHECKING:
    from pipesim.model.spec import ModelSpec


def check_layout(spec: ModelSpec, tp: int = 1, ep: int = 1, cp: int = 1, sequence_parallel: bool = False) -> None:
    """Raise ``ModelSpecError`` (one line) unless ``spec`` can be split over ``tp``
    tensor-parallel, ``ep`` expert-parallel and ``cp`` context-parallel ranks."""
    for flag, value in (("--tp", tp), ("--ep", ep), ("--cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelSpecError(f"{flag} must be an integer >= 1, got {value!r}")
    problem = tp_problem(spec, tp)
    if problem:
        valid = [size for size in range(1, spec.heads + 1) if not tp_problem(spec, size)]
        raise ModelSpecError(f"--tp {tp} {problem}: use one of {', '.join(map(str, valid))}")
    if cp > 1 and spec.seq_len % (2 * cp):
        valid = [size for size in range(1, spec.seq_len // 2 + 1) if spec.seq_len % (2 * size) == 0][:12]
        raise ModelSpecError(f"--cp {cp}: 2 x cp = {2 * cp} chunks (causal load balancing, as Megatron-Core cuts "
                             f"the sequence) do not divide the {spec.seq_len}-token sequence of {spec.name}: use "
                             f"one of {', '.join(map(str, valid))}, ...")
    if cp > 1 and any(spec.attention_window(layer) for layer in spec.sliding_layers):
        raise ModelSpecError(f"--cp {cp}: {spec.name} attends over a {spec.sliding_window}-token sliding window in "
                             f"some layers, and ring attention over a window is not modelled; use --cp 1")
    if cp > 1 and any(spec.attention_chunk_of(layer) for layer in spec.chunked_layers):
        raise ModelSpecError(f"--cp {cp}: {spec.name} attends in {spec.attention_chunk}-token chunks in some "
                             f"layers, and ring attention over chunks is not modelled; use --cp 1")
    if sequence_parallel and tp > 1 and (spec.seq_len // cp) % tp:
        raise ModelSpecError(f"--sequence-parallel splits each {spec.seq_len // cp}-token sequence"
                             f"{' shard' if cp > 1 else ''} over --tp {tp}, which does not divide it")
    if ep > 1:
        if spec.moe is None:
            raise ModelSpecError(f"--ep {ep}: {spec.name} has no routed experts to place (expert parallelism "
                                 f"needs a mixture-of-experts model); use --ep 1")
        experts = spec.moe.experts
        if experts % ep:
            valid = [size for size in range(1, experts + 1) if experts % size == 0]
            raise ModelSpecError(f"--ep {ep} does not divide the {experts} routed experts of {spec.name}: "
                                 f"use one of {', '.join(map(str, valid))}")
        if tp > 1 and not sequence_parallel:
            raise ModelSpecError(f"--ep {ep} with --tp {tp} needs --sequence-parallel: Megatron-LM requires it for a "
                                 f"mixture of experts with tensor parallelism (its all-to-all dispatcher sends each "
                                 f"tp rank's shard of the sequence)")
    check_expert_tp(spec, tp, sequence_parallel)


def check_expert_tp(spec: ModelSpec, tp: int, sequence_parallel: bool) -> None:
    """The routed experts' own tensor parallelism (``ModelSpec.expert_tp``; 0: tp)."""
    etp = spec.expert_tp
    if not etp:
        return
    if spec.moe is None:
        raise ModelSpecError(f"--etp {etp}: {spec.name} has no routed experts to split (expert tensor parallelism "
                             f"needs a mixture-of-experts model); drop --etp")
    width = spec.moe.expert_ffn
    if width % etp:
        valid = [size for size in range(1, min(width, 64) + 1) if width % size == 0]
        raise ModelSpecError(f"--etp {etp} does not divide the expert MLP width {width} of {spec.name}: use one of "
                             f"{', '.join(map(str, valid))}")
    if etp > tp:
        raise ModelSpecError(f"--etp {etp} above --tp {tp} (experts split over more ranks than attention) is not "
                             f"modelled; use --etp at most {tp}")
    if tp % etp:
        raise ModelSpecError(f"--etp {etp} must divide --tp {tp} (an expert tensor-parallel group inside one "
                             f"tensor-parallel group)")
    if etp != tp and tp > 1 and not sequence_parallel:
        raise ModelSpecError(f"--etp {etp} with --tp {tp} needs --sequence-parallel: under parallel folding each "
                             f"rank dispatches its own shard of the sequence to the experts")


def tp_problem(spec: ModelSpec, tp: int) -> str:
    """Why ``spec`` cannot be split over ``tp`` tensor-parallel ranks ('' when it can)."""
    if spec.heads % tp:
        return f"does not divide the {spec.heads} attention heads of {spec.name}"
    kv_heads = spec.num_kv_heads
    if spec.mla is None and kv_heads % tp and tp % kv_heads:
        return (f"neither divides the {kv_heads} key-value heads of {spec.name} nor is a multiple of them "
                f"(a multiple replicates each key-value head on tp / {kv_heads} ranks)")
    for width, what in mlp_widths(spec):
        if width % tp:
            return f"does not divide the {what} {width} of {spec.name}"
    return ""


def mlp_widths(spec: ModelSpec) -> list[tuple[int, str]]:
    """Every MLP width tensor parallelism splits, with its name (the routed experts' only
    when they are split over tp, not their own ``--etp``)."""
    widths = [] if spec.moe is not None and not spec.moe.dense_layers else [(spec.ffn, "MLP width")]
    if spec.moe is not None:
        if not spec.expert_tp:  # else split over etp instead (check_expert_tp)
            widths.append((spec.moe.expert_ffn, "expert MLP width"))
        if spec.moe.shared_ffn:
            widths.append((spec.moe.shared_ffn, "shared expert MLP width"))
    return widths


def layout_notes(spec: ModelSpec, tp: int = 1) -> list[str]:
    """What a valid layout does that a user may not expect: key-value heads replicated
    when tp is a multiple of them."""
    kv_heads = spec.num_kv_heads
    if spec.mla is None and tp > kv_heads and tp % kv_heads == 0:
        return [f"--tp {tp} exceeds the {kv_heads} key-value heads of {spec.name}: each is replicated on "
                f"{tp // kv_heads} ranks (Megatron-LM's rule), its K and V weights counted on each"]
    return []


def unmodelled_notes(spec: ModelSpec) -> list[str]:
    """What the prediction leaves out that moves it for this model: with routed experts
    and no capacity (dropless), the host's time. Megatron-Core's dropless dispatchers copy each MoE layer's token
    counts to the host (to size the all-to-all and the grouped GEMMs), so the host waits
    for the GPU once a layer and the GPU then waits for the host's launches; pipesim times
    the GPU's kernels only. Published H100 runs without CUDA graphs of the small-hidden
    mixtures (Qwen3-30B-A3B, gpt-oss-120b) ran far below such predictions
    (docs/cluster-model.md, "Mixture of experts")."""
    if spec.moe is None or spec.moe.capacity_factor is not None:  # capacity-padded: no token counts to wait on
        return []
    return [f"{spec.name} routes tokens to experts: the host's time is not modelled (a dropless dispatcher "
            f"waits on the GPU once a MoE layer, then its kernels run as fast as the host launches them), so "
            f"take the throughput as an upper bound, most of all for small hidden sizes without CUDA graphs "
            f"(docs/cluster-model.md, 'Mixture of experts')"]

