"""Llama 4's decoder as its config describes it: layers without rotary positions (every
fourth), weightless L2 query and key norms after the rotary turn on the others, and a
router whose chosen logits' sigmoids scale the experts' inputs, and the query
temperature of the layers without rotary positions at long positions. Each against a
hand computation; pipelined float64 runs (dp with ep, tp, the temperature biting from
position 1) equal the reference."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch

from executor.architectures.layers import Attention, apply_rotary, l2_norm, long_position_scales, rotary_angles
from executor.architectures.moe import MixtureOfExperts
from executor.config import ConfigError, RunConfig
from executor.models import build_model
from executor.reference import reference_run
from pipesim.model.spec import BUNDLED_CONFIGS, load_model
from tests.launched_cases import LaunchedCases, assert_equals_reference, assert_weights_equal_reference

pytestmark = pytest.mark.timeout(300)
SCOUT = str(BUNDLED_CONFIGS / "llama-4-scout.json")


def test_the_config_reads_its_parts() -> None:
    spec = load_model(SCOUT)
    assert spec.nope_layers[:3] == (3, 7, 11) and len(spec.nope_layers) == 12  # every fourth of 48
    assert spec.qk_norm == "l2" and spec.has_qk_norm(0) and not spec.has_qk_norm(3)
    moe = spec.moe
    assert (moe.gating, moe.normalize_top_k, moe.balanced_by_bias, moe.weighted_input) == ("sigmoid", False, False,
                                                                                           True)


def test_l2_norm_by_hand() -> None:
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)  # mean of squares 12.5
    assert l2_norm(x, eps=0.0)[0].tolist() == pytest.approx([3 / 12.5 ** 0.5, 4 / 12.5 ** 0.5], abs=1e-15)


def test_query_and_key_norms_follow_the_rotary_turn() -> None:
    torch.manual_seed(0)
    attention = Attention(8, 2, 2, 4, qk_norm="l2").double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    q, k, v = attention.projections(x)  # the norm comes after the turn: projections are raw
    assert torch.equal(q, attention.heads_of(attention.wq(x)))
    cos, sin = rotary_angles(5, 4, dtype=torch.float64)
    q_n, k_n = l2_norm(apply_rotary(q, cos, sin)), l2_norm(apply_rotary(k, cos, sin))
    expected = torch.softmax(q_n @ k_n.transpose(-2, -1) / 2 + torch.full((5, 5), -torch.inf).triu(1), -1) @ v
    assert torch.allclose(attention(x), attention.wo(expected.transpose(1, 2).flatten(2)), atol=1e-12)


def test_the_fourth_layers_have_no_rotary_positions_and_no_norms() -> None:
    config = RunConfig(model=SCOUT, layers=4, hidden=16, heads=4, pp=1, experts=4)
    blocks = build_model(config).build_stage(0, 1).blocks
    assert [block.attention.rotary for block in blocks] == [True, True, True, False]
    assert [block.attention.qk_norm for block in blocks] == ["l2", "l2", "l2", None]


def test_router_weights_scale_the_experts_inputs() -> None:
    torch.manual_seed(1)
    moe = MixtureOfExperts(4, experts=3, top_k=1, expert_ffn=5, shared_ffn=5, gating="sigmoid", normalize=False,
                           balanced_by_bias=False, weighted_input=True).double()
    assert moe.router.selection_bias is None
    x = torch.randn(1, 6, 4, dtype=torch.float64)
    tokens = x.reshape(6, 4)
    logits = moe.router.gate(tokens)
    expected = moe.shared(tokens)
    for token in range(6):
        best = int(logits[token].argmax())
        expected[token] += moe.experts[best](tokens[token] * torch.sigmoid(logits[token, best]))
    assert torch.allclose(moe(x).reshape(6, 4), expected, atol=1e-12)


def test_long_position_temperature_by_hand() -> None:
    assert load_model(SCOUT).nope_temperature == (8192.0, 0.1)  # Llama4TextConfig's defaults
    assert long_position_scales(torch.tensor([0, 8190, 8191, 16383]), 8192, 0.1).tolist() == pytest.approx(
        [1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)], abs=1e-15)
    torch.manual_seed(4)
    attention = Attention(8, 2, 2, 4, rotary=False, temperature=(4.0, 0.5)).double()
    x = torch.randn(1, 10, 8, dtype=torch.float64)
    q, k, v = attention.projections(x)
    # positions 0-2: 1; 3-6: 1 + 0.5 ln 2; 7-9: 1 + 0.5 ln 3
    scales = torch.tensor([1.0] * 3 + [1 + 0.5 * math.log(2)] * 4 + [1 + 0.5 * math.log(3)] * 3,
                          dtype=torch.float64).view(10, 1)
    scores = (q * scales) @ k.transpose(-2, -1) / 2 + torch.full((10, 10), -torch.inf).triu(1)
    expected = attention.wo((scores.softmax(-1) @ v).transpose(1, 2).flatten(2))
    torch.testing.assert_close(attention(x), expected, rtol=1e-12, atol=1e-14)
    blocks = build_model(RunConfig(model=SCOUT, layers=4, hidden=16, heads=4, pp=1, experts=4)).build_stage(0, 1).blocks
    assert [block.attention.temperature for block in blocks] == [None, None, None, (8192.0, 0.1)]


@pytest.mark.parametrize(("flags", "message"), [
    ({"cp": 2}, "query and key norms follow the rotary turn"),
    ({"expert_bias_rate": 0.01}, "router has no selection bias"),
])
def test_what_llama4_cannot_take_is_refused(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig(model=SCOUT, layers=4, hidden=16, heads=4, pp=1, experts=4, **flags).check()


SHORT_FLOOR = Path(tempfile.mkdtemp(prefix="pipesim-llama4-")) / "llama-4-scout-floor-2.json"
SHORT_FLOOR.write_text(json.dumps({**json.loads(Path(SCOUT).read_text()), "floor_scale": 2}))
# the fourth layers' query temperature grows from position 1 on (floor_scale 2), not from 8191
BASE = {"model": str(SHORT_FLOOR), "layers": 4, "hidden": 16, "heads": 4, "seq_len": 8, "vocab": 37, "batch_size": 8,
        "microbatches": 2, "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02, "return_grads": True,
        "schedule": "1f1b", "pp": 2, "experts": 4}
CASES = LaunchedCases(BASE, {4: {"pp2-dp2-ep2": {"dp": 2, "ep": 2},
                                 "pp2-tp2-sp": {"tp": 2, "kv_heads": 2, "sequence_parallel": True, "ffn_hidden": 48}}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_pipelined_llama4_equals_the_reference(name: str) -> None:
    result, reference = CASES.result(name), reference_run(CASES.config(name))
    assert_equals_reference(result, reference)
    assert_weights_equal_reference(result, reference)
