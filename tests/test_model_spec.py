"""Model specs: architecture-accurate parameters and FLOPs, Korthikanti et al.'s
activation memory, recompute, Hugging Face configs, and the training figures.

Expected values are the papers' closed forms or counts written out by hand here."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from pipesim.cli import main
from pipesim.model.activations import layer_stash_bytes
from pipesim.model.compute_model import layer_memory_seconds
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.memory_traffic import BACKWARD_TRAFFIC, HBM_EFFICIENCY
from pipesim.model.spec import ModelSpecError, model_costs, model_spec
from pipesim.model.stage_split import split_layers
from pipesim.model.transformer_costs import training_figures

PEAK = 1e15
RATE = PEAK * 0.5
FREE_HBM = {"fallback_memory_bandwidth": math.inf}  # FLOPs only: memory-bound kernels cost nothing


def test_gpt_costs_match_the_per_layer_formulas():
    spec = model_spec("gpt3-13b", seq_len=2048, microbatch_size=1)
    s, b, h, a, vocab = 2048, 1, 5120, 40, 50257
    costs = model_costs(spec, 4, [PEAK] * 4, mfu=0.5, **FREE_HBM)
    layer_seconds = s * b * h * (24 * h + 4 * s) / RATE  # Narayanan et al. 2021
    middle = costs.stages[1]
    assert middle.fwd == pytest.approx(10 * layer_seconds)
    assert middle.bwd == pytest.approx(2 * middle.fwd)
    # weight gradients: the GEMMs only (24sbh^2); the attention core has no weights
    assert middle.wgrad == pytest.approx(10 * 24 * s * b * h * h / RATE)
    assert middle.params == 10 * (12 * h * h + 13 * h)
    assert middle.param_bytes == pytest.approx(10 * (12 * h * h + 13 * h) * 2)
    assert middle.stash_bytes == pytest.approx(10 * s * b * h * 34)  # flash attention: no 5as/h
    assert middle.act_bytes == pytest.approx(s * b * h * 2)
    # first stage: token and position embeddings; last: the final LayerNorm (head tied)
    assert costs.stages[0].params == pytest.approx(middle.params + vocab * h + s * h)
    last = costs.stages[-1]
    assert last.params == pytest.approx(middle.params + 2 * h)
    assert last.fwd == pytest.approx(10 * layer_seconds + 2 * s * b * h * vocab / RATE)
    assert last.act_bytes == 0.0
    no_flash = model_costs(spec, 4, [PEAK] * 4, mfu=0.5, flash_attention=False, **FREE_HBM)
    assert no_flash.stages[1].stash_bytes == pytest.approx(10 * s * b * h * (34 + 5 * a * s / h))


def test_llama_layer_has_gqa_and_swiglu():
    spec = model_spec("llama3-8b")
    s, b, h, kv, f = 8192, 1, 4096, 8 * 128, 14336
    assert spec.layer_params() == 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert spec.layer_flops() == 2 * s * b * (h * (h + 2 * kv) + h * h + 3 * h * f) + 4 * s * s * b * h
    costs = model_costs(spec, 4, [PEAK] * 4, mfu=0.5, layers_per_stage=[8, 8, 8, 8], **FREE_HBM)
    assert costs.stages[1].fwd == pytest.approx(8 * spec.layer_flops() / RATE)
    assert costs.stages[-1].params == pytest.approx(8 * spec.layer_params() + h + 128256 * h)  # untied head


@pytest.mark.parametrize("name,published", [
    ("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9), ("llama3-405b", 405.8e9), ("gpt3-175b", 175e9),
])
def test_presets_are_within_one_percent_of_their_published_size(name, published):
    assert model_spec(name).total_params() == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("name,layers,hidden,published", [
    ("gpt3-1.3b", 24, 2048, "1.3"), ("gpt3-13b", 40, 5120, "13"), ("gpt3-175b", 96, 12288, "175"),
])
def test_gpt3_counts_by_hand_round_to_the_published_figure(name, layers, hidden, published):
    """GPT-2 lineage: tied embeddings, learned positions (2048 x h), biases, LayerNorm.
    The paper gives 2-3 significant figures; the exact count rounds to them."""
    h, vocab, seq = hidden, 50257, 2048
    exact = layers * (12 * h * h + 13 * h) + vocab * h + seq * h + 2 * h
    assert model_spec(name).total_params() == exact
    digits = len(published.replace(".", "").lstrip("0"))
    assert f"{exact / 1e9:.{digits}g}" == published


def test_layer_splits():
    assert split_layers(8, 4) == [2, 2, 2, 2]
    assert split_layers(10, 4) == [2, 3, 3, 2]
    assert split_layers(10, 4, [4, 2, 2, 2]) == [4, 2, 2, 2]
    with pytest.raises(ModelSpecError, match="1 layers, too few for 4 stages"):
        split_layers(1, 4)
    with pytest.raises(ModelSpecError, match="sums to 9 but the model has 10 layers"):
        split_layers(10, 4, [3, 2, 2, 2])
    with pytest.raises(ModelSpecError, match="lists 3 stages but the schedule has 4"):
        split_layers(10, 3 + 1, [4, 3, 3])
    with pytest.raises(ModelSpecError, match="unknown model 'gpt5'"):
        model_spec("gpt5")


# Korthikanti et al. 2022, Table 2, per layer, for a GPT layer (s, b, h, a, t)
S, B, H, A, T = 2048, 2, 12288, 96, 8
KORTHIKANTI = {
    # (tp, sequence parallel, recompute): sbh x (...)
    (1, False, "none"): 34 + 5 * A * S / H,
    (T, False, "none"): 10 + 24 / T + 5 * A * S / (H * T),
    (T, True, "none"): 34 / T + 5 * A * S / (H * T),
    (T, False, "selective"): 10 + 24 / T,
    (T, True, "selective"): 34 / T,
    (T, False, "full"): 2,
}


@pytest.mark.parametrize("case", list(KORTHIKANTI))
def test_activation_memory_is_korthikantis_table_2_without_flash_attention(case):
    tp, sequence_parallel, recompute = case
    spec = model_spec("gpt3-175b", microbatch_size=B)
    got = layer_stash_bytes(spec, tp, sequence_parallel, recompute, flash_attention=False)
    assert got == pytest.approx(S * B * H * KORTHIKANTI[case])


@pytest.mark.parametrize("case", list(KORTHIKANTI))
def test_flash_attention_drops_the_score_term(case):
    tp, sequence_parallel, recompute = case
    spec = model_spec("gpt3-175b", microbatch_size=B)
    # only the "none" rows carry the 5as/(ht) score term; selective and full have none to drop
    expected = KORTHIKANTI[case] - (5 * A * S / (H * tp) if recompute == "none" else 0.0)
    assert layer_stash_bytes(spec, tp, sequence_parallel, recompute) == pytest.approx(S * B * H * expected)


@pytest.mark.parametrize("tp", [1, 8])
def test_a_softmax_with_sinks_keeps_one_column_more(tp):
    """Attention sinks (gpt-oss) add one logit per head to each softmax's denominator, so
    a written-out softmax's output has ``s + 1`` columns: per token and head one 16-bit
    element more than without (no dropout: no mask or dropout output beside it)."""
    spec = replace(model_spec("llama3-8b"), dropout=False)
    with_sinks = replace(spec, attention_sinks=True)
    grown = (layer_stash_bytes(with_sinks, tp, flash_attention=False)
             - layer_stash_bytes(spec, tp, flash_attention=False))
    assert grown == spec.seq_len * spec.microbatch_size * spec.heads / tp * 2
    assert layer_stash_bytes(with_sinks, tp) == layer_stash_bytes(spec, tp)  # a fused kernel keeps no scores


def test_llama_activation_inventory_by_hand():
    """No dropout; GQA K and V of 1024 columns; SwiGLU keeps gate, up and product (3f)."""
    spec = model_spec("llama3-8b")
    s, h, kv, f = 8192, 4096, 1024, 14336
    per_token = 2 * (2 * h + h + h) + 2 * (2 * h + 2 * kv) + 2 * 3 * f
    assert layer_stash_bytes(spec) == s * per_token
    replicated = 2 * (2 * h + h + h)
    assert layer_stash_bytes(spec, 4) == pytest.approx(s * (replicated + (per_token - replicated) / 4))
    assert layer_stash_bytes(spec, 4, True) == pytest.approx(s * per_token / 4)
    assert layer_stash_bytes(spec, 4, True, "full") == pytest.approx(s * h * 2 / 4)


def test_recompute_adds_the_forward_to_the_backward():
    spec = model_spec("gpt3-13b")
    s, b, h = 2048, 1, 5120
    plain = model_costs(spec, 4, [PEAK] * 4, mfu=0.5, tp=2, **FREE_HBM).stages[1]
    full = model_costs(spec, 4, [PEAK] * 4, mfu=0.5, tp=2, recompute="full", **FREE_HBM).stages[1]
    selective = model_costs(spec, 4, [PEAK] * 4, mfu=0.5, tp=2, recompute="selective", **FREE_HBM).stages[1]
    assert full.fwd == plain.fwd and full.wgrad == plain.wgrad
    assert full.bwd == pytest.approx(3 * plain.fwd)
    assert full.recompute_layers == 10 and plain.recompute_layers == 0
    assert selective.bwd == pytest.approx(2 * plain.fwd + 10 * 4 * s * s * b * h / 2 / RATE)
    assert full.stash_bytes == pytest.approx(10 * 2 * s * b * h)
    with pytest.raises(ModelSpecError, match="--recompute 'some'"):
        model_costs(spec, 4, [PEAK] * 4, recompute="some", **FREE_HBM)


def test_megatron_flops_with_full_recompute_are_narayanan_equation_3():
    spec = model_spec("gpt3-175b")
    batch, s, layers, h, vocab = 64, 2048, 96, 12288, 50257
    eq3 = 96 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))
    figures = training_figures(spec, "full", makespan=10.0, microbatches=8, dp=8, gpus=512, peak_flops=312e12)
    assert figures["model_tflops_per_gpu"] == pytest.approx(eq3 / 10.0 / 512 / 1e12)
    without = 72 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
    assert figures["mfu"] == pytest.approx(without / 10.0 / 512 / 312e12)
    assert figures["tokens_per_second"] == pytest.approx(batch * s / 10.0)


LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "vocab_size": 128256,
}


def test_hugging_face_config_gives_the_preset(tmp_path):
    spec = spec_from_hf_config(LLAMA3_8B_CONFIG)
    assert spec.total_params() == model_spec("llama3-8b").total_params()
    assert spec.seq_len == 8192  # max_position_embeddings capped
    tied = spec_from_hf_config({**LLAMA3_8B_CONFIG, "tie_word_embeddings": True})
    assert spec.total_params() - tied.total_params() == 128256 * 4096
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_CONFIG))
    out = tmp_path / "r.json"
    assert main(["simulate", "--model", str(path), "--seq-len", "4096", "--pp", "2", "--microbatches", "4",
                 "--json", str(out)]) == 0
    model = json.loads(out.read_text())["model"]
    assert model["params"] == spec.total_params() and model["seq_len"] == 4096 and model["kv_heads"] == 8
    with pytest.raises(ModelSpecError, match="missing num_hidden_layers"):
        spec_from_hf_config({"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10})
    with pytest.raises(ModelSpecError, match="num_key_value_heads must be an integer >= 1, got -8"):
        spec_from_hf_config({**LLAMA3_8B_CONFIG, "num_key_value_heads": -8})


def test_simulate_json_reports_model_throughput_and_mfu(tmp_path):
    out = tmp_path / "r.json"
    argv = ["simulate", "--model", "gpt3-1.3b", "--pp", "2", "--microbatches", "4", "--gpu", "a100-80gb",
            "--mfu", "0.4", "--attention-flops", "whole", "--json", str(out)]
    assert main(argv) == 0
    document = json.loads(out.read_text())
    spec = model_spec("gpt3-1.3b")
    makespan, gpus = document["makespan"], 2
    assert document["model"]["flops_per_token"] == pytest.approx(3 * spec.forward_flops() / 2048)
    assert document["tokens_per_second"] == pytest.approx(4 * 2048 / makespan)
    assert document["mfu"] == pytest.approx(4 * 3 * spec.forward_flops() / makespan / gpus / 312e12)
    assert len(document["stage_costs"]) == 2
    # each rank computes at --mfu of the A100 peak, plus its memory-bound kernels at the
    # A100's 2.039 TB/s (flash attention: no score traffic): 38h bytes per token per layer
    # forward, 1.5x that backward; and the loss's unfused cross entropy over the 2048 x
    # 50,257 logits, 38 + 14 bytes each (tests/test_cross_entropy.py)
    hbm = 2.039e12 * HBM_EFFICIENCY
    memory = (24 * 2048 * 38 * 2048 * (1 + BACKWARD_TRAFFIC) + 2048 * spec.vocab * (38 + 14)) / hbm
    busy = sum(stage["fwd"] + stage["bwd"] for stage in document["stage_costs"])
    assert busy == pytest.approx(3 * spec.forward_flops() / (0.4 * 312e12) + memory)


def test_memory_bound_kernels_by_hand():
    """GPT layer, no flash: norms 4h + residual adds 6h elements (2 bytes) + 2h mask bytes
    + GeLU 2f elements = 38h bytes per token; scores: softmax 2 + dropout 2 elements + 1
    mask byte per score = 9as bytes per token."""
    spec = model_spec("gpt3-1.3b")
    s, h, a = 2048, 2048, 16
    bandwidth = 2e12
    forward, backward = layer_memory_seconds(spec, bandwidth, flash_attention=False)
    assert forward == pytest.approx(s * (38 * h + 9 * a * s) / (bandwidth * HBM_EFFICIENCY))
    assert backward == pytest.approx(BACKWARD_TRAFFIC * forward)
    flash, _ = layer_memory_seconds(spec, bandwidth)
    assert flash == pytest.approx(s * 38 * h / (bandwidth * HBM_EFFICIENCY))
    # tp=4 without sequence parallelism splits only the GeLU (16h of the 38h)
    split, _ = layer_memory_seconds(spec, bandwidth, tp=4)
    assert split == pytest.approx(s * (22 * h + 16 * h / 4) / (bandwidth * HBM_EFFICIENCY))
    _, full = layer_memory_seconds(spec, bandwidth, recompute="full")
    assert full == pytest.approx((1 + BACKWARD_TRAFFIC) * flash)


MiB = 2**20


# memory: the totals nvidia-smi reports (pipesim.hardware.gpus says where each was read)
@pytest.mark.parametrize("gpu,peak,memory,nvlink,nic", [
    ("a100-40gb", 312e12, 40960 * MiB, 300e9, 25e9), ("a100-80gb", 312e12, 81920 * MiB, 300e9, 25e9),
    ("h100", 989e12, 81559 * MiB, 450e9, 50e9), ("h200", 989e12, 143771 * MiB, 450e9, 50e9),
    ("b200", 2250e12, 183359 * MiB, 900e9, 50e9),
])
def test_gpu_presets_set_devices_nvlink_and_nics(gpu, peak, memory, nvlink, nic):
    from pipesim.cluster.files import load_topology

    topology = load_topology("ib", 2, gpu)
    device = topology.devices[9]
    assert topology.device_peak_flops(device) == peak and topology.device_memory(device) == memory
    assert topology.graph.edges[device, "n1.nvswitch"]["bandwidth"] == nvlink
    assert topology.graph.edges["n1.nic1", "ib_switch"]["bandwidth"] == nic


def test_gpu_flag_reaches_memory_capacity_and_mfu(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", "--model", "gpt3-1.3b", "--pp", "2", "-m", "2", "--topology", "nvlink", "--gpu", "h200",
                 "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["ranks"][0]["memory"]["capacity_bytes"] == 143771 * MiB
    assert document["model"]["peak_flops_per_gpu"] == 989e12
    topology_file = tmp_path / "t.json"
    topology_file.write_text(json.dumps({"devices": [{"name": "g0"}]}))
    assert main(["simulate", "--topology", str(topology_file), "--pp", "1", "--gpu", "h100"]) == 2
    assert "a topology file names its own" in capsys.readouterr().err


def test_full_recompute_slows_the_simulated_step_by_the_extra_forward(tmp_path):
    """Ideal links, one rank: step = m (F + B); full recompute adds one F per microbatch
    (the layers' part, not the logits'), selective the attention core's."""
    common = ["simulate", "--model", "gpt3-1.3b", "--pp", "1", "-m", "4", "--mfu", "0.5", "--json"]
    steps = {}
    for recompute in ("none", "selective", "full"):
        out = tmp_path / f"{recompute}.json"
        assert main([*common, str(out), "--recompute", recompute, "--gpu", "a100-80gb"]) == 0
        steps[recompute] = json.loads(out.read_text())["makespan"]
    spec = model_spec("gpt3-1.3b")
    rate = 0.5 * 312e12
    hbm = 2.039e12 * HBM_EFFICIENCY
    layer_memory = 2048 * 38 * 2048 / hbm  # forward bytes of a layer's memory-bound kernels
    assert steps["full"] - steps["none"] == pytest.approx(
        4 * 24 * (spec.layer_flops() / rate + layer_memory))
    assert steps["selective"] - steps["none"] == pytest.approx(4 * 24 * 4 * 2048 * 2048 * 2048 / rate)


def test_optimizer_step_reads_and_writes_the_state_once(tmp_path):
    """pp=1: the step ends with Adam over every parameter, 16 bytes each read and
    written at the A100's HBM bandwidth; ZeRO-1 over dp=8 leaves 2 + 2 + 12/8 bytes."""
    spec = model_spec("gpt3-1.3b")
    hbm = 2.039e12 * HBM_EFFICIENCY
    from pipesim.model.transformer_costs import model_costs as derive

    costs = derive(spec, 1, [312e12], fallback_memory_bandwidth=2.039e12)
    assert costs.step_overhead == pytest.approx(2 * spec.total_params() * 16 / hbm)
    sharded = derive(spec, 1, [312e12], fallback_memory_bandwidth=2.039e12, optimizer_state_bytes=2 + 2 + 12 / 8)
    assert sharded.step_overhead == pytest.approx(2 * spec.total_params() * 5.5 / hbm)
