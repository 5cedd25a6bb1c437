"""Lowest-latency routes of a topology file's graph, found per device pair on demand.

A file describes any graph, so its routes are searched for, not read off a structure as
the presets' are (``pipesim.cluster.hierarchy``). Searched naively, each pair costs a
walk of the whole graph: the fabric switch of a cluster joins every NIC, so every route
between nodes expands all of its links, and 2,048 GPUs took minutes. Real clusters are
small islands (a node's GPUs, NVSwitch and NICs) joined by a few *hubs* of high degree
(fabric, leaf and spine switches). A route either passes through a hub or stays in
the islands, so the route from ``a`` to ``b`` is the shorter of

- the best ``a -> hub -> b``, from one search from each hub over the whole graph (both
  directions, kept), and
- a search from ``a`` that never enters a hub, which stays inside ``a``'s island and stops
  as soon as it cannot beat the first.

That is the exact shortest path (a path through hubs is shortest through its first hub,
so the hub searches see it whole; one through none is what the island search sees); ties
between equally short routes may be broken differently from networkx's search.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx

HUB_DEGREE = 32
"""A node with more links than this (in or out) is a hub: searched from once, never
walked through by the per-pair search. Switches of nodes (8 GPUs) stay below it,
fabric switches are above it."""

Adjacency = dict[str, dict[str, float]]
Tree = tuple[dict[str, float], dict[str, str]]


class GraphRoutes:
    """The lowest-latency path between nodes of ``graph`` (edge weight ``latency``)."""

    def __init__(self, graph: nx.DiGraph, hub_degree: int = HUB_DEGREE) -> None:
        self.forward: Adjacency = {node: {} for node in graph}
        self.backward: Adjacency = {node: {} for node in graph}
        for src, dst, latency in graph.edges(data="latency"):
            self.forward[src][dst] = float(latency)
            self.backward[dst][src] = float(latency)
        self.hubs = sorted(node for node in graph
                           if len(self.forward[node]) > hub_degree or len(self.backward[node]) > hub_degree)
        self._from_hub: dict[str, Tree] = {}
        self._to_hub: dict[str, Tree] = {}

    def path(self, src: str, dst: str) -> list[str] | None:
        """Nodes from ``src`` to ``dst`` along a lowest-latency route; None when ``dst``
        cannot be reached."""
        if src == dst:
            return [src]
        best, best_hub = math.inf, None
        for hub in self.hubs:
            to_hub, from_hub = self._tree(hub, towards=True)[0], self._tree(hub, towards=False)[0]
            latency = to_hub.get(src, math.inf) + from_hub.get(dst, math.inf)
            if latency < best:
                best, best_hub = latency, hub
        island = self._island_path(src, dst, best)
        if island is not None:
            return island
        if best_hub is None:
            return None
        return self._through(src, best_hub, dst)

    def _tree(self, hub: str, towards: bool) -> Tree:
        """Shortest latencies and the next node on the way: to ``hub`` from every node
        (``towards``: searched over reversed links) or from ``hub`` to every node."""
        cache = self._to_hub if towards else self._from_hub
        if hub not in cache:
            cache[hub] = _dijkstra(self.backward if towards else self.forward, hub)
        return cache[hub]

    def _through(self, src: str, hub: str, dst: str) -> list[str]:
        """``src`` up to ``hub`` then on to ``dst``, each half along its search tree."""
        _, toward = self._tree(hub, towards=True)
        _, back = self._tree(hub, towards=False)
        climb = [src]
        while climb[-1] != hub:
            climb.append(toward[climb[-1]])
        descent = [dst]
        while descent[-1] != hub:
            descent.append(back[descent[-1]])
        return climb + descent[-2::-1]

    def _island_path(self, src: str, dst: str, bound: float) -> list[str] | None:
        """The shortest path from ``src`` to ``dst`` that passes through no hub, if one
        is shorter than ``bound`` (the best route through a hub)."""
        hubs = self._hub_set
        previous: dict[str, str] = {}
        for latency, node in _settle(self.forward, src, previous, lambda node: node == src or node not in hubs):
            if latency >= bound:
                return None
            if node == dst:
                path = [dst]
                while path[-1] != src:
                    path.append(previous[path[-1]])
                return path[::-1]
        return None

    @property
    def _hub_set(self) -> frozenset[str]:
        hubs = self.__dict__.get("_hubs_frozen")
        if hubs is None:
            hubs = self.__dict__["_hubs_frozen"] = frozenset(self.hubs)
        return hubs


def _dijkstra(adjacency: Adjacency, origin: str) -> Tree:
    """Latency from ``origin`` to every node it reaches over ``adjacency``, and each
    node's previous node on the way (over reversed links: its next node toward origin)."""
    previous: dict[str, str] = {}
    distance = {node: latency for latency, node in _settle(adjacency, origin, previous)}
    return distance, previous


def _settle(adjacency: Adjacency, origin: str, previous: dict[str, str],
            expands: Callable[[str], bool] = lambda node: True) -> Iterator[tuple[float, str]]:
    """Dijkstra's search from ``origin``: each node it reaches with its latency, nearest
    first, recording in ``previous`` the node before it; a node ``expands`` refuses is
    reached but not gone through."""
    distance = {origin: 0.0}
    queue = [(0.0, origin)]
    done = set()
    while queue:
        latency, node = heapq.heappop(queue)
        if node in done:
            continue
        done.add(node)
        yield latency, node
        if not expands(node):
            continue
        for neighbour, hop in adjacency[node].items():
            reached = latency + hop
            if reached < distance.get(neighbour, math.inf):
                distance[neighbour] = reached
                previous[neighbour] = node
                heapq.heappush(queue, (reached, neighbour))
