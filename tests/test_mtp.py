"""DeepSeek-V3's multi-token prediction (MTP) module, read from ``num_nextn_predict_layers``:
its parameters counted apart from the 671B main model, its work in the FLOPs and on the
last stage.

Published: README_WEIGHTS.md of DeepSeek-V3: "MTP Modules ... 11.5B unique parameters,
excluding the shared 0.9B Embedding and 0.9B output Head"; the report (section 2.2):
each module is a transformer block, a projection M of [RMSNorm(h); RMSNorm(Emb(t))] from
2d to d, and the shared embedding and output head.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipesim.cli import main
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.spec import BUNDLED_CONFIGS
from pipesim.model.transformer_costs import model_costs

CONFIGS = BUNDLED_CONFIGS
PEAK = 1e15
RATE = PEAK * 0.5
FREE_HBM = {"fallback_memory_bandwidth": float("inf")}  # FLOPs only
H, V = 7168, 129280


def v3(**changes):
    """DeepSeek-V3's config, its GEMMs in BF16 (the FP8 quantization_config left out: the
    FLOPs here are timed at one efficiency)."""
    data = {**json.loads((CONFIGS / "deepseek-v3.json").read_text()), **changes}
    data.pop("quantization_config", None)
    return spec_from_hf_config(data, "deepseek-v3.json", seq_len=4096)


def moe_layer_by_hand() -> int:
    """DeepSeek-V3's MoE layer: MLA, router, 256 + 1 gated experts of 2048, its norms."""
    attention = (H * 1536 + 1536 * 128 * 192 + H * (512 + 64) + 512 * 128 * 256 + 128 * 128 * H)
    return attention + H * 256 + 257 * 3 * H * 2048 + 2 * H + 1536 + 512


def test_the_module_is_a_moe_block_a_projection_and_three_norms():
    spec = v3()
    assert spec.mtp_depth == 1
    assert spec.mtp_params() == moe_layer_by_hand() + 2 * H * H + 3 * H
    assert spec.mtp_params() == pytest.approx(11.5e9, rel=0.01)  # README_WEIGHTS' "11.5B unique"
    assert v3(num_nextn_predict_layers=2).mtp_params() == 2 * spec.mtp_params()
    assert spec.total_params() == v3(num_nextn_predict_layers=0).total_params()  # the 671B stays the main model's


def test_its_forward_flops_are_a_moe_layer_a_projection_and_the_logits():
    with_mtp, without = v3(), v3(num_nextn_predict_layers=0)
    one_more_layer = replace(without, layers=62).forward_flops() - without.forward_flops()
    tokens = 4096
    expected = one_more_layer + 2 * tokens * 2 * H * H + 2 * tokens * H * V
    assert with_mtp.forward_flops() - without.forward_flops() == pytest.approx(expected, rel=1e-12)


def test_the_last_stage_runs_and_holds_it():
    """On 4 stages of fixed layers at one efficiency (FLOPs only): the last stage's forward
    grows by the module's FLOPs, its parameters by the module's, the others not at all."""
    with_mtp, without = v3(), v3(num_nextn_predict_layers=0)
    split = {"layers_per_stage": [16, 15, 15, 15], "mfu": 0.5, **FREE_HBM}
    more = model_costs(with_mtp, 4, [PEAK] * 4, **split).stages
    base = model_costs(without, 4, [PEAK] * 4, **split).stages
    for stage in range(3):
        assert more[stage].fwd == base[stage].fwd and more[stage].params == base[stage].params
    assert more[3].fwd - base[3].fwd == pytest.approx(with_mtp.mtp_module_flops() / RATE, rel=1e-12)
    assert more[3].params - base[3].params == with_mtp.mtp_params()
    assert more[3].moe_layers == base[3].moe_layers + 1 and more[3].layers == base[3].layers + 1
    assert more[3].stash_bytes > base[3].stash_bytes


def test_the_summary_names_it(tmp_path, capsys):
    path = tmp_path / "deepseek-v3.json"
    path.write_text((CONFIGS / "deepseek-v3.json").read_text())
    assert main(["simulate", "--model", str(path), "--layers", "4", "--pp", "2", "-m", "2"]) == 0
    assert "B multi-token prediction" in capsys.readouterr().out
