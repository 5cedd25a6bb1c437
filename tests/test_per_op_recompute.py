"""``--recompute per-op``: torchtitan's per-op selective checkpointing (SelectiveAC) as a
recompute mode, against hand counts of a small Llama-shaped layer.

The layer: hidden 64, 4 heads of 16, 2 key-value heads (K and V 32 wide), SwiGLU of 128,
no biases, 16 tokens, 2-byte activations. torchtitan's forward runs wq, wk, wv, wo, w1
(gate), w3 (up), w2 (down); its policy saves odd-numbered products and recomputes even
ones, so K, the output projection and the up projection are re-run, and Q, V, the
attention kernel's output, the gate's output and the down projection's output are kept
beside the block's input. Every figure below is written from those sizes, not read from
the code."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.mapping import map_ranks
from pipesim.job import Job, simulate_job
from pipesim.model.activations import layer_stash_bytes
from pipesim.model.compute_model import FixedEfficiency, block_time
from pipesim.model.costs import Costs, StageCost
from pipesim.model.errors import ModelSpecError
from pipesim.model.operations import layer_operations
from pipesim.model.per_op_checkpoint import recomputed_matrices
from pipesim.model.saved_tensors import EAGER_TORCH, layer_extra_bytes
from pipesim.model.spec import PRESETS, RECOMPUTE, ModelSpec
from pipesim.model.transformer_costs import model_stage_costs, training_figures
from pipesim.plan.layouts import searched_recompute
from pipesim.sim.parallel import tp_collective_seconds
from schedules import generate

H, HEADS, HEAD, KV, FFN, TOKENS, D = 64, 4, 16, 32, 128, 16, 2


def small_llama(**changes) -> ModelSpec:
    spec = ModelSpec("small-llama", layers=2, hidden=H, heads=HEADS, seq_len=TOKENS, vocab=100, kv_heads=2,
                     ffn_hidden=FFN, gated_mlp=True, tied_embeddings=False, learned_positions=False, bias=False,
                     rms_norm=True, dropout=False)
    return replace(spec, **changes)


def test_per_op_is_a_recompute_mode():
    assert "per-op" in RECOMPUTE


def test_llama_recomputes_every_second_matrix_in_forward_order():
    assert recomputed_matrices(small_llama()) == {"key", "output", "mlp up"}


def test_a_biased_linear_is_saved_and_not_counted():
    # q, k, v with biases run as addmm (saved, uncounted): the count starts at the output
    # projection (1, saved), gate (2, recomputed), up (3, saved), down (4, recomputed)
    assert recomputed_matrices(small_llama(qkv_bias=True)) == {"mlp gate", "mlp down"}
    assert recomputed_matrices(small_llama(bias=True)) == frozenset()  # GPT-style: every matrix biased


def test_stash_per_token_by_hand_on_one_rank():
    # block input 64 + Q 64 + V 32 + attention output 64 + gate 128 + down output 64 = 416
    assert layer_stash_bytes(small_llama(), recompute="per-op") == TOKENS * 416 * D


def test_stash_per_token_by_hand_under_tensor_parallelism():
    spec = small_llama()
    # tp 2: Q 32, V one key-value head 16, attention output 32, gate 64, and the down
    # projection's full-width partial sum 64 before its all-reduce; the input whole (64)
    assert layer_stash_bytes(spec, tp=2, recompute="per-op") == TOKENS * (64 + 32 + 16 + 32 + 64 + 64) * D
    # with sequence parallelism the input is the rank's shard (32) and the two
    # reduce-scatters' outputs are saved too (2 x 64 / 2)
    assert layer_stash_bytes(spec, tp=2, sequence_parallel=True, recompute="per-op") == \
        TOKENS * (32 + 32 + 16 + 32 + 64 + 64 + 64) * D


def test_the_executor_count_adds_only_the_kernels_log_sum_exp():
    # torch's autograd keeps nothing of its own inside a per-op checkpointed block: beyond the
    # inventory only the flash kernel's fp32 log-sum-exp, one per head and token
    assert layer_extra_bytes(small_llama(), EAGER_TORCH, recompute="per-op") == TOKENS * HEADS * 4


def test_recomputed_flops_are_the_k_output_and_up_projections():
    # 2 x tokens x 64 x (32 + 64 + 128)
    assert small_llama().layer_recompute_flops(0, "per-op") == 2 * TOKENS * H * (KV + H + FFN)
    # on one of 2 tp ranks: K one head (16), output 64 x 32 (rows / 2), up 64
    assert small_llama().layer_recompute_flops(0, "per-op", tp=2) == 2 * TOKENS * (H * 16 + 32 * H + H * 64)


def test_recomputed_time_is_those_gemms_and_every_element_wise_kernel():
    # at 1e12 FLOP/s and 1 GB/s of HBM (85% reached): the three GEMMs' forwards, and every
    # element-wise kernel's forward bytes per token: norms 4h, residual adds 6h, SwiGLU
    # 3 x 128, rotary 2 x (64 + 32), 2 bytes each, never the attention kernel
    model = FixedEfficiency(1e12, 1.0, 1e9)
    time = block_time(layer_operations(small_llama()), model, "per-op")
    gemms = 2 * TOKENS * H * (KV + H + FFN) / 1e12
    elementwise = TOKENS * (10 * H + 3 * FFN + 2 * (H + KV)) * D / (1e9 * 0.85)
    assert time.recompute == pytest.approx(gemms + elementwise)


def test_under_fp8_every_products_input_cast_is_re_run():
    # FP8 GEMMs at twice 1e12 FLOP/s: the three recomputed GEMMs' FLOPs over 2e12, and the
    # input cast of all four (QKV, output, gate-and-up, down: rows of 64, 64, 64 and 128
    # columns in, 4 bytes an element with delayed scaling), saved or not, beside the
    # element-wise kernels' bytes
    model = FixedEfficiency(1e12, 1.0, 1e9, fp8_speedup=2.0)
    spec = small_llama(fp8=True, fp8_scaling="delayed")
    time = block_time(layer_operations(spec), model, "per-op")
    gemms = 2 * TOKENS * H * (KV + H + FFN) / 2e12
    casts = 4 * TOKENS * (H + H + H + FFN)
    elementwise = TOKENS * (10 * H + 3 * FFN + 2 * (H + KV)) * D
    assert time.recompute == pytest.approx(gemms + (casts + elementwise) / (1e9 * 0.85))


def test_the_backward_repeats_the_collectives_whose_outputs_are_not_saved():
    # two layers over 2 GPUs at 10 GB/s: a 10 MB pair (all-reduce, or all-gather and
    # reduce-scatter) takes 1 ms; each pass holds 2 pairs a layer, 4 ms. Per-op re-runs the
    # two all-gathers (one pair's time) a layer with sequence parallelism: B and I 4 + 2;
    # without it both all-reduces: 4 + 4
    topology = topology_from_dict({"devices": [{"name": "g0"}, {"name": "g1"}],
                                   "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 0.0}]})
    for sequence_parallel, pairs, backward in ((True, 2, 6e-3), (False, 4, 8e-3)):
        stage = StageCost(fwd=4e-3, bwd=10e-3, wgrad=4e-3, layers=2, tp_message_bytes=10e6, recomputed_tp_pairs=pairs)
        costs = Costs(stages=(stage,), sequence_parallel=sequence_parallel)
        holds = tp_collective_seconds(generate("1f1b", 1, 1), costs, topology, map_ranks(topology, tp=2),
                                      overlap=False)
        assert (holds[0, "F"], holds[0, "B"], holds[0, "I"]) == pytest.approx((4e-3, backward, backward))


def test_a_models_stage_costs_carry_the_repeated_pairs():
    spec = small_llama()
    for sequence_parallel, per_layer in ((True, 1), (False, 2)):
        costs = model_stage_costs(spec, 1, [1e15], tp=2, sequence_parallel=sequence_parallel, recompute="per-op")
        assert costs.stages[0].recomputed_tp_pairs == 2 * per_layer  # two layers


@pytest.mark.parametrize("model, flags, reason", [
    ("mixtral-8x7b", [], "mixtral-8x7b has mixture-of-experts layers"),
    ("deepseek-v2-lite", [], "deepseek-v2-lite has mixture-of-experts layers"),
    ("llama3-8b", ["--no-flash-attention"], "drop --no-flash-attention"),
])
def test_refused_cases_are_one_line_and_exit_2(model, flags, reason, capsys):
    assert main(["simulate", "--model", model, "--pp", "2", "--microbatches", "2", "--recompute", "per-op",
                 *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("pipesim simulate: error: --recompute per-op: ") and reason in error
    assert "\n" not in error


def test_run_refuses_written_out_attention_by_its_part(capsys):
    """Gemma 2's soft-capped scores are written out in ``pipesim run`` (no fused kernel
    takes the cap there): the refusal names the part, not a flag the user never gave."""
    assert main(["run", "--model", "gemma-2-9b", "--layers", "4", "--hidden", "64",
                 "--heads", "8", "--pp", "2", "--seq-len", "32", "--vocab", "128", "--recompute", "per-op"]) == 2
    error = capsys.readouterr().err.strip()
    assert "soft-capped attention scores are written out" in error and "--no-flash-attention" not in error
    assert "\n" not in error


def test_latent_attention_alone_is_refused_by_name():
    spec = PRESETS["deepseek-v2-lite"]
    with pytest.raises(ModelSpecError, match="latent attention"):
        model_stage_costs(replace(spec, moe=None), 1, [1e15], recompute="per-op")


def test_simulate_takes_per_op_and_prints_a_step(capsys):
    assert main(["simulate", "--model", "llama3-8b", "--layers", "4", "--pp", "2", "--microbatches", "4",
                 "--recompute", "per-op"]) == 0
    out = capsys.readouterr().out
    assert "step time" in out


def test_the_planner_searches_per_op_where_it_is_modelled():
    assert "per-op" in searched_recompute(PRESETS["llama3-8b"])
    assert "per-op" not in searched_recompute(PRESETS["mixtral-8x7b"])
    assert "per-op" not in searched_recompute(PRESETS["deepseek-v2-lite"])


@settings(max_examples=40, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 4]), ffn=st.integers(1, 8).map(lambda n: 32 * n), gated=st.booleans(),
       qkv_bias=st.booleans(), tp=st.sampled_from([1, 2]), sequence_parallel=st.booleans())
def test_per_op_keeps_between_full_and_none(kv_heads, ffn, gated, qkv_bias, tp, sequence_parallel):
    # whatever it saves, per-op keeps more than the block input (full's stash); on one rank no
    # more than a layer keeps without recompute (under tp its saved row-parallel outputs are
    # full-width partial sums, which can outweigh what tp and sequence parallelism split); it
    # re-runs at most the layer's weight GEMMs' FLOPs
    spec = small_llama(kv_heads=kv_heads, ffn_hidden=ffn, gated_mlp=gated, qkv_bias=qkv_bias)
    sequence_parallel = sequence_parallel and tp > 1
    stash = {mode: layer_stash_bytes(spec, tp, sequence_parallel, mode) for mode in ("none", "per-op", "full")}
    assert stash["full"] < stash["per-op"]
    if tp == 1:
        assert stash["per-op"] <= stash["none"]
    flops = spec.layer_recompute_flops(0, "per-op", tp, sequence_parallel)
    assert 0 <= flops <= spec.layer_gemm_flops(0, tp, sequence_parallel)


def test_a_plan_row_of_per_op_is_what_simulate_gives_the_same_layout(tmp_path, capsys):
    # llama3-8b at 2048 tokens, pp 2 tp 2 with sequence parallelism: the row carries the
    # repeated all-gathers and the smaller stash exactly as simulate prices them
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8",
                 "--seq-len", "2048", "--topology", "nvlink", "--schedules", "1f1b", "--microbatch-sizes", "1",
                 "--zero", "1", "--sequence-parallel", "on", "--constraint", "pp=2", "--constraint", "tp=2",
                 "--top", "10", "--workers", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "1f1b pp2 tp2 dp2 mbs1 m4 recompute=per-op zero1 sp" in table
    rows = {row["recompute"]: row for row in json.loads(out.read_text())["ranked"]}
    assert sorted(rows) == ["full", "none", "per-op", "selective"]
    job = Job(model="llama3-8b", seq_len=2048, topology="nvlink", nodes=1, schedule="1f1b", pp=2, tp=2,
              dp=2, microbatches=4, microbatch_size=1, zero=1, recompute="per-op", sequence_parallel=True)
    result = simulate_job(job)
    assert rows["per-op"]["step_time"] == pytest.approx(result.metrics.makespan, rel=1e-12)
    assert rows["per-op"]["peak_memory_bytes"] == pytest.approx(max(rank.peak_bytes for rank in result.memory),
                                                                rel=1e-12)
    assert rows["full"]["peak_memory_bytes"] < rows["per-op"]["peak_memory_bytes"] < rows["none"]["peak_memory_bytes"]
    assert rows["none"]["step_time"] < rows["per-op"]["step_time"] < rows["full"]["step_time"]


def test_tflops_count_the_recomputed_gemms_and_no_attention():
    # two layers of 16 tokens: GEMMs 2 x 16 x (64 x 128 + 64 x 64 + 64 x 256 + 128 x 64) =
    # 1,179,648 a layer; attention 2 x 4 heads x 16^2 x (16 + 16) = 65,536 whole, 32,768
    # causal; logits 2 x 16 x 64 x 100 = 204,800. Model FLOPs, attention causal: 3 x (2 x
    # (1,179,648 + 32,768) + 204,800) = 7,888,896; per-op adds the K, output and up GEMMs
    # again, 2 x 458,752, and no attention (it keeps the kernel's output)
    figures = training_figures(small_llama(), "per-op", makespan=1.0, microbatches=1, dp=1, gpus=1, peak_flops=1e12,
                               attention_flops="causal")
    assert figures["model_tflops_per_gpu"] * 1e12 == pytest.approx(7_888_896 + 2 * 458_752)
    assert figures["mfu"] * 1e12 == pytest.approx(7_888_896)
