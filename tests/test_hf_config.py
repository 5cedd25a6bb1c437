"""Hugging Face config.json files read as Hugging Face builds the model.

The fixtures in pipesim/model/data/hf_configs are written by hand with the keys that matter,
values from the models' public config.json files. Published parameter counts:
- Llama 3.1 8B 8.03B, Qwen2.5-7B 7.62B, Mistral-7B 7.24B, gemma-2-9b 9.24B, Phi-3-mini
  3.82B: the sizes the Hugging Face model pages give, counted from the published weights
  (Qwen's model card rounds its own to 7.61B; the count here is 7.6156B).
- gpt2 124.4M: its Hugging Face model card ("the smallest version of GPT-2, with 124M
  parameters"); the exact count of its architecture is 124,439,808.
- Pythia-160M 162,322,944 (GPT-NeoX naming): EleutherAI's Pythia model card, exactly.
- Qwen1.5-MoE-A2.7B 14.3B total, 2.7B activated: Qwen's model card.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipesim.model.errors import ModelSpecError
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.spec import BUNDLED_CONFIGS, load_model, model_spec

CONFIGS = BUNDLED_CONFIGS


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name,published", [
    ("llama-3.1-8b", 8.03e9), ("qwen2.5-7b", 7.62e9), ("mistral-7b", 7.24e9), ("gemma-2-9b", 9.24e9),
    ("phi-3-mini", 3.82e9), ("gpt2", 124.4e6),
])
def test_dense_families_within_half_a_percent_of_published(name, published):
    assert load_model(str(CONFIGS / f"{name}.json")).total_params() == pytest.approx(published, rel=0.005)


def test_gemma2_reads_geglu_head_dim_four_norms_and_the_tied_default():
    """gelu_pytorch_tanh is GeGLU (gate, up, down); 16 heads of 256 = 4096 columns on a
    3584-wide model; four RMSNorms per layer; no tie_word_embeddings key: tied (Gemma2Config)."""
    h, f, q, kv, vocab = 3584, 14336, 16 * 256, 8 * 256, 256000
    layer = h * q + 2 * h * kv + q * h + 3 * h * f + 4 * h
    spec = spec_from_hf_config(config("gemma-2-9b"))
    assert spec.total_params() == 42 * layer + vocab * h + h
    untied = spec_from_hf_config({**config("gemma-2-9b"), "tie_word_embeddings": False})
    assert untied.total_params() - spec.total_params() == vocab * h


def test_gpt2_names_and_defaults():
    """n_embd/n_layer/n_head/n_positions; no hidden_act (activation_function gelu_new: two
    matrices); biases everywhere; LayerNorm; learned positions of n_positions rows; tied;
    dropout (resid_pdrop 0.1)."""
    h, vocab, positions = 768, 50257, 1024
    spec = spec_from_hf_config(config("gpt2"))
    assert spec.total_params() == 12 * (12 * h * h + 13 * h) + vocab * h + positions * h + 2 * h == 124_439_808
    assert spec.dropout and spec.seq_len == 1024
    shorter = spec_from_hf_config(config("gpt2"), seq_len=256)
    assert shorter.total_params() == spec.total_params()  # the position table is n_positions rows whatever is trained


def test_gpt_neox_is_pythia_160m_exactly():
    assert load_model(str(CONFIGS / "pythia-160m.json")).total_params() == 162_322_944


def test_qwen2_has_qkv_biases_only():
    h, kv, f, vocab = 3584, 512, 18944, 152064
    layer = 2 * h * h + 2 * h * kv + (h + 2 * kv) + 3 * h * f + 2 * h  # Q, K, V biases; O none
    assert spec_from_hf_config(config("qwen2.5-7b")).total_params() == 28 * layer + 2 * vocab * h + h


def test_falcon_multi_query_and_parallel_attention():
    """Falcon-7B: one key-value head (multi_query), one LayerNorm per layer
    (parallel_attn), MLP 4h of two matrices, no biases, tied; 40B-style
    new_decoder_architecture reads num_kv_heads and two norms."""
    h, head, f, vocab = 4544, 64, 4 * 4544, 65024
    layer = h * (h + 2 * head) + h * h + 2 * h * f + 2 * h
    spec = spec_from_hf_config(config("falcon-7b"))
    assert spec.num_kv_heads == 1 and spec.total_params() == 32 * layer + vocab * h + 2 * h
    new = spec_from_hf_config({**config("falcon-7b"), "new_decoder_architecture": True, "num_kv_heads": 71})
    assert new.num_kv_heads == 71 and new.norms_per_layer == 2


@pytest.mark.parametrize("name,preset,seq_len", [
    ("mixtral-8x7b", "mixtral-8x7b", None), ("deepseek-v3", "deepseek-v3", 4096),
    ("deepseek-v2-lite", "deepseek-v2-lite", 4096), ("llama-3.1-8b", "llama3-8b", None),
])
def test_configs_give_the_presets(name, preset, seq_len):
    """The presets are the main models; DeepSeek-V3's file adds its multi-token prediction module."""
    spec = spec_from_hf_config(config(name), seq_len=seq_len)
    expected = replace(model_spec(preset), mtp_depth=1 if name == "deepseek-v3" else 0)
    assert spec.total_params() == expected.total_params() and spec.active_params() == expected.active_params()
    assert spec.forward_flops() == expected.forward_flops()


def test_qwen_moe_within_one_percent_of_published():
    spec = load_model(str(CONFIGS / "qwen1.5-moe-a2.7b.json"))
    assert spec.total_params() == pytest.approx(14.3e9, rel=0.01)
    assert spec.active_params() == pytest.approx(2.7e9, rel=0.01)
    h = 2048
    attention = 4 * h * h + 3 * h  # Q, K, V biases
    shared_expert = 3 * h * 5632 + h  # and its sigmoid gate, h x 1
    assert spec.layer_params(0) == attention + h * 60 + 60 * 3 * h * 1408 + shared_expert + 2 * h
    assert spec.layer_active_params(0) == attention + h * 60 + 4 * 3 * h * 1408 + shared_expert + 2 * h


def test_qwen_moe_sparse_step_and_mlp_only_layers_are_hugging_faces_rule():
    """Qwen2-MoE: layer i is sparse when it is not in mlp_only_layers and (i + 1) %
    decoder_sparse_step == 0."""
    spec = spec_from_hf_config({**config("qwen1.5-moe-a2.7b"), "decoder_sparse_step": 2, "mlp_only_layers": [5]})
    assert [layer for layer in range(8) if spec.is_moe_layer(layer)] == [1, 3, 7]
    with pytest.raises(ModelSpecError, match="mlp_only_layers must be a list of layer indices"):
        spec_from_hf_config({**config("qwen1.5-moe-a2.7b"), "mlp_only_layers": 3})


def test_deepseek_v3_multi_token_prediction_is_counted_apart_from_the_main_model():
    """The 671B main model's count stays; the MTP module (one, num_nextn_predict_layers)
    is counted apart (tests/test_mtp.py pins its size and work)."""
    with_mtp = spec_from_hf_config(config("deepseek-v3"))
    without = spec_from_hf_config({key: value for key, value in config("deepseek-v3").items()
                                   if key != "num_nextn_predict_layers"})
    assert with_mtp.total_params() == without.total_params()
    assert with_mtp.mtp_depth == 1 and without.mtp_depth == 0 and without.mtp_params() == 0
    assert with_mtp.mtp_params() > 0 and with_mtp.forward_flops() > without.forward_flops()
    assert [layer for layer in range(5) if not with_mtp.is_moe_layer(layer)] == [0, 1, 2]


def test_a_missing_tie_key_takes_the_family_default():
    """Hugging Face's config classes: LlamaConfig ties nothing by default, GemmaConfig and
    GPT2Config (the base class's default) tie."""
    llama = {key: value for key, value in config("llama-3.1-8b").items() if key != "tie_word_embeddings"}
    assert not spec_from_hf_config(llama).tied_embeddings
    assert spec_from_hf_config(config("gpt2")).tied_embeddings
    assert spec_from_hf_config(config("gemma-2-9b")).tied_embeddings


def test_llama_biases_are_attention_and_mlp_apart():
    h, kv, f = 4096, 1024, 14336
    plain = spec_from_hf_config(config("llama-3.1-8b"))
    attention = spec_from_hf_config({**config("llama-3.1-8b"), "attention_bias": True})
    mlp = spec_from_hf_config({**config("llama-3.1-8b"), "mlp_bias": True})
    assert attention.layer_params() - plain.layer_params() == h + 2 * kv + h
    assert mlp.layer_params() - plain.layer_params() == 2 * f + h


def test_hand_written_config_without_model_type():
    """No model_type: Llama's keys, the activation deciding the MLP (GeLU: two matrices)."""
    data = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256,
            "vocab_size": 100, "hidden_act": "gelu"}
    h, f = 64, 256
    assert spec_from_hf_config(data).total_params() == 2 * (4 * h * h + 2 * h * f + 2 * h) + 2 * 100 * h + h


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mamba"}, "model_type 'mamba' is not one pipesim reads; supported: llama, mistral"),
    ({"num_local_experts": 8}, "num_local_experts = 8 changes the parameter count and pipesim does not model it "
                               "for model_type 'llama'"),
    ({"kv_lora_rank": 512}, "kv_lora_rank = 512 changes the parameter count"),
    ({"qk_layernorm": True}, "qk_layernorm = True changes the parameter count"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
    ({"attention_dropout": "high"}, "attention_dropout must be a probability, got 'high'"),
])
def test_what_is_not_understood_is_an_error_naming_it(change, message):
    with pytest.raises(ModelSpecError, match=message):
        spec_from_hf_config({**config("llama-3.1-8b"), **change}, "llama.json")


def test_keys_that_change_nothing_are_accepted():
    """A count key left at a value that changes nothing (null, false, 0, [], or phi3's
    head_dim equal to hidden / heads) is not an error."""
    base = spec_from_hf_config(config("phi-3-mini")).total_params()
    for change in ({"num_local_experts": None}, {"qk_layernorm": False}, {"mlp_only_layers": []},
                   {"head_dim": 96}):
        assert spec_from_hf_config({**config("phi-3-mini"), **change}).total_params() == base
    with pytest.raises(ModelSpecError, match="head_dim = 128 changes the parameter count"):
        spec_from_hf_config({**config("phi-3-mini"), "head_dim": 128})
