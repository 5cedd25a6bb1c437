"""Collective costs against their closed forms (nccl-tests PERFORMANCE.md factors)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cluster.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    bucketed_all_reduce,
    reduce_scatter,
    ring_pace,
)
from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.presets import nvlink
from pipesim.cluster.topology import ideal_topology

BW, LAT = 10e9, 2e-6


def ring_file(n: int, slow_link: int | None = None, slow_bw: float = 1e9, slow_lat: float = 50e-6):
    """n devices on a one-way ring of links (so routes cannot go around a slow one);
    optionally one slower link."""
    devices = [{"name": f"g{i}"} for i in range(n)]
    links = []
    for i in range(n):
        slow = i == slow_link
        links.append({"src": f"g{i}", "dst": f"g{(i + 1) % n}", "bandwidth": slow_bw if slow else BW,
                      "latency": slow_lat if slow else LAT, "directed": True})
    return topology_from_dict({"devices": devices, "links": links}), [f"g{i}" for i in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("size", [1e3, 1e6, 1e9])
def test_ring_all_reduce_all_gather_reduce_scatter_match_formulas(n, size):
    topology, group = ring_file(n)
    assert all_reduce(topology, group, size) == pytest.approx(2 * (n - 1) / n * size / BW + 2 * (n - 1) * LAT)
    assert all_gather(topology, group, size) == pytest.approx((n - 1) / n * size / BW + (n - 1) * LAT)
    assert reduce_scatter(topology, group, size) == pytest.approx((n - 1) / n * size / BW + (n - 1) * LAT)
    assert broadcast(topology, group, size) == pytest.approx(size / BW + (n - 1) * LAT)
    # all-reduce is reduce-scatter followed by all-gather
    assert all_reduce(topology, group, size) == pytest.approx(
        reduce_scatter(topology, group, size) + all_gather(topology, group, size))


def test_tree_all_reduce_formula():
    topology, group = ring_file(2)
    size = 1e8
    assert all_reduce(topology, group, size, "tree") == pytest.approx(2 * size / BW + 2 * 1 * LAT)
    topology = nvlink()
    group = topology.devices
    route = topology.route(group[0], group[1])
    expected = 2 * size / route.bandwidth + 2 * math.ceil(math.log2(8)) * route.latency
    assert all_reduce(topology, group, size, "tree") == pytest.approx(expected)
    with pytest.raises(ValueError, match="unknown collective algorithm 'butterfly'"):
        all_reduce(topology, group, size, "butterfly")


def test_slowest_link_on_the_ring_sets_the_pace():
    n, size = 4, 1e9
    topology, group = ring_file(n, slow_link=2, slow_bw=1e9, slow_lat=50e-6)
    assert ring_pace(topology, group) == (pytest.approx(1e9), pytest.approx(50e-6))
    assert all_reduce(topology, group, size) == pytest.approx(2 * (n - 1) / n * size / 1e9 + 2 * (n - 1) * 50e-6)
    fast, fast_group = ring_file(n)
    assert all_reduce(topology, group, size) > 5 * all_reduce(fast, fast_group, size)


def test_one_rank_and_free_links_cost_nothing():
    topology, group = ring_file(4)
    assert all_reduce(topology, group[:1], 1e9) == 0.0
    assert all_gather(topology, group[:1], 1e9) == 0.0
    assert all_reduce(ideal_topology(), ["gpu0", "gpu1", "gpu2"], 1e9) == 0.0


def test_bucketed_all_reduce_pays_latency_per_bucket():
    n = 4
    topology, group = ring_file(n)
    seconds, buckets = bucketed_all_reduce(topology, group, 10e6, 4e6)
    assert buckets == 3
    assert seconds == pytest.approx(2 * (n - 1) / n * 10e6 / BW + 3 * 2 * (n - 1) * LAT)
    assert bucketed_all_reduce(topology, group[:1], 10e6, 4e6) == (0.0, 0)


def test_bucket_sizes_cut_full_buckets_and_a_rest():
    from pipesim.cluster.collectives import bucket_sizes

    assert bucket_sizes(100.0, 40.0) == (40.0, 40.0, 20.0)
    assert bucket_sizes(80.0, 40.0) == (40.0, 40.0)
    assert bucket_sizes(0.0, 40.0) == ()
    with pytest.raises(ValueError, match="bucket size must be > 0 bytes, got nan"):
        bucket_sizes(100.0, float("nan"))


# A data-parallel group spread k to a node over several nodes: NCCL's channels, one ring per network port


def _ib_port_bandwidth() -> float:
    from pipesim.cluster.presets import IB_EFFICIENCY, IB_NDR_BW

    return IB_NDR_BW * IB_EFFICIENCY  # 45 GB/s: one H100's NDR port as NCCL reaches it


def test_group_with_two_gpus_a_node_runs_two_rings_at_twice_one_port():
    from pipesim.cluster.presets import ib

    topology = ib(2)
    group = ["n0.gpu0", "n0.gpu1", "n1.gpu0", "n1.gpu1"]
    size = 1e9
    # two rings, each leaving a node from a different GPU's port, each carrying half: 2 x 45 GB/s
    crossing = topology.route("n0.gpu1", "n1.gpu0")
    assert crossing.bandwidth == pytest.approx(_ib_port_bandwidth())
    latency = max(topology.route(a, b).latency for a, b in
                  [("n0.gpu0", "n0.gpu1"), ("n0.gpu1", "n1.gpu0"), ("n1.gpu1", "n0.gpu0")])
    expected = 3 / 4 * size / (2 * _ib_port_bandwidth()) + 3 * latency
    assert all_gather(topology, group, size) == pytest.approx(expected)
    assert all_reduce(topology, group, size) == pytest.approx(2 * expected)


def test_eight_gpus_a_node_run_at_the_node_ports_and_one_a_node_at_one_port():
    from pipesim.cluster.presets import NVLINK4_BW, NVLINK_EFFICIENCY, ib

    topology = ib(4)
    port = _ib_port_bandwidth()
    # tp 2: four dp members a node; each GPU's NVLink carries three of the four rings (4 x 360 / 3 = 480 GB/s),
    # the ports four rings' crossings one each: 4 x 45 = 180 GB/s sets the pace
    four = [f"n{node}.gpu{gpu}" for node in range(4) for gpu in (0, 2, 4, 6)]
    assert ring_pace(topology, four)[0] == pytest.approx(min(4 * port, 4 * NVLINK4_BW * NVLINK_EFFICIENCY / 3))
    assert ring_pace(topology, four)[0] == pytest.approx(4 * port)
    # tp 8: one member a node, one ring through one port each (as before channels)
    one = [f"n{node}.gpu3" for node in range(4)]
    assert ring_pace(topology, one)[0] == pytest.approx(port)
    # inside one node: every ring on NVLink, k rings of 1/k each load each GPU's link k times: NVLink's pace
    inside = [f"n0.gpu{gpu}" for gpu in range(8)]
    assert ring_pace(topology, inside)[0] == pytest.approx(NVLINK4_BW * NVLINK_EFFICIENCY)


def test_uneven_or_unplaced_groups_stay_one_ring():
    from pipesim.cluster.collectives import channel_rings
    from pipesim.cluster.presets import ib

    topology = ib(2)
    uneven = ["n0.gpu0", "n0.gpu1", "n0.gpu2", "n1.gpu0"]
    assert channel_rings(topology, uneven) == [uneven]
    assert ring_pace(topology, uneven)[0] == pytest.approx(_ib_port_bandwidth())
    ring, group = ring_file(4)  # a topology file without nodes
    assert channel_rings(ring, group) == [group]


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(2, 4), per_node=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_channel_rings_cover_the_group_and_cross_from_distinct_gpus(nodes, per_node, seed):
    import random

    from pipesim.cluster.collectives import channel_rings
    from pipesim.cluster.presets import ib

    topology = ib(nodes)
    rng = random.Random(seed)
    group = [f"n{node}.gpu{gpu}" for node in range(nodes) for gpu in sorted(rng.sample(range(8), per_node))]
    rings = channel_rings(topology, group)
    assert len(rings) == (per_node if per_node > 1 else 1)
    for ring in rings:
        assert sorted(ring) == sorted(group)
    leaving = [[ring[i] for i in range(len(ring)) if topology.node_of(ring[i]) != topology.node_of(
        ring[(i + 1) % len(ring)])] for ring in rings]
    for node in range(nodes):  # each ring leaves each node once, and from a GPU no other ring leaves it from
        exits = [device for ring_exits in leaving for device in ring_exits if device.startswith(f"n{node}.")]
        assert len(exits) == len(rings) and len(set(exits)) == len(rings)
