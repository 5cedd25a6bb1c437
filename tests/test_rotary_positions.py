"""Rotary positions as configs describe them (``rope_theta``, ``rope_scaling``): Llama
3.1's rescaling worked by hand, the base reaching the executor's attention, the
rescalings the executor does not build named in its shrink line, and a cp run (whose
ranks rotate at their true positions) equal to the reference under Llama 3.1's rope."""

from __future__ import annotations

import json
import math
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
from pipesim.model.rotary import Rope
from pipesim.model.spec import load_model
from tests.launched_cases import LaunchedCases, assert_equals_reference

pytestmark = pytest.mark.timeout(300)
CONFIGS = Path(__file__).parent / "data" / "hf_configs"
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


def test_angles_turn_by_the_base() -> None:
    cos, sin = rotary_angles(5, 8, Rope(theta=500000.0), dtype=torch.float64)
    angle = 3 * 500000 ** (-2 / 8)  # position 3, pair 1
    assert cos[3, 1].item() == pytest.approx(math.cos(angle), abs=1e-15)
    assert sin[3, 1].item() == pytest.approx(math.sin(angle), abs=1e-15)


def hf(name: str, **changes) -> dict:
    return {**json.loads((CONFIGS / f"{name}.json").read_text()), **changes}


def test_configs_and_presets_carry_their_rotary_positions() -> None:
    assert spec_from_hf_config(hf("qwen3-8b")).rope == Rope(theta=1000000)
    read = spec_from_hf_config(hf("llama-3.1-8b", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})).rope
    assert read == LLAMA31
    assert spec_from_hf_config(hf("llama-3.1-8b")).rope == Rope()  # no rope_theta: Hugging Face's default
    assert load_model("llama3-8b").rope == Rope(theta=500000.0)
    assert load_model("llama3-405b").rope == LLAMA31
    yarn = spec_from_hf_config(hf("gpt-oss-20b")).rope
    assert (yarn.theta, yarn.scaling, yarn.built) == (150000, "yarn", False)
    with pytest.raises(ModelSpecError, match="factor must be a number > 0, got 0"):
        spec_from_hf_config(hf("qwen3-8b", rope_scaling={"rope_type": "linear", "factor": 0}))


def test_the_executor_builds_the_base_and_names_what_it_does_not_build() -> None:
    config = RunConfig(model="llama3-8b", layers=1, hidden=16, heads=4, kv_heads=2, pp=1)
    attention = build_model(config).build_stage(0, 1).blocks[0].attention
    assert attention.rope.theta == 500000.0
    note = shrink_note(RunConfig(model=str(CONFIGS / "gpt-oss-20b.json"), layers=2, hidden=16, heads=4))
    assert "rotary frequencies unscaled (the config's yarn rope scaling not built)" in note
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
