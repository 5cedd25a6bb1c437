"""``--gpu h800``: H100's compute and memory with 400 GB/s (bidirectional) NVLink, on every
topology preset and in topology files.

Expected figures: NVIDIA's H800 SXM specifications (NVLink 400 GB/s bidirectional, 200
one way) and DeepSeek-V3's report, section 3.2.2 ("NVLink offers a bandwidth of 160
GB/s, roughly 3.2 times that of IB (50 GB/s)"): 200 GB/s at the presets' NVLink
efficiency of 0.8 is the 160 it measured.
"""

from __future__ import annotations

import pytest

from pipesim.cli import main
from pipesim.cluster.files import load_topology
from pipesim.cluster.presets import MULTI_NODE, PRESETS
from pipesim.hardware.gpus import gpu_spec

NVLINK_PRESETS = ("nvlink", "ib", "ethernet")


@pytest.mark.parametrize("preset", sorted(set(PRESETS) - {"nvl72"}))  # nvl72: GB200 racks only (test_gb200_nvl72)
def test_every_preset_takes_h800_with_h100_compute_and_memory(preset):
    topology = PRESETS[preset](nodes=2 if preset in MULTI_NODE else 1, gpu="h800")
    if preset == "ideal":
        return  # unbounded devices; --model takes the peak from --gpu (below)
    for device in topology.devices:
        assert topology.device_gpu(device) == "h800"
        assert topology.device_peak_flops(device) == 989e12
        assert topology.device_memory(device) == 81559 * 2**20  # the H100 SXM's nvidia-smi total


@pytest.mark.parametrize("preset", NVLINK_PRESETS)
def test_nvlink_inside_a_node_runs_at_deepseeks_measured_160_gb_s(preset):
    nodes = 2 if preset in MULTI_NODE else 1
    h800 = PRESETS[preset](nodes=nodes, gpu="h800")
    h100 = PRESETS[preset](nodes=nodes, gpu="h100")
    first, second = h800.devices[0], h800.devices[1]
    assert h800.route(first, second).bandwidth == pytest.approx(160e9)
    assert h100.route(first, second).bandwidth == pytest.approx(360e9)
    if preset == "ib":  # between nodes the 400 Gb/s port of each GPU, as on H100
        other = h800.devices[8]
        assert h800.route(first, other).bandwidth == h100.route(first, other).bandwidth


def test_h800_is_an_h100_but_for_nvlink():
    h800, h100 = gpu_spec("h800"), gpu_spec("h100")
    assert (h800.bf16_flops, h800.fp8_flops, h800.memory_bytes, h800.memory_bandwidth, h800.sms,
            h800.matmul_flops) == (h100.bf16_flops, h100.fp8_flops, h100.memory_bytes, h100.memory_bandwidth,
                                   h100.sms, h100.matmul_flops)
    assert h800.nvlink_bandwidth == 200e9 and h100.nvlink_bandwidth == 450e9


def test_a_topology_file_names_h800(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("devices:\n  - {name: g0, gpu: h800}\n  - {name: g1, gpu: h800}\n"
                    "links:\n  - {src: g0, dst: g1, bandwidth: 160e9, latency: 2e-6}\n")
    topology = load_topology(str(path))
    assert topology.device_gpu("g0") == "h800" and topology.device_peak_flops("g1") == 989e12


def test_h800_on_the_command_line_with_fp8(capsys):
    """Slower tensor-parallel collectives than on an H100 (NVLink), the same GEMMs."""
    steps = {}
    for gpu in ("h100", "h800"):
        assert main(["simulate", "--model", "llama3-8b", "--topology", "nvlink", "--gpu", gpu, "--tp", "8",
                     "--pp", "1", "-m", "2", "--fp8"]) == 0
        line = [text for text in capsys.readouterr().out.splitlines() if "step time" in text][0]
        steps[gpu] = float(line.split()[2])
    assert steps["h800"] > steps["h100"]
