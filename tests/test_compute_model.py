"""The compute model: a layer's operations by shape, GEMMs with tile and wave
quantisation, flash attention from measured throughput, the built-in GPU models, the
compute-model file, and ``--mfu`` as the override it was.

Expected values are closed forms written out by hand, the H200 measurements shipped in
pipesim/model/data (another implementation: the hardware), or published figures."""

from __future__ import annotations

import csv
import json
import math
import statistics
from importlib import resources

import pytest

from pipesim.cli import main
from pipesim.model.attention_model import AttentionTable, AttentionTiming, read_attention_csv
from pipesim.model.compute_model import (
    H200_GEMM_FIT,
    ComputeModelError,
    FixedEfficiency,
    gpu_compute_model,
    load_compute_model,
    measured_attention,
)
from pipesim.model.gemm_model import GemmFitError, GemmModel, GemmTiming, backward_shapes, fit_gemm_model
from pipesim.model.operations import FlashAttention, Gemm, head_operations, layer_operations
from pipesim.model.spec import model_spec
from pipesim.model.transformer_costs import layer_time, model_costs


def data_file(name: str):
    return resources.files("pipesim.model") / "data" / name


def h200_gemm_rows() -> list[dict]:
    with resources.as_file(data_file("h200_gemm_bf16.csv")) as path, open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def shape(row: dict) -> tuple[int, int, int]:
    return int(row["m"]), int(row["k"]), int(row["n"])


# ------------------------------------------------------------------------------------------
# operations


@pytest.mark.parametrize("name", ["gpt3-13b", "llama3-70b", "llama3-405b"])
@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("flash", [True, False])
def test_a_layers_operations_add_up_to_its_flops(name, tp, flash):
    """QKV 2sbh(h + 2k), output 2sbh^2, MLP 2sbhf per matrix, attention core 4s^2bh: the
    operations' FLOPs are the layer's, one tp rank's share, with and without flash."""
    spec = model_spec(name)
    s, b, h, f = spec.seq_len, spec.microbatch_size, spec.hidden, spec.ffn
    k = spec.num_kv_heads * h // spec.heads
    matrices = 3 if spec.gated_mlp else 2
    by_hand = 2 * s * b * (h * (h + 2 * k) + h * h + matrices * h * f) + 4 * s * s * b * h
    operations = layer_operations(spec, tp, flash_attention=flash)
    assert sum(op.flops for op in operations) == pytest.approx(by_hand / tp)
    core = [op for op in operations if op.attention_core and op.flops]
    assert sum(op.flops for op in core) == pytest.approx(4 * s * s * b * h / tp)
    assert all(isinstance(op, FlashAttention) for op in core) == flash
    logits, loss = head_operations(spec, tp)
    assert loss.flops == 0  # the cross entropy moves bytes (tests/test_cross_entropy.py)
    assert logits.flops == pytest.approx(2 * s * b * h * spec.vocab / tp)


def test_gpt3_layer_gemm_shapes_are_megatrons_split():
    """GPT-3 175B at tp 8, 2048 tokens: QKV 12288 -> 3 x 12288 / 8 columns, the output
    projection 12288 / 8 -> 12288 rows, the MLP 12288 -> 49152 / 8 -> 12288."""
    operations = {op.name: op for op in layer_operations(model_spec("gpt3-175b"), 8, flash_attention=False)}
    assert (operations["qkv"].m, operations["qkv"].k, operations["qkv"].n) == (2048, 12288, 4608)
    assert (operations["attention_out"].k, operations["attention_out"].n) == (1536, 12288)
    assert (operations["mlp_in"].k, operations["mlp_in"].n) == (12288, 6144)
    assert (operations["mlp_out"].k, operations["mlp_out"].n) == (6144, 12288)
    # without flash: per head (96 / 8 = 12 on a rank) QK^T is 2048 x 128 by 128 x 2048, PV 2048 x 2048 by 2048 x 128
    scores, context = operations["scores"], operations["context"]
    assert (scores.m, scores.k, scores.n, scores.count, scores.weighted) == (2048, 128, 2048, 12, False)
    assert (context.m, context.k, context.n, context.count) == (2048, 2048, 128, 12)


# ------------------------------------------------------------------------------------------
# GEMMs by shape

FOUR_SMS = GemmModel(peak_flops=4e12, memory_bandwidth=math.inf, sms=4, efficiency=1.0, k_overhead=0.0,
                     launch_seconds=0.0)


def test_tile_and_wave_quantisation_by_hand():
    """4 SMs of 1 TFLOP/s. 256 x 256 fills four 128 x 128 tiles: one wave, 2*128*128*k FLOPs
    per SM. One more row (257) and every tiling pads: 64 x 64 tiles are best, 5 x 4 = 20
    tiles in 5 waves of 2*64*64*k = 40960k FLOPs (256 x 128: 4 tiles, one wave of 65536k;
    128 x 64: 12 tiles, 3 waves of 16384k = 49152k): 25% longer for 0.4% more work."""
    k = 1024
    assert FOUR_SMS.seconds(256, k, 256) == pytest.approx(2 * 128 * 128 * k / 1e12)
    assert FOUR_SMS.seconds(257, k, 256) == pytest.approx(5 * 2 * 64 * 64 * k / 1e12)
    # a batch of 3 fills 12 tiles of 128 x 128: 3 waves
    assert FOUR_SMS.seconds(256, k, 256, count=3) == pytest.approx(3 * 2 * 128 * 128 * k / 1e12)


def test_short_k_memory_and_launch_floors():
    slow = GemmModel(4e12, 1e9, 4, efficiency=0.5, k_overhead=64.0, launch_seconds=0.0)
    # k overhead and efficiency: (k + 64) / 0.5
    fast_memory = GemmModel(4e12, math.inf, 4, efficiency=0.5, k_overhead=64.0, launch_seconds=0.0)
    assert fast_memory.seconds(256, 192, 256) == pytest.approx(2 * 128 * 128 * (192 + 64) / 0.5 / 1e12)
    # at 1 GB/s (x 0.85 streaming efficiency) reading A, B and writing C in bf16 takes longer
    bytes_moved = 2 * (256 * 192 + 192 * 256 + 256 * 256)
    assert slow.seconds(256, 192, 256) == pytest.approx(bytes_moved / 0.85e9)
    floored = GemmModel(4e12, math.inf, 4, 1.0, 0.0, launch_seconds=1.0)
    assert floored.seconds(256, 192, 256) == 1.0


def test_fit_recovers_a_known_model():
    """Timings made by a known model (forward and backward of a spread of shapes) give
    that model back."""
    truth = GemmModel(989e12, 3.35e12, 132, efficiency=0.61, k_overhead=160.0, launch_seconds=8e-6)
    timings = []
    for m in (512, 2048, 8192):
        for k in (256, 1024, 4096, 16384):
            for n in (768, 4096, 12288):
                timings.append(GemmTiming(((m, k, n),), truth.seconds(m, k, n)))
                timings.append(GemmTiming(backward_shapes(m, k, n),
                                          sum(truth.seconds(*part) for part in backward_shapes(m, k, n))))
    fitted = fit_gemm_model(timings, 989e12, 3.35e12, 132)
    assert fitted.k_overhead == 160.0
    assert fitted.efficiency == pytest.approx(0.61, rel=2e-3)
    assert fitted.launch_seconds == pytest.approx(8e-6)


def test_fit_refuses_timings_that_only_show_the_launch():
    timings = [GemmTiming(((64, 64, 64),), 10e-6), GemmTiming(((128, 64, 64),), 11e-6)]
    with pytest.raises(GemmFitError, match="launch floor"):
        fit_gemm_model(timings, 1e12, 1e12, 4)
    with pytest.raises(GemmFitError, match="positive number of seconds"):
        fit_gemm_model([GemmTiming(((64, 64, 64),), float("nan"))], 1e12, 1e12, 4)


def h200_timings() -> list[GemmTiming]:
    timings = []
    for row in h200_gemm_rows():
        timings.append(GemmTiming((shape(row),), float(row["fwd_s"])))
        timings.append(GemmTiming(backward_shapes(*shape(row)), float(row["bwd_s"])))
    return timings


def test_the_h200_figures_are_the_fit_of_the_shipped_measurements():
    """H200_GEMM_FIT is written once in the code; it must be what fit_gemm_model makes of
    data/h200_gemm_bf16.csv on the H200's datasheet figures (989 TFLOP/s, 4.8 TB/s, 132 SMs)."""
    fitted = fit_gemm_model(h200_timings(), 989e12, 4.8e12, 132)
    assert fitted.efficiency == pytest.approx(H200_GEMM_FIT["efficiency"], abs=1e-4)
    assert fitted.k_overhead == H200_GEMM_FIT["k_overhead"]
    assert fitted.launch_seconds == pytest.approx(H200_GEMM_FIT["launch_seconds"], rel=1e-3)


def test_the_h200_model_predicts_the_measured_gemms():
    """Against the measurements (forward and backward of 336 layer GEMMs): the kernel-bound
    ones (3 launch floors or longer) within a 3% median, none off by more than 26%."""
    model = gpu_compute_model("h200").gemm
    errors = []
    for timing in h200_timings():
        if timing.seconds >= 3 * model.launch_seconds * len(timing.shapes):
            predicted = sum(model.seconds(*part) for part in timing.shapes)
            errors.append(abs(predicted / timing.seconds - 1))
    assert len(errors) > 450
    assert statistics.median(errors) < 0.03
    assert max(errors) < 0.26


def test_sharded_gemms_lose_efficiency_as_measured():
    """The issue's example: a layer's forward GEMMs at h 1024 and 2048 tokens measured 340,
    214, 109 and 54 TFLOP/s at tp 1, 2, 4, 8; at h 12288 they stay at 648-693. The model
    keeps both shapes of it: the h 1024 layer falls fivefold or more from tp 1 to tp 8,
    each within 45% of the measurement (these kernels run 30-45 us, near the launch floor,
    where the model is weakest); the h 12288 layer stays within 5%."""
    model = gpu_compute_model("h200").gemm
    rows = h200_gemm_rows()

    def throughput(hidden: str, tp: str, seconds) -> float:
        chosen = [row for row in rows if row["h"] == hidden and row["tp"] == tp and row["tokens"] == "2048"]
        return sum(2 * math.prod(shape(row)) for row in chosen) / sum(seconds(row) for row in chosen)

    predicted = {}
    for hidden in ("1024", "12288"):
        for tp in ("1", "2", "4", "8"):
            predicted[hidden, tp] = throughput(hidden, tp, lambda row: model.seconds(*shape(row)))
            measured = throughput(hidden, tp, lambda row: float(row["fwd_s"]))
            assert predicted[hidden, tp] == pytest.approx(measured, rel=0.45 if hidden == "1024" else 0.05)
    assert predicted["1024", "1"] > 5 * predicted["1024", "8"]
    assert predicted["12288", "8"] > 0.95 * predicted["12288", "1"]


# ------------------------------------------------------------------------------------------
# attention


def test_attention_at_a_measured_shape_is_the_measurement():
    """seq 8192, 16 heads of 128, batch 1: forward 0.532 ms, forward + backward 1.974 ms
    in data/h200_attention_bf16.csv."""
    with resources.as_file(data_file("h200_attention_bf16.csv")) as path, open(path, newline="") as handle:
        row = next(row for row in csv.DictReader(handle) if row["seq"] == "8192" and row["heads"] == "16")
    forward, backward = measured_attention().seconds(FlashAttention("attention", 1, 16, 8192, 128))
    assert forward == pytest.approx(float(row["fwd_s"]))
    assert forward + backward == pytest.approx(float(row["fwd_bwd_s"]))


def test_attention_between_and_beyond_the_grid():
    table = measured_attention()
    low = table.seconds(FlashAttention("a", 1, 16, 4096, 128))[0]
    high = table.seconds(FlashAttention("a", 1, 16, 8192, 128))[0]
    middle = table.seconds(FlashAttention("a", 1, 16, 5793, 128))[0]
    assert low < middle < high
    # beyond the largest sequence the throughput holds: the time grows with the causal work, s^2
    longer = table.seconds(FlashAttention("a", 1, 16, 16384, 128))[0]
    assert longer == pytest.approx(4 * high)
    # two sequences of 16 heads are the work in flight of one of 32 heads
    assert table.seconds(FlashAttention("a", 2, 16, 8192, 128)) == pytest.approx(
        table.seconds(FlashAttention("a", 1, 32, 8192, 128)))
    # without the causal mask the kernel does the whole square
    full = table.seconds(FlashAttention("a", 1, 16, 8192, 128, causal=False))[0]
    assert full == pytest.approx(2 * high)


def test_attention_timings_must_cover_a_grid():
    timings = [AttentionTiming(1024, 8, 128, 1, 1e-4, 4e-4), AttentionTiming(2048, 8, 128, 1, 3e-4, 1e-3),
               AttentionTiming(1024, 16, 128, 1, 2e-4, 7e-4)]
    with pytest.raises(ValueError, match="missing seq 2048 with 16 heads"):
        AttentionTable.from_timings(timings)
    with pytest.raises(ValueError, match="below forward"):
        AttentionTable.from_timings([AttentionTiming(1024, 8, 128, 1, 5e-4, 4e-4)])


def test_the_shipped_attention_table_reads_its_throughput_columns():
    """The CSV's own TFLOP/s column (causal half of QK^T and PV) is what the table derives."""
    with resources.as_file(data_file("h200_attention_bf16.csv")) as path:
        table = read_attention_csv(path)
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                forward, _ = table.rates(int(row["seq"]), int(row["heads"]))
                assert forward / 1e12 == pytest.approx(float(row["fwd_tflops"]), rel=1e-6)


# ------------------------------------------------------------------------------------------
# the GPUs' models


def test_h100_and_h200_share_the_measured_kernels():
    h100, h200 = gpu_compute_model("h100"), gpu_compute_model("h200")
    assert h100.gemm.efficiency == h200.gemm.efficiency == pytest.approx(H200_GEMM_FIT["efficiency"])
    assert (h100.gemm.sms, h100.attention_scale) == (132, 1.0)
    assert (h100.gemm.memory_bandwidth, h200.gemm.memory_bandwidth) == (3.35e12, 4.8e12)


@pytest.mark.parametrize("gpu,peak,sms,matmul", [("a100-80gb", 312e12, 108, 271.2e12),
                                                  ("a100-40gb", 312e12, 108, 271.2e12),
                                                  ("b200", 2250e12, 148, 1745.0e12)])
def test_other_gpus_carry_the_h200_over_by_measured_matmul_throughput(gpu, peak, sms, matmul):
    """A full wave of long tiles reaches the same fraction of the part's best measured
    matmul (Bekman's MAMF table: A100 SXM 271.2, H100 SXM 794.5, B200 SXM 1745 TFLOP/s) as
    the H200 reached of its own."""
    model = gpu_compute_model(gpu)
    sustained = H200_GEMM_FIT["efficiency"] * 989e12 / 794.5e12
    assert model.gemm.sms == sms and model.gemm.peak_flops == peak
    assert model.gemm.efficiency * peak == pytest.approx(sustained * matmul)
    assert model.attention_scale == pytest.approx(matmul / 794.5e12)


def test_a100_flash_attention_lands_in_flashattention2s_published_range():
    """Dao 2023 (FlashAttention-2) reports its kernels at 50-73% of the A100's peak."""
    model = gpu_compute_model("a100-80gb")
    attention = FlashAttention("attention", 1, 16, 8192, 128)
    forward, backward = model.attention_seconds(attention)
    work = (attention.flops / 2) * (1 + 2.5)  # causal half, backward 2.5x the forward
    assert 0.5 < work / (forward + backward) / 312e12 < 0.73


def test_a_device_of_other_figures_keeps_its_gpus_kernels():
    h100 = gpu_compute_model("h100")
    halved = h100.on_device(989e12 / 2, 3.35e12)
    gemm = Gemm("g", 8192, 8192, 8192)
    assert halved.gemm_seconds(gemm, 2) == pytest.approx(2 * h100.gemm_seconds(gemm, 2))
    attention = FlashAttention("a", 1, 16, 8192, 128)
    assert halved.attention_seconds(attention)[0] == pytest.approx(2 * h100.attention_seconds(attention)[0])


# ------------------------------------------------------------------------------------------
# costs: the compute model by default, --mfu as the old model


def test_mfu_is_one_efficiency_for_every_kernel():
    """With --mfu, a GPT layer's forward is sbh(24h + 4s) / (peak x mfu), whatever its
    shape (Narayanan et al. 2021), as before the compute model."""
    spec = model_spec("gpt3-13b")
    s, h = 2048, 5120
    time = layer_time(spec, 4, False, True, "none", FixedEfficiency(989e12, 0.5, math.inf))
    assert time.forward == pytest.approx(s * h * (24 * h + 4 * s) / 4 / (0.5 * 989e12))
    assert time.weight_grad == pytest.approx(24 * s * h * h / 4 / (0.5 * 989e12))


def test_default_costs_time_each_gpus_kernels():
    """No --mfu: a100 costs come from the A100's model, and the layer takes what its
    operations take on it (GEMMs by shape, flash attention, memory-bound kernels)."""
    spec = model_spec("gpt3-13b")
    costs = model_costs(spec, 4, [312e12] * 4, tp=2, stage_gpus=["a100-80gb"] * 4,
                        stage_memory_bandwidth=[2.039e12] * 4)
    a100 = gpu_compute_model("a100-80gb")
    by_operation = sum(a100.gemm_seconds(op, 2) for op in layer_operations(spec, 2) if isinstance(op, Gemm))
    by_operation += a100.attention_seconds(next(op for op in layer_operations(spec, 2)
                                                if isinstance(op, FlashAttention)))[0]
    by_operation += sum(a100.memory_seconds(op.bytes) for op in layer_operations(spec, 2) if not op.flops)
    assert costs.stages[1].fwd == pytest.approx(10 * by_operation)
    assert costs.meta["compute_model"] == [a100.name]
    # the A100 model is slower than half of peak for these shapes, faster than a quarter
    flops = 10 * spec.layer_flops() / 2
    assert 0.25 * 312e12 < flops / costs.stages[1].fwd < 0.75 * 312e12


def test_simulate_uses_the_gpus_model_unless_mfu_is_given(tmp_path):
    runs = {}
    for name, extra in (("model", []), ("mfu", ["--mfu", "0.5"])):
        out = tmp_path / f"{name}.json"
        assert main(["simulate", "--model", "gpt3-1.3b", "--pp", "2", "-m", "2", "--topology", "nvlink",
                     "--gpu", "h200", "--json", str(out), *extra]) == 0
        runs[name] = json.loads(out.read_text())
    assert runs["model"]["model"]["compute_model"] == ["h200 (H200 kernel measurements)"]
    assert runs["mfu"]["model"]["compute_model"] == ["fixed efficiency 0.5 of peak (--mfu)"]
    assert runs["model"]["makespan"] != pytest.approx(runs["mfu"]["makespan"])


# ------------------------------------------------------------------------------------------
# the compute-model file


def test_compute_model_file_errors_name_the_field(tmp_path):
    path = tmp_path / "gpu.json"
    good = {"compute_model": 1, "peak_flops": 1e12, "memory_bandwidth": 1e11, "sms": 4,
            "gemm": {"efficiency": 0.5, "k_overhead": 0, "launch_seconds": 1e-5},
            "attention": [{"seq": 64, "heads": 2, "head_dim": 8, "batch": 1, "fwd_s": 1e-4, "fwd_bwd_s": 3e-4}]}
    path.write_text(json.dumps(good))
    assert load_compute_model(path).gemm.efficiency == 0.5
    for change, message in (({"sms": 2.5}, "sms must be a whole number > 0, got 2.5"),
                            ({"gemm": {**good["gemm"], "efficiency": 1.5}}, "efficiency is a fraction of peak"),
                            ({"peak_flops": None}, "peak_flops must be a finite number > 0, got None"),
                            ({"attention": []}, "'attention' must be a non-empty list"),
                            ({"compute_model": None}, "not a compute model")):
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(ComputeModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_compute_model(path)


def test_mfu_and_compute_model_conflict(tmp_path, capsys):
    assert main(["simulate", "--model", "gpt3-1.3b", "--mfu", "0.4", "--compute-model", str(tmp_path / "x.json")]) \
        == 2
    assert "--mfu 0.4 conflicts with --compute-model" in capsys.readouterr().err
    assert main(["simulate", "--compute-model", str(tmp_path / "x.json")]) == 2
    assert "needs --model" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# pipesim profile --compute-model: the code path on a CPU, the refusal without a GPU


def test_profile_fits_writes_and_simulate_reads_a_compute_model_on_cpu(tmp_path):
    """The profile's whole path with torch on this CPU and tiny shapes: time GEMMs and
    attention, fit, write the file; simulate --compute-model then times every stage with it."""
    torch = pytest.importorskip("torch")
    from pipesim.cli.profile_kernels import profile_compute_model, write_profile

    gemms = [(size, size, size) for size in (8, 32, 64, 128, 192, 256)] + [(256, 64, 256), (64, 256, 64)]
    attention = [(1, heads, seq, 8) for seq in (16, 32) for heads in (1, 2)]
    profile = profile_compute_model(gemms, attention, torch.device("cpu"), torch.float32, peak_flops=1e11,
                                    memory_bandwidth=1e10, sms=2, name="cpu", warmup=1, repeats=3)
    assert len(profile.gemm_timings) == 2 * len(gemms) and len(profile.attention_timings) == 4
    fitted = profile.model.gemm
    assert 0.001 <= fitted.efficiency <= 1 and fitted.launch_seconds > 0
    # the launch floor is the fastest GEMM measured, per GEMM
    assert fitted.launch_seconds == pytest.approx(min(timing.seconds / len(timing.shapes)
                                                      for timing in profile.gemm_timings))
    # more work takes longer under the fitted model
    assert fitted.seconds(256, 256, 256, element_bytes=4) > fitted.seconds(32, 32, 32, element_bytes=4)
    path = tmp_path / "cpu.json"
    write_profile(str(path), profile, "cpu")
    loaded = load_compute_model(path)
    assert loaded.gemm == fitted
    assert loaded.attention == profile.model.attention
    out = tmp_path / "r.json"
    assert main(["simulate", "--model", "gpt", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "16",
                 "--pp", "2", "-m", "2", "--compute-model", str(path), "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["model"]["compute_model"] == ["profiled on cpu (cpu.json)"]
    assert document["makespan"] > 0


def test_profile_compute_model_refuses_without_a_gpu(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["profile", "--compute-model", str(tmp_path / "gpu.json")]) == 2
    assert "--compute-model needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()
    assert main(["profile"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_profile_shapes_include_the_models_own():
    from pipesim.cli.profile_kernels import attention_shapes, gpu_from_device_name, profile_shapes

    spec = model_spec("llama3-70b")
    shapes = profile_shapes(spec, 8)
    # QKV of 8192 -> (8192 + 2 x 1024) / 8 columns, the SwiGLU up and gate fused: 2 x 28672 / 8
    assert (8192, 8192, 1280) in shapes and (8192, 8192, 7168) in shapes and (8192, 3584, 8192) in shapes
    grid = attention_shapes(spec, 8)
    assert (1, 8, 8192, 128) in grid and len(grid) == 4 * 4
    assert [gpu_from_device_name(name) for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                                                     "NVIDIA A100-SXM4-40GB", "NVIDIA H200", "Tesla V100")] == \
        ["h100", "a100-80gb", "a100-40gb", "h200", None]
