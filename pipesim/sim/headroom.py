"""What a device keeps back from the model: the headroom rule behind every out-of-memory
verdict (``simulate``, ``sweep``, ``plan``).

A rank's peak (``pipesim.sim.memory``: parameters, gradients, optimizer state, buffers,
stashes) is what PyTorch allocates. The device must also hold three things that are not
the model's, and ``--memory-headroom auto`` (the default) counts each from published
figures:

    context        the CUDA context of the process: 426 MiB. With lazy module loading
                   (CUDA 11.7 on, PyTorch's default) it is ~0.3-0.4 GB, over 1 GB before
                   (ptrblck in pytorch/pytorch issue 107667: "~300MB", issue 109888:
                   "around 400MB"); 426 MiB is the newest reading we found, nvidia-smi
                   with PyTorch 2.10 and CUDA 13 (unslothai/unsloth-zoo pull request 1053).
    nccl           NCCL's buffers, for every communicator the rank joins (tp, pp, dp over
                   dp x cp, cp, ep and the experts' data-parallel group): per channel
                   and per peer it receives from, one buffer for each protocol, Simple
                   ``NCCL_BUFFSIZE`` 4 MiB + LL 512 KiB + LL128 4.6875 MiB (NCCL's
                   ``DEFAULT_BUFFSIZE``, ``DEFAULT_LL_BUFFSIZE``, ``DEFAULT_LL128_BUFFSIZE``
                   in src/init.cc from the constants of src/include/device.h), allocated
                   in 2 MiB pages: 10 MiB, the allocation NVIDIA/nccl issue 1685 logs
                   (``NCCL_DEBUG_SUBSYS=ALLOC``: 10485760 bytes) on 32 channels per pair
                   of 8 H100s. A ring (tp, dp, cp, the experts' dp group) receives from
                   one peer per channel, on 32 channels; point-to-point (the pipeline's
                   neighbours, ep's all-to-all from every other rank of the group) on 32
                   channels per peer in a group of up to 8 ranks (one node), and in a
                   larger group as many as keep the group's peers, 8 a round, within the
                   32 (``ncclTopoComputeP2pChannels`` in NCCL's src/graph/paths.cc:
                   halved while channels x ceil(peers / 8) > 32): 16 at 16 ranks, 4 at
                   64. A pipeline whose ranks span nodes gets fewer: NCCL takes the
                   channels per peer as the least over the communicator's ranks, and a
                   peer across the network gets one channel per NIC at least, or as
                   many as carry the NIC's bandwidth at 14 GB/s a channel, rounded up
                   to a power of two (``ncclTopoGetNchannels``,
                   ``NCCL_P2P_PER_CHANNEL_NET_BW``, and ``ncclTopoComputeP2pChannels``
                   in src/graph/paths.cc): 4 over a 400 Gb/s NIC, 2 over 200 Gb/s
                   (``pipeline_net_channels``).
    fragmentation  the caching allocator's blocks are never packed perfectly: the memory
                   PyTorch reserves exceeds what it allocates by a share of it, 3%.
                   Megatron-LM training on an 80 GB A100 (NVIDIA/Megatron-LM issue 965)
                   read reserved over allocated 1.4% to 2.8% above through a step. The
                   share grows with irregular allocation: GMLake (Guo et al., ASPLOS
                   2024) measured 15% on average (up to 33%) over eight LLMs fine-tuned
                   with recomputation, offloading and LoRA; give ``--memory-headroom``
                   a share or gigabytes for such jobs.

A rank fits when ``peak x (1 + fragmentation) + context + nccl <= capacity``, that is
when its peak is at most the usable memory ``(capacity - context - nccl) / (1 +
fragmentation)``. A number instead of ``auto`` overrides the rule: ``"10%"`` keeps a
share of the capacity back, ``"6"`` that many gigabytes, ``"0"`` nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MiB = 2**20
CUDA_CONTEXT_BYTES = 426 * MiB
NCCL_SIMPLE_BUFFER_BYTES = 4 * MiB  # NCCL_BUFFSIZE's default
NCCL_LL_BUFFER_BYTES = 8 * 512 * 8 * 16  # LL lines per thread x threads x steps x a 16-byte line
NCCL_LL128_BUFFER_BYTES = 120 * 640 * 8 * 8  # LL128 elements per thread x threads x steps x 8 bytes
NCCL_PAGE_BYTES = 2 * MiB  # NCCL allocates its buffers through cuMem, in 2 MiB pages
NCCL_CONNECTION_BYTES = math.ceil(
    (NCCL_SIMPLE_BUFFER_BYTES + NCCL_LL_BUFFER_BYTES + NCCL_LL128_BUFFER_BYTES) / NCCL_PAGE_BYTES) * NCCL_PAGE_BYTES
NCCL_CHANNELS = 32
NCCL_P2P_PEERS_PER_ROUND = 8  # NCCL_MAX_DEV_WORK_P2P_PER_BATCH, src/include/device.h
NCCL_P2P_NET_CHANNEL_BANDWIDTH = 14e9  # NCCL_P2P_PER_CHANNEL_NET_BW's default, 14 GB/s
FRAGMENTATION_SHARE = 0.03
AUTO = "auto"
DEFAULT_HEADROOM = AUTO


@dataclass(frozen=True)
class Communicators:
    """The NCCL communicators one rank joins: the size of its tensor-parallel group, how
    many other ranks it exchanges pipeline activations with, the size of its gradient
    reduction group (dp x cp), of its context- and expert-parallel groups and of its
    experts' data-parallel group. A group of one rank is no communicator."""

    tp: int = 1
    pp_peers: int = 0
    dp: int = 1
    cp: int = 1
    ep: int = 1
    expert_dp: int = 1
    pp: int = 1
    pp_net_channels: int = 0  # NCCL's channels per peer when the pipeline spans nodes; 0 within one

    def connections(self) -> dict[str, int]:
        """Per communicator the rank joins, the connections it keeps receive buffers for:
        channels x peers (see the module)."""
        rings = {"tp": self.tp, "dp": self.dp, "cp": self.cp}
        connections = {kind: NCCL_CHANNELS for kind, size in rings.items() if size > 1}
        if self.pp_peers:
            channels = p2p_channels_per_peer(max(self.pp, self.pp_peers + 1))
            if self.pp_net_channels:
                channels = min(channels, self.pp_net_channels)
            connections["pp"] = channels * self.pp_peers
        if self.ep > 1:
            connections["ep"] = p2p_channels_per_peer(self.ep) * (self.ep - 1)
            if self.expert_dp > 1:
                connections["expert_dp"] = NCCL_CHANNELS
        return connections


def p2p_channels_per_peer(group: int) -> int:
    """NCCL's point-to-point channels per peer in a group of ``group`` ranks: all 32 in
    one node's group (up to 8 ranks), else halved while they cannot serve the group's
    peers, 8 a round, within the 32 (see the module)."""
    channels = NCCL_CHANNELS
    rounds = math.ceil(group / NCCL_P2P_PEERS_PER_ROUND)
    while channels * rounds > NCCL_CHANNELS and channels > 1:
        channels //= 2
    return channels


def net_p2p_channels(nic_bandwidth: float) -> int:
    """NCCL's point-to-point channels per peer across the network from a GPU whose NIC
    moves ``nic_bandwidth`` bytes/s: one at least, or as many as carry the bandwidth at
    14 GB/s a channel, rounded up to a power of two (see the module)."""
    channels = max(1, math.ceil(nic_bandwidth / NCCL_P2P_NET_CHANNEL_BANDWIDTH))
    return 1 << (channels - 1).bit_length()


def pipeline_net_channels(topology, devices) -> int:
    """NCCL's channels per peer for a pipeline on ``devices`` (one per pipeline rank) of
    ``topology``: 0 when they sit in one node (or the topology names no nodes), else
    ``net_p2p_channels`` of the slowest route between neighbouring ranks on different
    nodes. The route's bandwidth stands for the NIC's speed (NCCL reads the NIC's
    nominal one; the presets' 0.9 efficiency changes no count: 45 and 50 GB/s both give
    4 channels, 22.5 and 25 both 2)."""
    nodes = [topology.node_of(device) for device in devices]
    if None in nodes or len(set(nodes)) < 2:
        return 0
    crossing = [topology.route(devices[rank], devices[(rank + 1) % len(devices)]).bandwidth
                for rank in range(len(devices)) if nodes[rank] != nodes[(rank + 1) % len(devices)]]
    return net_p2p_channels(min(crossing))


def nccl_buffer_bytes(communicators: Communicators) -> dict[str, float]:
    """Bytes of NCCL buffers per communicator kind: connections (channels x peers) x one
    connection's buffers (see the module)."""
    return {kind: float(count * NCCL_CONNECTION_BYTES) for kind, count in communicators.connections().items()}


@dataclass(frozen=True)
class Headroom:
    """Memory a device keeps back from the model (see the module): by the published rule
    (``auto``), or ``fraction`` of its capacity plus ``fixed_bytes``."""

    fraction: float = 0.0
    fixed_bytes: float = 0.0
    text: str = "0"
    auto: bool = False

    def usable(self, capacity: float, communicators: Communicators = Communicators()) -> float:
        """What the model may use of a device of ``capacity`` bytes for a rank in
        ``communicators`` (all of an unbounded one)."""
        if not math.isfinite(capacity):
            return capacity
        if self.auto:
            kept = CUDA_CONTEXT_BYTES + sum(nccl_buffer_bytes(communicators).values())
            return (capacity - kept) / (1 + FRAGMENTATION_SHARE)
        return capacity - capacity * self.fraction - self.fixed_bytes

    def of(self, capacity: float, communicators: Communicators = Communicators()) -> float:
        """Bytes kept back on a device of ``capacity`` bytes (none on an unbounded one)."""
        return capacity - self.usable(capacity, communicators) if math.isfinite(capacity) else 0.0

    def parts(self, communicators: Communicators) -> dict | None:
        """The rule's parts for a rank (None when a number overrides it): the CUDA
        context's bytes, NCCL's bytes per communicator kind and the fragmentation share."""
        if not self.auto:
            return None
        return {"cuda_context_bytes": float(CUDA_CONTEXT_BYTES), "nccl_bytes": nccl_buffer_bytes(communicators),
                "fragmentation_share": FRAGMENTATION_SHARE}


def parse_headroom(text: str) -> Headroom:
    """``"auto"`` (the published rule), ``"10%"`` (a share of each device's memory) or
    ``"6"`` (gigabytes) -> ``Headroom``; a one-line error naming the flag otherwise."""
    value = str(text).strip()
    if value.lower() == AUTO:
        return Headroom(text=AUTO, auto=True)
    percent = value.endswith("%")
    number = value[:-1] if percent else value.removesuffix("GB").removesuffix("gb")
    try:
        amount = float(number)
    except ValueError:
        amount = math.nan
    if not math.isfinite(amount) or amount < 0 or (percent and amount >= 100):
        raise ValueError(f"--memory-headroom {text!r}: expected auto (CUDA context, NCCL buffers and fragmentation), "
                         "a share of each device's memory below 100% (e.g. 10%) or gigabytes >= 0 (e.g. 6)")
    return Headroom(amount / 100, 0.0, value) if percent else Headroom(0.0, amount * 1e9, value)
