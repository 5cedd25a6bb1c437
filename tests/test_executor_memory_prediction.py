"""The simulator's predicted peak memory per rank against the executor's measured one
(CPU, gloo): the per-layer bytes the executor's blocks keep for their backward, by hand,
and a handful of launched runs held within 10% of the prediction
(``pipesim.cli.run_memory``; the full table is ``benchmarks/executor_memory.py``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.architectures.build import shrunk_spec
from executor.config import RunConfig, build_schedule
from executor.models import build_model
from pipesim.cli.run_memory import executor_spec, flash_kernel, microbatch_weights, peak_lines
from pipesim.model.activations import layer_stash_bytes
from pipesim.model.saved_tensors import AUTOCAST_TORCH, KERNELS, SavedTensors
from pipesim.model.spec import ModelSpec

pytestmark = pytest.mark.timeout(240)

SIZES = {"layers": 1, "hidden": 32, "heads": 4, "seq_len": 16, "batch_size": 1, "microbatches": 1, "pp": 1}


def measured_block_bytes(config: RunConfig, block: int = 0) -> int:
    """Bytes block ``block`` of ``config``'s model keeps for its backward, counted as
    ``executor.memory`` counts them: each saved storage once, parameters excluded, at its
    size after the forward (``--recompute norm-mla-up`` empties what it rebuilds;
    ``selective`` checkpoints the attention cores, whose insides are not saved)."""
    from executor.recompute import apply_recompute

    model = build_model(config)
    stage = model.build_stage(0, 1)
    apply_recompute(stage, config.recompute, config.recompute_moe_act)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage
        return tensor

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.dtype == "bfloat16")
    with autocast:
        hidden = stage.embed(model.make_batch(0, config.batch_size)[0])
        for before in stage.blocks[:block]:
            hidden = before(hidden)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            stage.blocks[block](hidden)
    return sum(storage.nbytes() for storage in saved.values())


def assert_every_block_as_predicted(config: RunConfig) -> None:
    """Each block of ``config``'s model keeps, under its recompute mode, the bytes the
    model predicts for that layer (flash or written out as the executor runs it)."""
    spec, saved = executor_spec(config)
    for layer in range(spec.layers):
        torch.manual_seed(0)
        predicted = layer_stash_bytes(spec, recompute=config.recompute, layer=layer, saved=saved,
                                      flash_attention=flash_kernel(spec, config))
        assert predicted == measured_block_bytes(config, layer), layer


def test_gpt_block_keeps_what_the_hand_count_says() -> None:
    """The toy gpt's block, h = 32, a = 4 heads, s = 16 tokens, b = 1, float32 (4 bytes).
    Per token, in elements: each LayerNorm's input and its mean and 1/std (2 x (h + 2));
    the QKV input (h); Q, K and V, one packed output (3h); the attention kernel's output,
    which the output projection reads through a view (h); the MLP input (h); GeLU's input
    and output (4h + 4h). That is 16h + 4 = 516. Per token and head, the flash kernel's
    log-sum-exp in fp32: a = 4. Bytes: 16 x 516 x 4 + 16 x 4 x 4 = 33024 + 256 = 33280."""
    config = RunConfig(model="gpt", **SIZES)
    spec, saved = executor_spec(config)
    assert layer_stash_bytes(spec, saved=saved) == 33280
    assert measured_block_bytes(config) == 33280


def test_gpt_block_under_bf16_autocast_keeps_what_the_hand_count_says() -> None:
    """The same block under bf16 autocast over float32 weights. The residual stream and
    the LayerNorms stay float32: each norm's input and statistics, (h + 2) x 4 = 136
    bytes per token, 272 for two. In bf16 (2 bytes): the QKV input's cast (h), Q, K and
    V (3h), the kernel's output (h), the MLP input's cast (h), GeLU's input and output
    (8h): 14h x 2 = 896. The log-sum-exp in fp32: a x 4 = 16. Per token 272 + 896 + 16 =
    1184, 18944 for 16 tokens. Each linear keeps the bf16 copy of its weight it
    multiplied: QKV 3h^2, output h^2, MLP 4h^2 + 4h^2 = 12h^2 = 12288 elements, 24576
    bytes. In all 18944 + 24576 = 43520."""
    config = RunConfig(model="gpt", dtype="bfloat16", **SIZES)
    spec, saved = executor_spec(config)
    assert layer_stash_bytes(spec, saved=saved) == 43520
    assert measured_block_bytes(config) == 43520


def test_llama_block_keeps_what_the_hand_count_says() -> None:
    """llama3-8b shrunk: h = 32, 4 query heads of 8 and 1 key/value head (GQA), SwiGLU
    of f = 112, RMSNorm, rotary positions; s = 16, b = 1, float32. Per token, elements:
    each RMSNorm's input, normalised input and 1/rms (2 x (2h + 1)); the Q/K/V input (h);
    Q, and K and V repeated to the 4 query heads (3h); the kernel's output and the copy
    joining its heads for the output projection (2h); the MLP input (h); w1's and w3's
    outputs, silu's output and the product (4f): 11h + 2 + 4f = 802. Per token, the
    log-sum-exp: a = 4. Per layer, rotary's cos and sin, s x d/2 each: 16 x 8 = 128.
    Bytes: (16 x 802 + 16 x 4 + 128) x 4 = 13024 x 4 = 52096."""
    config = RunConfig(model="llama3-8b", **SIZES)
    spec, saved = executor_spec(config)
    assert (spec.num_kv_heads, spec.ffn, spec.gated_mlp, spec.rms_norm) == (1, 112, True, True)
    assert layer_stash_bytes(spec, saved=saved) == 52096
    assert measured_block_bytes(config) == 52096


def test_mixture_of_experts_block_keeps_what_the_hand_count_says() -> None:
    """mixtral-8x7b shrunk: the llama block above up to the MLP's input (11h + 2 = 354
    elements per token, the log-sum-exp and the rotary tables: 16 x 354 + 64 + 128 =
    5856 elements, 23424 bytes), then a dropless top-2 of 8 SwiGLU experts of f = 112.
    Whatever the routing, 16 tokens x k = 32 routed copies, each keeping its gathered
    input, its expert's output and its weighted output (3h), its expert's 4f and its
    weight (1), in float32: (3 x 32 + 448 + 1) x 4 = 2180 bytes, and its token and slot
    indices (the int64 pair ``nonzero`` returns): 16 bytes, 2196 in all. Per token, the
    router's scores over 8 experts (8 x 4 bytes), its 2 chosen experts (int64: 16), the 2
    gathered weights and their sum (3 x 4): 60 bytes. Mixtral's load-balancing loss (its
    config's 0.02) keeps the sequence's 8 expert shares and the loss: 9 x 4 = 36 bytes.
    In all 23424 + 32 x 2196 + 16 x 60 + 36 = 23424 + 70272 + 960 + 36 = 94692."""
    config = RunConfig(model="mixtral-8x7b", **SIZES)
    spec, saved = executor_spec(config)
    assert spec.moe.experts_per_token == 2 and spec.moe.capacity_factor is None and spec.moe.balance_loss == 0.02
    assert layer_stash_bytes(spec, saved=saved) == 94692
    assert measured_block_bytes(config) == 94692
    without = RunConfig(model="mixtral-8x7b", **SIZES, balance_loss=0.0)
    assert layer_stash_bytes(executor_spec(without)[0], saved=saved) == measured_block_bytes(without) == 94656


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-v2-lite"])
def test_latent_attention_blocks_keep_what_the_model_says(model: str, batch: int, dtype: str) -> None:
    """DeepSeek's blocks shrunk (latent attention, whose Q/K and V head widths differ, so
    torch's CPU attention takes its math path and keeps the s x s softmax; a dense first
    layer, then shared and routed experts: V3's sigmoid router with rescaled weights,
    V2-Lite's softmax without): the model's bytes per layer are what the pack hook
    counts on the real blocks, dense and mixture of experts, for a microbatch of one
    sequence (V a view of the joint K-nope/V projection) and of two (V copied). Under
    bf16 autocast the rotary tables are made in the block input's float32, so the rotated
    Q and K are float32 and the math path keeps Q, K, V and its softmax in float32; the
    two down-projections each keep their own bf16 cast of the input."""
    config = RunConfig(model=model, **{**SIZES, "layers": 2, "batch_size": batch}, dtype=dtype)
    spec, saved = executor_spec(config)
    assert spec.mla is not None and spec.is_moe_layer(1) and not spec.is_moe_layer(0)
    for layer in (0, 1):
        predicted = layer_stash_bytes(spec, layer=layer, saved=saved, flash_attention=flash_kernel(spec, config))
        assert predicted == measured_block_bytes(config, layer)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["mixtral-8x7b", "qwen1.5-moe-a2.7b",
                                   "llama-4-scout"])
def test_mixture_of_experts_blocks_keep_what_the_model_says(model: str, dtype: str) -> None:
    """Mixtures of experts in float32 and under bf16 autocast, two sequences: the model's
    bytes per layer are what the pack hook counts on the real block. Under autocast each
    expert's gate and up projections keep their own bf16 cast of its tokens, as do the
    router, the shared expert's two and its gate; the weighted expert outputs the combine
    keeps, and their weights, are float32 (the combine's type); Qwen1.5-MoE's gated shared
    expert keeps its output and its sigmoid gate; Llama 4 scales each copy in float32
    before its expert, so the scaled copy is float32 and the expert output is not kept."""
    config = RunConfig(model=model, **{**SIZES, "layers": 2, "hidden": 64, "heads": 8, "seq_len": 32,
                                       "batch_size": 2, "experts": 4}, dtype=dtype)
    spec, saved = executor_spec(config)
    layer = next(layer for layer in range(spec.layers) if spec.is_moe_layer(layer))
    torch.manual_seed(0)
    assert layer_stash_bytes(spec, layer=layer, saved=saved) == measured_block_bytes(config, layer)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("model", ["olmoe-1b-7b", "qwen3-30b-a3b", "qwen3-8b", "gpt-oss-20b", "gemma-3-1b",
                                   "gemma-2-9b", "gpt2", "falcon-7b", "llama-4-scout"])
def test_config_file_blocks_keep_what_the_model_says(model: str, batch: int, dtype: str) -> None:
    """Hugging Face families' blocks, one and two sequences, float32 and bf16 autocast,
    every layer: the model's bytes are what the pack hook counts. Under autocast a query
    and key norm's float32 weight makes the rotated Q and K float32, so the rotary tables
    are made float32 (OLMoE, Qwen3, Gemma 3); Gemma's post norms read the sublayers'
    16-bit outputs and keep them in 16 bits, and its offset norms each keep the
    ``1 + weight`` they multiply by; the written-out attention (gpt-oss's sinks, Gemma
    2's soft-capped scores) keeps its boolean mask, and gpt-oss's softmax the sink's
    column; Falcon-7B's one norm output is cast by both sublayers' first linears; GPT-2's
    attention output, laid out token by token, joins its heads without a copy, as does
    Llama 4's in its layers without rotary positions (the fourth), which keep their
    per-position query scales instead of the tables."""
    config = RunConfig(model=f"pipesim/model/data/hf_configs/{model}.json",
                       **{**SIZES, "layers": 4, "hidden": 64, "heads": 8, "seq_len": 32, "batch_size": batch,
                          "experts": 4}, dtype=dtype)
    assert_every_block_as_predicted(config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("model", "batch"), [("deepseek-v3", 1), ("deepseek-v3", 2), ("deepseek-v2-lite", 2),
                                              ("llama3-8b", 2), ("mixtral-8x7b", 2),
                                              ("falcon-7b", 2)])
def test_blocks_under_norm_mla_up_keep_what_the_model_says(model: str, batch: int, dtype: str) -> None:
    """``--recompute norm-mla-up``: every norm's output (Falcon-7B's one norm, read by
    both halves, too) and latent attention's up-projections are dropped after the forward
    and rebuilt before the backward. Under bf16 autocast what their readers made of them
    stays: each linear's own bf16 cast of a norm's output, and the written-out attention's
    products' bf16 casts of the rotated Q and K and of the softmax."""
    config = RunConfig(model=model, **{**SIZES, "layers": 2, "hidden": 64, "heads": 8, "seq_len": 32,
                                       "batch_size": batch, "experts": 4}, dtype=dtype, recompute="norm-mla-up")
    assert_every_block_as_predicted(config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["gpt-oss-20b", "gemma-2-9b", "gemma-3-1b", "llama-3.1-8b", "qwen3-30b-a3b",
                                   "olmoe-1b-7b", "deepseek-v2-lite", "deepseek-v3"])
def test_blocks_under_selective_recompute_keep_what_the_model_says(model: str, dtype: str) -> None:
    """``--recompute selective`` checkpoints every attention core, torch's kernel and the
    executor's written-out one (gpt-oss's sinks, Gemma 2's soft-capped scores) alike: no
    ``s x s`` scores, mask or softmax kept, as the model counts (the written-out core kept
    all three before it was checkpointed too: gemma-2's activations +15.7% over the
    prediction in a run). The checkpoint keeps the kernel's inputs as they come: under
    autocast a query norm's float32 weight makes Q and K float32 (Gemma 3, Qwen3, OLMoE),
    as latent attention's rotary tables do, and latent attention's V is the view of its
    joint K-nope/V up-projection it was handed, not the math path's copy."""
    config = RunConfig(model=f"pipesim/model/data/hf_configs/{model}.json",
                       **{**SIZES, "layers": 2, "hidden": 64, "heads": 8, "seq_len": 32, "batch_size": 2,
                          "experts": 4}, dtype=dtype, recompute="selective")
    assert_every_block_as_predicted(config)


def held_output_grads(config: RunConfig) -> int:
    """Bytes of the gradients a split backward's ``I`` over ``config``'s whole model (one
    stage) keeps for its ``W``, each storage once, as ``executor.memory`` counts them."""
    from executor.memory import storage_key, tensor_bytes
    from executor.split_backward import SplitBackward

    model = build_model(config)
    stage = model.build_stage(0, 1)
    split = SplitBackward(stage)
    tokens, targets = model.make_batch(0, config.batch_size)
    with split.recording() as calls:
        loss = model.loss_sum(stage(tokens), targets)
    _, work = split.input_grad(loss, None, None, calls)
    grads = {storage_key(grad): grad for _, held in work.calls for grad in held if grad is not None}
    return sum(map(tensor_bytes, grads.values()))


def test_the_toy_gpts_i_keeps_11h_a_token_and_layer_for_its_w() -> None:
    """h = 32, s = 16 tokens, vocab 128, 2 layers, float32. Each layer, per token: the two
    LayerNorms' outputs (h each), QKV's (3h), the projection's (h), the MLP's (4h + h):
    11h = 352 elements, 16 x 352 x 4 = 22,528 bytes. The ends: the token embedding's
    output (16 x 32), the learned positions' (16 x 32, one per position), the final
    norm's (16 x 32) and the logits (16 x 128): 3,584 elements, 14,336 bytes. In all
    2 x 22,528 + 14,336 = 59,392."""
    from pipesim.model.activations import end_output_grad_bytes, output_grad_bytes

    config = RunConfig(model="gpt", **{**SIZES, "layers": 2})
    assert held_output_grads(config) == 59392
    spec, saved = executor_spec(config)
    assert output_grad_bytes(spec, saved=saved) == 22528
    assert end_output_grad_bytes(spec, 1, False, True, True, saved) == 14336
    assert output_grad_bytes(spec) == 0  # the kernels' inventory counts them in wgrad_stash_bytes


@pytest.mark.parametrize("model", ["llama3-8b", "mixtral-8x7b", "deepseek-v2-lite", "deepseek-v3"])
def test_what_a_split_backward_holds_for_w_is_what_the_model_counts(model: str) -> None:
    """The architectures' parameter-owning modules (GQA's separate projections, SwiGLU's
    gate and up, the router and each expert over the copies routed to it, the shared
    experts, latent attention's norm over its latents; dense first layers) against the
    model's count, layer by layer as the stage holds them."""
    from pipesim.model.activations import end_output_grad_bytes, output_grad_bytes

    config = RunConfig(model=model, **{**SIZES, "layers": 2, "hidden": 64, "heads": 8})
    spec, saved = executor_spec(config)
    predicted = (sum(output_grad_bytes(spec, saved=saved, layer=layer) for layer in range(spec.layers))
                 + end_output_grad_bytes(spec, 1, False, True, True, saved))
    assert held_output_grads(config) == pytest.approx(predicted, rel=1e-12)


def test_the_default_inventory_is_the_papers() -> None:
    """Without ``saved`` (and with ``KERNELS``) a GPT-3-like layer keeps Korthikanti et
    al.'s ``sbh (34 + 5as/h)`` bytes in 16-bit with dropout and no flash attention."""
    spec = ModelSpec(name="gpt3-like", layers=2, hidden=64, heads=4, seq_len=32, vocab=100, microbatch_size=2)
    paper = 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64)
    assert layer_stash_bytes(spec, flash_attention=False) == paper
    assert layer_stash_bytes(spec, flash_attention=False, saved=KERNELS) == paper


@settings(max_examples=40, deadline=None)
@given(hidden=st.sampled_from([32, 64, 96]), heads=st.sampled_from([1, 2, 4]), kv=st.sampled_from([1, 2]),
       gated=st.booleans(), rms=st.booleans(), learned=st.booleans(), tp=st.sampled_from([1, 2]),
       sequence_parallel=st.booleans(), recompute=st.sampled_from(["none", "selective", "full"]),
       sandwich=st.booleans(), field=st.sampled_from([name for name in SavedTensors.__dataclass_fields__]))
def test_each_saved_tensor_only_adds(hidden, heads, kv, gated, rms, learned, tp, sequence_parallel, recompute,
                                     sandwich, field) -> None:
    """Every field of ``SavedTensors`` adds bytes to the inventory, never takes any away,
    so the default (all off) is the least and ``AUTOCAST_TORCH`` (every field on) the most."""
    kv = min(kv, heads)
    if heads % tp or kv % tp and tp % kv:
        return
    spec = ModelSpec(name="m", layers=2, hidden=hidden, heads=heads, kv_heads=kv, seq_len=16, vocab=64,
                     gated_mlp=gated, rms_norm=rms, learned_positions=learned, dropout=False, dtype_bytes=2,
                     norms_per_layer=4 if sandwich else 2, norm_offset=sandwich and rms)  # Gemma's four norms
    value = 2 if field.endswith("statistics") else 4 if field == "residual_bytes" else True
    one = replace(KERNELS, **{field: value})
    base, added, every = (layer_stash_bytes(spec, tp, sequence_parallel, recompute, saved=saved)
                          for saved in (KERNELS, one, AUTOCAST_TORCH))
    assert base <= added <= every


def launched_cases() -> list[RunConfig]:
    """Two-rank runs covering a schedule's in-flight count, a split backward, selective
    recompute, tp with sequence parallelism and ZeRO-3, in float32, float64 and bf16 autocast,
    and a batch the microbatches do not divide (6 sequences in 4: 2, 2, 1, 1)."""
    gpt = {"model": "gpt", "layers": 4, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64, "batch_size": 8,
           "microbatches": 4, "steps": 2, "optimizer": "adamw"}
    llama = {**gpt, "model": "llama3-8b", "heads": 8}
    return [RunConfig(schedule="gpipe", pp=2, dtype="float64", **gpt),
            RunConfig(schedule="zbv", pp=2, virtual_stages=2, recompute="selective", dtype="bfloat16", **llama),
            RunConfig(schedule="1f1b", pp=1, tp=2, sequence_parallel=True, **llama),
            RunConfig(schedule="1f1b", pp=1, dp=2, zero=3, **gpt),
            RunConfig(schedule="1f1b", pp=2, **{**gpt, "batch_size": 6})]


def test_launched_runs_peak_within_ten_percent_of_the_prediction() -> None:
    from executor.launch import launch
    from executor.report import summary

    configs = launched_cases()
    for config, result in zip(configs, launch(configs), strict=True):
        document = summary(result)
        lines = peak_lines(document, config)
        assert lines[0].startswith("peak memory, measured vs predicted"), lines
        for row in document["memory"]:
            assert abs(row["peak"] / row["predicted_peak"] - 1) < 0.10, (config.schedule, row)
            assert abs(row["activations_peak"] / row["predicted_activations"] - 1) < 0.10, (config.schedule, row)


TIGHT_CASES = {
    # the last stage keeps its own copy of the token table, whole on each tp rank as the table is
    # (the executor splits the blocks only): predicted at half the table before, 2.8% short
    "tied table at tp 2": {"model": "gemma-3-1b", "kv_heads": 2, "tp": 2,
                           "sequence_parallel": True},
    # context parallelism's ring keeps K and V at their own heads, its output in float32, and the query
    # norm's float32 Q and K/V message: counted as torch's kernel keeps them before, activations 2.9% short
    "query norms at cp 2": {"model": "qwen3-8b", "cp": 2},
    # parallel folding: each tp rank routes its own sequence shard, and keeps what routing keeps for
    # the shard's tokens (predicted for the whole sequence before: 5.7% high on the peak, 14% on the
    # activations)
    "folded experts route their shard": {"model": "qwen3-30b-a3b", "experts": 8, "kv_heads": 2, "tp": 2,
                                         "sequence_parallel": True, "etp": 1},
}

# Expert parallelism, predicted at the run's own routing (pipesim.cli.run_memory.routed_peaks): the
# dispatch's float32 rows and each rank's own experts' weight casts (predicted with every expert's
# weight casts and none of the dispatch's before, 10% high on Mixtral's peak; now within 0.4% on the
# peak and 2.3% on the activations). Folded at ep 2 under sequence parallelism the dispatched rows are
# bf16, so the expert outputs index_copy keeps are too (counted as float32 before: 2.6-3.8% high on the
# peak, 6% on the activations; now within 0.7%).
EP_CASES = {
    "experts at ep 2": ({"model": "mixtral-8x7b", "experts": 4, "kv_heads": 2, "dp": 2, "ep": 2}, 0.03),
    "folded experts at ep 2": ({"model": "qwen3-30b-a3b", "experts": 8, "kv_heads": 2, "tp": 2,
                                "sequence_parallel": True, "etp": 1, "ep": 2}, 0.01),
}


@pytest.mark.parametrize("case", list(EP_CASES))
def test_launched_expert_parallel_runs_peak_as_predicted_at_their_routing(case: str) -> None:
    """Shrunk mixtures of experts at ep 2, pp 2 under bf16 autocast, 4 gloo ranks: every
    rank's peak and activations within the case's tolerance of the prediction at the
    run's own routing, which the run counted (``routed_rows``)."""
    fields, tolerance = EP_CASES[case]
    document = assert_launched_peaks_within(RunConfig(**TIGHT_RUN, **fields), tolerance)
    assert all("routed_rows" in row and "predicted_peak_balanced" in row for row in document["memory"])


@pytest.mark.parametrize("case", list(TIGHT_CASES))
def test_launched_runs_peak_within_one_percent(case: str) -> None:
    """Shrunk config.json models at pp 2 under bf16 autocast, 4 gloo ranks: every rank's
    peak and activations within 1% of the prediction."""
    assert_launched_peaks_within(RunConfig(**TIGHT_RUN, **TIGHT_CASES[case]), 0.01)


# the launched runs held within 1%: 4 layers of 64 at pp 2, bf16 autocast, AdamW, 2 steps
TIGHT_RUN = {"layers": 4, "hidden": 64, "heads": 8, "seq_len": 32, "vocab": 128, "batch_size": 8, "microbatches": 4,
             "pp": 2, "dtype": "bfloat16", "steps": 2, "optimizer": "adamw"}


def assert_launched_peaks_within(config: RunConfig, tolerance: float) -> dict:
    """Launch ``config``; every rank's measured peak and most activations at once within
    ``tolerance`` of the prediction (``pipesim.cli.run_memory``)."""
    from executor.launch import launch
    from executor.report import summary

    (result,) = launch([config])
    document = summary(result)
    peak_lines(document, config)
    for row in document["memory"]:
        assert abs(row["peak"] / row["predicted_peak"] - 1) < tolerance, row
        assert abs(row["activations_peak"] / row["predicted_activations"] - 1) < tolerance, row
    return document


def test_what_has_no_spec_is_said_not_predicted() -> None:
    rows = {"memory": [{"rank": 0, "source": "tracked", "peak": 1.0}]}
    assert peak_lines(rows, RunConfig(model="mlp")) == [
        "peak memory not predicted: --model mlp has no transformer spec"]
    assert peak_lines(rows, RunConfig(model="gpt", dtype="float16")) == [
        "peak memory not predicted: float16 autocast is not described"]

def test_the_runs_dtype_and_microbatch_make_the_spec() -> None:
    """The preset keeps 16-bit; the run's spec takes its own element size,
    its microbatch (the replica's batch over the microbatches) and no dropout."""
    config = RunConfig(model="llama3-8b", **{**SIZES, "batch_size": 8, "microbatches": 2, "dp": 2}, dtype="float64")
    assert shrunk_spec(config).dtype_bytes == 2
    spec, _ = executor_spec(config)
    assert (spec.dtype_bytes, spec.microbatch_size, spec.dropout) == (8, 2, False)


def test_a_batch_the_microbatches_do_not_divide_is_predicted_at_its_largest_microbatch() -> None:
    """6 sequences in 4 microbatches run as torch.tensor_split cuts them, 2, 2, 1, 1: the
    two in flight at 1F1B's peak hold two sequences each, so the spec's microbatch is 2,
    not 6 // 4 = 1 (which predicted half the activations a run measured)."""
    config = RunConfig(model="gpt", **{**SIZES, "batch_size": 6, "microbatches": 4, "pp": 2, "layers": 2})
    assert [len(part) for part in torch.tensor_split(torch.arange(6), 4)] == [2, 2, 1, 1]
    assert executor_spec(config)[0].microbatch_size == 2
    # and each microbatch's stash scaled to its own size: 2, 2, 1, 1 of the spec's 2
    weight = microbatch_weights(config, build_schedule(config))
    assert weight(np.array([0, 0, 1, 1]), np.array([0, 1, 2, 3])).tolist() == [1.0, 1.0, 0.5, 0.5]


def test_dualpipes_copies_take_their_own_share_of_the_microbatches_sizes() -> None:
    """DualPipe at pp 2, 8 microbatches of a batch of 17 (3, 2, 2, 2, 2, 2, 2, 2): copy 0's
    stages take microbatches 0-3, copy 1's 4-7 (executor.copies.data_index), so only copy
    0's first keeps a stash of 3 sequences."""
    config = RunConfig(schedule="dualpipe", model="gpt", **{**SIZES, "batch_size": 17, "microbatches": 8, "pp": 2,
                                                           "layers": 3, "virtual_stages": 2})
    schedule = build_schedule(config)
    weight = microbatch_weights(config, schedule)
    copy_one = schedule.copy_stages  # the first stage of copy 1
    assert weight(np.array([0, 0, copy_one, copy_one]), np.array([0, 1, 0, 3])).tolist() == [1.0, 2 / 3, 2 / 3, 2 / 3]


def test_run_prints_and_writes_the_prediction_beside_the_measurement(tmp_path, capsys) -> None:
    """One process (pp 1): the summary line and the ``--json`` row carry the predicted
    peak and activations beside the measured ones, within 10%."""
    import json

    from pipesim.cli import main

    path = tmp_path / "run.json"
    assert main(["run", "--pp", "1", "--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4",
                 "--seq-len", "16", "--vocab", "64", "--batch-size", "4", "-m", "2", "--steps", "2",
                 "--optimizer", "adamw", "--quiet", "--json", str(path)]) == 0
    assert "peak memory, measured vs predicted" in capsys.readouterr().out
    (row,) = json.loads(path.read_text())["memory"]
    assert abs(row["peak"] / row["predicted_peak"] - 1) < 0.10
    assert abs(row["activations_peak"] / row["predicted_activations"] - 1) < 0.10
