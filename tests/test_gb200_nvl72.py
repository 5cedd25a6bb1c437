"""GB200 and its NVL72 rack: the part's datasheet figures, a rack as one NVLink domain of
72 GPUs, InfiniBand between racks, and the plan and simulate commands on it.

Hand figures: NVIDIA's GB200 NVL72 datasheet (per GPU: 5 PFLOP/s BF16 and 10 PFLOP/s FP8
with sparsity, so 2.5 and 5 dense; 186 GB HBM3e at 8 TB/s; NVLink 5 at 1.8 TB/s, 900 GB/s
a direction; 72 GPUs a rack), DGX GB200's ConnectX-7 at 400 Gb/s (50 GB/s) a GPU, and
the B200's measured matmul throughput (1745 TFLOP/s) scaled by the two datasheet peaks
(2500 over 2250)."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main
from pipesim.cluster.files import load_topology
from pipesim.cluster.presets import nodes_for
from pipesim.cluster.topology import TopologyError
from pipesim.hardware.gpus import gpu_spec
from pipesim.model.compute_model import H200_GEMM_FIT, gpu_compute_model

GB = 1e9


def test_gb200_carries_its_datasheet_figures():
    gb200 = gpu_spec("gb200")
    assert (gb200.bf16_flops, gb200.fp8_flops, gb200.memory_bytes) == (2500e12, 5000e12, 186 * GB)
    assert (gb200.memory_bandwidth, gb200.nvlink_bandwidth, gb200.nic_bandwidth, gb200.sms) == \
           (8000 * GB, 900 * GB, 50 * GB, 148)
    assert gb200.matmul_flops == pytest.approx(1745e12 * 2500 / 2250)  # 1938.9 TFLOP/s, estimated
    assert not gb200.matmul_measured and gpu_spec("b200").matmul_measured


def test_gb200_kernels_are_the_b200s_scaled_by_the_datasheet_peaks():
    gb200, b200 = gpu_compute_model("gb200"), gpu_compute_model("b200")
    assert gb200.gemm.efficiency * 2500e12 == pytest.approx(b200.gemm.efficiency * 2250e12 * 2500 / 2250)
    assert gb200.attention_scale == pytest.approx(b200.attention_scale * 2500 / 2250)
    assert gb200.gemm.efficiency == pytest.approx(H200_GEMM_FIT["efficiency"] * 989e12 / 794.5e12 * 1745 / 2250)
    assert "estimated from datasheet peaks" in gb200.name


def test_an_nvl72_rack_is_one_nvlink_domain_of_72_gpus():
    topology = load_topology("nvl72", 2)
    assert len(topology.devices) == 144 and topology.device_gpu("n1.gpu71") == "gb200"
    assert {topology.node_of(device) for device in topology.devices[:72]} == {"n0"}
    assert topology.node_of("n1.gpu0") == "n1"
    inside = topology.route("n0.gpu0", "n0.gpu71")  # across the rack's trays, still NVLink: two hops
    assert inside.bandwidth == pytest.approx(900e9 * 0.8) and inside.latency == pytest.approx(2 * 1.5e-6)
    across = topology.route("n0.gpu0", "n1.gpu0")  # NIC over PCIe, the fabric, the other NIC: 50 GB/s at 0.9
    assert across.bandwidth == pytest.approx(50e9 * 0.9)
    assert topology.device_memory("n0.gpu0") == 186 * GB


def test_nvl72_defaults_to_one_rack_and_refuses_other_gpus():
    assert len(load_topology("nvl72").devices) == 72
    with pytest.raises(TopologyError, match="nvl72 is a rack of GB200s; --gpu h100"):
        load_topology("nvl72", 1, "h100")
    with pytest.raises(TopologyError, match="--nodes must be >= 1"):
        load_topology("nvl72", 0)


@pytest.mark.parametrize("topology,gpus,per_node,nodes", [("nvl72", 256, 8, 4), ("nvl72", 72, 8, 1),
                                                          ("nvl72", 8, 8, 1), ("ib", 256, 8, 32), ("ib", 4, 8, 1)])
def test_a_plan_takes_whole_racks_on_nvl72_and_8_gpu_nodes_elsewhere(topology, gpus, per_node, nodes):
    assert nodes_for(topology, gpus, per_node) == nodes


def test_simulate_on_nvl72_times_gb200_kernels(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", "--model", "llama3-8b", "--pp", "2", "-m", "4", "--topology", "nvl72", "--fp8",
                 "current", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gb200 (H200 kernel measurements scaled by a matmul throughput estimated from datasheet peaks)" in printed
    document = json.loads(out.read_text())
    assert document["ranks"][0]["memory"]["capacity_bytes"] == 186 * GB
    assert document["model"]["peak_flops_per_gpu"] == 2500e12


def test_plan_on_nvl72_places_its_gpus_in_racks(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "144", "--global-batch", "144", "--topology", "nvl72",
                 "--schedules", "1f1b", "--top", "1"]) == 0
    printed = capsys.readouterr()
    assert "on 144 GPUs (nvl72)" in printed.err and "186.0 GB" in printed.out


def test_too_few_racks_names_the_racks_that_would_hold_the_job(capsys):
    assert main(["simulate", "--model", "llama3-405b", "--topology", "nvl72", "--pp", "16", "--tp", "8", "--dp", "2",
                 "-m", "16"]) == 2
    assert "needs 256 devices but topology nvl72 has 72" in (err := capsys.readouterr().err)
    assert "--topology nvl72 --nodes 4" in err
    assert nodes_for("nvl72", 256, 8) == 4  # the racks the hint names


def test_gb200s_across_8_gpu_nodes_are_pointed_at_the_rack(capsys):
    """dp 2 x tp 8 of GB200s on the ib preset spans two 8-GPU nodes joined by InfiniBand,
    where one NVL72 rack would hold all 16 on NVLink: simulate says so; on one node, or on
    nvl72, it says nothing."""
    argv = ["simulate", "--model", "llama3-70b", "--gpu", "gb200", "--pp", "1", "--tp", "8", "-m", "8"]
    assert main([*argv, "--dp", "2", "--topology", "ib", "--nodes", "2"]) == 0
    assert "the gb200 ranks span 2 nodes of topology ib" in capsys.readouterr().err
    assert main([*argv, "--topology", "ib", "--nodes", "2"]) == 0
    assert "span" not in capsys.readouterr().err
    assert main([*argv, "--dp", "2", "--topology", "nvl72"]) == 0
    assert "span" not in capsys.readouterr().err
