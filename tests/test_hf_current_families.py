"""Current Hugging Face families (OLMoE, Qwen3, Qwen3-MoE, gpt-oss, Gemma 3) read as
Hugging Face builds them, against the published parameter counts; vision-language and
chunked-attention families refused with the reason; sliding windows in the FLOPs.

The fixtures in pipesim/model/data/hf_configs are the public config.json files' keys (values
copied from the model repositories: allenai/OLMoE-1B-7B-0924, Qwen/Qwen3-8B,
Qwen/Qwen3-0.6B, Qwen/Qwen3-30B-A3B, openai/gpt-oss-120b, openai/gpt-oss-20b,
google/gemma-3-1b-pt; gpt-oss's without its MXFP4 quantization_config, as training
dequantizes it). Published counts:
- OLMoE-1B-7B: 6.9B total, 1.3B active (the OLMoE paper and model card; the active
  figure counts the embedding, as Mixtral's and DeepSeek's do).
- Qwen3-8B 8.2B, 6.95B without embeddings; Qwen3-0.6B 0.6B, 0.44B without embeddings;
  Qwen3-30B-A3B 30.5B total, 3.3B activated, 29.9B without embeddings; Qwen3-235B-A22B
  235B total, 22B activated (Qwen's model cards).
- gpt-oss-120b 116.83B total, 5.13B active; gpt-oss-20b 20.91B, 3.61B (OpenAI's gpt-oss
  model card, table 1). OpenAI's active figure counts the unembedding but not the
  embedding table (a lookup), so it is compared with the active count less the embedding.
- Gemma 3 1B: 1B (Google's model card).
- Llama 4 Scout 109B total / 17B active, Maverick 400B / 17B (Meta's model cards). The
  fixtures are the decoders' ``text_config`` (model_type ``llama4_text``; the published
  files are vision-language ``llama4`` configs, refused); Scout's 109B counts its vision
  encoder too, which the decoder leaves out (107.8B here, 1.1% under).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.model.errors import ModelSpecError
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.layout import check_layout
from pipesim.model.operations import FlashAttention
from pipesim.model.spec import BUNDLED_CONFIGS

CONFIGS = BUNDLED_CONFIGS


MXFP4 = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                    "lm_head"], "quant_method": "mxfp4"}  # gpt-oss's, left out of the fixtures


def config(name: str, drop: tuple[str, ...] = ()) -> dict:
    """A fixture (gpt-oss's without its MXFP4 quantization_config, which is refused: below)."""
    data = json.loads((CONFIGS / f"{name}.json").read_text())
    return {key: value for key, value in data.items() if key not in drop}


def non_embedding(spec) -> int:
    """Qwen's "non-embedding" figure: the total less the token table and an untied head."""
    return spec.total_params() - spec.embedding_params() - (0 if spec.tied_embeddings else spec.vocab * spec.hidden)


@pytest.mark.parametrize("name,total,active", [
    ("olmoe-1b-7b", 6.9e9, 1.3e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9),
    ("qwen3-8b", 8.2e9, None),
    ("qwen3-0.6b", 0.6e9, None), ("gemma-3-1b", 1.0e9, None),
])
def test_totals_and_actives_against_the_model_cards(name, total, active):
    """Published to two digits: within 2% (the active figures land 1.4% and 1.6% above)."""
    spec = spec_from_hf_config(config(name), name)
    assert spec.total_params() == pytest.approx(total, rel=0.02)
    if active is not None:
        assert spec.active_params() == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("name,published", [("qwen3-8b", 6.95e9), ("qwen3-0.6b", 0.44e9), ("qwen3-30b-a3b", 29.9e9)])
def test_qwen3_non_embedding_counts(name, published):
    assert non_embedding(spec_from_hf_config(config(name))) == pytest.approx(published, rel=0.005)


@pytest.mark.parametrize("name,total,active", [("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9)])
def test_gpt_oss_against_openais_table(name, total, active):
    spec = spec_from_hf_config(config(name))
    assert spec.total_params() == pytest.approx(total, rel=0.001)
    assert spec.active_params() - spec.embedding_params() == pytest.approx(active, rel=0.001)


def test_gpt_oss_layer_by_hand():
    """Biased Q, K, V, O (64 heads of 64, 8 key-value heads), a sink per head, a biased
    router, 128 experts each with a biased gate-and-up (2 x 2880) and a biased down
    projection, two RMSNorms."""
    h, head, kv, f, experts = 2880, 64, 8, 2880, 128
    attention = h * 64 * head + 64 * head + 2 * (h * kv * head + kv * head) + 64 * head * h + h + 64
    expert = h * 2 * f + 2 * f + f * h + h
    layer = attention + h * experts + experts + experts * expert + 2 * h
    spec = spec_from_hf_config(config("gpt-oss-120b"))
    assert spec.layer_params(0) == spec.layer_params(1) == layer
    assert spec.total_params() == 36 * layer + 2 * 201088 * h + h
    assert spec.layer_active_params(0) == layer - (experts - 4) * expert


def test_olmoe_and_qwen3_query_key_norms_by_hand():
    """OLMoE normalises the whole Q (h) and K (kv heads x head) projections; Qwen3 and
    Gemma 3 one head's width each, shared by the heads."""
    h, f, experts = 2048, 1024, 64
    olmoe = spec_from_hf_config(config("olmoe-1b-7b"))
    assert olmoe.layer_params(0) == 4 * h * h + (h + h) + h * experts + experts * 3 * h * f + 2 * h
    h, kv, f = 4096, 8 * 128, 12288
    qwen3 = spec_from_hf_config(config("qwen3-8b"))
    assert qwen3.layer_params() == 2 * h * h + 2 * h * kv + 2 * 128 + 3 * h * f + 2 * h
    h, q, kv, f = 1152, 4 * 256, 256, 6912
    gemma = spec_from_hf_config(config("gemma-3-1b"))
    assert gemma.layer_params() == 2 * h * q + 2 * h * kv + 2 * 256 + 3 * h * f + 4 * h
    assert gemma.total_params() == 26 * gemma.layer_params() + 262144 * h + h  # tied


def test_qwen3_moe_relabelled_as_qwen2_moe_is_refused_not_given_a_shared_expert():
    """qwen2_moe's config class adds a 5632-wide shared expert when the file names none:
    the file must name it."""
    relabelled = {**config("qwen3-30b-a3b"), "model_type": "qwen2_moe"}
    with pytest.raises(ModelSpecError, match="shared_expert_intermediate_size is missing; the config class's "
                                             r"default \(5632\) would add a shared expert"):
        spec_from_hf_config(relabelled, "q.json")
    with pytest.raises(ModelSpecError, match="num_experts is missing"):
        spec_from_hf_config(config("qwen3-30b-a3b", drop=("num_experts",)), "q.json")


def test_mxfp4_quantization_is_refused_with_the_reason():
    with pytest.raises(ModelSpecError, match="quant_method 'mxfp4'"):
        spec_from_hf_config({**config("gpt-oss-20b"), "quantization_config": MXFP4}, "gpt-oss-20b.json")


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gemma3", "text_config": {}}, "model_type 'gemma3' is a vision-language model .*'gemma3_text'"),
    ({"model_type": "llama4"}, "model_type 'llama4' is a vision-language model"),
    ({"model_type": "llama4_text"}, "num_local_experts is missing; the config class's default \\(16\\) would add "
                                    "routed experts"),
    ({"sliding_window": 4096}, "sliding_window = 4096 changes attention's FLOPs and pipesim does not model it for "
                               "model_type 'llama'"),
])
def test_families_not_modelled_are_refused_with_the_reason(change, message):
    base = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    with pytest.raises(ModelSpecError, match=message):
        spec_from_hf_config({**base, **change}, "x.json")


def test_layer_types_outside_the_model_are_refused():
    types = ["sliding_attention", "full_attention"] * 12
    with pytest.raises(ModelSpecError, match="layer_types entry 'chunked_attention' is not an attention"):
        spec_from_hf_config({**config("gpt-oss-20b"), "layer_types": ["chunked_attention", *types[1:]]})
    with pytest.raises(ModelSpecError, match=r"layer_types must list one attention type per layer \(24\)"):
        spec_from_hf_config({**config("gpt-oss-20b"), "layer_types": types[:3]})


def test_windows_follow_each_familys_rule():
    """gpt-oss: layer_types (even layers slide over 128); Gemma 3: every sixth layer full;
    Qwen3: from max_window_layers on, only with use_sliding_window."""
    oss = spec_from_hf_config(config("gpt-oss-20b"))
    assert oss.sliding_window == 128 and oss.sliding_layers == tuple(range(0, 24, 2))
    gemma = spec_from_hf_config(config("gemma-3-1b"))
    assert gemma.sliding_window == 512
    assert [layer for layer in range(26) if layer not in gemma.sliding_layers] == [5, 11, 17, 23]
    qwen = spec_from_hf_config({**config("qwen3-8b"), "use_sliding_window": True, "sliding_window": 4096,
                                "max_window_layers": 28})
    assert qwen.sliding_layers == tuple(range(28, 36)) and qwen.attention_window(30) == 4096
    assert not spec_from_hf_config({**config("qwen3-8b"), "sliding_window": 4096}).sliding_layers


def test_a_window_cuts_the_attention_flops_by_hand():
    """gpt-oss at 8192 tokens: a full layer's core counts 2 a s^2 (d + d); a sliding one
    2 a (2 s w - w^2)(d + d), w = 128."""
    spec = spec_from_hf_config(config("gpt-oss-20b"))
    s, w, heads, d = 8192, 128, 64, 64
    assert spec.seq_len == s
    assert spec.attention_core_flops(1) == 2 * heads * s * s * 2 * d
    assert spec.attention_core_flops(0) == 2 * heads * (2 * s * w - w * w) * 2 * d
    whole = spec_from_hf_config({**config("gpt-oss-20b"), "layer_types": ["full_attention"] * 24})
    saved = 12 * (whole.attention_core_flops(0) - spec.attention_core_flops(0))
    assert whole.forward_flops() - spec.forward_flops() == pytest.approx(saved, rel=1e-12)


@given(seq=st.integers(1, 300), window=st.integers(1, 400))
def test_window_square_is_twice_the_pairs_as_the_causal_count_is(seq, window):
    """Megatron counts a causal kernel's s(s+1)/2 pairs as s^2 = 2 pairs - s; a window
    counts its pairs the same way: 2 pairs - min(w, s)."""
    pairs = sum(min(query + 1, window) for query in range(seq))
    attention = FlashAttention("attention", 1, 1, seq, 64, window=window)
    assert attention.square() == 2 * pairs - min(window, seq)


def test_ring_attention_over_a_window_is_refused():
    spec = spec_from_hf_config(config("gpt-oss-20b"))
    with pytest.raises(ModelSpecError, match="--cp 2: .* 128-token sliding window"):
        check_layout(spec, cp=2)
    check_layout(spec_from_hf_config({**config("gpt-oss-20b"), "layer_types": ["full_attention"] * 24}), cp=2)


@pytest.mark.parametrize("name,total,active,within", [
    ("llama-4-maverick", 400e9, 17e9, 0.01), ("llama-4-scout", 109e9, 17e9, 0.015)])
def test_llama4_against_metas_model_cards(name, total, active, within):
    spec = spec_from_hf_config(config(name))
    assert spec.total_params() == pytest.approx(total, rel=within)
    assert spec.active_params() == pytest.approx(active, rel=0.015)


def test_llama4_layers_by_hand():
    """Scout: every layer 16 experts of 8192 and a shared one of 8192, a router, no
    weights in its L2 query and key norms; Maverick: the odd layers 128 experts, the even
    ones a dense MLP of 16384."""
    h, q, kv, f, dense = 5120, 40 * 128, 8 * 128, 8192, 16384
    attention = 2 * h * q + 2 * h * kv
    scout = spec_from_hf_config(config("llama-4-scout"))
    assert scout.layer_params(0) == attention + h * 16 + 17 * 3 * h * f + 2 * h
    assert scout.layer_active_params(0) == attention + h * 16 + 2 * 3 * h * f + 2 * h
    maverick = spec_from_hf_config(config("llama-4-maverick"))
    assert [layer for layer in range(6) if maverick.is_moe_layer(layer)] == [1, 3, 5]
    assert maverick.layer_params(0) == attention + 3 * h * dense + 2 * h
    assert maverick.layer_params(1) == attention + h * 128 + 129 * 3 * h * f + 2 * h


def test_llama4_chunks_three_layers_of_four():
    """At 32768 tokens a chunked layer (rotary positions: all but every fourth) counts
    4 chunks' squares, 4 x 8192^2 = s c; the fourth layers the whole s^2."""
    spec = spec_from_hf_config(config("llama-4-scout"), seq_len=32768)
    assert spec.chunked_layers == tuple(layer for layer in range(48) if (layer + 1) % 4)
    s, c, heads, d = 32768, 8192, 40, 128
    assert spec.attention_core_flops(0) == 2 * heads * (s // c) * c * c * 2 * d
    assert spec.attention_core_flops(3) == 2 * heads * s * s * 2 * d
    assert spec_from_hf_config(config("llama-4-scout")).attention_chunk_of(0) is None  # 8192 tokens: one chunk
    with pytest.raises(ModelSpecError, match="--cp 2: .* 8192-token chunks"):
        check_layout(spec, cp=2)


@given(seq=st.integers(1, 300), chunk=st.integers(1, 400))
def test_chunk_square_is_each_chunks_own_square(seq, chunk):
    """Twice a causal chunk's pairs less its diagonal is its square: summed over the chunks."""
    pairs = sum(query % chunk + 1 for query in range(seq))
    diagonal = seq
    attention = FlashAttention("attention", 1, 1, seq, 64, chunk=chunk)
    assert attention.square() == 2 * pairs - diagonal
