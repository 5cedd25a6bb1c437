"""Rotary positions as configs describe them (``rope_theta``, ``rope_scaling``): Llama
3.1's rescaling worked by hand, the base reaching the executor's attention, the
rescalings the executor does not build named in its shrink line, and a cp run (whose
ranks rotate at their true positions) equal to the reference under Llama 3.1's rope."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from executor.architectures.build import shrink_note
from executor.architectures.layers import rotary_angles
from executor.config import RunConfig
from executor.models import build_model
from executor.reference import reference_run
from pipesim.model.errors import ModelSpecError
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.rotary import Rope, longrope_pairs
from pipesim.model.spec import load_model
from tests.hf_fixtures import CONFIGS, hf
from tests.launched_cases import LaunchedCases, assert_equals_reference

pytestmark = pytest.mark.timeout(300)
LLAMA31 = Rope(theta=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_positions=8192)


def test_llama3_rescaling_by_hand() -> None:
    plain, scaled = Rope(theta=500000.0).inverse_frequencies(128), LLAMA31.inverse_frequencies(128)
    # pair 0 turns once per 2π tokens, shorter than 8192 / 4: kept
    assert scaled[0] == plain[0] == 1.0
    # pair 63: f = 500000^(-126/128), a wavelength of 2.55e6 tokens, longer than 8192: f / 8
    assert scaled[63] == pytest.approx(500000 ** (-126 / 128) / 8, rel=1e-12)
    # pair 32: f = 500000^(-1/2) = 1/707.107, wavelength 4442.88 between 2048 and 8192:
    # t = (8192 / 4442.8829 - 1) / 3 = 0.28128261, f (1 - t) / 8 + f t = 0.37112228 f
    assert scaled[32] / plain[32] == pytest.approx(0.37112228, abs=1e-8)
    assert Rope(theta=10000.0, scaling="linear", factor=4.0).inverse_frequencies(8)[1] == pytest.approx(
        10000 ** (-2 / 8) / 4, rel=1e-12)


GPT_OSS_YARN = Rope(theta=150000.0, scaling="yarn", factor=32.0, original_positions=4096, truncate=False)


def test_yarn_frequencies_by_hand() -> None:
    plain, scaled = Rope(theta=150000.0).inverse_frequencies(64), GPT_OSS_YARN.inverse_frequencies(64)
    # gpt-oss: the pair turning 32 times over 4096 tokens is 64 ln(4096 / 64π) / (2 ln 150000)
    # = 8.0928, the one turning once 64 ln(4096 / 2π) / (2 ln 150000) = 17.3980; pairs up to 8
    # kept, from 18 on divided by 32, pair 12 at t = (12 - 8.0928) / 9.3052 = 0.41989:
    # (1 - t) + t / 32 = 0.59322725
    assert scaled[8] == plain[8] and scaled[0] == plain[0] == 1.0
    assert scaled[18] == pytest.approx(plain[18] / 32, rel=1e-12)
    assert scaled[12] / plain[12] == pytest.approx(0.59322725, abs=1e-8)
    # rounded outwards (truncate, Hugging Face's default): the ramp runs from pair 8 to 18
    truncated = Rope(theta=150000.0, scaling="yarn", factor=32.0, original_positions=4096).inverse_frequencies(64)
    assert truncated[12] / plain[12] == pytest.approx(1 - 0.4 + 0.4 / 32, rel=1e-12)
    # the cosines and sines times 0.1 ln 32 + 1
    assert GPT_OSS_YARN.cos_sin_scale == pytest.approx(1.34657359, abs=1e-8)
    assert GPT_OSS_YARN.latent_softmax_scale == 1.0
    cos, sin = rotary_angles(3, 64, GPT_OSS_YARN, dtype=torch.float64)
    angle = 2 * scaled[12]
    assert (cos[2, 12].item(), sin[2, 12].item()) == pytest.approx(
        (1.34657359 * math.cos(angle), 1.34657359 * math.sin(angle)), abs=1e-8)


def test_deepseek_yarn_scales_the_softmax_not_the_angles() -> None:
    # DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1: the cosines' factor is 1 (the two
    # terms' ratio) and the softmax scale grows by (0.1 ln 40 + 1)^2 = 1.36888794^2
    v3 = spec_from_hf_config(hf("deepseek-v3")).rope
    assert (v3.scaling, v3.factor, v3.original_positions, v3.cos_sin_scale) == ("yarn", 40, 4096, 1.0)
    assert v3.latent_softmax_scale == pytest.approx(1.36888794 ** 2, rel=1e-8)
    # V2-Lite: mscale_all_dim 0.707: (0.0707 ln 40 + 1)^2
    assert spec_from_hf_config(hf("deepseek-v2-lite")).rope.latent_softmax_scale == pytest.approx(
        (0.0707 * math.log(40) + 1) ** 2, rel=1e-12)


def test_latent_attention_scales_its_queries_by_deepseeks_factor() -> None:
    from executor.architectures.latent_attention import LatentAttention
    from pipesim.model.latent_attention import LatentAttention as Sizes
    sizes = Sizes(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    yarn = Rope(scaling="yarn", factor=40.0, original_positions=4096, mscale=1.0, mscale_all_dim=1.0)
    plain_softmax = Rope(scaling="yarn", factor=40.0, original_positions=4096, attention_factor=1.0)
    mscale = 0.1 * math.log(40) + 1  # 1.36888794
    torch.manual_seed(0)
    scaled = LatentAttention(16, 2, sizes, rope=yarn).double()
    unscaled = LatentAttention(16, 2, sizes, rope=plain_softmax).double()
    unscaled.load_state_dict(scaled.state_dict())
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    q, k, v = (scaled.wq_a(x), *scaled.wkv_a(x).split([8, 4], dim=-1))
    cos, sin = rotary_angles(6, 4, yarn, dtype=torch.float64)
    q_scaled, k_scaled = scaled.up_projected(q, k, v, cos, sin)[:2]
    q_plain, k_plain = unscaled.up_projected(q, k, v, cos, sin)[:2]
    torch.testing.assert_close(q_scaled, q_plain * mscale ** 2, rtol=1e-14, atol=0)
    torch.testing.assert_close(k_scaled, k_plain, rtol=0, atol=0)
    # by hand: softmax(q k^T / sqrt(8) * 1.8738542) v, causal
    scores = q_plain @ k_plain.transpose(-2, -1) * 8 ** -0.5 * mscale ** 2
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    values = scaled.up_projected(q, k, v, cos, sin)[2]
    expected = scaled.wo((scores.softmax(-1) @ values).transpose(1, 2).flatten(2))
    torch.testing.assert_close(scaled(x), expected, rtol=1e-10, atol=1e-12)


def test_dynamic_scaling_grows_the_base_only_past_the_context() -> None:
    dynamic = Rope(theta=10000.0, scaling="dynamic", factor=2.0, max_positions=16)
    plain = Rope(theta=10000.0).inverse_frequencies(8)
    assert dynamic.inverse_frequencies(8, 16) == plain
    # 32 tokens past 16: base 10000 (2 * 32 / 16 - 1)^(8 / 6) = 10000 * 3^(4/3)
    assert dynamic.inverse_frequencies(8, 32)[1] == pytest.approx((10000 * 3 ** (4 / 3)) ** (-2 / 8), rel=1e-12)
    with pytest.raises(ModelSpecError, match="dynamic scaling needs max_position_embeddings"):
        Rope(scaling="dynamic", factor=2.0)


def test_angles_turn_by_the_base() -> None:
    cos, sin = rotary_angles(5, 8, Rope(theta=500000.0), dtype=torch.float64)
    angle = 3 * 500000 ** (-2 / 8)  # position 3, pair 1
    assert cos[3, 1].item() == pytest.approx(math.cos(angle), abs=1e-15)
    assert sin[3, 1].item() == pytest.approx(math.sin(angle), abs=1e-15)



# Phi-3-mini-128k's shape: 48 pairs, a context of 4096 extended to 131,072 (factor 32)
SHORT, LONG = [1.0 + pair / 100 for pair in range(48)], [2.0 + pair / 10 for pair in range(48)]
PHI3_LONG = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
             "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}}


def test_longrope_divides_each_pair_by_its_listed_factor() -> None:
    rope = spec_from_hf_config(hf("phi-3-mini", **PHI3_LONG)).rope
    assert (rope.scaling, rope.factor, rope.original_positions) == ("longrope", 32.0, 4096)
    plain = [10000 ** (-2 * pair / 96) for pair in range(48)]
    # up to the original context the short factors, beyond it the long ones
    short = [f / d for f, d in zip(plain, SHORT, strict=True)]
    long = [f / d for f, d in zip(plain, LONG, strict=True)]
    assert rope.inverse_frequencies(96, 4096) == pytest.approx(short, rel=1e-14)
    assert rope.inverse_frequencies(96, 4097) == pytest.approx(long, rel=1e-14)
    # sqrt(1 + ln 32 / ln 4096) = sqrt(1 + 5/12)
    assert rope.cos_sin_scale == pytest.approx(math.sqrt(17 / 12), rel=1e-14)
    # Phi-3's first configs named it "su"; an attention_factor given is taken as is
    legacy = {**PHI3_LONG, "rope_scaling": {**PHI3_LONG["rope_scaling"], "type": "su", "attention_factor": 1.5}}
    su = spec_from_hf_config(hf("phi-3-mini", **legacy)).rope
    assert (su.scaling, su.cos_sin_scale) == ("longrope", 1.5)
    # without a top-level original context: rope_scaling's factor, over max_position_embeddings
    inside = spec_from_hf_config(hf("phi-3-mini", rope_scaling={
        "type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 4.0})).rope
    assert (inside.factor, inside.original_positions) == (4.0, 4096)
    assert inside.cos_sin_scale == pytest.approx(math.sqrt(1 + math.log(4) / math.log(4096)), rel=1e-14)


def test_a_shrunk_head_takes_the_factor_of_the_pair_of_its_frequency(tmp_path: Path) -> None:
    # 4 pairs from 48 listed: pairs 0, 12, 24, 36, whose base frequencies 10000^(-2j/96)
    # are the shrunk head's 10000^(-2i/8)
    assert longrope_pairs(4, 48) == [0, 12, 24, 36]
    assert longrope_pairs(48, 48) == list(range(48))
    path = Path(tmp_path) / "phi3-128k.json"
    path.write_text(json.dumps(hf("phi-3-mini", **PHI3_LONG)))
    config = RunConfig(model=str(path), layers=1, hidden=32, heads=4, seq_len=16, pp=1)
    rope = build_model(config).build_stage(0, 1).blocks[0].attention.rope
    cos, sin = rotary_angles(16, 8, rope, torch.float64)
    for pair, listed in enumerate((0, 12, 24, 36)):
        angle = 15 * 10000 ** (-2 * listed / 96) / SHORT[listed]
        assert cos[15, pair].item() == pytest.approx(math.cos(angle) * math.sqrt(17 / 12), rel=1e-13)
        assert sin[15, pair].item() == pytest.approx(math.sin(angle) * math.sqrt(17 / 12), rel=1e-13)
    assert "longrope's 48 factors read for 4 rotary pairs" in shrink_note(config)


@pytest.mark.parametrize(("scaling", "words"), [
    ({"short_factor": SHORT}, "longrope rope scaling needs long_factor, a list of one number per feature pair"),
    ({"short_factor": SHORT, "long_factor": LONG[:47]}, "short_factor has 48 numbers and its long_factor 47"),
    ({"short_factor": SHORT, "long_factor": [-1.0] * 48}, "long_factor[0] must be a number > 0, got -1.0"),
    ({"short_factor": SHORT, "long_factor": ["x"] * 48}, "long_factor[0] must be a number > 0, got 'x'"),
])
def test_bad_longrope_lists_are_refused_naming_the_file(scaling: dict, words: str) -> None:
    with pytest.raises(ModelSpecError, match=r"^config: .*" + re.escape(words)):
        spec_from_hf_config(hf("phi-3-mini", rope_scaling={"type": "longrope", **scaling}))


def test_configs_and_presets_carry_their_rotary_positions() -> None:
    assert spec_from_hf_config(hf("qwen3-8b")).rope == Rope(theta=1000000)
    read = spec_from_hf_config(hf("llama-3.1-8b", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})).rope
    assert read == LLAMA31
    assert spec_from_hf_config(hf("llama-3.1-8b")).rope == Rope()  # no rope_theta: Hugging Face's default
    assert load_model("llama3-8b").rope == Rope(theta=500000.0)
    assert load_model("llama3-405b").rope == LLAMA31
    assert spec_from_hf_config(hf("gpt-oss-20b")).rope == GPT_OSS_YARN
    longrope = spec_from_hf_config(hf("phi-3-mini", rope_scaling={
        "type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})).rope
    assert (longrope.scaling, longrope.built) == ("longrope", True)
    with pytest.raises(ModelSpecError, match="config: rotary positions: mscale must be a number >= 0, got -1"):
        spec_from_hf_config(hf("deepseek-v3", rope_scaling={"type": "yarn", "factor": 40, "mscale": -1}))
    with pytest.raises(ModelSpecError, match="factor must be a number > 0, got 0"):
        spec_from_hf_config(hf("qwen3-8b", rope_scaling={"rope_type": "linear", "factor": 0}))


def test_the_executor_builds_the_base_and_names_what_it_does_not_build(tmp_path: Path) -> None:
    config = RunConfig(model="llama3-8b", layers=1, hidden=16, heads=4, kv_heads=2, pp=1)
    attention = build_model(config).build_stage(0, 1).blocks[0].attention
    assert attention.rope.theta == 500000.0
    attention = build_model(RunConfig(model=str(CONFIGS / "gpt-oss-20b.json"), layers=2, hidden=16, heads=4,
                                      pp=1)).build_stage(0, 1).blocks[0].attention
    assert attention.rope == GPT_OSS_YARN
    unknown = {**hf("phi-3-mini"), "rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}}
    path = Path(tmp_path) / "phi3-unknown.json"
    path.write_text(json.dumps(unknown))
    note = shrink_note(RunConfig(model=str(path), layers=2, hidden=16, heads=4))
    assert "rotary frequencies unscaled (the config's ntk-by-parts rope scaling not built)" in note
    assert "rotary" not in shrink_note(config)


BASE = {"model": "llama3-405b", "layers": 2, "hidden": 16, "heads": 4, "kv_heads": 2, "seq_len": 16, "vocab": 37,
        "batch_size": 4, "microbatches": 2, "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02,
        "return_grads": True, "schedule": "1f1b", "pp": 2}
# latent attention rotates its rotary part with the spec's rope too (DeepSeek-V3's config: base 10000)
CASES = LaunchedCases(BASE, {4: {"cp2": {"cp": 2}, "deepseek-cp2": {
    "model": str(CONFIGS / "deepseek-v3.json"), "kv_heads": None, "experts": 4, "layers": 4, "cp": 2}}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_context_parallel_ranks_rotate_as_the_reference(name: str) -> None:
    assert_equals_reference(CASES.result(name), reference_run(CASES.config(name)))
