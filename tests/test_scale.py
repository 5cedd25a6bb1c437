"""Routes read off the presets' structure equal a shortest-path search; large clusters
stay cheap; collective costs and whole simulations do not change.

The reference for every preset is its graph built link by link here, as the presets
described it before routes came from the structure, and searched with networkx."""

from __future__ import annotations

import random

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cluster import presets
from pipesim.cluster.collectives import all_gather, all_reduce, bucketed_all_reduce, tree_pace
from pipesim.cluster.mapping import map_ranks
from pipesim.cluster.topology import Route, Topology, TopologyError, add_link
from pipesim.cluster.twins import twin_transfers
from pipesim.model.costs import uniform_costs
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from schedules import generate, lower
from schedules.generators import (
    GENERATORS,
    MULTI_CHUNK,
    ScheduleTooLargeError,
    ScheduleUnavailableError,
    action_bound,
)

GB, US = 1e9, 1e-6
H100_BYTES = 81559 * 2**20  # what the driver reports for an "80 GB" H100 SXM (nvidia-smi: 81559 MiB)
H100 = {"kind": "gpu", "memory_bytes": H100_BYTES, "peak_flops": 989e12, "memory_bandwidth": 3.35e12, "gpu": "h100"}


def _nvswitch_node(graph: nx.DiGraph, node: int) -> list[str]:
    switch = f"n{node}.nvswitch"
    graph.add_node(switch, kind="nvswitch")
    devices = []
    for local in range(8):
        gpu = f"n{node}.gpu{local}"
        graph.add_node(gpu, **H100)
        add_link(graph, gpu, switch, 450 * GB, 1.5 * US, 0.8, "nvlink")
        devices.append(gpu)
    return devices


def reference_nvlink() -> tuple[nx.DiGraph, list[str]]:
    graph = nx.DiGraph()
    return graph, _nvswitch_node(graph, 0)


def reference_pcie(link_bw: float) -> tuple[nx.DiGraph, list[str]]:
    graph = nx.DiGraph()
    devices = []
    for socket in range(2):
        graph.add_node(f"cpu{socket}", kind="host")
        for switch_index in range(2):
            switch = f"pcie_switch{socket * 2 + switch_index}"
            graph.add_node(switch, kind="pcie_switch")
            add_link(graph, switch, f"cpu{socket}", link_bw, 1 * US, 0.8, "pcie")
            for _ in range(2):
                gpu = f"gpu{len(devices)}"
                graph.add_node(gpu, **H100)
                add_link(graph, gpu, switch, link_bw, 1 * US, 0.8, "pcie")
                devices.append(gpu)
    add_link(graph, "cpu0", "cpu1", 62 * GB, 1 * US, 0.8, "upi")
    return graph, devices


def reference_multi_node(nodes: int, nic_bw: float, hop_latency: float, efficiency: float,
                         medium: str) -> tuple[nx.DiGraph, list[str]]:
    graph = nx.DiGraph()
    fabric = f"{medium}_switch"
    graph.add_node(fabric, kind=fabric)
    devices = []
    for node in range(nodes):
        devices += _nvswitch_node(graph, node)
        for local in range(8):
            nic = f"n{node}.nic{local}"
            graph.add_node(nic, kind="nic")
            add_link(graph, f"n{node}.gpu{local}", nic, 63 * GB, 1 * US, 0.8, "pcie")
            add_link(graph, nic, fabric, nic_bw, hop_latency, efficiency, medium)
    return graph, devices


REFERENCES = {
    "nvlink": lambda nodes: reference_nvlink(),
    "pcie": lambda nodes: reference_pcie(31.5 * GB),
    "pcie5": lambda nodes: reference_pcie(63 * GB),
    "ib": lambda nodes: reference_multi_node(nodes, 50 * GB, 2.5 * US, 0.9, "ib"),
    "ethernet": lambda nodes: reference_multi_node(nodes, 12.5 * GB, 7.5 * US, 0.85, "ethernet"),
}
SMALL_NODES = {"nvlink": 1, "pcie": 1, "pcie5": 1, "ib": 3, "ethernet": 3}


def searched_route(graph: nx.DiGraph, src: str, dst: str) -> Route:
    """The route by networkx's shortest path (lowest total latency) on ``graph``."""
    path = nx.shortest_path(graph, src, dst, weight="latency")
    links = tuple(zip(path[:-1], path[1:], strict=True))
    bandwidths = tuple(graph.edges[link]["bandwidth"] * graph.edges[link]["efficiency"] for link in links)
    return Route(links, sum(graph.edges[link]["latency"] for link in links), min(bandwidths), bandwidths)


def searched_topology(name: str, nodes: int) -> Topology:
    """The preset as a plain graph topology (general path search), each device's node
    named as a topology file names it (what a collective's channel rings count)."""
    graph, devices = REFERENCES[name](nodes)
    for device in devices:
        if "." in device:
            graph.nodes[device]["node"] = device.split(".", 1)[0]
    return Topology(f"{name}-searched", graph, devices)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_every_preset_is_the_cluster_it_describes(name):
    graph, devices = REFERENCES[name](SMALL_NODES[name])
    topology = presets.PRESETS[name](SMALL_NODES[name])
    assert topology.devices == devices
    assert dict(topology.graph.nodes(data=True)) == dict(graph.nodes(data=True))
    assert {(u, v): data for u, v, data in topology.graph.edges(data=True)} == {
        (u, v): data for u, v, data in graph.edges(data=True)}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_structural_routes_equal_shortest_paths_on_every_pair(name):
    graph, devices = REFERENCES[name](SMALL_NODES[name])
    topology = presets.PRESETS[name](SMALL_NODES[name])
    for src in devices:
        for dst in devices:
            if src != dst:
                assert topology.route(src, dst) == searched_route(graph, src, dst), (src, dst)


@pytest.fixture(scope="module")
def ib_64_nodes():
    return presets.ib(64), REFERENCES["ib"](64)[0]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 511), st.integers(0, 511))
def test_structural_routes_equal_shortest_paths_on_random_pairs_of_512_gpus(ib_64_nodes, src, dst):
    topology, graph = ib_64_nodes
    if src != dst:
        source, target = topology.devices[src], topology.devices[dst]
        assert topology.route(source, target) == searched_route(graph, source, target)


def test_route_figures_by_hand():
    topology = presets.ib(2)
    inside = topology.route("n0.gpu1", "n0.gpu5")
    assert inside.links == (("n0.gpu1", "n0.nvswitch"), ("n0.nvswitch", "n0.gpu5"))
    assert inside.latency == pytest.approx(3 * US) and inside.bandwidth == pytest.approx(360 * GB)
    across = topology.route("n0.gpu1", "n1.gpu5")  # PCIe to the NIC (50.4 GB/s), NDR (45 GB/s), both ways
    assert across.latency == pytest.approx(2 * 1 * US + 2 * 2.5 * US)
    assert across.bandwidth == pytest.approx(45 * GB)
    cross_socket = presets.pcie(1).route("gpu0", "gpu6")  # 3 PCIe hops up and down, UPI between
    assert cross_socket.latency == pytest.approx(5 * US)
    assert cross_socket.bandwidth == pytest.approx(25.2 * GB)  # 31.5 GB/s x 0.8 on PCIe, UPI 62 x 0.8


def test_ring_all_reduce_across_nodes_by_hand():
    topology = presets.ib(4)
    group = map_ranks(topology, dp=4, pp=1, tp=8).dp_group(0, 0)  # one GPU per node
    n, size = 4, 1e9
    expected = 2 * (n - 1) / n * size / (45 * GB) + 2 * (n - 1) * 7 * US
    assert all_reduce(topology, group, size) == pytest.approx(expected)


@pytest.mark.parametrize("name,nodes", [("ib", 4), ("ethernet", 4), ("pcie", 1), ("nvlink", 1)])
def test_collective_costs_unchanged(name, nodes):
    structural, searched = presets.PRESETS[name](nodes), searched_topology(name, nodes)
    shuffled = list(structural.devices)
    random.Random(7).shuffle(shuffled)
    for group in (structural.devices, shuffled[:5], shuffled[: len(shuffled) // 2]):
        for algorithm in ("ring", "tree"):
            assert all_reduce(structural, group, 3e8, algorithm) == all_reduce(searched, group, 3e8, algorithm)
        assert all_gather(structural, group, 3e8) == all_gather(searched, group, 3e8)
        assert tree_pace(structural, group) == tree_pace(searched, group)
        assert bucketed_all_reduce(structural, group, 1e9, 25 * 2**20) == bucketed_all_reduce(
            searched, group, 1e9, 25 * 2**20)


def test_a_3d_step_is_the_same_on_structural_and_searched_routes():
    parallel = ParallelConfig(dp=2, tp=4)
    schedule = generate("interleaved-1f1b", 4, 8, 2)
    costs = uniform_costs(8, 1e-3, 2e-3, act_bytes=5e7, virtual_stages=2)
    structural = run_simulation(schedule, costs, presets.ib(4), parallel=parallel)
    searched = run_simulation(schedule, costs, searched_topology("ib", 4), parallel=parallel)
    assert structural.trace.events == searched.trace.events


def test_a_hundred_thousand_gpu_cluster_is_built_without_its_graph():
    topology = presets.ib(16384)
    assert len(topology.devices) == 131072
    assert topology._graph is None  # nothing materialised per link
    route = topology.route(topology.devices[0], topology.devices[-1])
    assert route.links[0] == ("n0.gpu0", "n0.nic0") and route.links[-1] == ("n16383.nic7", "n16383.gpu7")
    assert topology.device_memory("n16383.gpu7") == H100_BYTES
    assert topology._graph is None


def test_unknown_device_is_a_clear_error():
    with pytest.raises(TopologyError, match="'n9.gpu0' is not in the graph"):
        presets.ib(2).route("n0.gpu0", "n9.gpu0")


# --- the guard against schedules too large to build -------------------------------

@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(GENERATORS)), st.integers(1, 8), st.integers(1, 24), st.integers(1, 3))
def test_action_bound_is_the_lowered_action_count(name, pp, microbatches, chunks):
    chunks = chunks if name in MULTI_CHUNK else 1
    try:
        schedule = generate(name, pp, microbatches, chunks)
    except ScheduleUnavailableError:
        return
    bound, actual = action_bound(name, pp, microbatches, chunks), lower(schedule).num_actions
    looped = all(rank == stage % pp for stage, rank in enumerate(schedule.placement))
    # exact where every stage boundary crosses ranks (looped placements); V shapes keep some on
    # one rank, and dualpipev runs some backwards whole (B) instead of split (I, W)
    assert bound == actual if looped and name != "dualpipev" else bound >= actual


def test_generate_refuses_a_schedule_over_the_limit_before_building_it():
    with pytest.raises(ScheduleTooLargeError, match=r"59,999,600,000 actions .* --max-actions 59999600000"):
        generate("1f1b", 100_000, 100_000)  # would need ~20 TB if it were built
    count = action_bound("1f1b", 4, 8)  # 2*8*4 compute + 4*8*3 sends and receives
    assert count == 160
    assert generate("1f1b", 4, 8, max_actions=160).microbatches == 8
    with pytest.raises(ScheduleTooLargeError, match="over the limit of 159"):
        generate("1f1b", 4, 8, max_actions=159)


@pytest.mark.parametrize("command", ["simulate", "show", "export", "sweep", "demo"])
def test_every_schedule_command_refuses_impossible_work_naming_the_flag(command, capsys, tmp_path):
    status = main([command, "--pp", "100000", "--microbatches", "100000"]
                  + (["--out", str(tmp_path / "out")] if command in ("demo", "export") else []))
    assert status == 2
    error = capsys.readouterr().err
    assert "actions once lowered, over the limit of 5,000,000" in error and "--max-actions" in error


def test_max_actions_raises_the_limit():
    assert main(["simulate", "--pp", "4", "--microbatches", "8", "--max-actions", "159"]) == 2
    assert main(["simulate", "--pp", "4", "--microbatches", "8", "--max-actions", "160"]) == 0


@pytest.mark.parametrize("name", ["ib", "pcie"])
def test_all_to_all_by_the_shape_of_its_groups_equals_the_graph_search(name):
    """A preset prices an all-to-all once per shape of its groups (the devices' uplinks with
    their nodes renumbered): groups laid out alike on other nodes share it. Every answer
    must equal the general search's on the graph of the same cluster, which keys by device."""
    from pipesim.cluster.collectives import all_to_all

    nodes = SMALL_NODES[name]
    structural, searched = presets.PRESETS[name](nodes), searched_topology(name, nodes)
    devices = structural.devices
    rng = random.Random(7)
    cases = [([devices[0], devices[2]], [[devices[1], devices[3]]]), (devices[:4], [devices[4:8]])]
    if name == "ib":
        cases += [([f"n{node}.gpu{gpu}" for node in range(3) for gpu in (0, 1)], []),
                  ([f"n{node}.gpu{gpu}" for node in (1, 2, 0) for gpu in (5, 6)], []),  # the same shape, elsewhere
                  ([f"n0.gpu{gpu}" for gpu in range(8)], [[f"n1.gpu{gpu}" for gpu in range(8)]])]
    cases += [(rng.sample(devices, 4), [rng.sample(devices, 3)]) for _ in range(6)]
    for group, concurrent in cases:
        assert all_to_all(structural, group, 1e9, concurrent) == pytest.approx(
            all_to_all(searched, group, 1e9, concurrent), rel=1e-12), (group, concurrent)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_twins_read_off_private_links_equal_those_of_routing_every_pipeline(name):
    # a preset whose links are each one GPU's answers without routing; the same cluster as
    # a plain graph routes every pipeline: the two agree for every layout that fits
    nodes = SMALL_NODES[name]
    topology, searched = presets.PRESETS[name](nodes), searched_topology(name, nodes)
    assert topology.private_links() == (name in ("nvlink", "ib", "ethernet"))
    assert not searched.private_links()
    gpus = len(topology.devices)
    for pp, tp, order in ((2, 1, "tp-pp-dp"), (2, 2, "tp-pp-dp"), (4, 2, "tp-pp-dp"), (2, 2, "dp-pp-tp"),
                          (3, 1, "tp-pp-dp")):
        dp = gpus // (pp * tp)
        schedule = generate("1f1b", pp, 4)
        pipelines = map_ranks(topology, dp, pp, tp, order).pipelines()
        assert twin_transfers(schedule, topology, pipelines) == twin_transfers(schedule, searched, pipelines)
