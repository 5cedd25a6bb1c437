"""``--comm-sms``: SMs kept for communication kernels (DeepSeek-V3 kept 20 of an H800's
132, report section 3.2.2), the compute running on the rest.

Expected by hand: GEMMs tile over 112 SMs at 112/132 of the peak (each SM as fast as
before), attention at 112/132 of its throughput, memory-bound kernels at the whole HBM
bandwidth, ``--mfu``'s efficiency of 112/132 of the peak.
"""

from __future__ import annotations

import pytest

from pipesim.cli import main
from pipesim.model.compute_model import FixedEfficiency, gpu_compute_model, stage_compute_model
from pipesim.model.errors import ModelSpecError
from pipesim.model.operations import FlashAttention, Gemm

H800_PEAK, H800_HBM = 989e12, 3350e9


def test_the_kernel_model_runs_on_the_sms_left():
    whole = stage_compute_model(H800_PEAK, H800_HBM, "h800")
    kept = stage_compute_model(H800_PEAK, H800_HBM, "h800", comm_sms=20)
    assert kept.gemm.sms == 112 and whole.gemm.sms == 132
    assert kept.gemm.peak_flops == pytest.approx(H800_PEAK * 112 / 132, rel=1e-12)
    assert kept.gemm.peak_flops / kept.gemm.sms == pytest.approx(whole.gemm.peak_flops / whole.gemm.sms)
    assert (kept.gemm.efficiency, kept.gemm.k_overhead, kept.gemm.launch_seconds) == (
        whole.gemm.efficiency, whole.gemm.k_overhead, whole.gemm.launch_seconds)
    attention = FlashAttention("attention", 1, 16, 8192, 128)
    for kept_seconds, whole_seconds in zip(kept.attention_seconds(attention), whole.attention_seconds(attention),
                                           strict=True):
        assert kept_seconds == pytest.approx(whole_seconds * 132 / 112, rel=1e-12)
    assert kept.memory_seconds(1e9) == whole.memory_seconds(1e9)
    assert "20 of 132 SMs kept for communication" in kept.name


def test_a_fixed_efficiency_loses_the_reserved_share_of_its_peak():
    kept = stage_compute_model(H800_PEAK, H800_HBM, "h800", mfu=0.5, comm_sms=20)
    assert isinstance(kept, FixedEfficiency)
    gemm = Gemm("mlp_in", 4096, 4096, 14336)
    assert kept.gemm_seconds(gemm, 2) == pytest.approx(gemm.flops / (0.5 * H800_PEAK * 112 / 132), rel=1e-12)


def test_a_wave_quantised_gemm_pays_for_the_sms_it_lost():
    """132 tiles of 256 x 128 fill one wave of 132 SMs (32768 output elements per SM);
    on 112 the best tiling is 528 tiles of 128 x 64 in 5 waves (40960): 1.25 times as
    long, where the lost share alone would be 132 / 112 = 1.18."""
    whole = gpu_compute_model("h800")
    kept = stage_compute_model(whole.gemm.peak_flops, whole.gemm.memory_bandwidth, "h800", comm_sms=20)
    gemm = Gemm("mlp_in", 256 * 12, 8192, 128 * 11)  # 12 x 11 = 132 output tiles
    assert kept.gemm_seconds(gemm, 2) / whole.gemm_seconds(gemm, 2) == pytest.approx(40960 / 32768, rel=1e-9)


@pytest.mark.parametrize("reserved", [-1, 132, 500])
def test_reserving_every_sm_or_a_negative_count_is_refused(reserved):
    with pytest.raises(ModelSpecError, match=f"--comm-sms {reserved}: h800 has 132 SMs; keep 0 to 131"):
        stage_compute_model(H800_PEAK, H800_HBM, "h800", comm_sms=reserved)


def test_comm_sms_on_the_command_line(capsys):
    steps = {}
    for reserved in ("0", "20"):
        assert main(["simulate", "--model", "llama3-8b", "--gpu", "h800", "--pp", "2", "-m", "4",
                     "--comm-sms", reserved]) == 0
        line = [text for text in capsys.readouterr().out.splitlines() if "step time" in text][0]
        steps[reserved] = float(line.split()[2].replace(",", ""))
    assert 1 < steps["20"] / steps["0"] <= 132 / 112  # memory-bound kernels keep their pace
    assert main(["simulate", "--comm-sms", "20", "--pp", "2", "-m", "2"]) == 2
    assert "--comm-sms 20 needs --model" in capsys.readouterr().err
