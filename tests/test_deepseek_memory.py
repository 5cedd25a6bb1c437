"""DeepSeek-V3's memory rules (technical report, arXiv:2412.19437, sections 3.2.3 and
3.3.3), each against a hand count: what one layer stashes with its norms' outputs and
MLA's up-projections recomputed (``--recompute norm-mla-up``) and with FP8 caching
(``--fp8``), what the recomputation costs, the optimizer's bytes per parameter with BF16
moments (``--optimizer-moments``), ZeRO over DualPipe's two copies, and the report's
layout fitting an 80 GB H800.

The layer counts below are written from the config's sizes (hidden 7168, q rank 1536, kv
rank 512, rotary 64, 128 heads of 192 / 128, 8 of 256 experts of 2048 + 1 shared expert),
not read from the code."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.job import Job, model_spec_of, simulate_job
from pipesim.model.activations import FP8_CACHED_BYTES, layer_stash_bytes
from pipesim.model.compute_model import FixedEfficiency, block_time, operation_time
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.memory_traffic import memory_seconds
from pipesim.model.operations import layer_operations
from pipesim.model.spec import BUNDLED_CONFIGS
from pipesim.sim.memory import BytesPerParam, static_bytes_per_param, with_optimizer_moments

CONFIG = BUNDLED_CONFIGS / "deepseek-v3.json"
H, Q_RANK, KV_RANK, ROPE, HEADS, QK_HEAD, V_HEAD = 7168, 1536, 512, 64, 128, 192, 128
K, EXPERTS, EXPERT_FFN, SHARED_FFN, DENSE_FFN = 8, 256, 2048, 2048, 18432
TOKENS = 4096
FP8 = 1 + 4 / 128  # an FP8 byte and its share of one FP32 scale per 1x128 tile (report, section 3.3.2)
MOE_LAYER, DENSE_LAYER = 3, 0


def deepseek(fp8: bool = True):
    """DeepSeek-V3's config at 4K tokens, its FP8 quantization_config kept or dropped."""
    data = json.loads(CONFIG.read_text())
    if not fp8:
        data.pop("quantization_config")
    return spec_from_hf_config(data, "deepseek-v3.json", seq_len=TOKENS)


def test_fp8_cached_bytes_are_a_byte_and_a_tile_scale():
    assert FP8_CACHED_BYTES == FP8 == 1.03125


def test_a_moe_layer_as_deepseek_trained_it_by_hand():
    # per token: both norms' inputs (2 x h, BF16), MLA's latents before their norms and the
    # rotary key (BF16), the attention output (BF16, which the output projection and the
    # attention backward read), each expert's SwiGLU inputs (2 x 2048, FP8) for 8 routed and
    # 1 shared, the 8 dispatched copies of the token (FP8), the router's 256 FP32 scores
    per_token = (2 * H * 2 + (Q_RANK + KV_RANK + ROPE) * 2 + HEADS * V_HEAD * 2
                 + 2 * (K * EXPERT_FFN + SHARED_FFN) * FP8 + K * H * FP8 + 4 * EXPERTS)
    assert per_token == 163840  # 160 KiB
    spec = deepseek()
    assert layer_stash_bytes(spec, recompute="norm-mla-up", layer=MOE_LAYER) == pytest.approx(TOKENS * per_token)
    # the same layer in BF16 with nothing recomputed keeps 3.48 times as much (557 KiB)
    bf16 = (2 * H * 2 + 2 * H * 2 + (2 * Q_RANK + 2 * KV_RANK + ROPE) * 2
            + (2 * HEADS * QK_HEAD + 2 * HEADS * V_HEAD) * 2 + 3 * (K * EXPERT_FFN + SHARED_FFN) * 2
            + 2 * K * H * 2 + 4 * EXPERTS)
    assert layer_stash_bytes(deepseek(fp8=False), layer=MOE_LAYER) == TOKENS * bf16
    assert bf16 == 570496 and bf16 / per_token == pytest.approx(3.482, abs=1e-3)


def test_each_rule_alone_by_hand():
    norms_in, rotary = 2 * H * 2, ROPE * 2
    router = 4 * EXPERTS
    # FP8 caching alone: the norms' outputs (QKV and MLP inputs, MLA's normed latents) are
    # GEMM inputs, kept in FP8; Q, K, V and the output stay BF16
    fp8_only = (norms_in + 2 * H * FP8 + (Q_RANK + KV_RANK) * 2 + rotary + (Q_RANK + KV_RANK) * FP8
                + (2 * HEADS * QK_HEAD + 2 * HEADS * V_HEAD) * 2
                + 2 * (K * EXPERT_FFN + SHARED_FFN) * FP8 + K * H * FP8 + router)
    assert layer_stash_bytes(deepseek(), layer=MOE_LAYER) == pytest.approx(TOKENS * fp8_only)
    # recomputation alone, in BF16: no norm outputs, of attention the output only; the MLP
    # and the routed copies as in BF16 (SwiGLU's inputs and output, dispatched input and
    # expert output)
    recompute_only = (norms_in + (Q_RANK + KV_RANK) * 2 + rotary + HEADS * V_HEAD * 2
                      + 3 * (K * EXPERT_FFN + SHARED_FFN) * 2 + 2 * K * H * 2 + router)
    assert layer_stash_bytes(deepseek(fp8=False), recompute="norm-mla-up", layer=MOE_LAYER) == TOKENS * recompute_only


def test_a_dense_layer_under_fp8_keeps_swiglus_inputs_in_bf16_and_the_down_input_in_fp8():
    # the first three layers: a dense SwiGLU of 18432, outside the mixture of experts
    per_token = 2 * H * 2 + (Q_RANK + KV_RANK + ROPE) * 2 + HEADS * V_HEAD * 2 + 2 * DENSE_FFN * 2 + DENSE_FFN * FP8
    assert layer_stash_bytes(deepseek(), recompute="norm-mla-up", layer=DENSE_LAYER) == pytest.approx(
        TOKENS * per_token)


def test_a_model_without_latent_attention_recomputes_only_its_norms():
    spec = replace(deepseek(fp8=False), mla=None, moe=None, heads=32, kv_heads=8, hidden=4096, ffn_hidden=14336)
    d, h, f = 2, 4096, 14336
    q, kv = 4096, 8 * 128
    kept = 2 * h * d + (q + 2 * kv + q) * d + 3 * f * d  # norm inputs, Q K V and output, SwiGLU
    assert layer_stash_bytes(spec, recompute="norm-mla-up") == TOKENS * kept
    assert layer_stash_bytes(spec) == TOKENS * (kept + 2 * h * d)  # and the two norm outputs


def test_the_recomputation_costs_the_norms_and_the_up_projections_forward():
    spec = deepseek()
    compute = FixedEfficiency(989e12, 0.6, 3.35e12, fp8_speedup=2.0)
    operations = layer_operations(spec, layer=MOE_LAYER)
    plain = block_time(operations, compute)
    light = block_time(operations, compute, "norm-mla-up")
    up = [operation for operation in operations if operation.name in ("query_up", "kv_up")]
    assert [(gemm.k, gemm.n) for gemm in up] == [(Q_RANK, HEADS * QK_HEAD),
                                                  (KV_RANK, HEADS * (QK_HEAD - ROPE + V_HEAD))]
    norms = memory_seconds(TOKENS * 4 * H * 2, 3.35e12)  # two norms read and write h each, BF16
    # FP8 caching drops SwiGLU's output, so every backward re-runs it: reads 2f, writes f for
    # 8 routed and 1 shared expert of 2048, in BF16
    swiglu = memory_seconds(TOKENS * 3 * (K * EXPERT_FFN + SHARED_FFN) * 2, 3.35e12)
    expected = sum(operation_time(gemm, compute).forward for gemm in up) + norms + swiglu
    assert light.recompute == pytest.approx(expected)
    assert (light.forward, light.input_grad, light.weight_grad) == (plain.forward, plain.input_grad, plain.weight_grad)
    assert plain.recompute == pytest.approx(swiglu)
    assert block_time(layer_operations(deepseek(fp8=False), layer=MOE_LAYER), compute).recompute == 0.0
    assert block_time(layer_operations(spec, layer=DENSE_LAYER), compute).recompute == 0.0  # a dense MLP keeps it
    # and the FLOPs it adds: 2 T (1536 x 128 x 192 + 512 x 128 x 256) per layer, 61 layers
    per_layer = 2 * TOKENS * (Q_RANK * HEADS * QK_HEAD + KV_RANK * HEADS * (QK_HEAD - ROPE + V_HEAD))
    assert spec.recompute_flops("norm-mla-up") == pytest.approx(61 * per_layer)


def test_bf16_moments_take_four_bytes_off_each_parameters_optimizer_state():
    # DeepSeek's: BF16 weights, FP32 gradients, FP32 master weights + two BF16 moments
    deepseek_bytes = with_optimizer_moments(BytesPerParam(2, 4, 12), "bf16")
    assert deepseek_bytes == BytesPerParam(2, 4, 4 + 2 + 2)
    assert with_optimizer_moments(BytesPerParam(2, 4, 12), "fp32") == BytesPerParam(2, 4, 12)
    # ZeRO-1 over 256 holders: the optimizer state sharded, weights and gradients whole
    assert static_bytes_per_param(deepseek_bytes, 256, 1) == 2 + 4 + 8 / 256
    with pytest.raises(ValueError, match=r"--optimizer-moments bf16 with --bytes-per-param's OPTIMIZER 4"):
        with_optimizer_moments(BytesPerParam(2, 2, 4), "bf16")


@settings(max_examples=50, deadline=None)
@given(weights=st.sampled_from([2.0, 4.0]), grads=st.sampled_from([2.0, 4.0]),
       optimizer=st.floats(8, 16), dp=st.integers(1, 512), zero=st.sampled_from([0, 1, 2, 3]))
def test_bf16_moments_save_four_bytes_sharded_as_the_optimizer_state_is(weights, grads, optimizer, dp, zero):
    fp32 = BytesPerParam(weights, grads, optimizer)
    saved = static_bytes_per_param(fp32, dp, zero) - static_bytes_per_param(with_optimizer_moments(fp32, "bf16"),
                                                                            dp, zero)
    assert saved == pytest.approx(4 / (dp if zero >= 1 else 1))


def exit_status(argv: list[str]) -> int:
    """The command line's exit status: what ``main`` returns, or argparse's exit."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("argv, message", [
    (["--optimizer-moments", "bf16", "--bytes-per-param", "2,2,4"], "--optimizer-moments bf16 with --bytes-per-param"),
    (["--optimizer-moments", "fp16"], "argument --optimizer-moments: invalid choice: 'fp16'"),
])
def test_bad_optimizer_moments_are_one_line_and_exit_2(argv, message, capsys):
    assert exit_status(["simulate", *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error.split("error: ", 1)[1]


def test_zero_shards_dualpipes_state_over_both_copies():
    # DualPipe's two copies of a stage reduce their gradients together, so ZeRO-1 spreads the
    # optimizer state over dp x 2 holders: pp 4 dp 2 with 2-2-12 bytes, each rank's two
    # stages of 1e9 parameters hold 2 x 1e9 x (2 + 2 + 12 / 4) bytes
    job = Job(schedule="dualpipe", pp=4, microbatches=8, fwd=1.0, bwd=2.0, param_bytes=2e9, stash_bytes=1.0,
              dp=2, zero=1, topology="nvlink")
    result = simulate_job(job)
    assert [rank.static_bytes for rank in result.memory] == [2 * 1e9 * (2 + 2 + 12 / 4)] * 4
    one_copy = simulate_job(replace(job, schedule="1f1b"))
    assert [rank.static_bytes for rank in one_copy.memory] == [1e9 * (2 + 2 + 12 / 2)] * 4


def test_the_reports_layout_fits_an_h800_and_is_within_15_percent_of_its_throughput():
    from benchmarks.deepseek_v3 import PUBLISHED_TOKENS_PER_GPU, job_of, predict

    assert PUBLISHED_TOKENS_PER_GPU == pytest.approx(14.8e12 / (2664e3 * 3600))
    row = predict(job_of())
    assert row["fits"] and row["peak_gb"] <= row["usable_gb"] < row["capacity_gb"]
    assert math.isclose(row["tokens_per_gpu"], PUBLISHED_TOKENS_PER_GPU, rel_tol=0.15)


@pytest.mark.parametrize("schedule, pp, keeps_a_copy", [
    ("1f1b", 2, True),  # the last stage's rank holds no embedding: it keeps one for the MTP module
    ("1f1b", 1, False),  # one rank holds both ends
    ("zbv", 2, False),  # V-shaped: the last stage is on rank 0, beside the embedding
    ("dualpipe", 2, False),  # each copy's last stage sits beside the other copy's embedding
])
def test_the_mtp_modules_embedding_is_counted_where_no_first_stage_shares_its_rank(schedule, pp, keeps_a_copy):
    job = Job(model=str(CONFIG), layers=4, seq_len=TOKENS, schedule=schedule, pp=pp, microbatches=4)
    spec = model_spec_of(job)
    result = simulate_job(job)
    whole = spec.describe()["params"] + spec.mtp_params()  # main model and MTP module, the embedding once
    table = 129280 * H  # the vocabulary's rows of 7168
    assert spec.embedding_params() == table
    counted = sum(cost.params for cost in result.costs.stages)
    assert counted == result.schedule.copies * whole + (table if keeps_a_copy else 0)
