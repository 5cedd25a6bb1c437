"""Model specs: FLOP-derived costs, parameter and stash bytes, layer splits."""

from __future__ import annotations

import pytest

from pipesim.model_spec import ModelSpecError, model_costs, model_spec, split_layers

PEAK = 1e15


def test_costs_match_the_per_layer_formulas():
    spec = model_spec("gpt3-13b", seq_len=2048, microbatch_size=1)
    s, b, h, a, vocab = 2048, 1, 5120, 40, 50257
    costs = model_costs(spec, 4, [PEAK] * 4, mfu=0.5)
    layer_seconds = s * b * h * (24 * h + 4 * s) / (PEAK * 0.5)
    middle = costs.stages[1]
    assert middle.fwd == pytest.approx(10 * layer_seconds)
    assert middle.bwd == pytest.approx(2 * middle.fwd)
    assert middle.wgrad == pytest.approx(middle.fwd)
    assert middle.param_bytes == pytest.approx(10 * (12 * h * h + 13 * h) * 2)
    assert middle.stash_bytes == pytest.approx(10 * s * b * h * (34 + 5 * a * s / h))
    assert middle.act_bytes == pytest.approx(s * b * h * 2)
    # the first stage holds the embedding, the last the head and computes the logits
    assert costs.stages[0].param_bytes == pytest.approx(middle.param_bytes + vocab * h * 2)
    last = costs.stages[-1]
    assert last.fwd == pytest.approx(10 * layer_seconds + 2 * s * b * h * vocab / (PEAK * 0.5))
    assert last.act_bytes == 0.0


def test_tensor_parallel_divides_compute_and_parameters():
    spec = model_spec("llama3-8b")
    one = model_costs(spec, 4, [PEAK] * 4)
    four = model_costs(spec, 4, [PEAK] * 4, tp=4)
    assert four.stages[1].fwd == pytest.approx(one.stages[1].fwd / 4)
    assert four.stages[1].param_bytes == pytest.approx(one.stages[1].param_bytes / 4)
    assert four.stages[1].layers == 8 and four.stages[1].tp_message_bytes == 8192 * 4096 * 2
    sp = model_costs(spec, 4, [PEAK] * 4, tp=4, sequence_parallel=True)
    assert sp.stages[1].stash_bytes == pytest.approx(one.stages[1].stash_bytes / 4)
    assert sp.stages[1].act_bytes == pytest.approx(one.stages[1].act_bytes / 4)


def test_layer_splits():
    assert split_layers(8, 4) == [2, 2, 2, 2]
    assert split_layers(10, 4) == [2, 3, 3, 2]
    assert split_layers(10, 4, [4, 2, 2, 2]) == [4, 2, 2, 2]
    with pytest.raises(ModelSpecError, match="3 layers, fewer than the 4 stages"):
        split_layers(3, 4)
    with pytest.raises(ModelSpecError, match="sums to 9 but the model has 10 layers"):
        split_layers(10, 4, [3, 2, 2, 2])
    with pytest.raises(ModelSpecError, match="lists 3 stages but the schedule has 4"):
        split_layers(10, 3 + 1, [4, 3, 3])
    with pytest.raises(ModelSpecError, match="unknown model 'gpt5'"):
        model_spec("gpt5")


def test_presets_have_about_their_named_size():
    assert model_spec("gpt3-13b").total_params() == pytest.approx(13e9, rel=0.05)
    assert model_spec("gpt3-175b").total_params() == pytest.approx(175e9, rel=0.02)
    assert model_spec("gpt3-1.3b").total_params() == pytest.approx(1.3e9, rel=0.1)  # untied head adds V*h
    assert model_spec("llama3-8b").total_params() == pytest.approx(8e9, rel=0.1)
    assert model_spec("llama3-70b").total_params() == pytest.approx(70e9, rel=0.1)
