"""Which architecture ``run --model`` builds: a preset or a Hugging Face config.json read
as ``pipesim simulate`` reads it (``pipesim.model``), shrunk to the run's sizes.

The executor trains the architecture's real parts (``executor.architectures.transformer``) at the
sizes ``--layers/--hidden/--heads/--kv-heads/--ffn-hidden/--experts/--seq-len/--vocab``
give; what no flag gives is scaled with the hidden size so the shrunk model keeps the
original's proportions: the grouped-query ratio ``heads / kv_heads``, the MLP's width
over the hidden size (each expert's too), the latent ranks of multi-head latent
attention. Experts are cut to 8 at most and the top-k to half of them (a router that
picks every expert routes nothing); DeepSeek's expert groups to as many as divide them,
each token keeping the original's share of the groups. ``shrink_note`` says, in one line, what changed.

Plain data, no torch: the command line checks a run before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

from executor.config import ConfigError, RunConfig
from pipesim.model.errors import ModelSpecError
from pipesim.model.experts import MixtureOfExperts
from pipesim.model.latent_attention import LatentAttention
from pipesim.model.spec import ModelSpec, load_model
from pipesim.model.transformer_costs import model_stage_costs

TOY_MODELS = ("mlp", "gpt")
MAX_EXPERTS = 8  # experts kept when --experts is not given
# Sizes a run takes when no flag gives them: on a CPU the toys' (RunConfig's defaults, a
# step in well under a second), on a GPU a model worth the device.
CPU_SIZES = {field.name: field.default for field in fields(RunConfig)
             if field.name in ("layers", "hidden", "heads", "seq_len", "vocab")}
GPU_SIZES = {"layers": 8, "hidden": 1024, "heads": 16, "seq_len": 512, "vocab": 32000}


def is_architecture(model: str) -> bool:
    """Whether ``--model`` names an architecture (a preset or a config.json), not a toy."""
    return model not in TOY_MODELS


def full_spec(model: str) -> ModelSpec:
    """The architecture ``model`` names, at its published size."""
    try:
        return load_model(model)
    except (ModelSpecError, FileNotFoundError) as error:
        raise ConfigError(f"--model {model}: {error}") from None


def kv_heads_like(full: ModelSpec, heads: int) -> int:
    """Key/value heads for ``heads`` query heads at the original's grouping (at least 1,
    and a divisor of ``heads``)."""
    kv = max(1, heads * full.num_kv_heads // full.heads)
    while heads % kv:
        kv -= 1
    return kv


def scaled(width: int, factor: float) -> int:
    """``width`` times ``factor``, rounded, at least 1."""
    return max(1, round(width * factor))


def shrunk_experts(moe: MixtureOfExperts, layers: int, experts: int | None, factor: float,
                   capacity_factor: float | None) -> MixtureOfExperts:
    """The router and experts at ``experts`` experts (default: at most ``MAX_EXPERTS``),
    widths scaled by ``factor``; the dense layers kept where they still exist, at most
    half of the layers (DeepSeek-V3's first three dense layers would leave a 4-layer
    model one sparse layer, a 3-layer one none)."""
    count = experts or min(moe.experts, MAX_EXPERTS)
    top_k = moe.experts_per_token if count == moe.experts else min(moe.experts_per_token, max(1, count // 2))
    shared_ffn = moe.shared_expert_ffn and scaled(moe.shared_expert_ffn, factor)
    dense = tuple(layer for layer in moe.dense_layers if layer < layers)[:layers // 2]
    top_k = min(top_k, count)
    return replace(moe, experts=count, experts_per_token=top_k, expert_ffn=scaled(moe.expert_ffn, factor),
                   shared_expert_ffn=shared_ffn, dense_layers=dense, capacity_factor=capacity_factor,
                   **shrunk_groups(moe, count, top_k))


def shrunk_groups(moe: MixtureOfExperts, experts: int, top_k: int) -> dict:
    """Group-limited routing at ``experts`` experts: as many equal groups as the original
    has, or the most that divide the experts (two a group where a group scores by its
    best two), and the original's share of them kept per token, or enough to hold the
    token's ``top_k``. One group is no limit."""
    if moe.expert_groups == 1 or experts == moe.experts:
        return {}
    smallest = 2 if moe.group_scoring == "top2-sum" else 1
    groups = max((count for count in range(1, min(moe.expert_groups, experts) + 1)
                  if experts % count == 0 and experts // count >= smallest), default=1)
    if groups == 1:
        return {"expert_groups": 1, "node_limit": None}
    per_group = experts // groups
    kept = max(math.ceil(moe.node_limit * groups / moe.expert_groups), math.ceil(top_k / per_group))
    return {"expert_groups": groups, "node_limit": min(kept, groups)}


def shrunk_latents(mla: LatentAttention, head_dim: int, factor: float) -> LatentAttention:
    """Latent ranks scaled with the hidden size; each head ``head_dim`` wide, half of
    that (even) for its rotary part."""
    return LatentAttention(q_lora_rank=mla.q_lora_rank and scaled(mla.q_lora_rank, factor),
                           kv_lora_rank=scaled(mla.kv_lora_rank, factor), qk_nope_head_dim=head_dim,
                           qk_rope_head_dim=max(2, head_dim // 2 // 2 * 2), v_head_dim=head_dim)


def shrunk_spec(config: RunConfig) -> ModelSpec:
    """The architecture of ``config.model`` at the run's sizes, its multi-token
    prediction modules included."""
    full = full_spec(config.model)
    factor = config.hidden / full.hidden
    ffn = config.ffn_hidden or scaled(full.ffn, factor)
    width_factor = ffn / full.ffn  # experts keep their width relative to the dense MLP
    kv = None if full.mla else (config.kv_heads or kv_heads_like(full, config.heads))
    moe = mla = None
    if full.moe is not None:
        moe = shrunk_experts(full.moe, config.layers, config.experts, width_factor, config.capacity_factor)
        if config.balance_loss is not None:
            moe = replace(moe, balance_loss=config.balance_loss)
    if full.mla is not None:
        mla = shrunk_latents(full.mla, config.hidden // config.heads, factor)
    # Gemma's softmax scale keeps its ratio to the head width (Gemma 2 27B: 144 for heads of 128)
    scalar = full.query_pre_attn_scalar
    if scalar is not None:
        scalar *= (config.hidden // config.heads) / full.head_size
    return replace(full, layers=config.layers, hidden=config.hidden, heads=config.heads, kv_heads=kv,
                   ffn_hidden=ffn, seq_len=config.seq_len, vocab=config.vocab, head_dim=None, positions=None,
                   moe=moe, mla=mla, fused_qkv=config.qkv == "fused", query_pre_attn_scalar=scalar,
                   fp8=False, fp8_dispatch=False)  # the GEMMs run in --dtype (shrink_note says so)


def run_spec(config: RunConfig) -> ModelSpec:
    """The transformer ``config`` trains, as a ``ModelSpec``: an architecture shrunk
    (``shrunk_spec``), or the toy gpt (``executor.models.Block``: GPT-2's layers, learned
    positions, untied embeddings). The ``mlp`` toy has none (a ``ConfigError``)."""
    if is_architecture(config.model):
        return shrunk_spec(config)
    if config.model != "gpt":
        raise ConfigError(f"--model {config.model} is not a transformer: it has no model spec")
    return ModelSpec(name="gpt", layers=config.layers, hidden=config.hidden, heads=config.heads,
                     seq_len=config.seq_len, vocab=config.vocab, tied_embeddings=False, dropout=False)


def shrink_note(config: RunConfig) -> str:
    """One line: what of ``config.model`` was shrunk (``was`` -> ``now``) and what the
    executor builds differently."""
    full, small = full_spec(config.model), shrunk_spec(config)
    kv_heads = [] if full.mla else [("kv-heads", full.num_kv_heads, small.num_kv_heads)]
    pairs = [("layers", full.layers, small.layers), ("hidden", full.hidden, small.hidden),
             ("heads", full.heads, small.heads), *kv_heads,
             ("ffn-hidden", full.ffn, small.ffn), ("seq-len", full.seq_len, small.seq_len),
             ("vocab", full.vocab, small.vocab)]
    if full.moe and small.moe:
        pairs += [("experts", full.moe.experts, small.moe.experts),
                  ("top-k", full.moe.experts_per_token, small.moe.experts_per_token),
                  ("expert ffn", full.moe.expert_ffn, small.moe.expert_ffn),
                  ("dense layers", len(full.moe.dense_layers), len(small.moe.dense_layers))]
        if full.moe.expert_groups > 1:
            pairs += [("expert groups", full.moe.expert_groups, small.moe.expert_groups),
                      ("groups per token", full.moe.node_limit, small.moe.node_limit or small.moe.expert_groups)]
    if full.mla and small.mla:
        pairs += [("kv latent", full.mla.kv_lora_rank, small.mla.kv_lora_rank)]
    changed = [f"{name} {was}->{now}" for name, was, now in pairs if was != now]
    notes = []
    if full.tied_embeddings:
        notes.append("embeddings tied (the last stage's copy summed with the table's gradient)")
    if full.dropout:
        notes.append("no dropout")
    if full.fp8:
        notes.append("GEMMs in --dtype, not FP8 (the config's quantization_config: the executor has no FP8 GEMMs)")
    if small.moe is not None and small.moe.balance_loss > 0:
        source = "--balance-loss" if config.balance_loss is not None else "the config's"
        notes.append(f"load-balancing loss {small.moe.balance_loss:g} per MoE layer, per sequence ({source})")
    if not full.rope.built:
        notes.append(f"rotary frequencies unscaled (the config's {full.rope.scaling} rope scaling not built)")
    listed, pairs = len(small.rope.short_factor or ()), small.rotary_width // 2
    if small.rope.scaling == "longrope" and listed != pairs:
        notes.append(f"longrope's {listed} factors read for {pairs} rotary pairs (each pair takes the factor of "
                     "the listed pair of its base frequency)")
    shrunk = ", ".join(changed) if changed else "nothing shrunk"
    return f"model {small.name}: {shrunk}" + "".join(f"; {note}" for note in notes)


def stage_layers(spec: ModelSpec, num_stages: int, layout: tuple[int, ...] | None, tp: int = 1,
                 sequence_parallel: bool = False, split_ranks: tuple[int, ...] | None = None) -> list[int]:
    """Layers on each stage: ``layout`` (checked), or the split ``pipesim simulate
    --model`` makes of the same model, by the same function (the stages' times on the
    simulator's default GPU, the output layer's on the last, balanced by
    ``pipesim.model.stage_split``, rank by rank as ``split_ranks`` groups them:
    ``RunConfig.split_ranks``), so a run and its prediction hold the same layers."""
    given = list(layout) if layout else None
    try:
        costs = model_stage_costs(spec, num_stages, [math.nan] * num_stages, tp=tp,
                                  sequence_parallel=sequence_parallel, layers_per_stage=given,
                                  split_ranks=split_ranks)
    except ModelSpecError as error:
        prefix = "" if layout else f"--layers {spec.layers}: "
        raise ConfigError(f"{prefix}{error}") from None
    counts = [stage.layers for stage in costs.stages]
    counts[-1] -= spec.mtp_depth  # the last stage's count holds its MTP modules' blocks beside the model's layers
    return counts


def check_architecture(config: RunConfig) -> ModelSpec:
    """Refuse, naming the flag, what the executor cannot build; return the shrunk spec."""
    full = full_spec(config.model)
    if full.norms_per_layer not in ((1, 2) if full.parallel_residual else (2, 4)):
        raise ConfigError(f"--model {config.model}: {full.norms_per_layer} norms per layer is not built by "
                          "the executor (pre-norm blocks of two norms: Llama, Mistral, Mixtral, Qwen, DeepSeek; "
                          "four, before and after each half: Gemma 2/3; one shared by a parallel block: Falcon-7B)")
    if config.hidden % config.heads:
        raise ConfigError(f"--hidden {config.hidden} must be a multiple of --heads {config.heads}")
    if config.kv_heads is not None and full.mla:
        raise ConfigError(f"--kv-heads: {config.model} uses latent attention, every head its own key and value")
    if full.moe is None:
        for flag, value in (("--experts", config.experts), ("--capacity-factor", config.capacity_factor),
                            ("--balance-loss", config.balance_loss)):
            if value is not None:
                raise ConfigError(f"{flag} {value}: {config.model} has no mixture-of-experts layers")
    for flag, value in (("--experts", config.experts), ("--ffn-hidden", config.ffn_hidden),
                        ("--kv-heads", config.kv_heads)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    rate = config.expert_bias_rate
    if rate is not None:
        if not (math.isfinite(rate) and rate >= 0):
            raise ConfigError(f"--expert-bias-rate must be a finite number >= 0 (0 keeps the biases), got {rate}")
        if full.moe is None or not full.moe.balanced_by_bias:
            raise ConfigError(f"--expert-bias-rate {rate}: {config.model}'s router has no selection bias (only "
                              "DeepSeek-V3's sigmoid router balances by one)")
    coefficient = config.balance_loss
    if coefficient is not None and not (math.isfinite(coefficient) and coefficient >= 0):
        raise ConfigError(f"--balance-loss must be a finite number >= 0 (0 leaves the loss out), got {coefficient}")
    factor = config.capacity_factor
    if factor is not None and not (math.isfinite(factor) and factor > 0):
        raise ConfigError(f"--capacity-factor must be a finite number > 0 (leave it out for dropless), got {factor}")
    if config.kv_heads is not None and config.heads % config.kv_heads:
        raise ConfigError(f"--kv-heads {config.kv_heads} must divide --heads {config.heads}")
    try:
        spec = shrunk_spec(config)
    except ModelSpecError as error:
        raise ConfigError(f"--model {config.model}: {error}") from None
    rotary = spec.rotary_width
    if not spec.learned_positions and (rotary % 2 or rotary < 2):
        share = "" if spec.rotary_fraction == 1 or spec.mla else (
            f", of which {config.model} turns {spec.rotary_fraction:g}: {rotary} features")
        raise ConfigError(f"--hidden {config.hidden} / --heads {config.heads} gives heads {spec.head_size} "
                          f"wide{share}; rotary positions turn pairs of features, so it must be even and at "
                          f"least 2")
    if config.tp > 1:
        check_tensor_parallel(config, spec)
    if config.cp > 1:
        check_context_parallel(config, spec)
    stage_layers(spec, config.num_stages, config.layout, config.tp, config.sequence_parallel, config.split_ranks)
    return spec


def check_context_parallel(config: RunConfig, spec: ModelSpec) -> None:
    """Ring attention masks by position only (causal): a sliding window or a chunk
    shorter than the sequence, attention sinks or soft-capped scores are not in its
    blocks."""
    limits = [(f"sliding window {spec.sliding_window}", spec.sliding_window, spec.sliding_layers),
              (f"attention chunk {spec.attention_chunk}", spec.attention_chunk, spec.chunked_layers)]
    for what, size, layers in limits:
        if size is not None and layers and size < spec.seq_len:
            raise ConfigError(f"--cp {config.cp}: {config.model}'s {what} is shorter than --seq-len {spec.seq_len}; "
                              "context parallelism's attention masks causally only (run with --seq-len at most "
                              f"{size}, or without --cp)")
    if spec.attention_sinks:
        raise ConfigError(f"--cp {config.cp}: {config.model}'s attention sinks are not in context parallelism's "
                          "blockwise softmax (run without --cp)")
    if spec.attention_softcap is not None:
        raise ConfigError(f"--cp {config.cp}: {config.model}'s soft-capped attention scores (cap "
                          f"{spec.attention_softcap:g}) are not in context parallelism's blockwise softmax (run "
                          "without --cp)")
    if spec.qk_norm == "l2":
        raise ConfigError(f"--cp {config.cp}: {config.model}'s query and key norms follow the rotary turn, which "
                          "context parallelism's attention makes itself (run without --cp)")


def check_tensor_parallel(config: RunConfig, spec: ModelSpec) -> None:
    """Blocks split by whole query and key/value heads and by MLP columns (every
    expert's too); query and key norms over the whole projection (their statistic spans
    every rank's heads) and attention sinks (one per head) are not split."""
    if spec.qk_norm == "projection":
        raise ConfigError(f"--tp {config.tp}: {config.model}'s query and key norms span the whole projection, "
                          "every tp rank's heads, which the executor's tensor parallelism does not split (run with "
                          "--tp 1)")
    if spec.attention_sinks:
        raise ConfigError(f"--tp {config.tp}: {config.model}'s attention sinks (one per head) are not split by the "
                          "executor's tensor parallelism (run with --tp 1)")
    widths = [("--heads", spec.heads), ("--kv-heads", spec.num_kv_heads), ("--ffn-hidden", spec.ffn)]
    if spec.moe is not None:
        if not config.folded:  # folded (--etp 1): the routed experts stay whole
            widths += [("the experts' width (from --ffn-hidden)", spec.moe.expert_ffn)]
        widths += [("the shared experts' width", spec.moe.shared_ffn)] if spec.moe.shared_ffn else []
    for flag, value in widths:
        if value % config.tp:
            raise ConfigError(f"--tp {config.tp} must divide {flag} {value} (each tp rank holds whole heads "
                              "and MLP columns)")
