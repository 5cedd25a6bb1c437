"""NCCL's point-to-point channels per pipeline peer when the pipeline spans nodes
(``pipesim.sim.headroom``): one per NIC at least, or as many as carry the NIC's bandwidth at
14 GB/s a channel, rounded up to a power of two, the least over the communicator's ranks
(NCCL's ``ncclTopoGetNchannels`` and ``ncclTopoComputeP2pChannels``, src/graph/paths.cc)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipesim.cluster.files import load_topology
from pipesim.sim.headroom import Communicators, net_p2p_channels, pipeline_net_channels

GB = 1e9


@pytest.mark.parametrize("bandwidth,channels", [
    (50 * GB, 4),    # NDR 400 Gb/s: 50 / 14 = 3.6 -> 4
    (45 * GB, 4),    # the ib preset's NDR at 0.9 efficiency: 3.2 -> 4
    (25 * GB, 2),    # HDR 200 Gb/s: 1.8 -> 2
    (22.5 * GB, 2),  # 1.6 -> 2
    (12.5 * GB, 1),  # 100 GbE: 0.9 -> 1
    (100 * GB, 8),   # 7.1 -> 8
    (200 * GB, 16),  # 14.3 -> 15 -> 16, a power of two
])
def test_channels_carry_the_nic_at_14_gb_s_each_in_a_power_of_two(bandwidth, channels):
    assert net_p2p_channels(bandwidth) == channels


@given(st.floats(1e6, 1e13))
def test_the_channels_are_the_least_power_of_two_that_carries_the_nic(bandwidth):
    channels = net_p2p_channels(bandwidth)
    needed = max(1, math.ceil(bandwidth / (14 * GB)))  # one a NIC at least
    assert channels & (channels - 1) == 0  # a power of two
    assert channels >= needed and (channels == 1 or channels // 2 < needed)


def test_a_pipeline_across_nodes_keeps_the_network_s_channels_per_peer():
    """pp 16 in one node's rule: 16 channels a peer (two rounds of 8 peers in 32); across
    nodes with a 400 Gb/s NIC: 4. A middle rank, two peers: 32 connections against 8."""
    inside = Communicators(pp_peers=2, pp=16)
    across = Communicators(pp_peers=2, pp=16, pp_net_channels=4)
    assert inside.connections() == {"pp": 32}
    assert across.connections() == {"pp": 8}


def test_a_large_group_keeps_fewer_channels_than_the_network_gives():
    """pp 128: 32 halved while channels x ceil(128 / 8) > 32 leaves 2, fewer than the NIC's 4."""
    assert Communicators(pp_peers=2, pp=128, pp_net_channels=4).connections() == {"pp": 4}


def test_which_pipelines_cross_the_network_on_the_presets():
    one_node = load_topology("ib", 1, "h100")
    assert pipeline_net_channels(one_node, one_node.devices[:8]) == 0
    h100 = load_topology("ib", 2, "h100")
    assert pipeline_net_channels(h100, h100.devices[:8]) == 0  # one node of two
    assert pipeline_net_channels(h100, [h100.devices[0], h100.devices[8]]) == 4
    a100 = load_topology("ib", 2, "a100-80gb")
    assert pipeline_net_channels(a100, [a100.devices[0], a100.devices[8]]) == 2
