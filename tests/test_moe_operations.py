"""Mixture-of-experts and latent-attention layers as the compute model times them: the
GEMM shapes written out by hand from the public configs, the routed experts' tile and
wave quantisation worked by hand on a small GPU, the timed GEMMs covering exactly the
weights counted as parameters (total, active, per tensor-parallel rank), and --mfu
still one efficiency for every kernel of such a layer.

Shapes by hand, tokens T = b s, tp t, k experts per token of E:
- Mixtral-8x7B (h 4096, 32 heads of 128, 8 kv heads, 8 experts of 14336, top 2): QKV
  ``T x 4096 . 4096 x (4096 + 2 x 1024)/t``; router ``T x 4096 . 4096 x 8`` (on T/t tokens
  with sequence parallelism); each of the 8 experts gate and up fused ``T k/E x 4096 .
  4096 x 2 x 14336/t`` and down ``T k/E x 14336/t . 14336/t x 4096``.
- DeepSeek-V3 (h 7168, 128 heads, q rank 1536, kv rank 512, qk 128 + 64, v 128; 256
  experts of 2048 top 8 + 1 shared): query down ``h -> 1536`` and key-value down
  ``h -> 512 + 64`` whole on every rank, query up ``1536 -> 128 x 192 / t``, key-value up
  ``512 -> 128 x 256 / t``, output ``128 x 128 / t -> h``; attention with queries and keys
  of 192 and values of 128.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipesim.cli import main
from pipesim.model.compute_model import FixedEfficiency
from pipesim.model.gemm_model import GemmModel
from pipesim.model.layout import tp_problem
from pipesim.model.operations import Gemm, layer_operations
from pipesim.model.spec import BUNDLED_CONFIGS, PRESETS, load_model, model_spec
from pipesim.model.transformer_costs import layer_time, model_costs
from pipesim.model.weights import layer_weights, norm_params, shard

CONFIGS = BUNDLED_CONFIGS


def by_name(operations) -> dict:
    return {operation.name: operation for operation in operations}


def shape(gemm: Gemm) -> tuple:
    return gemm.m, gemm.k, gemm.n, gemm.count


def test_mixtral_layer_gemm_shapes_by_hand():
    """b 2, s 4096 (T 8192), tp 2 with sequence parallelism: each expert gets
    8192 x 2 / 8 = 2048 rows, 2560 with a capacity factor of 1.25."""
    spec = model_spec("mixtral-8x7b", microbatch_size=2, seq_len=4096)
    ops = by_name(layer_operations(spec, tp=2, sequence_parallel=True))
    assert shape(ops["qkv"]) == (8192, 4096, (4096 + 2 * 1024) // 2, 1)
    assert shape(ops["attention_out"]) == (8192, 2048, 4096, 1)
    assert shape(ops["router"]) == (4096, 4096, 8, 1)  # the rank's half of the sequence
    assert shape(ops["expert_in"]) == (2048, 4096, 14336, 8)
    assert shape(ops["expert_out"]) == (2048, 7168, 4096, 8)
    assert "mlp_in" not in ops and "shared_expert_in" not in ops
    padded = by_name(layer_operations(spec.with_capacity_factor(1.25), tp=2, sequence_parallel=True))
    assert padded["expert_in"].m == padded["expert_out"].m == 2560
    unpadded = by_name(layer_operations(spec.with_capacity_factor(1.25), tp=2, padded=False))
    assert unpadded["expert_in"].m == 2048
    # without sequence parallelism every rank routes all of the microbatch
    assert by_name(layer_operations(spec, tp=2))["router"].m == 8192


def test_token_permutations_by_hand():
    """Megatron-Core's all-to-all dispatcher copies, in bytes, worked by hand for Mixtral
    (h 4096, top 2 of 8, BF16), b 2 s 4096 (T 8192): permutation 1 reads and writes the
    T k routed rows, unpermutation 1 reads them and writes T rows; with ep 2 (4 experts a
    rank, tokens received from the other) the sort and unsort after and before the
    all-to-alls read and write T k rows each; a dense layer has none."""
    spec = model_spec("mixtral-8x7b", microbatch_size=2, seq_len=4096)
    row = 4096 * 2
    alone = by_name(layer_operations(spec))["token_permutations"]
    assert alone.bytes == (2 * 2 * 8192 + (2 * 8192 + 8192)) * row
    over_two = by_name(layer_operations(spec, ep=2))["token_permutations"]
    assert over_two.bytes == alone.bytes + 2 * (2 * 2 * 8192) * row
    # sequence parallelism over tp 2: the rank's own 4096 tokens permuted, every token's copies sorted
    sharded = by_name(layer_operations(spec, tp=2, sequence_parallel=True))["token_permutations"]
    assert sharded.bytes == (2 * 2 * 4096 + (2 * 4096 + 4096)) * row + 2 * (2 * 2 * 8192) * row
    # one expert a rank (8 experts over ep 8): nothing to sort
    assert by_name(layer_operations(spec, ep=8))["token_permutations"].bytes == alone.bytes
    # a capacity factor pads the copies as it pads the experts' rows
    padded = by_name(layer_operations(spec.with_capacity_factor(1.25)))["token_permutations"]
    assert padded.bytes == (2 * 2.5 * 8192 + (2.5 * 8192 + 8192)) * row
    dense = layer_operations(model_spec("llama3-8b"))
    assert "token_permutations" not in by_name(dense)


LAYER_TABLE = (  # docs/cluster-model.md's table of one layer's times: (its row's label, model, sequences, layer)
    ("Llama 3 8B (T 8192), dense", "llama3-8b", 1, 8192, 0),
    ("Mixtral-8x7B (T 8192), 8 experts of 2048 rows", "mixtral-8x7b", 2, 4096, 0),
    ("DeepSeek-V3 (T 4096), dense layer 0", "deepseek-v3", 1, 4096, 0),
    ("DeepSeek-V3 (T 4096), MoE layer: 256 experts of 128 rows", "deepseek-v3", 1, 4096, 3),
)


@pytest.mark.parametrize(("label", "model", "sequences", "seq_len", "layer"), LAYER_TABLE)
def test_the_docs_layer_table_is_what_the_compute_model_gives(label, model, sequences, seq_len, layer):
    """docs/cluster-model.md's H100 table (tp 8, sequence parallel, flash): each row's
    forward, backward (of which W) and forward TFLOP/s as ``layer_time`` gives them now."""
    from pipesim.hardware.gpus import gpu_spec
    from pipesim.model.compute_model import stage_compute_model

    h100 = gpu_spec("h100")
    compute = stage_compute_model(h100.bf16_flops, h100.memory_bandwidth, "h100")
    spec = model_spec(model, microbatch_size=sequences, seq_len=seq_len)
    time = layer_time(spec, 8, True, True, "none", compute, layer)
    flops = sum(operation.flops for operation in layer_operations(spec, 8, True, True, layer))
    row = (f"| {label} | {time.forward * 1e3:.3f} ms | {(time.input_grad + time.weight_grad) * 1e3:.3f} "
           f"({time.weight_grad * 1e3:.3f}) ms | {flops / time.forward / 1e12:.0f} |")
    docs = (Path(__file__).resolve().parents[1] / "docs" / "cluster-model.md").read_text()
    assert row in docs, row


def test_deepseek_v3_layer_gemm_shapes_by_hand():
    """b 1, s 4096, tp 8 with sequence parallelism. Layer 0 is dense (18432 wide), layer 3
    has 256 experts of 128 rows each (4096 x 8 / 256) and the shared expert on every token."""
    spec = model_spec("deepseek-v3")
    dense = by_name(layer_operations(spec, tp=8, sequence_parallel=True, layer=0))
    moe = by_name(layer_operations(spec, tp=8, sequence_parallel=True, layer=3))
    for ops in (dense, moe):
        assert shape(ops["query_down"]) == (512, 7168, 1536, 1)
        assert shape(ops["query_up"]) == (4096, 1536, 128 * 192 // 8, 1)
        assert shape(ops["kv_down"]) == (512, 7168, 512 + 64, 1)
        assert shape(ops["kv_up"]) == (4096, 512, 128 * 256 // 8, 1)
        assert shape(ops["attention_out"]) == (4096, 128 * 128 // 8, 7168, 1)
        attention = ops["attention"]
        assert (attention.heads, attention.head_dim, attention.value_dim) == (16, 192, 128)
        assert attention.flops == 2 * 16 * 4096 * 4096 * (192 + 128)
    assert shape(dense["mlp_in"]) == (4096, 7168, 2 * 18432 // 8, 1)
    assert shape(dense["mlp_out"]) == (4096, 18432 // 8, 7168, 1)
    assert "router" not in dense
    assert shape(moe["router"]) == (512, 7168, 256, 1)
    assert shape(moe["expert_in"]) == (128, 7168, 2 * 2048 // 8, 256)
    assert shape(moe["expert_out"]) == (128, 2048 // 8, 7168, 256)
    assert shape(moe["shared_expert_in"]) == (4096, 7168, 2 * 2048 // 8, 1)
    assert shape(moe["shared_expert_out"]) == (4096, 2048 // 8, 7168, 1)
    # without flash attention: QK^T over 192-wide heads, PV over 128-wide values
    plain = by_name(layer_operations(spec, tp=8, flash_attention=False, layer=3))
    assert shape(plain["scores"]) == (4096, 192, 4096, 16)
    assert shape(plain["context"]) == (4096, 4096, 128, 16)


# 4 SMs of 1 TFLOP/s each, nothing but tiles: times are waves x tile FLOPs per SM
FOUR_SMS = GemmModel(peak_flops=4e12, memory_bandwidth=math.inf, sms=4, efficiency=1.0, k_overhead=0.0,
                     launch_seconds=0.0)


def test_routed_experts_pay_tile_quantisation_per_expert():
    """Mixtral with 520 tokens: each of the 8 experts gets 520 x 2 / 8 = 130 rows of the
    4096 x 28672 gate-and-up GEMM. The best tiling pads 130 rows to 192 (three 64-row
    tiles; 128-row tiles would pad to 256): 8 experts x 3 x 28672/64 = 10752 tiles of
    64 x 64, 2688 waves on 4 SMs, each 2 x 64 x 64 x 4096 FLOPs at 1 TFLOP/s per SM. The
    same FLOPs as one dense GEMM of 1040 rows pad to 1088 (17 x 64): 7616 tiles, 1904
    waves. The experts take 2688 / 1904 = 1.41x as long."""
    spec = model_spec("mixtral-8x7b", seq_len=520)
    expert_in = by_name(layer_operations(spec))["expert_in"]
    assert shape(expert_in) == (130, 4096, 28672, 8)
    tile = 2 * 64 * 64 * 4096 / 1e12
    experts = FOUR_SMS.seconds(expert_in.m, expert_in.k, expert_in.n, expert_in.count)
    assert experts == pytest.approx(2688 * tile)
    dense = FOUR_SMS.seconds(1040, 4096, 28672)
    assert dense == pytest.approx(1904 * tile)
    assert experts / dense == pytest.approx(2688 / 1904)


ALL_MODELS = [*PRESETS, *(str(path) for path in sorted(CONFIGS.glob("*.json")))]


def layer_kinds(spec) -> list[int]:
    return sorted({layer for layer, _ in spec.layer_groups()})


def biases_and_norms(spec, layer: int, tp: int, active: bool = False) -> int:
    """Parameters no GEMM multiplies by: the biases of the columns a rank computes and the
    layer's norms (whole on every rank)."""
    top_k = spec.moe.experts_per_token if spec.moe else 0
    biases = sum((top_k if active and weight.routed else weight.stack) * shard(weight, spec, tp)[1]
                 for weight in layer_weights(spec, spec.is_moe_layer(layer)) if weight.bias)
    return biases + norm_params(spec)


@pytest.mark.parametrize("name", ALL_MODELS, ids=lambda name: Path(name).stem)
def test_timed_gemms_cover_exactly_the_weights_counted_as_parameters(name):
    """Every weight matrix counted as a parameter is the k x n operand of one timed GEMM,
    and nothing else is: summed over a layer's weighted GEMMs, k x n x count is the total
    parameter count less biases and norms (every expert); their FLOPs at the unpadded
    rows over 2T are the active count less biases and norms (top-k experts). Per tp rank
    too, where every tp divides the model (replicated key-value heads included)."""
    spec = load_model(name)
    tps = [tp for tp in (1, 2, 8, 16) if not tp_problem(spec, tp)]
    for layer in layer_kinds(spec):
        for tp in tps:
            gemms = [op for op in layer_operations(spec, tp, layer=layer) if isinstance(op, Gemm) and op.weighted]
            held = sum(gemm.k * gemm.n * gemm.count for gemm in gemms)
            assert held + biases_and_norms(spec, layer, tp) == spec.layer_params(layer, tp), (name, layer, tp)
        gemms = [op for op in layer_operations(spec, layer=layer, padded=False)
                 if isinstance(op, Gemm) and op.weighted]
        used = sum(gemm.flops for gemm in gemms) / (2 * spec.tokens)
        assert used + biases_and_norms(spec, layer, 1, active=True) == pytest.approx(
            spec.layer_active_params(layer), abs=1e-6), (name, layer)


@pytest.mark.parametrize("name", ALL_MODELS, ids=lambda name: Path(name).stem)
def test_fused_matrices_share_their_input(name):
    """Matrices computed as one GEMM read one input: same rows in, same stack, routed alike."""
    spec = load_model(name)
    for layer in layer_kinds(spec):
        fused: dict[str, list] = {}
        for weight in layer_weights(spec, spec.is_moe_layer(layer)):
            fused.setdefault(weight.gemm, []).append(weight)
        for members in fused.values():
            assert len({(weight.fan_in, weight.stack, weight.routed, weight.split == "whole")
                        for weight in members}) == 1, members


def test_model_flops_are_the_operations_flops():
    """MFU's numerator and the timed operations are one description: a layer's model FLOPs
    are its operations' FLOPs with unpadded experts (DeepSeek-V3, a capacity factor set)."""
    spec = model_spec("deepseek-v3").with_capacity_factor(1.5)
    for layer in (0, 3):
        operations = layer_operations(spec, layer=layer, padded=False)
        assert spec.layer_flops(layer, padded=False) == pytest.approx(sum(op.flops for op in operations))
    padded = sum(op.flops for op in layer_operations(spec, layer=3))
    routed = 2 * spec.tokens * 8 * 3 * 7168 * 2048  # k = 8 experts of 3 matrices 7168 x 2048
    assert padded - spec.layer_flops(3, padded=False) == pytest.approx(0.5 * routed)


def test_mfu_prices_a_moe_layer_at_one_efficiency():
    """With --mfu every GEMM and attention kernel of a mixture-of-experts layer runs at
    that fraction of peak whatever its shape: forward = padded FLOPs / (peak x mfu),
    backward twice that (memory-bound kernels left out with infinite HBM)."""
    spec = model_spec("mixtral-8x7b").with_capacity_factor(1.25)
    fixed = FixedEfficiency(989e12, 0.4, math.inf)
    time = layer_time(spec, 2, False, True, "none", fixed)
    flops = spec.layer_flops(0, tp=2)
    assert time.forward == pytest.approx(flops / (989e12 * 0.4))
    assert time.input_grad + time.weight_grad == pytest.approx(2 * flops / (989e12 * 0.4))
    costs = model_costs(spec, 4, [989e12] * 4, tp=2, mfu=0.4, fallback_memory_bandwidth=math.inf)
    assert costs.stages[1].fwd == pytest.approx(8 * flops / (989e12 * 0.4))
    kernel = model_costs(spec, 4, [989e12] * 4, tp=2, fallback_gpu="h100")
    assert kernel.stages[1].fwd != costs.stages[1].fwd


def test_simulate_times_a_moe_model_by_the_compute_model(tmp_path, capsys):
    """Without --mfu, simulate names the GPU's kernel model and reports FLOPs from the
    active parameters: MFU = 3 x model FLOPs per token x tokens/s / (GPUs x peak)."""
    out = tmp_path / "r.json"
    assert main(["simulate", "--model", "deepseek-v2-lite", "--pp", "3", "-m", "3", "--gpu", "h100",
                 "--attention-flops", "whole", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    model = document["model"]
    assert model["compute_model"] == ["h100 (H200 kernel measurements)"]
    assert document["mfu"] == pytest.approx(
        model["flops_per_token"] * document["tokens_per_second"] / (3 * 989e12))
    assert "compute timed by: h100" in capsys.readouterr().out
