"""Routes of tree-shaped clusters, read off their structure instead of searched for.

The built-in presets are hierarchies: a GPU reaches any other by climbing a short chain
of uplinks (GPU -> NVSwitch; GPU -> NIC -> fabric switch; GPU -> PCIe switch -> CPU
socket -> the other socket) until the two chains meet, then going down the other one.
A route is therefore found by comparing two chains of at most a few hops, whatever the
size of the cluster, where a shortest-path search over the whole graph costs time in
proportion to the number of devices (17.7 s for the dp rings of 16,384 GPUs, 99% of
it in that search). ``tests/test_scale.py`` checks, on small instances of every preset,
that the route found here is the one networkx's shortest path finds on the same graph.

Nothing here holds per-device state beyond the device list, so a 131,072-GPU cluster
costs a few tens of MB; the networkx graph (for drawing, ``topology show``) is built
only when asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from pipesim.cluster.topology import Route

if TYPE_CHECKING:
    import networkx as nx


@dataclass(frozen=True)
class Link:
    """The figures of one full-duplex link, the same in each direction."""

    bandwidth: float
    latency: float
    efficiency: float = 1.0
    medium: str = ""

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


class Hop(NamedTuple):
    """One step up a chain: the node reached, its kind, and the link that reaches it."""

    node: str
    kind: str
    link: Link


Chain = tuple[Hop, ...]
"""The uplinks of a device from the device upward, nearest node first."""


class Hierarchy:
    """Devices and, per device, the chains of uplinks it can climb.

    ``uplinks(index)`` returns the chains of device ``devices[index]``; two chains meet
    at their first common node. The route between two devices is the cheapest (lowest
    total latency, as the general search weighs it) way up one chain of the source to a
    node it shares with a chain of the destination and down that chain. Every device
    carries the same ``device_attributes`` (memory_bytes, peak_flops, memory_bandwidth, gpu)."""

    def __init__(self, devices: Sequence[str], uplinks: Callable[[int], tuple[Chain, ...]],
                 device_attributes: dict[str, object]) -> None:
        self.devices = list(devices)
        self.uplinks = uplinks
        self.device_attributes = dict(device_attributes)
        self.index = {device: position for position, device in enumerate(self.devices)}

    def __contains__(self, device: str) -> bool:
        return device in self.index

    @functools.cached_property
    def private_links(self) -> bool:
        """Whether every link lies on one device's chains only. A route climbs its
        source's chain and descends its destination's, so then transfers between
        different devices never meet on a link: what ``twin_transfers`` asks of a whole
        job's pipelines, answered with one walk of the chains instead of routing them all."""
        owner: dict[tuple[str, str], int] = {}
        for index, device in enumerate(self.devices):
            for chain in self.uplinks(index):
                below = device
                for hop in chain:
                    if owner.setdefault((below, hop.node), index) != index:
                        return False
                    below = hop.node
        return True

    def route(self, src: str, dst: str) -> Route | None:
        """The route from ``src`` to ``dst``, or None when no chains meet. Latencies
        are summed in path order, as a search over the graph sums them."""
        best = None
        downs = self.uplinks(self.index[dst])
        for up in self.uplinks(self.index[src]):
            for down in downs:
                meeting = _meeting(up, down)
                if meeting is None:
                    continue
                position, peak = meeting
                latency = 0.0
                for step in up[: position + 1]:
                    latency += step.link.latency
                for step in down[peak::-1]:
                    latency += step.link.latency
                if best is None or latency < best[0]:
                    best = (latency, up[: position + 1], down[peak::-1])
        if best is None:
            return None
        latency, climb, descent = best  # descent: the meeting node's link first, the destination's last
        nodes = [src] + [step.node for step in climb] + [step.node for step in descent[1:]] + [dst]
        figures = [step.link for step in climb] + [step.link for step in descent]
        bandwidths = tuple(figure.bandwidth * figure.efficiency for figure in figures)
        return Route(links=tuple(zip(nodes[:-1], nodes[1:], strict=True)), latency=latency,
                     bandwidth=min(bandwidths), link_bandwidths=bandwidths)

    def graph(self) -> nx.DiGraph:
        """The same cluster as a networkx graph: every device, every node of its chains,
        every link both ways."""
        import networkx as nx

        graph = nx.DiGraph()
        for index, device in enumerate(self.devices):
            graph.add_node(device, kind="gpu", **self.device_attributes)
            for chain in self.uplinks(index):
                below = device
                for hop in chain:
                    if hop.node not in graph:
                        graph.add_node(hop.node, kind=hop.kind)
                    if not graph.has_edge(below, hop.node):
                        attributes = {"bandwidth": hop.link.bandwidth, "latency": hop.link.latency,
                                      "efficiency": hop.link.efficiency, "medium": hop.link.medium}
                        graph.add_edge(below, hop.node, **attributes)
                        graph.add_edge(hop.node, below, **attributes)
                    below = hop.node
        return graph


def _meeting(up: Chain, down: Chain) -> tuple[int, int] | None:
    """(position on ``up``, position on ``down``) of the first node of ``up`` that
    ``down`` also reaches; None when the chains never meet."""
    for position, hop in enumerate(up):
        node = hop.node
        for peak, other in enumerate(down):
            if other.node == node:
                return position, peak
    return None
