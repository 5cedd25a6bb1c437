"""Topology files route as fast as the presets and exactly as a shortest-path search.

A file that describes a preset's cluster (written by ``benchmarks/topology_files.py``)
must give the preset's routes and the preset's simulated step; on any graph the per-pair
search (``pipesim.cluster.graph_routes``) must find a path as short as networkx's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cluster import presets
from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.graph_routes import GraphRoutes
from pipesim.cluster.topology import TopologyError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from topology_files import topology_document  # noqa: E402


@pytest.mark.parametrize("name,nodes", [("ib", 3), ("ethernet", 2), ("nvlink", 1), ("pcie", 1)])
def test_a_file_of_a_preset_routes_every_pair_as_the_preset(name, nodes):
    preset = presets.PRESETS[name](nodes)
    written = topology_from_dict(topology_document(preset), name="file")
    assert written.hierarchy is None and written.devices == preset.devices
    for src in preset.devices:
        for dst in preset.devices:
            assert written.route(src, dst) == preset.route(src, dst), (src, dst)


def test_a_file_of_a_preset_simulates_the_preset_step(tmp_path, capsys):
    path = tmp_path / "ib4.json"
    path.write_text(json.dumps(topology_document(presets.ib(4))))
    steps = []
    for topology in (["--topology", "ib", "--nodes", "4"], ["--topology", str(path)]):
        out = tmp_path / f"{len(steps)}.json"
        assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "--dp", "4", "--tp", "2", "--microbatches", "8",
                     "--model", "llama3-8b", *topology, "--json", str(out)]) == 0
        steps.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert steps[0]["makespan"] == steps[1]["makespan"] > 0
    assert steps[0]["ranks"] == steps[1]["ranks"]


def _hub_route_figures() -> dict:
    """Five islands of two GPUs behind a switch of their own, joined by one fabric switch
    (the hub) and by one slow direct link between islands 0 and 1."""
    devices, switches, links = [], [{"name": "fabric"}], []
    for island in range(5):
        switches.append({"name": f"sw{island}"})
        links.append({"src": f"sw{island}", "dst": "fabric", "bandwidth": 50e9, "latency": 5e-6})
        for local in range(2):
            gpu = f"i{island}g{local}"
            devices.append({"name": gpu})
            links.append({"src": gpu, "dst": f"sw{island}", "bandwidth": 400e9, "latency": 1e-6})
    links.append({"src": "sw0", "dst": "sw1", "bandwidth": 10e9, "latency": 2e-6})
    return {"devices": devices, "switches": switches, "links": links}


def test_routes_by_hand_through_the_hub_and_around_it():
    topology = topology_from_dict(_hub_route_figures())
    topology._searcher = GraphRoutes(topology.graph, hub_degree=4)  # five links: a hub at a lower threshold
    assert topology._searcher.hubs == ["fabric"]
    inside = topology.route("i2g0", "i2g1")
    assert inside.links == (("i2g0", "sw2"), ("sw2", "i2g1")) and inside.latency == pytest.approx(2e-6)
    across = topology.route("i2g0", "i3g1")  # up to the fabric and down: 1 + 5 + 5 + 1 us
    assert across.links == (("i2g0", "sw2"), ("sw2", "fabric"), ("fabric", "sw3"), ("sw3", "i3g1"))
    assert across.latency == pytest.approx(12e-6) and across.bandwidth == pytest.approx(50e9)
    direct = topology.route("i0g0", "i1g1")  # the direct link (4 us) beats the fabric (12 us)
    assert direct.links == (("i0g0", "sw0"), ("sw0", "sw1"), ("sw1", "i1g1"))
    assert direct.latency == pytest.approx(4e-6) and direct.bandwidth == pytest.approx(10e9)


@st.composite
def latency_graphs(draw):
    """Random strongly connected digraphs with random latencies, some nodes of high degree."""
    size = draw(st.integers(3, 14))
    graph = nx.DiGraph()
    graph.add_nodes_from(range(size))
    for node in range(size):  # a ring keeps every node reachable both ways
        graph.add_edge(node, (node + 1) % size, latency=draw(st.integers(0, 9)) / 4)
    for _ in range(draw(st.integers(0, 3 * size))):
        src, dst = draw(st.integers(0, size - 1)), draw(st.integers(0, size - 1))
        if src != dst:
            graph.add_edge(src, dst, latency=draw(st.integers(0, 9)) / 4)
    return nx.relabel_nodes(graph, {node: f"v{node}" for node in graph})


@settings(max_examples=150, deadline=None)
@given(latency_graphs(), st.integers(0, 4), st.data())
def test_the_search_finds_a_shortest_path_on_any_graph(graph, hub_degree, data):
    routes = GraphRoutes(graph, hub_degree=hub_degree)
    nodes = sorted(graph)
    src, dst = data.draw(st.sampled_from(nodes)), data.draw(st.sampled_from(nodes))
    path = routes.path(src, dst)
    assert path[0] == src and path[-1] == dst
    latency = sum(graph.edges[hop]["latency"] for hop in zip(path[:-1], path[1:], strict=True))
    assert latency == pytest.approx(nx.shortest_path_length(graph, src, dst, weight="latency"))


def test_unreachable_device_is_still_named():
    figures = _hub_route_figures()
    figures["devices"].append({"name": "lonely"})
    figures["links"].append({"src": "lonely", "dst": "sw0", "bandwidth": 1e9, "latency": 1e-6, "directed": True})
    with pytest.raises(TopologyError, match="device 'lonely' is not connected to 'i0g0' in both directions"):
        topology_from_dict(figures, name="t")


def test_a_device_node_field_is_read_and_a_bad_one_named():
    """A file's ``node`` says which server a device sits in: what node-limited expert
    routing and NCCL's channel counts (the memory headroom) read. Without it each device
    counts as a node of its own (None)."""
    link = {"src": "a", "dst": "b", "bandwidth": 1e9, "latency": 1e-6}
    both = topology_from_dict({"devices": [{"name": "a", "node": "rack1-n0"}, {"name": "b", "node": 7}],
                               "links": [link]}, name="file")
    assert (both.node_of("a"), both.node_of("b")) == ("rack1-n0", "7")
    unnamed = topology_from_dict({"devices": [{"name": "a"}, {"name": "b"}], "links": [link]}, name="f")
    assert unnamed.node_of("a") is None
    with pytest.raises(TopologyError, match=r"devices\[1\]: 'node' must be a name or a whole number"):
        topology_from_dict({"devices": [{"name": "a"}, {"name": "b", "node": [1]}], "links": [link]}, name="f")
    with pytest.raises(TopologyError, match=r"devices\[0\]: 'node' must be a name or a whole number, not 1.5"):
        topology_from_dict({"devices": [{"name": "a", "node": 1.5}, {"name": "b"}], "links": [link]}, name="f")
