"""Gemma 2 and 3 as their configs describe them: RMSNorms scaling by one plus their
weight, embeddings times sqrt(hidden), a norm before and after each half of a layer,
the softmax scaled by ``query_pre_attn_scalar``, soft-capped attention scores and
logits (Gemma 2), and Gemma 3's sliding layers at their own rotary base. Each against a
hand computation; pipelined float64 runs equal the one-process reference."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch

from executor.architectures.build import shrunk_spec
from executor.architectures.layers import Attention, RMSNorm, SoftCappedLinear
from executor.architectures.transformer import TokenEmbedding, TransformerBlock
from executor.config import RunConfig
from executor.models import build_model
from executor.reference import reference_run
from pipesim.model.errors import ModelSpecError
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.rotary import Rope
from tests.hf_fixtures import CONFIGS, hf
from tests.launched_cases import LaunchedCases, assert_equals_reference

pytestmark = pytest.mark.timeout(300)



def test_the_configs_read_gemmas_parts() -> None:
    two = spec_from_hf_config(hf("gemma-2-9b"))
    assert (two.norms_per_layer, two.norm_offset, two.embedding_scale, two.mlp_activation) == (4, True, True,
                                                                                             "gelu-tanh")
    assert (two.query_pre_attn_scalar, two.attention_softcap, two.logit_softcap) == (256, 50, 30)  # Gemma2Config's
    three = spec_from_hf_config(hf("gemma-3-1b"))
    assert (three.qk_norm, three.attention_softcap, three.logit_softcap) == ("head", None, None)
    assert (three.rope, three.local_rope) == (Rope(theta=1000000), Rope(theta=10000))
    unnamed = {key: value for key, value in hf("gemma-3-1b").items() if key != "rope_theta"}
    assert spec_from_hf_config(unnamed).rope.theta == 1_000_000  # Gemma3TextConfig's default
    assert json.loads(json.dumps(three.describe()))["local_rope"]["theta"] == 10000  # --json writes it
    with pytest.raises(ModelSpecError, match="attn_logit_softcapping must be a number > 0, got -1"):
        spec_from_hf_config(hf("gemma-2-9b", attn_logit_softcapping=-1))


def test_a_shrunk_model_keeps_the_softmax_scale_ratio() -> None:
    # Gemma 2 27B: heads of 128, scalar 144 (hidden / heads): shrunk to heads of 8, 9
    path = Path(tempfile.mkdtemp()) / "gemma-2-27b.json"
    path.write_text(json.dumps(hf("gemma-2-9b", hidden_size=4608, num_attention_heads=32, num_key_value_heads=16,
                                  head_dim=128, query_pre_attn_scalar=144)))
    assert shrunk_spec(RunConfig(model=str(path), hidden=32, heads=4, layers=2)).query_pre_attn_scalar == 9.0


def test_offset_norm_by_hand() -> None:
    norm = RMSNorm(4, eps=0.0, offset=True).double()
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0]], dtype=torch.float64)  # mean of squares 7.5
    assert norm.weight.tolist() == [0.0] * 4
    torch.testing.assert_close(norm(x), x / 7.5 ** 0.5, rtol=1e-15, atol=0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    torch.testing.assert_close(norm(x), x / 7.5 ** 0.5 * torch.tensor([1.5, 0.0, 1.0, 3.0], dtype=torch.float64),
                               rtol=1e-15, atol=0)


def test_soft_capped_scaled_attention_by_hand() -> None:
    torch.manual_seed(0)
    cap, scalar = 0.3, 9.0
    attention = Attention(8, 2, 1, 4, query_scale=(4 / scalar) ** 0.5, softcap=cap, rotary=False).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    q = attention.heads_of(attention.wq(x))
    k, v = attention.heads_of(attention.wk(x)), attention.heads_of(attention.wv(x))
    scores = q @ k.transpose(-2, -1) / math.sqrt(scalar)  # not / sqrt(4)
    assert scores.abs().max() > cap  # the cap bites
    capped = cap * torch.tanh(scores / cap) + torch.full((5, 5), -torch.inf).triu(1)
    expected = attention.wo((capped.softmax(-1) @ v).transpose(1, 2).flatten(2))
    torch.testing.assert_close(attention(x), expected, rtol=1e-12, atol=1e-14)


def test_sandwich_block_embedding_and_capped_logits_by_hand() -> None:
    torch.manual_seed(1)
    spec = shrunk_spec(RunConfig(model=str(CONFIGS / "gemma-2-9b.json"), hidden=16, heads=4, layers=2, seq_len=6))
    block = TransformerBlock(spec, 0).double()
    for norm in (block.attention_norm, block.ffn_norm, block.post_attention_norm, block.post_ffn_norm):
        torch.nn.init.normal_(norm.weight)  # away from zero, so each norm's place shows
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    middle = x + block.post_attention_norm(block.attention(block.attention_norm(x)))
    expected = middle + block.post_ffn_norm(block.feed_forward(block.ffn_norm(middle)))
    torch.testing.assert_close(block(x), expected, rtol=1e-13, atol=1e-13)
    embed = TokenEmbedding(spec).double()
    tokens = torch.tensor([[3, 1, 4]])
    torch.testing.assert_close(embed(tokens), embed.tokens.weight[tokens] * 4.0, rtol=1e-15, atol=0)  # sqrt(16)
    head = SoftCappedLinear(16, 7, cap=0.2).double()
    plain = x @ head.weight.T
    torch.testing.assert_close(head(x), 0.2 * torch.tanh(plain / 0.2), rtol=1e-14, atol=0)


def test_gemma3_sliding_layers_turn_at_their_own_base() -> None:
    config = RunConfig(model=str(CONFIGS / "gemma-3-1b.json"), layers=6, hidden=16, heads=4, pp=1)
    blocks = build_model(config).build_stage(0, 1).blocks
    # five sliding layers to one full: the sixth at rope_theta, the others at rope_local_base_freq
    assert [block.attention.rope.theta for block in blocks] == [10000] * 5 + [1000000]
    assert blocks[0].attention.q_norm.offset and blocks[0].attention.k_norm.offset


TIGHT = Path(tempfile.mkdtemp(prefix="pipesim-gemma-")) / "gemma-2-tight-caps.json"
TIGHT.write_text(json.dumps(hf("gemma-2-9b", attn_logit_softcapping=0.5, final_logit_softcapping=0.5)))
BASE = {"layers": 4, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 37, "batch_size": 4, "microbatches": 2,
        "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02, "return_grads": True, "schedule": "1f1b",
        "pp": 2, "weight_decay": 0.1}
GEMMA3 = str(CONFIGS / "gemma-3-1b.json")
CASES = LaunchedCases(BASE, {4: {
    "gemma2-tp2-sp": {"model": str(TIGHT), "tp": 2, "sequence_parallel": True},
    "gemma2-dp2-zero1": {"model": str(TIGHT), "dp": 2, "zero": 1},
    # the written-out, soft-capped attention core checkpointed, under a split backward
    "gemma2-dp2-zbv-selective": {"model": str(TIGHT), "dp": 2, "schedule": "zbv", "virtual_stages": 2,
                                 "recompute": "selective"},
    "gemma3-cp2": {"model": GEMMA3, "cp": 2, "layers": 6},
    "gemma3-tp2-zbv": {"model": GEMMA3, "tp": 2, "kv_heads": 2, "schedule": "zbv", "virtual_stages": 2, "layers": 6},
}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_runs_equal_the_reference(name: str) -> None:
    assert_equals_reference(CASES.result(name), reference_run(CASES.config(name)))
