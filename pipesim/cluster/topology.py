"""The modelled cluster: devices, switches and links as a networkx graph.

Every link is stored once per direction (a directed edge) because NVLink, PCIe and
InfiniBand are full duplex: traffic one way does not slow traffic the other way, but
two transfers going the same way over one link share it. Routes follow the graph
(lowest total latency; ``pipesim.cluster.graph_routes`` searches them per pair) and are
cached per device pair. networkx is imported only where a
graph is built or walked: preset clusters and the simulation need none, and importing it
took a third of the command line's start. The built-in presets are
hierarchies (``pipesim.cluster.hierarchy``): their routes are read off the structure, and their
graph is built only when something asks for it, so a 100k-GPU cluster stays cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx

    from pipesim.cluster.graph_routes import GraphRoutes
    from pipesim.cluster.hierarchy import Hierarchy


class TopologyError(ValueError):
    """A topology that cannot carry the plan (bad file, missing device, no route)."""


@dataclass(frozen=True)
class Route:
    """The path a transfer takes: directed links in order, their summed latency and the
    slowest effective bandwidth on the way (which sets the pace of the whole transfer);
    ``link_bandwidths``: each link's effective bandwidth, in the order of ``links`` (what
    a collective whose transfers share some of the links asks: an all-to-all)."""

    links: tuple[tuple[str, str], ...]
    latency: float
    bandwidth: float
    link_bandwidths: tuple[float, ...] = ()

    def wire(self, num_bytes: float) -> tuple[float, float]:
        """How a transfer of ``num_bytes`` uses this route, the one rule of its time: the
        seconds its bytes hold every link (``bytes / bandwidth``, the slowest link's pace)
        and the latency it arrives after that. The engine queues transfers on the links
        for the first and adds the second; a route with no links (one device, an ideal
        cluster) costs nothing."""
        if not self.links:
            return 0.0, 0.0
        return num_bytes / self.bandwidth, self.latency

    def seconds(self, num_bytes: float) -> float:
        """Unloaded transfer time: the two parts of ``wire`` one after the other."""
        occupancy, latency = self.wire(num_bytes)
        return occupancy + latency


FREE_ROUTE = Route(links=(), latency=0.0, bandwidth=math.inf)


class Topology:
    """A cluster: ``graph`` nodes carry ``kind`` (``gpu`` or a switch kind) and, for
    devices, ``memory_bytes`` and ``peak_flops``; directed edges carry ``bandwidth``
    (bytes/s per direction), ``latency`` (s), ``efficiency`` (fraction of bandwidth a
    real transfer reaches) and ``medium`` (nvlink, pcie, ib, ethernet, ...).
    ``devices`` lists the GPUs in the order ranks are mapped onto them. An ``ideal``
    topology has free, instant links. ``backend`` is the torch.distributed backend whose
    links were measured (``bench-comm`` files say), None for presets of GPU clusters
    (NCCL); it sets the P2P semantics a prediction defaults to.

    A topology made ``from_hierarchy`` has no graph up front: routes and device figures
    come from the hierarchy, and ``graph`` is built from it on first use.

    ``device_defaults`` are the figures of a device the topology does not list: an ideal
    cluster's devices exist only as rank names, and ``--gpu`` gives them a capacity so that
    out of memory is judged on every topology.

    ``measured_collectives`` maps ``(operation, ranks)`` to the ``(bandwidth, latency)``
    that collective was measured at on this machine, as the backend runs it
    (``bench-comm``'s ``all_to_all`` and ``ring_exchange``): a group of that size is
    priced by it rather than by its links (``pipesim.cluster.collectives``)."""

    def __init__(self, name: str, graph: nx.DiGraph | None, devices: list[str], ideal: bool = False,
                 description: str = "", backend: str | None = None, hierarchy: Hierarchy | None = None,
                 device_defaults: dict[str, float] | None = None,
                 measured_collectives: dict[tuple[str, int], tuple[float, float]] | None = None) -> None:
        if graph is None and hierarchy is None:
            raise ValueError("a Topology needs a graph or a hierarchy")
        self.name = name
        self.backend = backend
        self._graph = graph
        self.devices = list(devices)
        self.ideal = ideal
        self.description = description
        self.hierarchy = hierarchy
        self.device_defaults = dict(device_defaults or {})
        self.measured_collectives = dict(measured_collectives or {})
        self._routes: dict[tuple[str, str], Route] = {}
        self._searcher: GraphRoutes | None = None
        # what follows from the routes alone, computed once per topology: (algorithm, device group) ->
        # (bandwidth, latency) of a collective step (pipesim.cluster.collectives), and the twin transfers of a
        # rank mapping (pipesim.sim.parallel)
        self.pace_cache: dict[tuple, object] = {}
        known = hierarchy if hierarchy is not None else graph
        for device in self.devices:
            if device not in known:
                raise TopologyError(f"topology {name}: device {device!r} is not in the graph")

    @classmethod
    def from_hierarchy(cls, name: str, hierarchy: Hierarchy, description: str = "") -> Topology:
        """A preset-style cluster whose routes follow from its structure."""
        return cls(name, None, hierarchy.devices, description=description, hierarchy=hierarchy)

    @property
    def graph(self) -> nx.DiGraph:
        """Devices, switches and links as a networkx graph (built on first use for a
        hierarchy)."""
        if self._graph is None:
            assert self.hierarchy is not None
            self._graph = self.hierarchy.graph()
        return self._graph

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, devices={len(self.devices)})"

    def effective_bandwidth(self, src: str, dst: str) -> float:
        data = self.graph.edges[src, dst]
        return data["bandwidth"] * data.get("efficiency", 1.0)

    def route(self, src: str, dst: str) -> Route:
        """The route from device ``src`` to device ``dst`` (cached)."""
        key = (src, dst)
        cached = self._routes.get(key)
        if cached is not None:
            return cached
        if self.ideal or src == dst:
            route = FREE_ROUTE
        elif self.hierarchy is not None:
            for device in (src, dst):
                if device not in self.hierarchy:
                    raise TopologyError(f"topology {self.name}: device {device!r} is not in the graph")
            route = self.hierarchy.route(src, dst)
            if route is None:
                raise TopologyError(f"topology {self.name}: no route from {src} to {dst}")
        else:
            for device in (src, dst):
                if device not in self.graph:
                    raise TopologyError(f"topology {self.name}: device {device!r} is not in the graph")
            path = self._graph_routes().path(src, dst)
            if path is None:
                raise TopologyError(f"topology {self.name}: no route from {src} to {dst}")
            links = tuple(zip(path[:-1], path[1:], strict=True))
            bandwidths = tuple(self.effective_bandwidth(*link) for link in links)
            route = Route(
                links=links,
                latency=sum(self.graph.edges[link]["latency"] for link in links),
                bandwidth=min(bandwidths),
                link_bandwidths=bandwidths,
            )
        self._routes[key] = route
        return route

    def _graph_routes(self) -> GraphRoutes:
        """The per-pair route search over this topology's graph, built once."""
        if self._searcher is None:
            from pipesim.cluster.graph_routes import GraphRoutes

            self._searcher = GraphRoutes(self.graph)
        return self._searcher

    def private_links(self) -> bool:
        """Whether a link carries the transfers of one device only (as their source or
        destination), so that transfers between different devices never share one: true
        of an ideal cluster (no links) and of a hierarchy whose links each lie on one
        device's chains (``Hierarchy.private_links``); a graph is not asked (false)."""
        if self.ideal:
            return True
        return self.hierarchy is not None and self.hierarchy.private_links

    def device_figure(self, device: str, key: str, default: float = math.inf) -> float:
        """A figure of ``device`` (``memory_bytes``, ``peak_flops``, ``memory_bandwidth``),
        ``default`` when the topology does not say; a hierarchy answers without its graph."""
        default = self.device_defaults.get(key, default)
        if self.hierarchy is not None:
            known = device in self.hierarchy
            return float(self.hierarchy.device_attributes.get(key, default)) if known else default
        if device not in self.graph:
            return default
        return float(self.graph.nodes[device].get(key, default))

    def device_gpu(self, device: str) -> str | None:
        """The ``pipesim.hardware.gpus`` name of ``device``'s GPU, None when the topology
        does not name one (ideal devices, a file giving only figures)."""
        if self.hierarchy is not None:
            return self.hierarchy.device_attributes.get("gpu") if device in self.hierarchy else None
        if device not in self.graph:
            return None
        return self.graph.nodes[device].get("gpu")

    def device_memory(self, device: str) -> float:
        """Bytes of memory on ``device``; unbounded when the topology does not say."""
        return self.device_figure(device, "memory_bytes")

    def node_of(self, device: str) -> str | None:
        """The node (server) ``device`` sits in, what node-limited expert routing counts:
        a preset's ``n<k>`` (its devices are ``n<k>.gpu<i>``; single-node presets have
        one), a topology file's ``node`` field of the device; None when unknown (every
        device then counts as one node)."""
        if self.hierarchy is not None:
            return device.split(".", 1)[0] if "." in device else None
        if device not in self.graph:
            return None
        node = self.graph.nodes[device].get("node")
        return None if node is None else str(node)

    def device_peak_flops(self, device: str) -> float:
        """Peak FLOP/s of ``device``; unbounded (unknown) when the topology does not say."""
        return self.device_figure(device, "peak_flops")

    def require_devices(self, count: int, what: str = "ranks") -> None:
        """Fail clearly when the plan needs more devices than the cluster has."""
        if self.ideal:
            return
        if count > len(self.devices):
            raise TopologyError(
                f"topology {self.name} has {len(self.devices)} devices but the plan needs {count} {what}; "
                f"use a larger topology (e.g. --topology ib --nodes {math.ceil(count / 8)})"
            )

    def summary(self) -> str:
        """A readable description: devices, switches and every link once per pair."""
        lines = [f"topology {self.name}: {len(self.devices)} devices" + (" (ideal: free links)" if self.ideal else "")]
        if self.description:
            lines.append(f"  {self.description}")
        kinds: dict[str, int] = {}
        for _, data in self.graph.nodes(data=True):
            kinds[data.get("kind", "?")] = kinds.get(data.get("kind", "?"), 0) + 1
        lines.append("  nodes: " + ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())))
        seen = set()
        for u, v, data in self.graph.edges(data=True):
            if (v, u) in seen:
                continue
            seen.add((u, v))
            both = "<->" if self.graph.has_edge(v, u) else "->"
            lines.append(
                f"  {u} {both} {v}: {data['bandwidth'] / 1e9:g} GB/s x {data.get('efficiency', 1.0):g} eff, "
                f"{data['latency'] * 1e6:g} us, {data.get('medium', '')}"
            )
        return "\n".join(lines)


def add_link(graph: nx.DiGraph, src: str, dst: str, bandwidth: float, latency: float,
             efficiency: float = 1.0, medium: str = "", directed: bool = False) -> None:
    """Add a link (both directions unless ``directed``) with the same figures each way."""
    attributes = {"bandwidth": bandwidth, "latency": latency, "efficiency": efficiency, "medium": medium}
    graph.add_edge(src, dst, **attributes)
    if not directed:
        graph.add_edge(dst, src, **attributes)


def ideal_topology(num_devices: int = 0, memory_bytes: float | None = None) -> Topology:
    """Free, instant links: what the closed-form schedule analyses assume; with
    ``memory_bytes``, every device holds that much (the capacity of ``--gpu``)."""
    import networkx as nx

    graph = nx.DiGraph()
    devices = [f"gpu{index}" for index in range(num_devices)]
    for device in devices:
        graph.add_node(device, kind="gpu")
    defaults = {"memory_bytes": float(memory_bytes)} if memory_bytes is not None else None
    description = "free, instant links" + (f"; {memory_bytes / 1e9:g} GB per device" if memory_bytes else "")
    return Topology("ideal", graph, devices, ideal=True, description=description, device_defaults=defaults)
