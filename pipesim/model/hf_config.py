"""Hugging Face ``config.json`` files read as Hugging Face builds the model.

A config's keys mean what the model class of its ``model_type`` does with them, and a
key the file leaves out takes that config class's default, not one guess for every
family. What differs between the families read here (``transformers``' modeling code):

- ``llama``: gated MLP (SwiGLU), RMSNorm, ``attention_bias`` (Q, K, V and O) and
  ``mlp_bias`` apart, ``head_dim``, untied by default.
- ``mistral``, ``phi3``: gated, RMSNorm, no biases, untied by default.
- ``mixtral``: every MLP ``num_local_experts`` gated experts, top ``num_experts_per_tok``.
- ``qwen2``: Q, K and V always biased, O not. ``qwen2_moe``: the same attention, experts
  of ``moe_intermediate_size``, one shared expert with its sigmoid gate, sparse layers by
  ``decoder_sparse_step`` and ``mlp_only_layers``.
- ``gemma``, ``gemma2``: gated (GeGLU), ``head_dim`` (default 256), tied by default,
  RMSNorms scaling by one plus their weight, embeddings times sqrt(hidden); gemma-2 has
  four RMSNorms per layer (before and after each half), its softmax scaled by
  ``query_pre_attn_scalar`` and its attention scores and logits soft-capped.
- ``gpt2``: ``n_embd``, ``n_layer``, ``n_head``, ``n_inner``; two matrices (GeLU),
  LayerNorm, every linear biased, learned positions of ``n_positions`` rows, tied.
- ``gpt_neox``: two matrices, LayerNorm, MLP biases always, attention biases unless
  ``attention_bias`` is false, untied; attention and MLP side by side on the block's
  input (``use_parallel_residual``, on by default), rotary positions on the first
  ``rotary_pct`` of each head (a quarter by default) at ``rotary_emb_base``.
- ``falcon``: two matrices of ``ffn_hidden_size`` (4h), LayerNorm, ``bias`` for every
  linear (default none), one key-value head with ``multi_query``, ``num_kv_heads`` with
  ``new_decoder_architecture``, tied; a parallel block (``parallel_attn``, always with
  the new decoder) of one norm, or two with the new decoder; ``alibi`` refused.
- ``deepseek_v2``, ``deepseek_v3``: multi-head latent attention, gated experts from
  layer ``first_k_dense_replace`` on (every ``moe_layer_freq``-th), shared experts,
  untied; the router's ``scoring_func`` (V2 softmax, V3 sigmoid) and ``norm_topk_prob``
  (V2 false, V3 true; Qwen-MoE false), ``routed_scaling_factor`` (V3 2.5 by default, on
  every weight; V2 1.0, only on weights left unnormalised) and the group-limited routing
  of ``n_group``/``topk_group``/``topk_method``, which change no count, are kept for the
  executor (the limit, as nodes, also for the all-to-all).
- ``olmoe``: every MLP ``num_experts`` gated experts of ``intermediate_size``, top
  ``num_experts_per_tok``, no shared expert; RMSNorms over the whole Q and K projections.
- ``qwen3``: Qwen2's model without the Q, K, V biases (``attention_bias``), with an
  RMSNorm one head wide on queries and on keys, ``head_dim`` 128 by default.
  ``qwen3_moe``: the same attention (``head_dim`` hidden / heads by default), experts of
  ``moe_intermediate_size`` and no shared expert, sparse layers as ``qwen2_moe``.
- ``gpt_oss``: every MLP ``num_local_experts`` gated experts with biases and its clamped
  SwiGLU (``swiglu_limit``), a router with biases, top ``num_experts_per_tok``; biased
  attention with one learned sink logit per head; ``layer_types`` alternating a 128-token
  sliding window with full attention.
- ``gemma3_text``: Gemma 2's layer with query and key norms one head wide and no soft caps
  by default; five sliding (``sliding_window``) layers to one full by default, their
  rotary base ``rope_local_base_freq`` (10000) where the full layers' is ``rope_theta``
  (1e6 by default).
- ``llama4_text``: experts of ``intermediate_size`` (top ``num_experts_per_tok``, 1)
  beside a shared expert of the same width in ``moe_layers`` (every
  ``interleave_moe_layer_step``-th), dense layers of ``intermediate_size_mlp``; weightless
  L2 query and key norms; chunked attention (``attention_chunk_size``) on the layers with
  rotary positions, three of four by default (``no_rope_layers``, ``layer_types``).

The MLP's activation is read from the family's key (``hidden_act``; Gemma's
``hidden_activation``, the tanh GeLU by default, Gemma 1's legacy ``hidden_act: gelu``
not read; GPT-2's ``activation_function``, ``gelu_new``; Falcon's ``activation``) and
refused when it is none pipesim builds (silu, GeLU exact or tanh, ReLU, gpt-oss's).
Phi-3 reads ``partial_rotary_factor`` (Phi-4-mini turns three quarters of each head).
A mixture of experts reads its load-balancing loss's coefficient, ``router_aux_loss_coef``
(Mixtral 0.02, OLMoE 0.01, Qwen-MoE 0.001, gpt-oss 0.9) or DeepSeek's ``aux_loss_alpha``
(0.001), whatever ``output_router_logits`` says (it turns on Hugging Face's computing the
loss in a forward; the training stacks always add it); none where the file names none.

Sliding windows are read where the family has them: ``layer_types`` when the file lists
them, else the family's rule (Mistral, Phi-3, Mixtral: every layer when
``sliding_window`` is set; Qwen2 and Qwen3: layers from ``max_window_layers`` on, Qwen-MoE
every layer, when ``use_sliding_window``; Gemma 2 and gpt-oss: every other layer from the
first; Gemma 3: all but every ``sliding_window_pattern``-th). A window cuts attention's
FLOPs and time (``pipesim.model.operations``), not the parameters.

A family's defaults never add a part the file does not name: a mixture-of-experts family
whose file leaves out its experts (or Qwen-MoE's shared expert) is refused rather than
built with the config class's default count (a Qwen3-MoE file relabelled ``qwen2_moe``
would otherwise gain qwen2_moe's default shared expert). Vision-language configs
(``gemma3``, ``llama4``, ...) are refused, naming the decoder's own ``text_config``
family. A
``quantization_config`` is never ignored: ``pipesim.model.quantization`` reads FP8 (the
GEMMs then run in FP8; block-scaled, DeepSeek-V3's recipe, a mixture of experts also
dispatches in FP8) and refuses the rest with the reason.

A config without ``model_type`` (written by hand) is read with Llama's keys, a gated MLP
unless ``hidden_act`` names another activation, RMSNorm unless it gives only
``layer_norm_eps``, learned positions with ``position_embedding_type: absolute``.

Never a silent dense count: an unknown ``model_type`` is an error, and so is any key
that changes the parameter count (experts, latent attention, extra norms, biases, ...)
which the family's reader does not model, unless its value changes nothing (null,
false, 0, an empty list). DeepSeek-V3's ``num_nextn_predict_layers`` (its
multi-token-prediction modules, trained beside the main model though Hugging Face does
not build them) is read as ``ModelSpec.mtp_depth``: their parameters are counted apart
from the 671B main model (``mtp_params``), their work in the FLOPs, the last stage's
time and memory.

The training sequence length is not part of such a config: ``seq_len``, else the
config's ``seq_length``, else ``max_position_embeddings`` capped at 8192.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pipesim.model.errors import MAX_LAYERS, ModelSpecError, require_count, require_non_negative, require_positive
from pipesim.model.experts import GATINGS, MixtureOfExperts, dense_layer_indices
from pipesim.model.latent_attention import LatentAttention
from pipesim.model.quantization import dispatches_in_fp8, gemms_in_fp8
from pipesim.model.rotary import Rope, rope_from_config
from pipesim.model.spec import CLAMPED_SWIGLU, ModelSpec

HF_DEFAULT_SEQ_LEN_CAP = 8192
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# keys that change the parameter count in some family: read by the family, or refused
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
            "shared_expert_intermediate_size", "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq",
            "decoder_sparse_step", "mlp_only_layers")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
COUNT_KEYS = (*MOE_KEYS, *MLA_KEYS, "intermediate_size_mlp", "interleave_moe_layer_step", "moe_layers",
              "head_dim", "attention_bias", "mlp_bias", "bias", "n_inner", "ffn_hidden_size",
              "multi_query", "new_decoder_architecture", "num_kv_heads", "n_head_kv", "parallel_attn",
              "num_ln_in_parallel_attn", "qk_layernorm", "use_qk_norm", "num_nextn_predict_layers")
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")
# keys that change attention's FLOPs: read by a family with a window rule, or refused
WINDOW_KEYS = ("sliding_window", "layer_types", "use_sliding_window", "sliding_window_pattern",
               "attention_chunk_size")
LAYER_TYPES = ("full_attention", "sliding_attention")
CHUNKED = "chunked_attention"  # Llama 4's layer type: attention within chunks of attention_chunk_size
# model types whose file holds more than a decoder, or a decoder pipesim does not model, and why
REFUSED = {
    "gemma3": "a vision-language model (a SigLIP vision tower and a projector beside the decoder); its "
              "text_config is the decoder alone: save it as its own config.json (model_type 'gemma3_text')",
    "llama4": "a vision-language model (a vision encoder and a projector beside the decoder); its text_config "
              "is the decoder alone: save it as its own config.json (model_type 'llama4_text')",
    "mllama": "a vision-language model (cross-attention layers and a vision encoder)",
    "qwen2_vl": "a vision-language model (a vision encoder beside the decoder)",
    "qwen2_5_vl": "a vision-language model (a vision encoder beside the decoder)",
}


class Config:
    """A config's keys under their family's names (GPT-2's ``n_embd`` is ``hidden_size``),
    each value checked where it is read."""

    def __init__(self, data: dict, name: str, aliases: dict[str, str]):
        self.data, self.name, self.aliases = data, name, aliases

    def has(self, key: str) -> bool:
        return key in self.data or self.aliases.get(key) in self.data

    def get(self, key: str, default=None):
        if key in self.data:
            return self.data[key]
        return self.data.get(self.aliases.get(key, key), default)

    def key_name(self, key: str) -> str:
        """The spelling the file uses, for messages."""
        return key if key in self.data or key not in self.aliases else self.aliases[key]

    def count(self, key: str, default: int | None = None, minimum: int = 1) -> int | None:
        value = self.get(key, default)
        if value is not None:
            require_count(value, f"{self.name}: {self.key_name(key)}", minimum,
                          MAX_LAYERS if key == "num_hidden_layers" else None)
        return value

    def part(self, key: str, what: str, default: int, minimum: int = 0) -> int:
        """A count that adds ``what`` to the model, which the file must name: the config
        class's ``default`` is not taken for a part the file leaves out."""
        if not self.has(key):
            raise ModelSpecError(f"{self.name}: {key} is missing; the config class's default ({default}) would add "
                                 f"{what} the file does not name: give {key} (0 for none)")
        return self.count(key, minimum=minimum)


@dataclass(frozen=True)
class Family:
    """How Hugging Face builds one ``model_type``: fixed architecture, key defaults, the
    count-changing keys it reads, and a reader for what is particular to it."""

    gated_mlp: bool
    rms_norm: bool = True
    tied: bool = False  # tie_word_embeddings when the file leaves it out
    reads: tuple[str, ...] = ()
    particular: Callable[[Config], dict] | None = None
    aliases: tuple[tuple[str, str], ...] = ()
    head_dim: int | None = None  # default head width when the file gives none (gemma: 256)
    windows: Callable[[Config], dict] | None = None  # which layers slide, over what window
    rope_theta: float = 10000.0  # rope_theta when the file leaves it out (its Hugging Face config's default)
    activation_keys: tuple[str, ...] = ("hidden_act",)  # the keys naming the MLP's activation, first found wins
    activation: str = "silu"  # its Hugging Face name when the file names none


# Hugging Face's activation names (transformers' ACT2FN) -> pipesim's (pipesim.model.spec.ACTIVATIONS)
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "swiglu": "silu", "gelu": "gelu",
                  "gelu_pytorch_tanh": "gelu-tanh", "gelu_new": "gelu-tanh", "gelu_fast": "gelu-tanh",
                  "relu": "relu"}


def _activation(config: Config, family: Family, gated: bool) -> dict:
    """The MLP's activation as the family's keys name it (``None`` where it is the spec's
    default for the MLP: silu gated, gelu not), refused when it is none pipesim builds."""
    named = next((config.get(key) for key in family.activation_keys if config.get(key) is not None),
                 family.activation)
    activation = HF_ACTIVATIONS.get(str(named).lower())
    if activation is None:
        raise ModelSpecError(f"{config.name}: {family.activation_keys[0]} {named!r} is not an activation pipesim "
                             f"builds ({', '.join(HF_ACTIVATIONS)})")
    return {} if activation == ("silu" if gated else "gelu") else {"activation": activation}


def _llama_biases(config: Config) -> dict:
    return {"attention_bias": bool(config.get("attention_bias", False)),
            "mlp_bias": bool(config.get("mlp_bias", False))}


def _attention_bias(config: Config) -> dict:
    return {"attention_bias": bool(config.get("attention_bias", False))}


def _qwen2(config: Config) -> dict:
    return {"qkv_bias": True}


def _mixtral(config: Config) -> dict:
    return {"moe": MixtureOfExperts(experts=config.part("num_local_experts", "routed experts", 8, minimum=1),
                                    experts_per_token=config.count("num_experts_per_tok", 2),
                                    expert_ffn=config.count("intermediate_size", 14336))}


def _qwen_sparse_layers(config: Config) -> tuple[int, ...]:
    """Qwen-MoE's dense layers: those in ``mlp_only_layers`` and those ``i`` with ``(i + 1)``
    not a multiple of ``decoder_sparse_step``."""
    listed = config.get("mlp_only_layers") or []
    if not isinstance(listed, list):
        raise ModelSpecError(f"{config.name}: mlp_only_layers must be a list of layer indices, got {listed!r}")
    return dense_layer_indices(config.count("num_hidden_layers"), moe_every=config.count("decoder_sparse_step", 1),
                               moe_offset=1, listed=listed)


def _qwen2_moe(config: Config) -> dict:
    experts = config.part("num_experts", "routed experts", 60)
    shared = config.part("shared_expert_intermediate_size", "a shared expert", 5632)
    if not experts:
        return {"qkv_bias": True}
    return {"qkv_bias": True, "moe": MixtureOfExperts(
        experts=experts, experts_per_token=config.count("num_experts_per_tok", 4),
        expert_ffn=config.count("moe_intermediate_size", 1408), shared_experts=1 if shared else 0,
        shared_expert_ffn=shared or None, shared_expert_gate=bool(shared), dense_layers=_qwen_sparse_layers(config),
        normalize_top_k=bool(config.get("norm_topk_prob", False)))}


def _qwen3(config: Config) -> dict:
    return {**_attention_bias(config), "qk_norm": "head"}


def _qwen3_moe(config: Config) -> dict:
    found = _qwen3(config)
    experts = config.part("num_experts", "routed experts", 128)
    if experts:
        found["moe"] = MixtureOfExperts(experts=experts, experts_per_token=config.count("num_experts_per_tok", 8),
                                        expert_ffn=config.count("moe_intermediate_size", 768),
                                        dense_layers=_qwen_sparse_layers(config),
                                        normalize_top_k=bool(config.get("norm_topk_prob", False)))
    return found


def _olmoe(config: Config) -> dict:
    return {**_attention_bias(config), "qk_norm": "projection", "moe": MixtureOfExperts(
        experts=config.part("num_experts", "routed experts", 64, minimum=1),
        experts_per_token=config.count("num_experts_per_tok", 8), expert_ffn=config.count("intermediate_size", 2048))}


def _gpt_oss(config: Config) -> dict:
    """Experts whose gate-and-up and down projections carry biases, a biased router,
    attention biased by default, a sink logit per head."""
    limit = config.get("swiglu_limit", 7.0)
    require_positive(limit, f"{config.name}: swiglu_limit")
    return {"attention_bias": bool(config.get("attention_bias", True)), "mlp_bias": True, "attention_sinks": True,
            "activation": CLAMPED_SWIGLU, "activation_limit": float(limit),
            "moe": MixtureOfExperts(experts=config.part("num_local_experts", "routed experts", 128, minimum=1),
                                    experts_per_token=config.count("num_experts_per_tok", 4),
                                    expert_ffn=config.count("intermediate_size", 2880), router_bias=True)}


def _windows(default: int | None, slides: Callable[[Config, int], bool],
             enabled: Callable[[Config], bool] = lambda config: True) -> Callable[[Config], dict]:
    """A family's sliding windows: ``layer_types`` when the file lists them, else the
    layers ``slides`` names; a window of ``sliding_window`` tokens (``default`` when the
    file leaves it out), none unless ``enabled``."""
    def read(config: Config) -> dict:
        if not enabled(config):
            return {}
        window = config.count("sliding_window", default)
        layers = config.count("num_hidden_layers")
        types = config.get("layer_types")
        if types is None:
            sliding = tuple(layer for layer in range(layers) if slides(config, layer))
        else:
            sliding = tuple(layer for layer, kind in enumerate(_layer_types(config, types, layers))
                            if kind == "sliding_attention")
        if window is None or not sliding:
            return {}
        return {"sliding_window": window, "sliding_layers": sliding}
    return read


def _layer_types(config: Config, types: object, layers: int, known: tuple[str, ...] = LAYER_TYPES) -> list[str]:
    if not isinstance(types, list) or len(types) != layers:
        raise ModelSpecError(f"{config.name}: layer_types must list one attention type per layer ({layers}), "
                             f"got {types!r}")
    for kind in types:
        if kind not in known:
            raise ModelSpecError(f"{config.name}: layer_types entry {kind!r} is not an attention pipesim models "
                                 f"for this family (it models {', '.join(known)})")
    return types


def _llama4_chunks(config: Config) -> dict:
    """Llama 4's chunked attention: ``layer_types`` when listed, else every layer that uses
    rotary positions (``no_rope_layers``: 1 for those; by default all but every
    ``no_rope_layer_interval``-th) attends within chunks of ``attention_chunk_size``; the
    others (no positions) attend over the whole sequence."""
    layers = config.count("num_hidden_layers")
    chunk = config.count("attention_chunk_size", 8192)
    types = config.get("layer_types")
    if types is not None:
        chunked = tuple(layer for layer, kind in enumerate(_layer_types(config, types, layers,
                                                                        ("full_attention", CHUNKED)))
                        if kind == CHUNKED)
    else:
        chunked = tuple(layer for layer, uses_rope in enumerate(_llama4_rope(config)) if uses_rope)
    if chunk is None or not chunked:
        return {}
    return {"attention_chunk": chunk, "chunked_layers": chunked}


def _llama4_rope(config: Config) -> list[int]:
    """Llama 4's ``no_rope_layers``: 1 for a layer with rotary positions, 0 for one without
    (by default every ``no_rope_layer_interval``-th, 4)."""
    layers = config.count("num_hidden_layers")
    rope = config.get("no_rope_layers")
    if rope is None:
        interval = config.count("no_rope_layer_interval", 4)
        rope = [int((layer + 1) % interval != 0) for layer in range(layers)]
    if not isinstance(rope, list) or len(rope) != layers:
        raise ModelSpecError(f"{config.name}: no_rope_layers must list 0 or 1 per layer ({layers}), got {rope!r}")
    return rope


def _no_sliding_window(config: Config) -> dict:
    """Llama 4 chunks its attention (read with the family) and has no sliding window."""
    if config.get("sliding_window") not in (None, 0):
        raise ModelSpecError(f"{config.name}: sliding_window = {config.get('sliding_window')!r} changes attention's "
                             f"FLOPs and pipesim does not model it for model_type 'llama4_text'")
    return {}


def _llama4(config: Config) -> dict:
    """Llama 4's decoder: routed experts of ``intermediate_size`` (top
    ``num_experts_per_tok``) beside one shared expert of the same width in the layers
    ``moe_layers`` names (default every ``interleave_moe_layer_step``-th), the other layers
    a dense MLP of ``intermediate_size_mlp``; its query and key norms (``use_qk_norm``)
    are L2 norms without weights, after the rotary turn, on the layers that have one
    (``no_rope_layers``), and the layers without one scale their queries at long positions
    (``attn_temperature_tuning``: ``1 + attn_scale ln(floor((p + 1) / floor_scale) + 1)``,
    1 below position 8191 by default); its router scales each expert's input by the
    sigmoid of the chosen logit."""
    layers = config.count("num_hidden_layers")
    step = config.count("interleave_moe_layer_step", 1)
    moe_layers = config.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, layers, step))
    if not isinstance(moe_layers, list):
        raise ModelSpecError(f"{config.name}: moe_layers must be a list of layer indices, got {moe_layers!r}")
    width = config.count("intermediate_size", 8192)
    found = {**_attention_bias(config), "ffn_hidden": config.count("intermediate_size_mlp", 16384),
             **_llama4_chunks(config),
             "nope_layers": tuple(layer for layer, uses_rope in enumerate(_llama4_rope(config)) if not uses_rope)}
    if config.get("use_qk_norm", True):
        found["qk_norm"] = "l2"
    if config.get("attn_temperature_tuning", True):
        floor, scale = config.get("floor_scale", 8192), config.get("attn_scale", 0.1)
        require_positive(floor, f"{config.name}: floor_scale")
        require_positive(scale, f"{config.name}: attn_scale")
        found["nope_temperature"] = (float(floor), float(scale))
    experts = config.part("num_local_experts", "routed experts", 16)
    if experts and moe_layers:
        # the top-k logits' sigmoids scale the experts' inputs; no bias, nothing renormalised
        found["moe"] = MixtureOfExperts(
            experts=experts, experts_per_token=config.count("num_experts_per_tok", 1), expert_ffn=width,
            shared_experts=1, shared_expert_ffn=width,
            dense_layers=tuple(layer for layer in range(layers) if layer not in moe_layers),
            gating="sigmoid", normalize_top_k=False, selection_bias=False, weighted_input=True)
    return found


EVERY_LAYER = _windows(None, lambda config, layer: True)


def every_other(default: int) -> Callable[[Config], dict]:
    """Gemma 2 and gpt-oss: a window on every other layer, the first included."""
    return _windows(default, lambda config, layer: layer % 2 == 0)


QWEN_WINDOWS = _windows(4096, lambda config, layer: layer >= config.count("max_window_layers", 28, minimum=0),
                        enabled=lambda config: bool(config.get("use_sliding_window", False)))
QWEN_MOE_WINDOWS = _windows(4096, lambda config, layer: True,
                            enabled=lambda config: bool(config.get("use_sliding_window", False)))
GEMMA3_WINDOWS = _windows(4096, lambda config, layer: (layer + 1) % config.count("sliding_window_pattern", 6) != 0)


def _gpt2(config: Config) -> dict:
    return {"bias": True, "learned_positions": True, "positions": config.count("max_position_embeddings", 1024),
            "ffn_hidden": config.count("n_inner")}


def _gemma(config: Config) -> dict:
    """Gemma's RMSNorms scale by one plus their weight, and its embeddings are multiplied
    by the square root of the hidden size."""
    return {**_attention_bias(config), "norm_offset": True, "embedding_scale": True}


def _positive_or_none(config: Config, key: str, default: float | None) -> float | None:
    """``key`` as a number > 0, or None where the file (or the default) has none."""
    value = config.get(key, default)
    if value is None:
        return None
    require_positive(value, f"{config.name}: {key}")
    return float(value)


def _gemma_sandwich(config: Config, attention_cap: float | None, logit_cap: float | None) -> dict:
    """Gemma 2/3's layer: Gemma 1's parts, four norms (before and after each half), the
    softmax scaled by ``query_pre_attn_scalar`` (256 by default), the attention scores
    and output logits soft-capped where the family's defaults or the file say."""
    return {**_gemma(config), "norms_per_layer": 4,
            "query_pre_attn_scalar": _positive_or_none(config, "query_pre_attn_scalar", 256),
            "attention_softcap": _positive_or_none(config, "attn_logit_softcapping", attention_cap),
            "logit_softcap": _positive_or_none(config, "final_logit_softcapping", logit_cap)}


def _gemma2(config: Config) -> dict:
    """Soft caps by default (``attn_logit_softcapping`` 50, ``final_logit_softcapping`` 30)."""
    return _gemma_sandwich(config, 50.0, 30.0)


def _gemma3(config: Config) -> dict:
    """Query and key norms one head wide, no soft caps by default, and its sliding layers'
    rotary positions at ``rope_local_base_freq`` (10000), unscaled, where the full layers
    use ``rope_theta`` (1e6) and ``rope_scaling``."""
    local = config.get("rope_local_base_freq", 10000.0)
    require_positive(local, f"{config.name}: rope_local_base_freq")
    return {**_gemma_sandwich(config, None, None), "qk_norm": "head", "local_rope": Rope(theta=local)}


def _gpt_neox(config: Config) -> dict:
    """Attention and MLP side by side on the block's input (``use_parallel_residual``, on
    by default), rotary positions on the first ``rotary_pct`` of each head (a quarter by
    default; ``partial_rotary_factor`` in newer files) at ``rotary_emb_base``."""
    return {"attention_bias": bool(config.get("attention_bias", True)), "mlp_bias": True,
            "parallel_residual": bool(config.get("use_parallel_residual", True)),
            "rotary_fraction": config.get("partial_rotary_factor", 0.25)}


def _falcon(config: Config) -> dict:
    if config.get("alibi", False):
        raise ModelSpecError(f"{config.name}: alibi positions (Falcon-RW) are not a part pipesim builds: its "
                             "executor turns queries and keys by rotary positions (remove alibi to read it so)")
    heads = config.count("num_attention_heads")
    if config.get("new_decoder_architecture", False):
        kv_heads = config.count("num_kv_heads") or heads
        norms = 1 if config.get("num_ln_in_parallel_attn") == 1 else 2
        parallel = True
    else:
        kv_heads = 1 if config.get("multi_query", True) else heads
        parallel = bool(config.get("parallel_attn", True))
        norms = 1 if parallel else 2
    return {"bias": bool(config.get("bias", False)), "kv_heads": kv_heads, "norms_per_layer": norms,
            "ffn_hidden": config.count("ffn_hidden_size"), "parallel_residual": parallel}


def _gating(config: Config, default: str) -> str:
    """``scoring_func`` (DeepSeek): the router's ``softmax`` or ``sigmoid`` scores."""
    value = config.get("scoring_func", default)
    if value not in GATINGS:
        raise ModelSpecError(f"{config.name}: scoring_func {value!r} is not one of: {', '.join(GATINGS)}")
    return value


def _deepseek(first_dense_default: int, routed_default: int | None, shared_default: int | None,
              top_k_default: int | None, expert_ffn_default: int, gating: str = "softmax",
              normalize: bool = False, scaling_default: float = 1.0,
              always_scaled: bool = False) -> Callable[[Config], dict]:
    def read(config: Config) -> dict:
        mla = LatentAttention(q_lora_rank=config.count("q_lora_rank", 1536),
                              kv_lora_rank=config.count("kv_lora_rank", 512),
                              qk_nope_head_dim=config.count("qk_nope_head_dim", 128),
                              qk_rope_head_dim=config.count("qk_rope_head_dim", 64),
                              v_head_dim=config.count("v_head_dim", 128))
        found = {"mla": mla, "kv_heads": None, **_attention_bias(config),
                 "mtp_depth": config.count("num_nextn_predict_layers", 0, minimum=0) or 0}
        experts = (config.part("n_routed_experts", "routed experts", routed_default) if routed_default
                   else config.count("n_routed_experts"))
        if not experts:
            return found
        dense = dense_layer_indices(config.count("num_hidden_layers"),
                                    first_dense=config.count("first_k_dense_replace", first_dense_default, minimum=0),
                                    moe_every=config.count("moe_layer_freq", 1))
        shared = (config.part("n_shared_experts", "shared experts", shared_default) if shared_default
                  else config.count("n_shared_experts", minimum=0))
        top_k = config.count("num_experts_per_tok", top_k_default)
        normalized = bool(config.get("norm_topk_prob", normalize))
        found["moe"] = MixtureOfExperts(
            experts=experts, experts_per_token=top_k,
            expert_ffn=config.count("moe_intermediate_size", expert_ffn_default),
            shared_experts=shared or 0, dense_layers=dense, node_limit=_node_limit(config),
            gating=_gating(config, gating), normalize_top_k=normalized, **_expert_groups(config),
            routed_scaling=_routed_scaling(config, scaling_default, always_scaled or not (normalized and top_k > 1)))
        return found
    return read


def _expert_groups(config: Config) -> dict:
    """``n_group`` and how a group is scored, where routing is group-limited (V2's
    ``group_limited_greedy``: a group's best expert; V3's ``noaux_tc``: its best two's
    sum, by biased score)."""
    if _node_limit(config) is None:
        return {}
    return {"expert_groups": config.count("n_group"),
            "group_scoring": "top2-sum" if config.get("topk_method") == "noaux_tc" else "max"}


def _routed_scaling(config: Config, default: float, applied: bool) -> float:
    """``routed_scaling_factor`` where the family applies it: V3 to every top-k weight,
    V2 only to weights it does not rescale to sum to one (as their modelling code does)."""
    value = config.get("routed_scaling_factor", default)
    require_positive(value, f"{config.name}: routed_scaling_factor")
    return float(value) if applied else 1.0


def _node_limit(config: Config) -> int | None:
    """DeepSeek's group-limited routing: a token picks ``topk_group`` of ``n_group``
    expert groups, then its experts within them (``topk_method`` ``noaux_tc`` in V3,
    ``group_limited_greedy`` in V2; ``greedy`` has no limit). DeepSeek deploys one group
    per node (V3: 8 groups of 32 experts on 8 nodes), so the limit is on nodes."""
    method = config.get("topk_method", "greedy")
    groups = config.count("n_group", 1)
    if method == "greedy" or groups <= 1:
        return None
    if method not in ("noaux_tc", "group_limited_greedy"):
        raise ModelSpecError(f"{config.name}: topk_method {method!r} is not a routing pipesim models (greedy, "
                             f"group_limited_greedy, noaux_tc)")
    return config.count("topk_group", groups)


LLAMA_BIASES = ("attention_bias", "mlp_bias")
# Gemma's MLP is GeGLU with the tanh approximation, named by hidden_activation; the Gemma 1 files'
# legacy "hidden_act": "gelu" (exact) is not what the model was trained with, and is not read
GEMMA_ACTIVATION = {"activation_keys": ("hidden_activation",), "activation": "gelu_pytorch_tanh"}
QWEN_MOE_READS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                  "mlp_only_layers")
DEEPSEEK_READS = (*MLA_KEYS, "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok",
                  "first_k_dense_replace", "moe_layer_freq", "attention_bias")
FAMILIES: dict[str, Family] = {
    "llama": Family(gated_mlp=True, reads=("head_dim", *LLAMA_BIASES), particular=_llama_biases),
    "mistral": Family(gated_mlp=True, reads=("head_dim",), windows=_windows(4096, lambda config, layer: True)),
    "mixtral": Family(gated_mlp=True, reads=("head_dim", "num_local_experts", "num_experts_per_tok"),
                      particular=_mixtral, windows=EVERY_LAYER),
    "qwen2": Family(gated_mlp=True, reads=("head_dim",), particular=_qwen2, windows=QWEN_WINDOWS),
    "qwen2_moe": Family(gated_mlp=True, reads=("head_dim", *QWEN_MOE_READS, "shared_expert_intermediate_size"),
                        particular=_qwen2_moe, windows=QWEN_MOE_WINDOWS),
    "qwen3": Family(gated_mlp=True, reads=("head_dim", "attention_bias"), particular=_qwen3, head_dim=128,
                    windows=QWEN_WINDOWS),
    "qwen3_moe": Family(gated_mlp=True, reads=("head_dim", "attention_bias", *QWEN_MOE_READS), particular=_qwen3_moe,
                        windows=QWEN_MOE_WINDOWS),
    "olmoe": Family(gated_mlp=True, reads=("attention_bias", "num_experts", "num_experts_per_tok"),
                    particular=_olmoe),
    "gpt_oss": Family(gated_mlp=True, reads=("head_dim", "attention_bias", "num_local_experts", "num_experts_per_tok"),
                      particular=_gpt_oss, head_dim=64, windows=every_other(128), rope_theta=150000.0),
    "gemma": Family(gated_mlp=True, tied=True, reads=("head_dim", "attention_bias"), particular=_gemma,
                    head_dim=256, **GEMMA_ACTIVATION),
    "gemma2": Family(gated_mlp=True, tied=True, reads=("head_dim", "attention_bias"),
                     particular=_gemma2, head_dim=256, windows=every_other(4096), **GEMMA_ACTIVATION),
    "gemma3_text": Family(gated_mlp=True, tied=True, reads=("head_dim", "attention_bias"),
                          particular=_gemma3, head_dim=256, windows=GEMMA3_WINDOWS, rope_theta=1_000_000.0,
                          **GEMMA_ACTIVATION),
    "phi3": Family(gated_mlp=True, windows=EVERY_LAYER,  # Phi-4-mini turns 3/4 of each head
                   particular=lambda config: {"rotary_fraction": config.get("partial_rotary_factor", 1.0)}),
    "llama4_text": Family(gated_mlp=True, reads=("head_dim", "attention_bias", "num_local_experts",
                                                 "num_experts_per_tok", "use_qk_norm", "intermediate_size_mlp",
                                                 "interleave_moe_layer_step", "moe_layers"),
                          particular=_llama4, head_dim=128, windows=_no_sliding_window, rope_theta=500000.0),
    "gpt2": Family(gated_mlp=False, rms_norm=False, tied=True, reads=("n_inner",), particular=_gpt2,
                   aliases=(("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"),
                            ("num_attention_heads", "n_head"), ("max_position_embeddings", "n_positions")),
                   activation_keys=("activation_function",), activation="gelu_new"),
    "gpt_neox": Family(gated_mlp=False, rms_norm=False, reads=("attention_bias",), particular=_gpt_neox,
                       activation="gelu",  # older files' names for the rotary base and share
                       aliases=(("rope_theta", "rotary_emb_base"), ("partial_rotary_factor", "rotary_pct"))),
    "falcon": Family(gated_mlp=False, rms_norm=False, tied=True,
                     reads=("bias", "multi_query", "new_decoder_architecture", "num_kv_heads", "n_head_kv",
                            "parallel_attn", "num_ln_in_parallel_attn", "ffn_hidden_size"),
                     particular=_falcon, aliases=(("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
                                                  ("num_kv_heads", "n_head_kv")),
                     activation_keys=("activation",), activation="gelu"),
    "deepseek_v2": Family(gated_mlp=True, reads=DEEPSEEK_READS, particular=_deepseek(0, None, None, None, 1407)),
    "deepseek_v3": Family(gated_mlp=True, reads=(*DEEPSEEK_READS, "num_nextn_predict_layers"),
                          particular=_deepseek(3, 256, 1, 8, 2048, "sigmoid", True, 2.5, True)),
}


def _hand_written(config: Config) -> dict:
    """Llama's keys, the activation deciding the MLP (a file no Hugging Face class reads)."""
    activation = str(config.get("hidden_act", "silu")).lower()
    return {"gated_mlp": activation in ("silu", "swish", "swiglu"),
            "rms_norm": config.has("rms_norm_eps") or not config.has("layer_norm_eps"),
            "learned_positions": config.get("position_embedding_type") == "absolute", **_llama_biases(config)}


HAND_WRITTEN = Family(gated_mlp=True, reads=("head_dim", *LLAMA_BIASES), particular=_hand_written)


def spec_from_hf_config(data: object, name: str = "config", seq_len: int | None = None) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json``, read as its ``model_type``'s
    Hugging Face class builds the model."""
    if not isinstance(data, dict):
        raise ModelSpecError(f"{name}: expected a JSON object with hidden_size, num_hidden_layers, ...")
    model_type = data.get("model_type")
    if model_type in REFUSED:
        raise ModelSpecError(f"{name}: model_type {model_type!r} is {REFUSED[model_type]}")
    fp8 = gemms_in_fp8(data, name)
    family = HAND_WRITTEN if model_type is None else FAMILIES.get(model_type)
    if family is None:
        raise ModelSpecError(f"{name}: model_type {model_type!r} is not one pipesim reads; supported: "
                             f"{', '.join(FAMILIES)} (or leave model_type out for Llama's keys)")
    config = Config(data, name, dict(family.aliases))
    missing = [config.key_name(key) for key in REQUIRED if not config.has(key)]
    if missing:
        raise ModelSpecError(f"{name}: missing {', '.join(missing)} (a Hugging Face style config)")
    check_understood(config, family, model_type)
    if seq_len is None:
        seq_len = config.count("seq_length") or min(config.count("max_position_embeddings", 4096),
                                                     HF_DEFAULT_SEQ_LEN_CAP)
    hidden, heads = config.count("hidden_size"), config.count("num_attention_heads")
    fields = dict(
        name=str(data.get("_name_or_path") or model_type or name),
        layers=config.count("num_hidden_layers"), hidden=hidden, heads=heads, seq_len=seq_len,
        vocab=config.count("vocab_size"), kv_heads=config.count("num_key_value_heads"),
        ffn_hidden=config.count("intermediate_size"), gated_mlp=family.gated_mlp,
        tied_embeddings=bool(config.get("tie_word_embeddings", family.tied)), learned_positions=False, bias=False,
        rms_norm=family.rms_norm, dropout=_has_dropout(config),
        head_dim=config.count("head_dim", family.head_dim), fp8=fp8,
        rope=rope_from_config(config.get("rope_theta", family.rope_theta), config.get("rope_scaling"), name,
                              config.get("max_position_embeddings"), config.get("original_max_position_embeddings")),
    )
    if family.particular is not None:
        fields.update(family.particular(config))
    if "activation" not in fields:  # gpt-oss names its own
        fields.update(_activation(config, family, fields["gated_mlp"]))
    if family.windows is not None:
        fields.update(family.windows(config))
    if fields.get("moe") is not None:
        fields["moe"] = replace(fields["moe"], balance_loss=_balance_loss(config))
    # DeepSeek-V3's block-scaled recipe sends the experts' FP8 input over the all-to-all
    fields["fp8_dispatch"] = fields.get("moe") is not None and dispatches_in_fp8(data, name)
    return ModelSpec(**fields)


def _balance_loss(config: Config) -> float:
    """The load-balancing loss's coefficient the file names (0 where it names none)."""
    for key in ("router_aux_loss_coef", "aux_loss_alpha"):
        value = config.get(key)
        if value is not None:
            require_non_negative(value, f"{config.name}: {key}")
            return float(value)
    return 0.0


def check_understood(config: Config, family: Family, model_type: str | None) -> None:
    """Refuse a key that changes the count and that ``family``'s reader does not model."""
    for key in COUNT_KEYS:
        if key in family.reads or not config.has(key):
            continue
        value = config.get(key)
        if value in (None, False, 0, [], {}) or (key == "head_dim" and _default_head_dim(config) == value):
            continue
        family_name = f"model_type {model_type!r}" if model_type else "a config without model_type"
        raise ModelSpecError(f"{config.name}: {config.key_name(key)} = {value!r} changes the parameter count and "
                             f"pipesim does not model it for {family_name}")
    if family.windows is None:
        for key in WINDOW_KEYS:
            value = config.get(key)
            if value not in (None, False, 0, [], {}):
                family_name = f"model_type {model_type!r}" if model_type else "a config without model_type"
                raise ModelSpecError(f"{config.name}: {key} = {value!r} changes attention's FLOPs and pipesim does "
                                     f"not model it for {family_name}")


def _default_head_dim(config: Config):
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _has_dropout(config: Config) -> bool:
    for key in DROPOUT_KEYS:
        value = config.get(key) or 0
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelSpecError(f"{config.name}: {key} must be a probability, got {value!r}")
        if value > 0:
            return True
    return False
