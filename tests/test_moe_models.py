"""Mixture-of-experts and latent-attention models: total and active parameters against
the published figures, per-layer counts written out by hand from the public configs,
FLOPs from active parameters (against torchtitan's formula), capacity, activation
memory, and stage costs that sum the layers a stage holds.

Where the published figures come from:
- Mixtral-8x7B 46.7B total, 12.9B active: Mistral AI's release post "Mixtral of
  experts" (Dec 2023): "46.7B total parameters but only uses 12.9B parameters per token".
- DeepSeek-V3 671B total, 37B activated: the technical report (arXiv 2412.19437,
  section 2) and README; README_WEIGHTS.md: "Main Model Weights ... Total parameters:
  671B, Activation parameters: 36.7B (including 0.9B for Embedding and 0.9B for the
  output Head)", the multi-token-prediction module (11.5B unique) not included.
- DeepSeek-V2-Lite 15.7B total, 2.4B activated: the DeepSeek-V2 paper (arXiv 2405.04434,
  appendix B).

What is counted: every parameter of the main model (embedding and untied head once
each); active = the total less the routed experts a token is not sent to, the embedding
table counted whole as the published figures state they count it.
"""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main
from pipesim.model.activations import layer_stash_bytes
from pipesim.model.errors import ModelSpecError
from pipesim.model.experts import MixtureOfExperts
from pipesim.model.latent_attention import LatentAttention
from pipesim.model.spec import ModelSpec, model_spec
from pipesim.model.transformer_costs import model_costs

PEAK = 1e15
RATE = PEAK * 0.5
FREE_HBM = {"fallback_memory_bandwidth": float("inf")}  # FLOPs only


def gated_mlp(h: int, f: int) -> int:
    return 3 * h * f


# DeepSeek-V3 config.json: h 7168, 61 layers, 128 heads, q_lora_rank 1536, kv_lora_rank 512,
# qk_nope 128, qk_rope 64, v_head 128, dense MLP 18432 on layers 0-2, then 256 experts of
# 2048 (top 8) + 1 shared, vocab 129280, untied
V3 = dict(h=7168, layers=61, heads=128, q_rank=1536, kv_rank=512, nope=128, rope=64, v=128, ffn=18432,
          expert=2048, experts=256, top_k=8, shared=1, dense=3, vocab=129280)


def v3_attention() -> int:
    c = V3
    return (c["h"] * c["q_rank"] + c["q_rank"] * c["heads"] * (c["nope"] + c["rope"])  # query down, up
            + c["h"] * (c["kv_rank"] + c["rope"]) + c["kv_rank"] * c["heads"] * (c["nope"] + c["v"])  # kv down, up
            + c["heads"] * c["v"] * c["h"])  # output


def v3_norms() -> int:
    return 2 * V3["h"] + V3["q_rank"] + V3["kv_rank"]  # two RMSNorms, and the two latents'


def test_deepseek_v3_counts_by_hand():
    c = V3
    spec = model_spec("deepseek-v3")
    assert v3_attention() == 48_758_784 + 20_905_984 + 117_440_512  # query, key-value, output
    expert = gated_mlp(c["h"], c["expert"])
    router = c["h"] * c["experts"]
    dense_layer = v3_attention() + gated_mlp(c["h"], c["ffn"]) + v3_norms()
    moe_layer = v3_attention() + router + (c["experts"] + c["shared"]) * expert + v3_norms()
    assert spec.layer_params(0) == dense_layer and spec.layer_params(3) == moe_layer
    embedding = head_matrix = c["vocab"] * c["h"]
    assert round(embedding / 1e9, 1) == 0.9  # README_WEIGHTS: "0.9B for Embedding and 0.9B for the output Head"
    total = c["dense"] * dense_layer + (c["layers"] - c["dense"]) * moe_layer + embedding + head_matrix + c["h"]
    assert spec.total_params() == total
    active_moe_layer = moe_layer - (c["experts"] - c["top_k"]) * expert
    assert spec.active_params() == total - (c["layers"] - c["dense"]) * (c["experts"] - c["top_k"]) * expert
    assert spec.layer_active_params(3) == active_moe_layer


@pytest.mark.parametrize("name,total,active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),
    ("deepseek-v3", 671e9, None),
    ("deepseek-v2-lite", 15.7e9, None),
])
def test_totals_and_actives_within_one_percent_of_published(name, total, active):
    spec = model_spec(name)
    assert spec.total_params() == pytest.approx(total, rel=0.01)
    if active is not None:
        assert spec.active_params() == pytest.approx(active, rel=0.01)


def test_deepseek_active_figures_against_published():
    """The architecture's own count sits above DeepSeek's rounded activated figures:
    DeepSeek-V3 37.55B against the report's 37B (+1.5%) and README_WEIGHTS' 36.7B
    (+2.3%, whose own breakdown puts 34.9B in the 61 layers where the config gives
    35.7B); DeepSeek-V2-Lite 2.66B against 2.4B (+11%), though the same counting gives
    Mixtral's and Qwen1.5-MoE's published actives within 0.4% (test_hf_config). The
    per-layer sums are pinned by hand above; here the gaps are pinned, so a change in
    what is counted shows."""
    v3 = model_spec("deepseek-v3").active_params()
    assert v3 == pytest.approx(37e9, rel=0.02) and v3 > 37e9
    # without the input embedding (129280 x 7168) it lands on README_WEIGHTS' 36.7B, though
    # that README says the figure includes the embedding (docs/cluster-model.md)
    assert (v3 - 129280 * 7168) / 36.7e9 == pytest.approx(0.998, abs=0.0005)
    lite = model_spec("deepseek-v2-lite")
    c = dict(h=2048, heads=16, kv_rank=512, nope=128, rope=64, v=128, vocab=102400)
    attention = (c["h"] * c["heads"] * (c["nope"] + c["rope"]) + c["h"] * (c["kv_rank"] + c["rope"])
                 + c["kv_rank"] * c["heads"] * (c["nope"] + c["v"]) + c["heads"] * c["v"] * c["h"])
    norms = 2 * c["h"] + c["kv_rank"]
    dense = attention + gated_mlp(2048, 10944) + norms
    active_moe = attention + 2048 * 64 + (6 + 2) * gated_mlp(2048, 1408) + norms
    assert lite.active_params() == dense + 26 * active_moe + 2 * c["vocab"] * c["h"] + c["h"]
    assert lite.active_params() / 2.4e9 == pytest.approx(1.109, abs=0.001)
    assert (lite.active_params() - c["vocab"] * c["h"]) / 2.4e9 == pytest.approx(1.021, abs=0.001)  # still +2.1%


@pytest.mark.parametrize("name,head_dims", [("deepseek-v3", 128 + 64 + 128), ("mixtral-8x7b", 2 * 128)])
def test_flops_per_token_follow_active_parameters_as_torchtitan_counts(name, head_dims):
    """torchtitan's ``get_moe_model_nparams_and_flops``: ``6 (active - embedding) + 6 L a
    (d_qk + d_v) s`` per token, the router and shared experts active, routed experts at
    top_k / experts. It counts the norm weights among the active ones too; they do no
    multiply-adds, so they are taken out here (2h per layer, MLA's latent norms, the final h)."""
    spec = model_spec(name)
    embedding = spec.vocab * spec.hidden
    latents = (1536 + 512) if name == "deepseek-v3" else 0
    norms = spec.layers * (2 * spec.hidden + latents) + spec.hidden
    expected = (6 * (spec.active_params() - embedding - norms)
                + 6 * spec.layers * spec.heads * head_dims * spec.seq_len)
    assert spec.flops_per_token() == pytest.approx(expected, rel=1e-12)


def test_capacity_factor_pads_the_routed_experts_time_not_the_model_flops():
    base = model_spec("mixtral-8x7b")
    padded = ModelSpec(**{**base.__dict__, "moe": MixtureOfExperts(8, 2, 14336, capacity_factor=1.25)})
    tokens, h, f = base.tokens, 4096, 14336
    routed = 2 * tokens * 2 * gated_mlp(h, f)  # 2 experts per token, 2 FLOPs per multiply-add
    assert padded.layer_flops(0) - base.layer_flops(0) == pytest.approx(0.25 * routed)
    assert padded.forward_flops() == base.forward_flops()  # MFU counts the tokens' work
    stage_base = model_costs(base, 4, [PEAK] * 4, mfu=0.5, **FREE_HBM).stages[1]
    stage_padded = model_costs(padded, 4, [PEAK] * 4, mfu=0.5, **FREE_HBM).stages[1]
    assert stage_padded.fwd - stage_base.fwd == pytest.approx(8 * 0.25 * routed / RATE)
    assert stage_padded.params == stage_base.params  # capacity is compute, not weights


def test_stage_costs_sum_the_layers_they_hold():
    """DeepSeek-V2-Lite on 3 stages of 9 layers: the first holds the dense layer 0 and 8
    MoE layers, the others 9 MoE layers; params (memory) count every expert, FLOPs the
    active ones."""
    spec = model_spec("deepseek-v2-lite")
    costs = model_costs(spec, 3, [PEAK] * 3, mfu=0.5, layers_per_stage=[9, 9, 9], **FREE_HBM)
    dense, moe = spec.layer_params(0), spec.layer_params(1)
    assert moe == spec.layer_params(26) and dense != moe
    vocab_rows = 102400 * 2048
    assert costs.stages[0].params == dense + 8 * moe + vocab_rows
    assert costs.stages[1].params == 9 * moe
    assert costs.stages[2].params == 9 * moe + 2048 + vocab_rows  # final norm, untied head
    assert sum(stage.params for stage in costs.stages) == spec.total_params()
    dense_flops, moe_flops = spec.layer_flops(0), spec.layer_flops(1)
    assert costs.stages[0].fwd == pytest.approx((dense_flops + 8 * moe_flops) / RATE)
    assert costs.stages[1].fwd == pytest.approx(9 * moe_flops / RATE)
    moe_gemm = 2 * spec.tokens * (spec.layer_active_params(1) - 2 * 2048 - 512)  # less the norms
    assert spec.layer_gemm_flops(1) == pytest.approx(moe_gemm)
    uneven = model_costs(spec, 3, [PEAK] * 3, mfu=0.5, layers_per_stage=[5, 11, 11], **FREE_HBM)
    assert uneven.stages[0].params == dense + 4 * moe + vocab_rows


def test_moe_layer_stash_by_hand():
    """Mixtral layer, tp 1, flash attention, no dropout, bf16: norm inputs 2h, attention
    and MLP inputs h + h; Q, K, V, attention output h + 2k + h; per routed slot (top 2)
    the dispatched token h, the expert's gate, up and product 3f, its output h; router
    scores 8 x 4 bytes."""
    spec = model_spec("mixtral-8x7b")
    h, k, f, s = 4096, 1024, 14336, 8192
    per_token = 2 * (2 * h + h + h) + 2 * (h + 2 * k + h) + 2 * 2 * 3 * f + 2 * 2 * 2 * h + 8 * 4
    assert layer_stash_bytes(spec) == s * per_token


def test_simulate_reports_total_and_active_parameters(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", "--model", "mixtral-8x7b", "--pp", "4", "-m", "4", "--tp", "8",
                 "--json", str(out)]) == 0
    model = json.loads(out.read_text())["model"]
    assert model["params"] == 46_702_792_704 and model["active_params"] == 12_879_925_248
    assert model["moe"]["experts"] == 8 and model["moe"]["experts_per_token"] == 2
    assert "46.7 B params (12.9 B active)" in capsys.readouterr().out
    assert main(["simulate", "--model", "llama3-8b", "--pp", "2", "-m", "2"]) == 0
    line = [text for text in capsys.readouterr().out.splitlines() if "model llama3-8b" in text][0]
    assert "8.03 B params;" in line and "active" not in line


def test_moe_and_mla_descriptions_refuse_bad_values():
    with pytest.raises(ModelSpecError, match="experts_per_token 9 exceeds the 8 routed experts"):
        MixtureOfExperts(experts=8, experts_per_token=9, expert_ffn=64)
    with pytest.raises(ModelSpecError, match="capacity_factor must be a number > 0"):
        MixtureOfExperts(experts=8, experts_per_token=2, expert_ffn=64, capacity_factor=0)
    with pytest.raises(ModelSpecError, match="kv_lora_rank must be an integer >= 1, got 0"):
        LatentAttention(q_lora_rank=None, kv_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    mla = LatentAttention(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    with pytest.raises(ModelSpecError, match="latent attention gives every head its own key and value"):
        ModelSpec("m", layers=2, hidden=64, heads=4, seq_len=16, vocab=32, kv_heads=2, mla=mla)


def test_capacity_factor_flag(tmp_path, capsys):
    """--capacity-factor pads the routed experts' time; the model FLOPs per token (MFU's
    numerator) stay the tokens' work; a dense model has no experts to pad."""
    steps = {}
    for factor in (None, "1.25"):
        out = tmp_path / f"{factor}.json"
        extra = ["--capacity-factor", factor] if factor else []
        assert main(["simulate", "--model", "mixtral-8x7b", "--pp", "2", "-m", "2", "--json", str(out), *extra]) == 0
        document = json.loads(out.read_text())
        steps[factor] = document["makespan"], document["model"]["flops_per_token"], document["model"]["moe"]
    assert steps["1.25"][0] > steps[None][0] and steps["1.25"][1] == steps[None][1]
    assert steps["1.25"][2]["capacity_factor"] == 1.25 and steps[None][2]["capacity_factor"] is None
    assert main(["simulate", "--model", "llama3-8b", "--capacity-factor", "1.25", "--pp", "2", "-m", "2"]) == 2
    assert "--capacity-factor 1.25: llama3-8b has no routed experts" in capsys.readouterr().err
