"""Layouts checked before any work: tensor parallelism against the heads, key-value
heads and MLP widths (key-value heads replicated when tp is a multiple of them, as
Megatron-LM does), expert parallelism against the routed experts, context parallelism
against the sequence; and whole-number parameter counts on every tp rank."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipesim.cli import main
from pipesim.model.errors import ModelSpecError
from pipesim.model.experts import MixtureOfExperts
from pipesim.model.layout import check_layout
from pipesim.model.spec import ModelSpec, model_spec
from pipesim.model.transformer_costs import model_costs


def test_tp_must_divide_the_attention_heads():
    with pytest.raises(ModelSpecError, match=r"^--tp 3 does not divide the 32 attention heads of llama3-8b: "
                                             r"use one of 1, 2, 4, 8, 16, 32$"):
        check_layout(model_spec("llama3-8b"), tp=3)
    with pytest.raises(ModelSpecError, match="--tp 3 does not divide the 32 attention heads"):
        model_costs(model_spec("llama3-8b"), 2, [1e15] * 2, tp=3)


def test_tp_neither_dividing_nor_a_multiple_of_the_kv_heads_is_refused():
    spec = ModelSpec("gqa", layers=2, hidden=24 * 64, heads=24, seq_len=64, vocab=100, kv_heads=8, ffn_hidden=4608,
                     gated_mlp=True)
    with pytest.raises(ModelSpecError, match="--tp 12 neither divides the 8 key-value heads of gqa nor is a "
                                             "multiple of them .*: use one of 1, 2, 4, 8, 24"):
        check_layout(spec, tp=12)
    check_layout(spec, tp=24)  # 3 ranks share each key-value head


def test_tp_must_divide_every_mlp_width():
    dense = ModelSpec("odd", layers=2, hidden=1024, heads=16, seq_len=64, vocab=100, ffn_hidden=1000)
    with pytest.raises(ModelSpecError, match="--tp 16 does not divide the MLP width 1000 of odd: use one of 1, 2, 4"):
        check_layout(dense, tp=16)
    mixtral = model_spec("mixtral-8x7b")
    check_layout(mixtral, tp=8)  # 14336 / 8 experts' columns
    narrow = replace(mixtral, moe=MixtureOfExperts(experts=8, experts_per_token=2, expert_ffn=1000))
    with pytest.raises(ModelSpecError, match="--tp 16 does not divide the expert MLP width 1000"):
        check_layout(narrow, tp=16)


def test_replicated_kv_heads_are_counted_on_every_rank_that_holds_them():
    """Llama 3 8B on tp 16: 2 query heads per rank, and one of the 8 key-value heads
    replicated on 2 ranks each; norms whole on every rank."""
    spec = model_spec("llama3-8b")
    h, head, f = 4096, 128, 14336
    per_rank = h * 2 * head + 2 * h * head + 2 * head * h + 3 * h * f // 16 + 2 * h
    assert spec.layer_params(0, tp=16) == per_rank
    replicated_kv = (16 - 8) * 2 * h * head
    assert 16 * per_rank == spec.layer_params(0) + replicated_kv + 15 * 2 * h
    costs = model_costs(spec, 2, [1e15] * 2, tp=16, layers_per_stage=[16, 16])
    assert costs.stages[0].params == 16 * per_rank + 128256 * h // 16


def test_gpt_shards_keep_row_biases_norms_and_positions_whole():
    """GPT-3 13B on tp 8: weights and column biases (Q, K, V, MLP up) / 8; the output
    and MLP-down biases and the two LayerNorms whole; vocabulary 50257 split as 6283
    rows (the last rank padded); the 2048 x h position table whole."""
    spec = model_spec("gpt3-13b")
    h, tp = 5120, 8
    layer = 12 * h * h // tp + (3 * h + 4 * h) // tp + 2 * h + 2 * 2 * h
    assert spec.layer_params(0, tp) == layer
    costs = model_costs(spec, 4, [1e15] * 4, tp=tp)
    assert costs.stages[0].params == 10 * layer + 6283 * h + 2048 * h
    assert costs.stages[-1].params == 10 * layer + 2 * h


def test_expert_parallelism_must_divide_the_routed_experts():
    check_layout(model_spec("deepseek-v3"), ep=64)
    with pytest.raises(ModelSpecError, match=r"^--ep 3 does not divide the 8 routed experts of mixtral-8x7b: "
                                             r"use one of 1, 2, 4, 8$"):
        check_layout(model_spec("mixtral-8x7b"), ep=3)
    with pytest.raises(ModelSpecError, match="--ep 8: llama3-8b has no routed experts to place"):
        check_layout(model_spec("llama3-8b"), ep=8)


def test_context_parallelism_must_divide_the_sequence():
    check_layout(model_spec("llama3-8b"), tp=8, cp=16, sequence_parallel=True)  # 8192 / 16 = 512 = 8 x 64
    with pytest.raises(ModelSpecError, match=r"^--cp 3: 2 x cp = 6 chunks \(causal load balancing, as "
                                             r"Megatron-Core cuts the sequence\) do not divide the 8192-token "
                                             r"sequence of llama3-8b: use one of 1, 2, 4, 8, 16, 32"):
        check_layout(model_spec("llama3-8b"), cp=3)
    # 6 divides 4098 but 12 does not: cp 3 splits the tokens yet cannot balance the causal work
    with pytest.raises(ModelSpecError, match="--cp 6: 2 x cp = 12 chunks"):
        check_layout(model_spec("llama3-8b", seq_len=4098), cp=6)
    with pytest.raises(ModelSpecError, match="--sequence-parallel splits each 4100-token sequence over --tp 8"):
        check_layout(model_spec("llama3-8b", seq_len=4100), tp=8, sequence_parallel=True)
    with pytest.raises(ModelSpecError, match="--cp must be an integer >= 1, got 0"):
        check_layout(model_spec("llama3-8b"), cp=0)


def test_simulate_checks_tp_before_work_and_prints_whole_parameter_counts(tmp_path, capsys):
    assert main(["simulate", "--model", "llama3-8b", "--tp", "3", "--pp", "2", "-m", "4"]) == 2
    err = capsys.readouterr().err
    assert "--tp 3 does not divide the 32 attention heads of llama3-8b" in err and len(err.strip().splitlines()) == 1
    out = tmp_path / "r.json"
    assert main(["simulate", "--model", "deepseek-v2-lite", "--tp", "16", "--pp", "3", "-m", "3",
                 "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    for stage in document["stage_costs"]:
        assert isinstance(stage["params"], int)
    for rank in document["ranks"]:
        assert (rank["memory"]["static_bytes"] / 16).is_integer()  # 16 bytes per whole parameter


def test_replicated_kv_heads_are_stated(capsys):
    assert main(["simulate", "--model", "llama3-8b", "--tp", "16", "--pp", "2", "-m", "2"]) == 0
    assert ("note: --tp 16 exceeds the 8 key-value heads of llama3-8b: each is replicated on 2 ranks"
            in capsys.readouterr().out)
    assert main(["simulate", "--model", "llama3-8b", "--tp", "8", "--pp", "2", "-m", "2"]) == 0
    assert "note:" not in capsys.readouterr().out
