"""DeepSeek-V3's FP8 dispatch (technical report, section 3.3.3): the all-to-all that
carries tokens toward the experts (the forward's dispatch, the backward's combine
gradient) in FP8 with an FP32 scale per 1 x 128 tile, the one back (the combine, the
dispatch's gradient) in BF16. Bytes per layer and pass against hand calculation, the
engine pricing the two apart, the ep stream of a simulated step moving by the
hand-computed share, the defaults (FP8 only for a block-scaled FP8 config) and the
flag's errors."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cluster.presets import nvlink
from pipesim.model.costs import Costs, StageCost, load_costs
from pipesim.model.errors import ModelSpecError
from pipesim.model.experts import MixtureOfExperts
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.spec import BUNDLED_CONFIGS, model_spec
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from schedules.generators import generate
from tests.cli_runs import assert_one_line_error, simulate_json

ROOT = Path(__file__).resolve().parent.parent
DEEPSEEK = json.loads((BUNDLED_CONFIGS / "deepseek-v3.json").read_text())
NVLINK_BW = 450e9 * 0.8  # H100 NVSwitch port x efficiency
NVLINK_PAIR_LATENCY = 2 * 1.5e-6  # GPU -> NVSwitch -> GPU
# Mixtral at its 8192 tokens a sequence, top 2 of 8: a rank's 2 x 8192 routed copies of 4096
COPIES = 2 * 8192
HIDDEN = 4096
BF16_BYTES = COPIES * HIDDEN * 2  # 134,217,728
FP8_BYTES = COPIES * (HIDDEN * 1 + HIDDEN // 128 * 4)  # an FP8 byte each, an FP32 scale per 128: 69,206,016


# --- the bytes -------------------------------------------------------------------------

def test_a_small_moe_layers_all_to_all_bytes_per_pass():
    """4 routed copies (top 2 of 8, capacity 2) of 1000 tokens 256 wide: BF16 both ways is
    4 x 1000 x 256 x 2 = 2,048,000 bytes each; the FP8 dispatch 4 x 1000 x (256 + 2 x 4) =
    1,056,000 bytes (256 FP8 bytes and two FP32 scales a copy), the combine unchanged."""
    moe = MixtureOfExperts(experts=8, experts_per_token=2, expert_ffn=512, capacity_factor=2.0)
    spec = model_spec("mixtral-8x7b")
    assert not spec.fp8_dispatch and spec.dispatch_element_bytes == 2
    assert moe.dispatch_bytes(1000, 256, spec.dispatch_element_bytes) == 2_048_000
    fp8 = replace(spec, fp8=True, fp8_dispatch=True)
    assert fp8.dispatch_element_bytes == pytest.approx(1.03125)
    assert moe.dispatch_bytes(1000, 256, fp8.dispatch_element_bytes) == pytest.approx(1_056_000)
    assert moe.dispatch_bytes(1000, 256, fp8.dtype_bytes) == 2_048_000


@settings(max_examples=60, deadline=None)
@given(copies=st.integers(1, 16), tokens=st.integers(1, 8192), tiles=st.integers(1, 64))
def test_an_fp8_copy_is_a_byte_an_element_and_a_4_byte_scale_per_128(copies, tokens, tiles):
    hidden = 128 * tiles
    moe = MixtureOfExperts(experts=16, experts_per_token=copies, expert_ffn=64)
    spec = model_spec("mixtral-8x7b", hidden=hidden)
    spec = replace(spec, fp8=True, fp8_dispatch=True)
    assert moe.dispatch_bytes(tokens, hidden, spec.dispatch_element_bytes) == pytest.approx(
        copies * tokens * (hidden + 4 * tiles))
    assert moe.dispatch_bytes(tokens, hidden, spec.dtype_bytes) == copies * tokens * hidden * 2


def test_the_stage_costs_carry_the_fp8_dispatch_and_the_bf16_combine():
    default = simulate_json(["--model", "mixtral-8x7b", "--pp", "4", "-m", "1", "--dp", "8", "--ep", "8",
                             "--topology", "ib", "--nodes", "4", "--fp8"])
    fp8 = simulate_json(["--model", "mixtral-8x7b", "--pp", "4", "-m", "1", "--dp", "8", "--ep", "8",
                         "--topology", "ib", "--nodes", "4", "--fp8", "--ep-dispatch", "fp8"])
    # --fp8 alone dispatches in BF16, as Megatron-Core does
    assert default["stage_costs"][0]["dispatch_bytes"] == default["stage_costs"][0]["combine_bytes"] == BF16_BYTES
    assert fp8["stage_costs"][0]["dispatch_bytes"] == pytest.approx(FP8_BYTES)
    assert fp8["stage_costs"][0]["combine_bytes"] == BF16_BYTES


# --- the engine --------------------------------------------------------------------------

def _one(size: float) -> float:
    return 3 / 4 * size / NVLINK_BW + NVLINK_PAIR_LATENCY  # ep 4 inside one node


def test_the_engine_prices_the_dispatch_and_the_combine_each_at_its_size():
    """pp 2, dp 4, ep 4 on one node, 2 MoE layers a stage: after every forward and every
    backward, 2 x (a2a(dispatch) + a2a(combine))."""
    dispatch, combine = 36e6, 72e6
    stage = StageCost(fwd=1e-3, bwd=2e-3, moe_layers=2, dispatch_bytes=dispatch, combine_bytes=combine)
    result = run_simulation(generate("1f1b", 2, 2), Costs(stages=(stage,) * 2), nvlink(),
                            parallel=ParallelConfig(dp=4, ep=4))
    held = [event for event in result.trace.events if event.stream == "ep"]
    assert len(held) == 2 * 2 * 2
    for event in held:
        assert event.duration == pytest.approx(2 * (_one(dispatch) + _one(combine)))


def test_with_tp_the_routed_copies_are_gathered_at_the_combines_bf16_size():
    """tp 2 with sequence parallelism, ep 2: Megatron-Core's dispatcher gathers and scatters
    over tp the 2 x C routed copies of BF16 (C the combine's bytes), whatever the size of
    the all-to-all toward the experts: per MoE layer the attention's pair of M and the
    experts' pair of 2 x C, each gather or scatter over 2 GPUs x/2 / B + alpha."""
    message, dispatch, combine = 40e6, 50e6, 100e6

    def gather_and_scatter(size: float) -> float:
        return 2 * (size / 2 / NVLINK_BW + NVLINK_PAIR_LATENCY)

    stage = StageCost(fwd=1e-3, bwd=2e-3, layers=2, tp_message_bytes=message, moe_layers=2, dispatch_bytes=dispatch,
                      combine_bytes=combine)
    result = run_simulation(generate("1f1b", 2, 1), Costs(stages=(stage,) * 2, sequence_parallel=True), nvlink(),
                            parallel=ParallelConfig(tp=2, dp=2, ep=2, overlap_tp=False))
    tp = [event.duration for event in result.trace.events if event.stream == "tp"]
    assert tp == pytest.approx([2 * (gather_and_scatter(message) + gather_and_scatter(2 * combine))] * 4)


def test_a_costs_file_with_one_size_prices_both_all_to_alls_at_it(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"stages": [{"fwd": 1e-3, "bwd": 2e-3, "moe_layers": 2, "dispatch_bytes": 72e6}] * 2}))
    costs = load_costs(str(path), 2, 1)
    assert costs.stages[0].all_to_all_bytes == (72e6, 72e6)
    result = run_simulation(generate("1f1b", 2, 2), costs, nvlink(), parallel=ParallelConfig(dp=4, ep=4))
    assert {round(event.duration, 12) for event in result.trace.events if event.stream == "ep"} == \
        {round(4 * _one(72e6), 12)}


def test_mixtrals_ep_stream_shrinks_by_the_hand_computed_share():
    """Mixtral, pp 4 x dp 8 on 4 ib nodes, ep 8 inside a node, 4 microbatches of 1F1B:
    each of 8 layers a stage holds the rank for 2 all-to-alls a pass of each size, so the
    FP8 dispatch saves 4 x 8 x 2 x 7/8 x (BF16 - FP8 bytes) / 360 GB/s (latencies cancel)."""
    common = ["--model", "mixtral-8x7b", "--pp", "4", "-m", "4", "--dp", "8", "--ep", "8", "--topology", "ib",
              "--nodes", "4", "--fp8"]
    bf16 = simulate_json(common)
    fp8 = simulate_json([*common, "--ep-dispatch", "fp8"])
    one_bf16 = 7 / 8 * BF16_BYTES / NVLINK_BW + NVLINK_PAIR_LATENCY
    one_fp8 = 7 / 8 * FP8_BYTES / NVLINK_BW + NVLINK_PAIR_LATENCY
    assert bf16["ranks"][0]["ep"] == pytest.approx(4 * 8 * 4 * one_bf16)
    assert fp8["ranks"][0]["ep"] == pytest.approx(4 * 8 * 2 * (one_bf16 + one_fp8))
    saved = 4 * 8 * 2 * 7 / 8 * (BF16_BYTES - FP8_BYTES) / NVLINK_BW
    assert bf16["ranks"][0]["ep"] - fp8["ranks"][0]["ep"] == pytest.approx(saved)
    assert fp8["comm"][0]["ep"]["total"] == pytest.approx(fp8["ranks"][0]["ep"])


# --- the defaults ------------------------------------------------------------------------

def test_deepseeks_block_scaled_fp8_config_dispatches_in_fp8():
    spec = spec_from_hf_config(DEEPSEEK, "deepseek-v3.json")
    assert spec.fp8 and spec.fp8_dispatch and spec.dispatch_element_bytes == pytest.approx(1 + 4 / 128)


def test_a_per_tensor_fp8_config_or_none_dispatches_in_bf16():
    per_tensor = copy.deepcopy(DEEPSEEK)
    del per_tensor["quantization_config"]["weight_block_size"]
    spec = spec_from_hf_config(per_tensor, "per-tensor.json")
    assert spec.fp8 and not spec.fp8_dispatch and spec.dispatch_element_bytes == 2
    plain = copy.deepcopy(DEEPSEEK)
    del plain["quantization_config"]
    spec = spec_from_hf_config(plain, "bf16.json")
    assert not spec.fp8 and not spec.fp8_dispatch


def test_a_dense_block_scaled_config_has_no_dispatch_to_send_in_fp8():
    dense = {"hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 1000,
             "intermediate_size": 4096, "quantization_config": DEEPSEEK["quantization_config"]}
    spec = spec_from_hf_config(dense, "dense.json")
    assert spec.fp8 and not spec.fp8_dispatch


def test_an_fp8_dispatch_without_fp8_gemms_is_refused_in_the_spec():
    spec = model_spec("mixtral-8x7b")
    with pytest.raises(ModelSpecError, match="FP8 dispatch feeds the experts' FP8 GEMMs"):
        replace(spec, fp8_dispatch=True)


# --- the flag ----------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["--model", "mixtral-8x7b", "--fp8", "--ep-dispatch", "fp16"], "--ep-dispatch 'fp16' is not one of: fp8, bf16"),
    (["--model", "mixtral-8x7b", "--ep-dispatch", "fp8"], "--ep-dispatch fp8 needs --fp8"),
    (["--model", "llama3-8b", "--fp8", "--ep-dispatch", "fp8"], "--ep-dispatch fp8: llama3-8b has no mixture of "
                                                                 "experts"),
    (["--fwd", "1e-3", "--ep-dispatch", "bf16"], "--ep-dispatch bf16 needs --model"),
])
def test_bad_ep_dispatch_is_one_line_exit_2(capsys, args, message):
    assert_one_line_error(capsys, ["simulate", "--pp", "2", "-m", "2", *args], message)


def test_plan_refuses_an_fp8_dispatch_without_fp8_gemms_before_searching(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--global-batch", "8",
                 "--ep-dispatch", "fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--ep-dispatch fp8 needs --fp8" in err and len(err.splitlines()) == 1


def test_plan_carries_the_flag_to_every_layouts_model():
    from pipesim.job import model_spec_of
    from pipesim.plan.request import PlanRequest, checked

    base, _ = checked(PlanRequest(model="mixtral-8x7b", gpus=8, global_batch=8, fp8=True, ep_dispatch="fp8"))
    assert model_spec_of(base).fp8_dispatch
    base, _ = checked(PlanRequest(model=str(BUNDLED_CONFIGS / "deepseek-v3.json"), gpus=8,
                                  global_batch=8, gpu="h800", ep_dispatch="bf16"))
    assert model_spec_of(base).fp8 and not model_spec_of(base).fp8_dispatch


@pytest.mark.parametrize("command", ["simulate", "plan", "sweep"])
def test_help_names_the_flag_and_its_default(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--ep-dispatch fp8|bf16" in text
    assert "(default: fp8 for a config.json whose FP8 quantization_config is block-scaled" in text
