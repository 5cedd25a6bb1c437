"""The MLPs and blocks configs name beyond Llama's: GeGLU's tanh GeLU (Gemma, GPT-2's
gelu_new), gpt-oss's clamped SwiGLU in biased experts, GPT-NeoX's partial rotary and
parallel residual, Falcon-7B's one norm feeding both halves of a parallel block. Each
against a hand computation; pipelined float64 runs equal the one-process reference."""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from executor.architectures.layers import Attention, FeedForward, apply_rotary, rotary_angles
from executor.architectures.transformer import TransformerBlock
from executor.config import ConfigError, RunConfig
from executor.reference import reference_run
from pipesim.model.errors import ModelSpecError
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.spec import load_model
from tests.hf_fixtures import CONFIGS, hf
from tests.launched_cases import LaunchedCases, assert_equals_reference

pytestmark = pytest.mark.timeout(300)



def test_configs_name_their_activation_and_block() -> None:
    oss = spec_from_hf_config(hf("gpt-oss-20b"))
    assert (oss.mlp_activation, oss.activation_limit, oss.mlp_has_bias) == ("clamped-swiglu", 7.0, True)
    assert spec_from_hf_config(hf("gpt-oss-20b", swiglu_limit=10)).activation_limit == 10.0
    # Gemma trained GeGLU with the tanh approximation; Gemma 1's legacy hidden_act "gelu" is not read
    gemma = {"model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 100, "intermediate_size": 128, "hidden_act": "gelu"}
    assert spec_from_hf_config(gemma).mlp_activation == "gelu-tanh"
    assert spec_from_hf_config(hf("gemma-2-9b")).mlp_activation == "gelu-tanh"
    assert spec_from_hf_config(hf("gpt2")).mlp_activation == "gelu-tanh"  # gelu_new
    assert spec_from_hf_config(hf("llama-3.1-8b")).mlp_activation == "silu"
    pythia = spec_from_hf_config(hf("pythia-160m"))
    assert (pythia.mlp_activation, pythia.parallel_residual, pythia.rotary_fraction, pythia.rotary_width) == (
        "gelu", True, 0.25, 16)  # a quarter of 64
    assert not spec_from_hf_config(hf("pythia-160m", use_parallel_residual=False)).parallel_residual
    falcon = spec_from_hf_config(hf("falcon-7b"))
    assert (falcon.parallel_residual, falcon.norms_per_layer, falcon.num_kv_heads) == (True, 1, 1)
    with pytest.raises(ModelSpecError, match="hidden_act 'tanh' is not an activation pipesim builds"):
        spec_from_hf_config(hf("llama-3.1-8b", hidden_act="tanh"))
    with pytest.raises(ModelSpecError, match="swiglu_limit must be a number > 0, got -1"):
        spec_from_hf_config(hf("gpt-oss-20b", swiglu_limit=-1))
    with pytest.raises(ModelSpecError, match="alibi positions"):
        spec_from_hf_config(hf("falcon-7b", alibi=True))
    with pytest.raises(ModelSpecError, match="activation_limit 7.0 clamps only clamped-swiglu, not silu"):
        replace(load_model("llama3-8b"), activation_limit=7.0)


def by_hand_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


def test_clamped_swiglu_by_hand() -> None:
    torch.manual_seed(0)
    limit = 0.3  # below the projections' spread, so both clamps bite
    mlp = FeedForward(6, 10, True, True, "clamped-swiglu", limit).double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    gate = x @ mlp.w1.weight.T + mlp.w1.bias
    up = x @ mlp.w3.weight.T + mlp.w3.bias
    assert (gate > limit).any() and (up.abs() > limit).any()
    gate_c = torch.where(gate > limit, torch.full_like(gate, limit), gate)
    up_c = torch.where(up > limit, torch.full_like(up, limit), torch.where(up < -limit, -limit, up))
    expected = ((up_c + 1) * gate_c * by_hand_sigmoid(1.702 * gate_c)) @ mlp.w2.weight.T + mlp.w2.bias
    torch.testing.assert_close(mlp(x), expected, rtol=1e-13, atol=1e-14)
    # the clamps' gradients too: none through a gate past the limit or an up outside it
    weights = [mlp.w1.weight, mlp.w3.weight, x]
    by_module = torch.autograd.grad(mlp(x).sum(), weights)
    by_hand = torch.autograd.grad(expected.sum(), weights)
    for got, want in zip(by_module, by_hand, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_geglu_with_tanh_gelu_by_hand() -> None:
    torch.manual_seed(1)
    mlp = FeedForward(6, 10, True, False, "gelu-tanh").double()
    x = torch.randn(5, 6, dtype=torch.float64)
    gate = x @ mlp.w1.weight.T
    tanh_gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    torch.testing.assert_close(mlp(x), (tanh_gelu * (x @ mlp.w3.weight.T)) @ mlp.w2.weight.T, rtol=1e-13, atol=1e-14)
    plain = FeedForward(6, 10, False, False, "relu").double()
    torch.testing.assert_close(plain(x), (x @ plain.w1.weight.T).clamp(min=0) @ plain.w2.weight.T, rtol=0, atol=0)


def test_partial_rotary_turns_the_first_features_only() -> None:
    torch.manual_seed(2)
    attention = Attention(8, 2, 2, 4, rotary_dim=2).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    q, k, v = attention.projections(x)
    cos, sin = rotary_angles(5, 2, dtype=torch.float64)  # one pair: angle = position
    position = torch.arange(5, dtype=torch.float64).view(1, 1, 5)

    def turned(t: torch.Tensor) -> torch.Tensor:
        first = t[..., 0] * position.cos() - t[..., 1] * position.sin()
        second = t[..., 0] * position.sin() + t[..., 1] * position.cos()
        return torch.cat((first.unsqueeze(-1), second.unsqueeze(-1), t[..., 2:]), dim=-1)

    torch.testing.assert_close(apply_rotary(q, cos, sin), turned(q), rtol=0, atol=1e-15)
    scores = turned(q) @ turned(k).transpose(-2, -1) / 2 + torch.full((5, 5), -torch.inf).triu(1)
    expected = attention.wo((scores.softmax(-1) @ v).transpose(1, 2).flatten(2))
    torch.testing.assert_close(attention(x), expected, rtol=1e-12, atol=1e-13)


def test_parallel_blocks_add_both_halves_to_the_input() -> None:
    torch.manual_seed(3)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    pythia = TransformerBlock(spec_from_hf_config(hf("pythia-160m", hidden_size=16, num_attention_heads=4,
                                                     intermediate_size=32, max_position_embeddings=6)), 0).double()
    expected = x + pythia.attention(pythia.attention_norm(x)) + pythia.feed_forward(pythia.ffn_norm(x))
    torch.testing.assert_close(pythia(x), expected, rtol=1e-13, atol=1e-14)
    falcon = TransformerBlock(spec_from_hf_config(hf("falcon-7b", hidden_size=16, num_attention_heads=4,
                                                     ffn_hidden_size=32, max_position_embeddings=6)), 0).double()
    assert falcon.ffn_norm is None
    normed = falcon.attention_norm(x)
    torch.testing.assert_close(falcon(x), x + falcon.attention(normed) + falcon.feed_forward(normed),
                               rtol=1e-13, atol=1e-14)


def test_a_rotary_share_too_narrow_is_refused() -> None:
    config = RunConfig(model=str(CONFIGS / "pythia-160m.json"), layers=2, hidden=16, heads=4, pp=1)
    with pytest.raises(ConfigError, match="heads 4 wide, of which .* turns 0.25: 1 features; rotary positions turn "
                                          "pairs of features, so it must be even and at least 2"):
        config.check()


TIGHT = Path(tempfile.mkdtemp(prefix="pipesim-oss-")) / "gpt-oss-tight-limit.json"
TIGHT.write_text(json.dumps(hf("gpt-oss-20b", swiglu_limit=0.05)))  # clamps that bite at a random start
BASE = {"layers": 4, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 37, "batch_size": 4, "microbatches": 2,
        "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02, "return_grads": True, "schedule": "1f1b",
        "pp": 2}
PYTHIA, FALCON = str(CONFIGS / "pythia-160m.json"), str(CONFIGS / "falcon-7b.json")
CASES = LaunchedCases(BASE, {4: {
    "pythia-dp2": {"model": PYTHIA, "dp": 2},
    "pythia-tp2-sp": {"model": PYTHIA, "tp": 2, "sequence_parallel": True},
    "falcon-dp2": {"model": FALCON, "dp": 2},
    # one norm both halves read: each gathers it, drops its copy and gathers again in the backward
    "falcon-tp2-sp": {"model": FALCON, "kv_heads": 2, "tp": 2, "sequence_parallel": True},
    # ... and rebuilt in the backward from the norm's input, before either half's backward reads it
    "falcon-dp2-norm-mla-up": {"model": FALCON, "dp": 2, "recompute": "norm-mla-up"},
    "falcon-tp2-sp-norm-mla-up": {"model": FALCON, "kv_heads": 2, "tp": 2, "sequence_parallel": True,
                                  "recompute": "norm-mla-up"},
    "gpt-oss-ep2": {"model": str(TIGHT), "dp": 2, "ep": 2, "experts": 4, "schedule": "zbv", "virtual_stages": 2},
}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_runs_equal_the_reference(name: str) -> None:
    assert_equals_reference(CASES.result(name), reference_run(CASES.config(name)))
