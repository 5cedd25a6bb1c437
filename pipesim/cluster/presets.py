"""Built-in cluster presets, with the figures they rest on.

Bandwidths are per direction (DESIGN.md, "Reference links"); ``efficiency`` is the
fraction of peak that a measured NCCL send/recv reaches, since no real transfer runs
at the line rate (e.g. ~195 GB/s of 300 GB/s one way on A100 NVLink: 0.65).
Latencies are per hop; a GPU-to-GPU path crosses two or more hops.

Each preset is a ``Hierarchy``: per GPU, the chains of uplinks it climbs (see
``pipesim.cluster.hierarchy``), from which its routes and, on demand, its graph follow.
"""

from __future__ import annotations

from collections.abc import Callable

from pipesim.cluster.hierarchy import Chain, Hierarchy, Hop, Link
from pipesim.cluster.topology import Topology, TopologyError, ideal_topology
from pipesim.hardware.gpus import GPUS, GpuSpec, gpu_spec

GB = 1e9
US = 1e-6

# Devices (pipesim.hardware.gpus has every GPU model; these two remain for callers that name them)
H100_MEMORY = GPUS["h100"].memory_bytes
H100_BF16_FLOPS = GPUS["h100"].bf16_flops  # dense BF16 tensor-core peak, H100 SXM datasheet
A100_MEMORY = GPUS["a100-80gb"].memory_bytes
A100_BF16_FLOPS = GPUS["a100-80gb"].bf16_flops  # dense BF16 peak, A100 datasheet

# Links (per direction)
NVLINK4_BW = GPUS["h100"].nvlink_bandwidth  # H100/H200 through NVSwitch
PCIE4_X16_BW = 31.5 * GB
PCIE5_X16_BW = 63 * GB
UPI_BW = 62 * GB  # CPU-to-CPU socket link (3 x UPI at ~20.8 GB/s); carries PCIe P2P across sockets
IB_NDR_BW = 50 * GB  # 400 Gb/s per port
ETH_100G_BW = 12.5 * GB

NVLINK_EFFICIENCY = 0.8  # NCCL send/recv reaches ~360 GB/s of 450 on H100 NVSwitch systems
PCIE_EFFICIENCY = 0.8  # P2P over a PCIe switch reaches ~25 GB/s of 31.5 on Gen4 x16
IB_EFFICIENCY = 0.9  # NDR send/recv reaches ~45 of 50 GB/s in nccl-tests
ETH_EFFICIENCY = 0.85  # RoCE/TCP on 100 GbE

NVLINK_HOP_LATENCY = 1.5 * US  # GPU <-> NVSwitch; GPU-to-GPU is two hops, ~3 us
PCIE_HOP_LATENCY = 1.0 * US
UPI_LATENCY = 1.0 * US
IB_HOP_LATENCY = 2.5 * US  # NIC <-> switch; GPU-to-GPU across nodes ~8-10 us in all
ETH_HOP_LATENCY = 7.5 * US

GPUS_PER_NODE = 8
# A GB200 NVL72 rack: 72 GPUs (18 compute trays of 4) on one NVLink 5 fabric of 9 NVSwitch
# trays, every GPU its full 900 GB/s per direction to any other in the rack (NVIDIA's GB200
# NVL72 datasheet: 130 TB/s of NVLink in all, 72 x 1.8 TB/s); between racks, one
# ConnectX-7 at 400 Gb/s a GPU (DGX GB200's networking)
NVL72_GPUS = 72
NVL72_GPU = "gb200"


def _gpu(gpu: GpuSpec) -> dict[str, object]:
    """The figures every device of a preset carries."""
    return {"memory_bytes": gpu.memory_bytes, "peak_flops": gpu.bf16_flops,
            "memory_bandwidth": gpu.memory_bandwidth, "gpu": gpu.name}


NIC_PCIE = Link(PCIE5_X16_BW, PCIE_HOP_LATENCY, PCIE_EFFICIENCY, "pcie")  # GPU <-> its own NIC


def _nvswitch_uplink(node: int, gpu: GpuSpec) -> Chain:
    """Eight GPUs on one NVSwitch fabric: every GPU a full-bandwidth link to the switch."""
    return (Hop(f"n{node}.nvswitch", "nvswitch",
                Link(gpu.nvlink_bandwidth, NVLINK_HOP_LATENCY, NVLINK_EFFICIENCY, "nvlink")),)


def _nvlink_words(gpu: GpuSpec) -> str:
    return f"{gpu.name.upper()}, NVLink {gpu.nvlink_generation} via NVSwitch"


def _node_devices(nodes: int, per_node: int = GPUS_PER_NODE) -> list[str]:
    return [f"n{node}.gpu{local}" for node in range(nodes) for local in range(per_node)]


def nvlink(nodes: int = 1, gpu: str | None = None) -> Topology:
    """One node, 8 GPUs (default H100 SXM) through NVSwitch at the GPU's NVLink bandwidth
    (NVLink 4: 450 GB/s per GPU per direction)."""
    _single_node("nvlink", nodes)
    spec = gpu_spec(gpu)
    uplink = _nvswitch_uplink(0, spec)
    hierarchy = Hierarchy(_node_devices(1), lambda index: (uplink,), _gpu(spec))
    return Topology.from_hierarchy("nvlink", hierarchy, description=f"1 node, 8x {_nvlink_words(spec)}")


def _pcie_node(name: str, link_bw: float, description: str, gpu: GpuSpec) -> Topology:
    """8 GPUs, two per PCIe switch, two switches per CPU socket, sockets joined by UPI.

    GPUs on one switch talk through it; across switches the transfer climbs to the
    socket's root complex; across sockets it also crosses UPI (the slowest, most shared
    part of a PCIe box, which is why cross-socket P2P is the bottleneck there)."""
    pcie_link = Link(link_bw, PCIE_HOP_LATENCY, PCIE_EFFICIENCY, "pcie")
    upi = Link(UPI_BW, UPI_LATENCY, PCIE_EFFICIENCY, "upi")

    def uplinks(index: int) -> tuple[Chain, ...]:
        switch, socket = index // 2, index // 4
        chain = (Hop(f"pcie_switch{switch}", "pcie_switch", pcie_link), Hop(f"cpu{socket}", "host", pcie_link))
        if socket == 1:  # socket 1 reaches socket 0 over UPI; chains meet at cpu0 at the latest
            chain += (Hop("cpu0", "host", upi),)
        return (chain,)

    hierarchy = Hierarchy([f"gpu{index}" for index in range(GPUS_PER_NODE)], uplinks, _gpu(gpu))
    return Topology.from_hierarchy(name, hierarchy, description=description)


def pcie(nodes: int = 1, gpu: str | None = None) -> Topology:
    """One node, 8 GPUs on PCIe Gen4 x16 (31.5 GB/s) through switches and the host."""
    _single_node("pcie", nodes)
    spec = gpu_spec(gpu)
    return _pcie_node("pcie", PCIE4_X16_BW,
                      f"1 node, 8x {spec.name.upper()}, PCIe Gen4 x16 via 4 switches and 2 sockets", spec)


def pcie5(nodes: int = 1, gpu: str | None = None) -> Topology:
    """As ``pcie`` with PCIe Gen5 x16 (63 GB/s)."""
    _single_node("pcie5", nodes)
    spec = gpu_spec(gpu)
    return _pcie_node("pcie5", PCIE5_X16_BW,
                      f"1 node, 8x {spec.name.upper()}, PCIe Gen5 x16 via 4 switches and 2 sockets", spec)


def _multi_node(name: str, nodes: int, nic_bw: float, hop_latency: float, efficiency: float, medium: str,
                description: str, gpu: GpuSpec, per_node: int = GPUS_PER_NODE) -> Topology:
    """``nodes`` NVSwitch nodes (NVLink domains) of ``per_node`` GPUs; each GPU has its own
    NIC (rail-optimised, as DGX/HGX systems are built) into one non-blocking fabric switch.
    A GPU climbs either to its node's NVSwitch or through its NIC to the fabric."""
    if nodes < 1:
        raise TopologyError(f"--nodes must be >= 1, got {nodes}")
    fabric = Hop(f"{medium}_switch", f"{medium}_switch", Link(nic_bw, hop_latency, efficiency, medium))

    def uplinks(index: int) -> tuple[Chain, ...]:
        node, local = divmod(index, per_node)
        return _nvswitch_uplink(node, gpu), (Hop(f"n{node}.nic{local}", "nic", NIC_PCIE), fabric)

    hierarchy = Hierarchy(_node_devices(nodes, per_node), uplinks, _gpu(gpu))
    return Topology.from_hierarchy(name, hierarchy, description=description.format(nodes=nodes))


def ib(nodes: int = 2, gpu: str | None = None) -> Topology:
    """``nodes`` x 8 GPUs (default H100), NVLink inside each node, one InfiniBand port per
    GPU between nodes at the speed of that GPU's reference system (NDR 400 Gb/s for
    H100/H200/B200, HDR 200 Gb/s for A100)."""
    spec = gpu_spec(gpu)
    rate = f"{spec.nic_bandwidth * 8 / GB:g} Gb/s"
    return _multi_node("ib", nodes, spec.nic_bandwidth, IB_HOP_LATENCY, IB_EFFICIENCY, "ib",
                       f"{{nodes}} nodes x 8 {_nvlink_words(spec)} inside, InfiniBand {rate} per GPU between", spec)


def nvl72(nodes: int = 1, gpu: str | None = None) -> Topology:
    """``nodes`` GB200 NVL72 racks: 72 GPUs a rack on one NVLink 5 fabric (900 GB/s per GPU
    per direction to any GPU of the rack), one InfiniBand port of 400 Gb/s per GPU between
    racks. A rack is what ``node`` means on this preset: the GPUs a transfer reaches
    without the network (node-limited routing, the collectives' NVLink and network parts,
    NCCL's channel counts)."""
    spec = gpu_spec(NVL72_GPU if gpu is None else gpu)
    if spec.name != NVL72_GPU:
        raise TopologyError(f"preset nvl72 is a rack of GB200s; --gpu {spec.name} is not one of them "
                            f"(use --gpu {NVL72_GPU}, or --topology ib for {spec.name} nodes)")
    rate = f"{spec.nic_bandwidth * 8 / GB:g} Gb/s"
    return _multi_node("nvl72", nodes, spec.nic_bandwidth, IB_HOP_LATENCY, IB_EFFICIENCY, "ib",
                       f"{{nodes}} GB200 NVL72 rack(s) x {NVL72_GPUS} {_nvlink_words(spec)} inside, InfiniBand "
                       f"{rate} per GPU between", spec, per_node=NVL72_GPUS)


def ethernet(nodes: int = 2, gpu: str | None = None) -> Topology:
    """``nodes`` x 8 GPUs (default H100), NVLink inside, 100 GbE per GPU between nodes."""
    spec = gpu_spec(gpu)
    return _multi_node("ethernet", nodes, ETH_100G_BW, ETH_HOP_LATENCY, ETH_EFFICIENCY, "ethernet",
                       f"{{nodes}} nodes x 8 {_nvlink_words(spec)} inside, 100 GbE per GPU between", spec)


def _single_node(name: str, nodes: int) -> None:
    if nodes != 1:
        raise TopologyError(f"preset {name} is one node; for {nodes} nodes use 'ib' or 'ethernet'")


def ideal(nodes: int = 1, gpu: str | None = None) -> Topology:
    """Free, instant links; with ``gpu``, devices of its capacity (out of memory is judged
    on every topology), without, unbounded ones. Model costs take the peak from ``--gpu``."""
    spec = gpu_spec(gpu)
    return ideal_topology(memory_bytes=spec.memory_bytes if gpu else None)


PRESETS: dict[str, Callable[..., Topology]] = {
    "ideal": ideal,
    "nvlink": nvlink,
    "pcie": pcie,
    "pcie5": pcie5,
    "ib": ib,
    "nvl72": nvl72,
    "ethernet": ethernet,
}

MULTI_NODE = frozenset({"ib", "nvl72", "ethernet"})
# GPUs a node (an NVLink domain) of the presets whose nodes are not 8 GPUs
GPUS_PER_PRESET_NODE = {"nvl72": NVL72_GPUS}


def nodes_for(topology: str, gpus: int, gpus_per_node: int) -> int:
    """The ``--nodes`` that holds ``gpus`` on ``topology``: whole racks of a preset whose
    node is an NVLink domain of its own size (``nvl72``: 72 GPUs, the last rack partly
    used), else ``gpus_per_node``-GPU nodes."""
    per_node = GPUS_PER_PRESET_NODE.get(topology, gpus_per_node)
    return max(1, -(-gpus // per_node))
