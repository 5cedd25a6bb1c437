"""Hugging Face style ``config.json`` files as ``ModelSpec``s.

The keys read are the ones Llama, Mistral and Qwen configs share: ``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``; ``hidden_act: silu`` means
a SwiGLU MLP, ``rms_norm_eps`` RMSNorm, rotary positions unless
``position_embedding_type: absolute``, biases only with ``attention_bias``/``mlp_bias``.
"""

from __future__ import annotations

from pipesim.model.spec import ModelSpec, ModelSpecError

HF_DEFAULT_SEQ_LEN_CAP = 8192


def spec_from_hf_config(data: object, name: str = "config", seq_len: int | None = None) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face style ``config.json`` (Llama/Mistral/Qwen keys).

    The training sequence length is not part of such a config: ``seq_len``, else the
    config's ``seq_length``, else ``max_position_embeddings`` capped at 8192."""
    if not isinstance(data, dict):
        raise ModelSpecError(f"{name}: expected a JSON object with hidden_size, num_hidden_layers, ...")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [key for key in required if key not in data]
    if missing:
        raise ModelSpecError(f"{name}: missing {', '.join(missing)} (a Hugging Face style config)")

    def integer(key: str, default: int | None = None) -> int | None:
        value = data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelSpecError(f"{name}: {key} must be an integer >= 1, got {value!r}")
        return value

    if seq_len is None:
        seq_len = integer("seq_length") or min(integer("max_position_embeddings", 4096), HF_DEFAULT_SEQ_LEN_CAP)
    activation = str(data.get("hidden_act", "silu")).lower()
    dropout = any(float(data.get(key) or 0) > 0 for key in ("attention_dropout", "hidden_dropout", "resid_pdrop"))
    return ModelSpec(
        name=str(data.get("_name_or_path") or data.get("model_type") or name),
        layers=integer("num_hidden_layers"),
        hidden=integer("hidden_size"),
        heads=integer("num_attention_heads"),
        seq_len=seq_len,
        vocab=integer("vocab_size"),
        kv_heads=integer("num_key_value_heads"),
        ffn_hidden=integer("intermediate_size"),
        gated_mlp=activation in ("silu", "swish", "swiglu"),
        tied_embeddings=bool(data.get("tie_word_embeddings", False)),
        learned_positions=data.get("position_embedding_type") == "absolute",
        bias=bool(data.get("attention_bias", False) or data.get("mlp_bias", False)),
        rms_norm="rms_norm_eps" in data or "layer_norm_eps" not in data,
        dropout=dropout,
    )
