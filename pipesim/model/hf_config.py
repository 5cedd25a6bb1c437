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
- ``gemma``, ``gemma2``: gated (GeGLU, whatever ``hidden_act`` says), ``head_dim``
  (default 256), tied by default; gemma-2 has four RMSNorms per layer.
- ``gpt2``: ``n_embd``, ``n_layer``, ``n_head``, ``n_inner``; two matrices (GeLU),
  LayerNorm, every linear biased, learned positions of ``n_positions`` rows, tied.
- ``gpt_neox``: two matrices, LayerNorm, MLP biases always, attention biases unless
  ``attention_bias`` is false, untied.
- ``falcon``: two matrices of ``ffn_hidden_size`` (4h), LayerNorm (one per layer with
  ``parallel_attn``), ``bias`` for every linear (default none), one key-value head with
  ``multi_query``, ``num_kv_heads`` with ``new_decoder_architecture``, tied.
- ``deepseek_v2``, ``deepseek_v3``: multi-head latent attention, gated experts from
  layer ``first_k_dense_replace`` on (every ``moe_layer_freq``-th), shared experts,
  untied; the router's ``scoring_func`` (V2 softmax, V3 sigmoid) and ``norm_topk_prob``
  (V2 false, V3 true; Qwen-MoE false), which change no count, are kept for the executor.

A config without ``model_type`` (written by hand) is read with Llama's keys, a gated MLP
unless ``hidden_act`` names another activation, RMSNorm unless it gives only
``layer_norm_eps``, learned positions with ``position_embedding_type: absolute``.

Never a silent dense count: an unknown ``model_type`` is an error, and so is any key
that changes the parameter count (experts, latent attention, extra norms, biases, ...)
which the family's reader does not model, unless its value changes nothing (null,
false, 0, an empty list). DeepSeek-V3's ``num_nextn_predict_layers`` (its
multi-token-prediction module) is accepted and not counted: Hugging Face does not build
it, and DeepSeek's 671B is the main model without it.

The training sequence length is not part of such a config: ``seq_len``, else the
config's ``seq_length``, else ``max_position_embeddings`` capped at 8192.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipesim.model.errors import ModelSpecError, require_count
from pipesim.model.experts import GATINGS, MixtureOfExperts, dense_layer_indices
from pipesim.model.latent_attention import LatentAttention
from pipesim.model.spec import ModelSpec

HF_DEFAULT_SEQ_LEN_CAP = 8192
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# keys that change the parameter count in some family: read by the family, or refused
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
            "shared_expert_intermediate_size", "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq",
            "decoder_sparse_step", "mlp_only_layers")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
COUNT_KEYS = (*MOE_KEYS, *MLA_KEYS, "head_dim", "attention_bias", "mlp_bias", "bias", "n_inner", "ffn_hidden_size",
              "multi_query", "new_decoder_architecture", "num_kv_heads", "n_head_kv", "parallel_attn",
              "num_ln_in_parallel_attn", "qk_layernorm", "use_qk_norm", "num_nextn_predict_layers")
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")


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
            require_count(value, f"{self.name}: {self.key_name(key)}", minimum)
        return value


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


def _llama_biases(config: Config) -> dict:
    return {"attention_bias": bool(config.get("attention_bias", False)),
            "mlp_bias": bool(config.get("mlp_bias", False))}


def _attention_bias(config: Config) -> dict:
    return {"attention_bias": bool(config.get("attention_bias", False))}


def _qwen2(config: Config) -> dict:
    return {"qkv_bias": True}


def _mixtral(config: Config) -> dict:
    return {"moe": MixtureOfExperts(experts=config.count("num_local_experts", 8),
                                    experts_per_token=config.count("num_experts_per_tok", 2),
                                    expert_ffn=config.count("intermediate_size", 14336))}


def _qwen2_moe(config: Config) -> dict:
    experts = config.count("num_experts", 60, minimum=0)
    layers = config.count("num_hidden_layers")
    listed = config.get("mlp_only_layers") or []
    if not isinstance(listed, list):
        raise ModelSpecError(f"{config.name}: mlp_only_layers must be a list of layer indices, got {listed!r}")
    shared = config.count("shared_expert_intermediate_size", 5632, minimum=0)
    if not experts:
        return {"qkv_bias": True}
    dense = dense_layer_indices(layers, moe_every=config.count("decoder_sparse_step", 1), moe_offset=1, listed=listed)
    return {"qkv_bias": True, "moe": MixtureOfExperts(
        experts=experts, experts_per_token=config.count("num_experts_per_tok", 4),
        expert_ffn=config.count("moe_intermediate_size", 1408), shared_experts=1 if shared else 0,
        shared_expert_ffn=shared or None, shared_expert_gate=bool(shared), dense_layers=dense,
        normalize_top_k=bool(config.get("norm_topk_prob", False)))}


def _gpt2(config: Config) -> dict:
    return {"bias": True, "learned_positions": True, "positions": config.count("max_position_embeddings", 1024),
            "ffn_hidden": config.count("n_inner")}


def _gpt_neox(config: Config) -> dict:
    return {"attention_bias": bool(config.get("attention_bias", True)), "mlp_bias": True}


def _falcon(config: Config) -> dict:
    heads = config.count("num_attention_heads")
    if config.get("new_decoder_architecture", False):
        kv_heads = config.count("num_kv_heads") or heads
        norms = 1 if config.get("num_ln_in_parallel_attn") == 1 else 2
    else:
        kv_heads = 1 if config.get("multi_query", True) else heads
        norms = 1 if config.get("parallel_attn", True) else 2
    return {"bias": bool(config.get("bias", False)), "kv_heads": kv_heads, "norms_per_layer": norms,
            "ffn_hidden": config.count("ffn_hidden_size")}


def _gating(config: Config, default: str) -> str:
    """``scoring_func`` (DeepSeek): the router's ``softmax`` or ``sigmoid`` scores."""
    value = config.get("scoring_func", default)
    if value not in GATINGS:
        raise ModelSpecError(f"{config.name}: scoring_func {value!r} is not one of: {', '.join(GATINGS)}")
    return value


def _deepseek(first_dense_default: int, routed_default: int | None, shared_default: int | None,
              top_k_default: int | None, expert_ffn_default: int, gating: str = "softmax",
              normalize: bool = False) -> Callable[[Config], dict]:
    def read(config: Config) -> dict:
        mla = LatentAttention(q_lora_rank=config.count("q_lora_rank", 1536),
                              kv_lora_rank=config.count("kv_lora_rank", 512),
                              qk_nope_head_dim=config.count("qk_nope_head_dim", 128),
                              qk_rope_head_dim=config.count("qk_rope_head_dim", 64),
                              v_head_dim=config.count("v_head_dim", 128))
        found = {"mla": mla, "kv_heads": None, **_attention_bias(config)}
        experts = config.count("n_routed_experts", routed_default)
        if experts is None:
            return found
        dense = dense_layer_indices(config.count("num_hidden_layers"),
                                    first_dense=config.count("first_k_dense_replace", first_dense_default, minimum=0),
                                    moe_every=config.count("moe_layer_freq", 1))
        found["moe"] = MixtureOfExperts(
            experts=experts, experts_per_token=config.count("num_experts_per_tok", top_k_default),
            expert_ffn=config.count("moe_intermediate_size", expert_ffn_default),
            shared_experts=config.count("n_shared_experts", shared_default, minimum=0) or 0, dense_layers=dense,
            gating=_gating(config, gating), normalize_top_k=bool(config.get("norm_topk_prob", normalize)))
        return found
    return read


LLAMA_BIASES = ("attention_bias", "mlp_bias")
DEEPSEEK_READS = (*MLA_KEYS, "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok",
                  "first_k_dense_replace", "moe_layer_freq", "attention_bias")
FAMILIES: dict[str, Family] = {
    "llama": Family(gated_mlp=True, reads=("head_dim", *LLAMA_BIASES), particular=_llama_biases),
    "mistral": Family(gated_mlp=True, reads=("head_dim",)),
    "mixtral": Family(gated_mlp=True, reads=("head_dim", "num_local_experts", "num_experts_per_tok"),
                      particular=_mixtral),
    "qwen2": Family(gated_mlp=True, reads=("head_dim",), particular=_qwen2),
    "qwen2_moe": Family(gated_mlp=True, reads=("head_dim", "num_experts", "num_experts_per_tok",
                                               "moe_intermediate_size", "shared_expert_intermediate_size",
                                               "decoder_sparse_step", "mlp_only_layers"), particular=_qwen2_moe),
    "gemma": Family(gated_mlp=True, tied=True, reads=("head_dim", "attention_bias"), particular=_attention_bias,
                    head_dim=256),
    "gemma2": Family(gated_mlp=True, tied=True, reads=("head_dim", "attention_bias"),
                     particular=lambda config: {**_attention_bias(config), "norms_per_layer": 4}, head_dim=256),
    "phi3": Family(gated_mlp=True),
    "gpt2": Family(gated_mlp=False, rms_norm=False, tied=True, reads=("n_inner",), particular=_gpt2,
                   aliases=(("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"),
                            ("num_attention_heads", "n_head"), ("max_position_embeddings", "n_positions"))),
    "gpt_neox": Family(gated_mlp=False, rms_norm=False, reads=("attention_bias",), particular=_gpt_neox),
    "falcon": Family(gated_mlp=False, rms_norm=False, tied=True,
                     reads=("bias", "multi_query", "new_decoder_architecture", "num_kv_heads", "n_head_kv",
                            "parallel_attn", "num_ln_in_parallel_attn", "ffn_hidden_size"),
                     particular=_falcon, aliases=(("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
                                                  ("num_kv_heads", "n_head_kv"))),
    "deepseek_v2": Family(gated_mlp=True, reads=DEEPSEEK_READS, particular=_deepseek(0, None, None, None, 1407)),
    "deepseek_v3": Family(gated_mlp=True, reads=(*DEEPSEEK_READS, "num_nextn_predict_layers"),
                          particular=_deepseek(3, 256, 1, 8, 2048, "sigmoid", True)),
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
        head_dim=config.count("head_dim", family.head_dim),
    )
    if family.particular is not None:
        fields.update(family.particular(config))
    return ModelSpec(**fields)


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
