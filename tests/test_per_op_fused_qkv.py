"""``--qkv fused``: Q, K and V built as one ``wqkv`` linear (torchtitan 0.3's Llama 3),
which changes what ``--recompute per-op`` keeps and re-runs, and nothing else.

The layer, as in ``tests/test_per_op_recompute.py``: hidden 64, 4 heads of 16, 2
key-value heads (K and V 32 wide), SwiGLU of 128, no biases, 16 tokens, 2-byte
activations. Fused, torchtitan's forward runs five products, wqkv, wo, w1 (gate), w3
(up), w2 (down); its policy saves the odd ones and re-runs the even ones: wqkv is kept
whole (Q, K and V), the output projection and the up projection re-run. Every figure
below is written from those sizes, not read from the code."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.model.activations import layer_stash_bytes
from pipesim.model.compute_model import FixedEfficiency, block_time
from pipesim.model.errors import ModelSpecError
from pipesim.model.operations import layer_operations
from pipesim.model.per_op_checkpoint import fusing_qkv_changes_per_op, recomputed_matrices
from pipesim.model.spec import PRESETS, ModelSpec
from pipesim.model.transformer_costs import model_stage_costs, training_figures

H, HEADS, HEAD, KV, FFN, TOKENS, D = 64, 4, 16, 32, 128, 16, 2


def small_llama(fused: bool = True, **changes) -> ModelSpec:
    spec = ModelSpec("small-llama", layers=2, hidden=H, heads=HEADS, seq_len=TOKENS, vocab=100, kv_heads=2,
                     ffn_hidden=FFN, gated_mlp=True, tied_embeddings=False, learned_positions=False, bias=False,
                     rms_norm=True, dropout=False, fused_qkv=fused)
    return replace(spec, **changes)


def test_fused_recomputes_the_output_and_up_projections_only():
    assert recomputed_matrices(small_llama()) == {"output", "mlp up"}
    assert recomputed_matrices(small_llama(fused=False)) == {"key", "output", "mlp up"}


def test_a_biased_wqkv_is_saved_and_not_counted_either_way():
    # wqkv with a bias runs as addmm: the count starts at the output projection (1, saved),
    # gate (2, re-run), up (3, saved), down (4, re-run), as with three biased linears
    assert recomputed_matrices(small_llama(qkv_bias=True)) == {"mlp gate", "mlp down"}
    assert not fusing_qkv_changes_per_op(small_llama(qkv_bias=True))
    assert fusing_qkv_changes_per_op(small_llama())
    assert not fusing_qkv_changes_per_op(small_llama(bias=True))  # GPT-style: nothing counted either way


def test_the_fused_stash_per_token_by_hand():
    # block input 64 + Q 64 + K 32 + V 32 + attention output 64 + gate 128 + down 64 = 448;
    # of it the products' outputs 320 (separate: 288, K's 32 fewer)
    assert layer_stash_bytes(small_llama(), recompute="per-op") == TOKENS * 448 * D
    assert layer_stash_bytes(small_llama(fused=False), recompute="per-op") == TOKENS * 416 * D


def test_the_fused_stash_under_tensor_parallelism_by_hand():
    # tp 2: input 64, Q 32, K and V one key-value head (16 each), attention output 32, gate 64,
    # the down projection's full-width partial sum 64
    assert layer_stash_bytes(small_llama(), tp=2, recompute="per-op") == TOKENS * (64 + 32 + 16 + 16 + 32 + 64 + 64) * D
    # sequence parallel: the input's shard 32 and the two reduce-scatters' outputs 2 x 32
    assert layer_stash_bytes(small_llama(), tp=2, sequence_parallel=True, recompute="per-op") == \
        TOKENS * (32 + 32 + 16 + 16 + 32 + 64 + 64 + 64) * D


def test_fused_recomputed_flops_are_the_output_and_up_projections():
    assert small_llama().layer_recompute_flops(0, "per-op") == 2 * TOKENS * H * (H + FFN)
    # one of 2 tp ranks: the output projection 32 x 64 (rows split), up 64 x 64
    assert small_llama().layer_recompute_flops(0, "per-op", tp=2) == 2 * TOKENS * (32 * H + H * 64)


def test_fused_recomputed_time_is_those_gemms_and_every_element_wise_kernel():
    # 1e12 FLOP/s, 1 GB/s of HBM at 85%: the two GEMMs' forwards, and the element-wise
    # kernels' forward bytes per token (norms 4h, residual adds 6h, SwiGLU 3 x 128, rotary
    # 2 x (64 + 32)), 2 bytes each; none of the QKV GEMM, never the attention kernel
    time = block_time(layer_operations(small_llama()), FixedEfficiency(1e12, 1.0, 1e9), "per-op")
    gemms = 2 * TOKENS * H * (H + FFN) / 1e12
    elementwise = TOKENS * (10 * H + 3 * FFN + 2 * (H + KV)) * D / (1e9 * 0.85)
    assert time.recompute == pytest.approx(gemms + elementwise)


def test_under_fp8_the_saved_wqkv_still_re_runs_its_input_cast():
    # FP8 GEMMs at 2e12: the output and up GEMMs' FLOPs, and the input cast of all four GEMMs
    # (QKV, output, gate-and-up, down: 64, 64, 64 and 128 columns in, 4 bytes an element with
    # delayed scaling): the cast is no saved op, so the saved wqkv's runs again too
    model = FixedEfficiency(1e12, 1.0, 1e9, fp8_speedup=2.0)
    time = block_time(layer_operations(small_llama(fp8=True, fp8_scaling="delayed")), model, "per-op")
    gemms = 2 * TOKENS * H * (H + FFN) / 2e12
    casts = 4 * TOKENS * (H + H + H + FFN)
    elementwise = TOKENS * (10 * H + 3 * FFN + 2 * (H + KV)) * D
    assert time.recompute == pytest.approx(gemms + (casts + elementwise) / (1e9 * 0.85))


@pytest.mark.parametrize("sequence_parallel, per_layer", [(True, 1), (False, 2)])
def test_the_repeated_tp_collectives_do_not_change(sequence_parallel, per_layer):
    # the re-run forward runs every op it does not save: both all-gathers (sequence
    # parallel) or both all-reduces, in front of or behind a saved product or not
    costs = model_stage_costs(small_llama(), 1, [1e15], tp=2, sequence_parallel=sequence_parallel, recompute="per-op")
    assert costs.stages[0].recomputed_tp_pairs == 2 * per_layer


def test_tflops_count_the_output_and_up_gemms_again():
    # model FLOPs as in test_per_op_recompute (7,888,896, the same fused or not); per-op adds
    # the output and up GEMMs of both layers, 2 x 2 x 16 x 64 x (64 + 128) = 2 x 393,216
    figures = training_figures(small_llama(), "per-op", makespan=1.0, microbatches=1, dp=1, gpus=1, peak_flops=1e12,
                               attention_flops="causal")
    assert figures["model_tflops_per_gpu"] * 1e12 == pytest.approx(7_888_896 + 2 * 393_216)
    assert figures["mfu"] * 1e12 == pytest.approx(7_888_896)


@settings(max_examples=40, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 4]), ffn=st.integers(1, 8).map(lambda n: 32 * n), gated=st.booleans(),
       qkv_bias=st.booleans(), tp=st.sampled_from([1, 2]), sequence_parallel=st.booleans())
def test_fusing_keeps_ks_output_and_saves_its_gemm(kv_heads, ffn, gated, qkv_bias, tp, sequence_parallel):
    # Bias-less Q, K and V: K is the second product when separate (re-run) and inside the
    # first when fused (kept); every later product keeps its parity (the three became one,
    # two fewer), so the only change is K: its output on the rank kept, its GEMM not re-run.
    # Biased, they are addmm either way: no change.
    sequence_parallel = sequence_parallel and tp > 1
    fused = small_llama(kv_heads=kv_heads, ffn_hidden=ffn, gated_mlp=gated, qkv_bias=qkv_bias)
    separate = replace(fused, fused_qkv=False)
    k_columns = 0 if qkv_bias else HEAD * max(1, kv_heads // tp)  # a rank's whole key-value heads
    stash = {spec.fused_qkv: layer_stash_bytes(spec, tp, sequence_parallel, "per-op") for spec in (fused, separate)}
    assert stash[True] - stash[False] == TOKENS * k_columns * D
    flops = {spec.fused_qkv: spec.layer_recompute_flops(0, "per-op", tp, sequence_parallel)
             for spec in (fused, separate)}
    assert flops[False] - flops[True] == 2 * TOKENS * H * k_columns
    for mode in ("none", "selective", "full"):  # every other mode: the same layer
        assert layer_stash_bytes(fused, tp, sequence_parallel, mode) == \
            layer_stash_bytes(separate, tp, sequence_parallel, mode)
        assert fused.layer_recompute_flops(0, mode, tp, sequence_parallel) == \
            separate.layer_recompute_flops(0, mode, tp, sequence_parallel)


def simulated(tmp_path, qkv: str, recompute: str) -> dict:
    out = tmp_path / f"{qkv}-{recompute}.json"
    assert main(["simulate", "--model", "llama3-8b", "--layers", "4", "--pp", "2", "--microbatches", "4",
                 "--recompute", recompute, "--qkv", qkv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_simulate_changes_only_per_op(tmp_path, capsys):
    # llama3-8b's layer: K 1,024 columns (8 key-value heads of 128) kept and not re-run
    for mode in ("none", "full"):
        fused, separate = simulated(tmp_path, "fused", mode), simulated(tmp_path, "separate", mode)
        assert (fused.pop("model")["fused_qkv"], separate.pop("model")["fused_qkv"]) == (True, False)
        assert fused == separate
    fused, separate = simulated(tmp_path, "fused", "per-op"), simulated(tmp_path, "separate", "per-op")
    assert fused["makespan"] < separate["makespan"]
    # a stage's microbatch keeps K's output of each of its layers: 8,192 tokens x 1,024 x 2 bytes;
    # rank 0 holds 2 microbatches in flight (1F1B, pp 2)
    for fused_stage, separate_stage in zip(fused["stage_costs"], separate["stage_costs"], strict=True):
        assert fused_stage["stash_bytes"] - separate_stage["stash_bytes"] == fused_stage["layers"] * 8192 * 1024 * 2
    peaks = [rank["memory"]["peak_stash_bytes"] for rank in (fused["ranks"][0], separate["ranks"][0])]
    assert peaks[0] - peaks[1] == 2 * fused["stage_costs"][0]["layers"] * 8192 * 1024 * 2
    capsys.readouterr()


@pytest.mark.parametrize("command", [
    ["simulate", "--model", "llama3-8b"],
    ["simulate"],  # refused without a model too: never silently ignored
    ["sweep", "--model", "llama3-8b", "--pp", "2", "--microbatches", "2,4"],
    ["export", "--model", "llama3-8b", "--pp", "2", "--out", "unused.csv"],
    ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8"],
])
def test_a_bad_qkv_is_one_line_and_exit_2(command, capsys):
    assert main([*command, "--qkv", "grouped"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"pipesim {command[0]}: error: --qkv 'grouped' is not one of: separate, fused"


def test_latent_attention_has_nothing_to_fuse(capsys):
    assert main(["simulate", "--model", "deepseek-v2-lite", "--qkv", "fused"]) == 2
    assert capsys.readouterr().err.strip() == ("pipesim simulate: error: model deepseek-v2-lite: latent attention "
                                               "has no Q, K and V projections to fuse; drop --qkv fused")
    with pytest.raises(ModelSpecError, match="latent attention"):
        replace(PRESETS["deepseek-v2-lite"], fused_qkv=True)


def test_plan_prices_the_fused_model(tmp_path, capsys):
    # the same search fused and separate: per-op's row keeps K's output (1,024 columns of
    # 8,192 tokens, 2 bytes, in every layer in flight) and re-runs less
    rows = {}
    for qkv in ("separate", "fused"):
        out = tmp_path / f"{qkv}.json"
        assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--topology", "nvlink",
                     "--schedules", "1f1b", "--microbatch-sizes", "1", "--zero", "1", "--sequence-parallel", "off",
                     "--constraint", "pp=2", "--constraint", "tp=1", "--recompute", "per-op,none", "--top", "4",
                     "--workers", "1", "--qkv", qkv, "--json", str(out)]) == 0
        rows[qkv] = {row["recompute"]: row for row in json.loads(out.read_text())["ranked"]}
    assert (rows["fused"]["none"].pop("qkv"), rows["separate"]["none"].pop("qkv")) == ("fused", "separate")
    assert rows["fused"]["none"] == rows["separate"]["none"]
    assert rows["fused"]["per-op"]["peak_memory_bytes"] > rows["separate"]["per-op"]["peak_memory_bytes"]
    assert rows["fused"]["per-op"]["step_time"] < rows["separate"]["per-op"]["step_time"]
    capsys.readouterr()


TORCHTITAN_REFUSAL = ("--recompute per-op with --qkv separate: torchtitan 0.3's Llama 3 fuses Q, K and V into one "
                      "wqkv, whose per-op checkpointing keeps K's output too and does not re-run K's GEMM, so it would "
                      "not run what pipesim priced; give --qkv fused, or a recompute mode other than per-op")


def export(folder, *flags) -> int:
    return main(["export", "--pp", "2", "--microbatches", "4", "--recompute", "per-op", "--torchtitan", str(folder),
                 *flags])


def test_export_for_torchtitan_refuses_per_op_over_separate_projections(tmp_path, capsys):
    llama = ["--model", "llama3-8b", "--layers", "4"]
    assert export(tmp_path / "separate", *llama) == 2
    assert capsys.readouterr().err.strip() == f"pipesim export: error: {TORCHTITAN_REFUSAL}"
    assert not (tmp_path / "separate").exists()  # refused before anything is written
    assert export(tmp_path / "fused", *llama, "--qkv", "fused") == 0
    assert (tmp_path / "fused" / "torchtitan.args").read_text().split()[-1] == "activation_checkpoint:selective"
    # where fusing changes nothing (every linear biased) or no model was priced, separate is written
    assert export(tmp_path / "gpt", "--model", "gpt3-1.3b", "--layers", "4") == 0
    assert export(tmp_path / "bare", "--layers", "4") == 0
    capsys.readouterr()


def test_plan_for_torchtitan_refuses_before_searching_per_op_over_separate_projections(tmp_path, capsys):
    search = ["plan", "--model", "llama3-8b", "--seq-len", "2048", "--gpus", "8", "--global-batch", "8",
              # zero 1: what torchtitan's FSDP runs pipelined replicas as (pipesim.plan.torchtitan_fsdp)
              "--topology", "nvlink", "--schedules", "1f1b", "--microbatch-sizes", "1", "--zero", "1",
              "--sequence-parallel", "off",
              "--constraint", "pp=2", "--constraint", "tp=1", "--constraint", "dp=4", "--top", "2", "--workers", "1",
              "--quiet", "--fsdp"]
    assert main([*search, "--torchtitan", str(tmp_path / "separate")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"pipesim plan: error: {TORCHTITAN_REFUSAL}" and not any("simulated" in line for line in err)
    assert main([*search, "--recompute", "none,full", "--torchtitan", str(tmp_path / "none")]) == 0
    assert main([*search, "--recompute", "per-op", "--qkv", "fused", "--torchtitan", str(tmp_path / "fused")]) == 0
    assert (tmp_path / "fused" / "torchtitan.args").read_text().split()[-1] == "activation_checkpoint:selective"
    capsys.readouterr()


def test_a_plan_row_carries_its_qkv_to_export_and_run(tmp_path, capsys):
    from pipesim.cli import build_parser  # noqa: PLC0415 - run's parser, for run --plan
    from pipesim.cli.plan_row import config_from_plan_row  # noqa: PLC0415

    plans = {}
    for qkv in ("fused", "separate"):
        plans[qkv] = tmp_path / f"{qkv}.json"
        assert main(["plan", "--model", "llama3-8b", "--seq-len", "2048", "--gpus", "4", "--global-batch", "4",
                     "--topology", "nvlink", "--schedules", "1f1b", "--microbatch-sizes", "1", "--zero", "0",
                     "--sequence-parallel", "off", "--constraint", "pp=2", "--constraint", "tp=1",
                     "--recompute", "per-op", "--top", "1", "--workers", "1", "--quiet", "--qkv", qkv,
                     "--json", str(plans[qkv])]) == 0
        assert json.loads(plans[qkv].read_text())["ranked"][0]["qkv"] == qkv
    # export takes the row's --qkv: the fused per-op row is written for torchtitan, the separate one refused
    assert main(["export", "--from-plan", str(plans["fused"]), "--seq-len", "2048", "--topology", "nvlink",
                 "--torchtitan", str(tmp_path / "fused")]) == 0
    assert main(["export", "--from-plan", str(plans["separate"]), "--seq-len", "2048", "--topology", "nvlink",
                 "--torchtitan", str(tmp_path / "separate")]) == 2
    assert capsys.readouterr().err.strip().endswith(TORCHTITAN_REFUSAL)
    assert main(["export", "--from-plan", str(plans["separate"]), "--qkv", "fused", "--seq-len", "2048",
                 "--torchtitan", str(tmp_path / "changed")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"pipesim export: error: --qkv fused conflicts with --from-plan {plans['separate']}: layout 1 was planned "
        "with --qkv separate; drop --qkv")
    # run --plan builds the row's projections, and refuses a --qkv that changes them
    parser = build_parser("run")
    config, _ = config_from_plan_row(parser.parse_args(["run", "--plan", str(plans["fused"]), "--row", "1"]))
    assert (config.qkv, config.recompute, config.model) == ("fused", "per-op", "llama3-8b")
    from executor.config import ConfigError  # noqa: PLC0415

    with pytest.raises(ConfigError, match=r"^--qkv fused conflicts with --plan .*: row 1 was planned with --qkv "
                                          r"separate; drop --qkv$"):
        config_from_plan_row(parser.parse_args(["run", "--plan", str(plans["separate"]), "--qkv", "fused"]))
