"""Collective costs against their closed forms (nccl-tests PERFORMANCE.md factors)."""

from __future__ import annotations

import math

import pytest

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
