"""Collective communication as closed-form costs on a group of devices.

Ring algorithms (nccl-tests PERFORMANCE.md): over n ranks a message of S bytes costs

    all-reduce       2(n-1)/n * S/B + 2(n-1) * alpha
    all-gather       (n-1)/n * S/B  + (n-1) * alpha      (S: the gathered, full size)
    reduce-scatter   (n-1)/n * S/B  + (n-1) * alpha      (S: the full input size)
    broadcast        S/B + (n-1) * alpha                 (pipelined along the ring)

Every step of a ring moves one chunk between each pair of neighbours at once, so a
step lasts as long as the slowest neighbour route: B is the lowest effective bandwidth
and alpha the highest latency among the routes ``group[i] -> group[i+1]``.

A group with k members on each of several nodes is not one ring: NCCL runs the
collective over several channels, each a ring that leaves every node from a different
GPU and so through a different network port (its topology search builds one ring per
NIC on rail-optimised nodes), each carrying 1/k of the message. pipesim lays out k such
rings (the members of every node rotated by one for each ring) and takes the pace of
the most loaded link: ``B = min over links l of k * B_l / (ring edges crossing l)``.
With one port per GPU the network crossing runs k times as fast as one ring's (the
bus bandwidth nccl-tests reports across DGX nodes is the node's ports together, not
one); a group with one member per node (tp 8, a pipeline's ranks) is one ring as
before, and so is a group inside one node (each GPU's NVLink then carries all k rings).

Tree all-reduce (NCCL's double binary tree): the message is reduced up a binary tree
and broadcast back down, pipelined in chunks. Each direction carries S over the
slowest tree edge and pays one latency per level:

    tree all-reduce  2 * S/B + 2 * ceil(log2 n) * alpha

(NCCL splits S over two complementary trees so each node's links carry ~S each way;
this is the bandwidth of one tree at full S, a slight overestimate for large n, and
the log-depth latency that makes trees win for small messages on many ranks.)

All-to-all (expert parallelism's token dispatch and combine): each of n ranks holds S
bytes, S/n for every member, and sends the n-1 pieces meant for the others at once
(NCCL posts them as one group of sends and receives). Every piece crosses the links of
its route, so a link's time is the bytes of every piece crossing it over its bandwidth,
and the slowest link sets the pace:

    all-to-all       max over links l of (pieces crossing l) * (S/n) / B_l  +  alpha

alpha the largest latency of the routes used. With every rank on a link of its own into
one switch (NVSwitch, a rail of InfiniBand) each link carries the (n-1) pieces of its
rank: ``(n-1)/n * S/B + alpha``, the ``(n-1)/n`` bus-bandwidth factor of nccl-tests'
``AlltoAllGetBw`` (src/alltoall.cu). Across nodes, a GPU's network port carries every
piece to the other nodes, which is why an all-to-all over two 8-GPU nodes runs at the
port's pace, half of S through it. Groups that exchange at the same moment (the other
tensor-parallel shards' and replicas' ep groups) add their pieces to the links they
share (``concurrent``).

A ring exchange (context parallelism's K/V ring): every rank sends S bytes to its
successor at once, ``S/B + alpha`` over the ring's slowest neighbour route, as one step
of the ring collectives above.

A collective measured on the machine as the backend runs it (``bench-comm``'s
``all_to_all`` and ``ring_exchange``, kept in ``Topology.measured_collectives``) is
priced by what was measured, ``S/B_measured + alpha_measured``, for a group of the
size it ran over, every group of the job exchanging at once as they did there; its
links then set only the other collectives' prices. This is how ``compare`` prices the
all-to-alls and K/V exchanges a gloo run makes: gloo's ``all_to_all_single`` is one call
(one posting, one wait) between the pair, not the whole job's send/recv ring whose
fit sets the links. ``compare`` also sets the tp group's ``all_reduce``, or with
sequence parallelism its ``all_gather`` and ``reduce_scatter``, from what its
calibration steps timed (``pipesim.cli.held_collectives``); being keyed by group size,
such a pace prices any group of that size, a dp group of as many ranks included.

These are analytical durations. The gradient reductions of data parallelism also hold
the links their ring (or tree) crosses in the engine's walk (``links_crossed``,
``schedules.dp_channel``), so they and the pipeline's P2P transfers delay each other
where they share one; the other collectives do not reserve links. n = 1 costs nothing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pipesim.cluster.topology import Topology

ALGORITHMS = ("ring", "tree")


def _pace(topology: Topology, pairs: Sequence[tuple[str, str]]) -> tuple[float, float]:
    """(slowest bandwidth, largest latency) over the routes of ``pairs``."""
    bandwidth, latency = math.inf, 0.0
    for src, dst in pairs:
        route = topology.route(src, dst)
        if route.links:
            bandwidth = min(bandwidth, route.bandwidth)
            latency = max(latency, route.latency)
    return bandwidth, latency


def ring_pairs(group: Sequence[str]) -> list[tuple[str, str]]:
    """The (sender, receiver) neighbours of a ring laid over ``group`` in order."""
    n = len(group)
    return [(group[i], group[(i + 1) % n]) for i in range(n)]


def tree_pairs(group: Sequence[str]) -> list[tuple[str, str]]:
    """The edges, both ways, of a binary tree laid over ``group`` in order (parent of i
    is (i-1)//2)."""
    pairs = []
    for child in range(1, len(group)):
        parent = (child - 1) // 2
        pairs += [(group[child], group[parent]), (group[parent], group[child])]
    return pairs


def ring_pace(topology: Topology, group: Sequence[str]) -> tuple[float, float]:
    """Bandwidth and latency of one ring step: the slowest neighbour route sets both; a
    group spread k to a node over several nodes runs as k rings, one per network port
    (``channel_rings``, see the module). Kept per topology and group: a step charges the
    same group once per bucket and layer."""
    key = ("ring", tuple(group))
    cached = topology.pace_cache.get(key)
    if cached is None:
        rings = channel_rings(topology, group)
        if len(rings) == 1:
            cached = _pace(topology, ring_pairs(group))
        else:  # groups laid out alike on other nodes (each pipeline stage's, each layout's) share one pace
            shape = ("rings", *_all_to_all_key(topology, (tuple(group),))[1:])
            cached = topology.pace_cache.get(shape) or _channels_pace(topology, rings)
            topology.pace_cache[shape] = cached
        topology.pace_cache[key] = cached
    return cached


def channel_rings(topology: Topology, group: Sequence[str]) -> list[list[str]]:
    """The rings NCCL's channels lay over ``group``: one (the group in order) unless the
    group has k >= 2 members on each of two or more nodes (``Topology.node_of``); then k
    rings visiting the nodes in the group's order, ring j entering each node at its j-th
    member (in the group's order) and leaving it from the member before, so that every
    ring crosses the network from a different GPU."""
    nodes = [topology.node_of(device) for device in group]
    by_node: dict[str, list[str]] = {}
    for device, node in zip(group, nodes, strict=True):
        if node is None:
            return [list(group)]
        by_node.setdefault(node, []).append(device)
    sizes = {len(members) for members in by_node.values()}
    if len(by_node) < 2 or len(sizes) != 1 or min(sizes) < 2:
        return [list(group)]
    (k,) = sizes
    return [[members[(j + i) % k] for members in by_node.values() for i in range(k)] for j in range(k)]


def _load_route(topology: Topology, src: str, dst: str, amount: float,
                load: dict[tuple[str, str], float], bandwidth: dict[tuple[str, str], float]) -> float:
    """Add ``amount`` to every link of the route from ``src`` to ``dst`` in ``load`` (each
    link's bandwidth into ``bandwidth``); the route's latency (0 for a route of no links)."""
    route = topology.route(src, dst)
    for link, link_bandwidth in zip(route.links, _link_bandwidths(route), strict=True):
        load[link] = load.get(link, 0) + amount
        bandwidth[link] = link_bandwidth
    return route.latency if route.links else 0.0


def _channels_pace(topology: Topology, rings: list[list[str]]) -> tuple[float, float]:
    """(bandwidth, latency) of ``rings`` run at once, each carrying ``1/len(rings)`` of the
    message: a link crossed by ``c`` ring edges passes each ring's chunk ``c`` times, so
    the pace is ``len(rings) * B_l / c`` on the most loaded link ``l``."""
    edges = Counter((src, ring[(index + 1) % len(ring)]) for ring in rings for index, src in enumerate(ring))
    load: dict[tuple[str, str], int] = {}
    bandwidth: dict[tuple[str, str], float] = {}
    latency = 0.0
    for (src, dst), count in edges.items():  # each pair routed once: the rings share most of their edges
        latency = max(latency, _load_route(topology, src, dst, count, load, bandwidth))
    pace = min((len(rings) * bandwidth[link] / load[link] for link in load), default=math.inf)
    return pace, latency


def tree_pace(topology: Topology, group: Sequence[str]) -> tuple[float, float]:
    """Slowest bandwidth and largest latency over the edges (both ways) of a binary tree
    laid over ``group`` in order (``tree_pairs``)."""
    key = ("tree", tuple(group))
    cached = topology.pace_cache.get(key)
    if cached is None:
        cached = topology.pace_cache[key] = _pace(topology, tree_pairs(group))
    return cached


def links_crossed(topology: Topology, group: Sequence[str], algorithm: str = "ring") -> tuple[tuple[str, str], ...]:
    """The directed links a collective over ``group`` crosses, each once in the order met:
    those of the routes between ring neighbours (``ring_pairs``) of each of the group's
    channel rings (``channel_rings``), or the tree's edges (``tree_pairs``) for a tree
    all-reduce. What the engine holds for a gradient reduction while it runs; kept per
    topology, group and algorithm."""
    key = ("links", algorithm, tuple(group))
    cached = topology.pace_cache.get(key)
    if cached is None:
        pairs = (tree_pairs(group) if algorithm == "tree"
                 else [pair for ring in channel_rings(topology, group) for pair in ring_pairs(ring)])
        links = {link: None for src, dst in pairs for link in topology.route(src, dst).links}
        cached = topology.pace_cache[key] = tuple(links)
    return cached


def _seconds(bytes_factor: float, latency_steps: float, num_bytes: float, pace: tuple[float, float]) -> float:
    bandwidth, latency = pace
    if bandwidth == math.inf:
        return latency_steps * latency
    return bytes_factor * num_bytes / bandwidth + latency_steps * latency


def all_reduce(topology: Topology, group: Sequence[str], num_bytes: float, algorithm: str = "ring") -> float:
    """Seconds to all-reduce ``num_bytes`` across ``group`` (``ring`` or ``tree``), or at
    the pace measured for a group of its size (``measured_pace``: ``num_bytes / B +
    alpha``, whatever the algorithm)."""
    n = len(group)
    if n <= 1:
        return 0.0
    measured = measured_pace(topology, "all_reduce", group)
    if measured is not None:
        return _seconds(1.0, 1, num_bytes, measured)
    if algorithm == "ring":
        return _seconds(2 * (n - 1) / n, 2 * (n - 1), num_bytes, ring_pace(topology, group))
    if algorithm == "tree":
        return _seconds(2.0, 2 * math.ceil(math.log2(n)), num_bytes, tree_pace(topology, group))
    raise ValueError(f"unknown collective algorithm {algorithm!r}: use one of {', '.join(ALGORITHMS)}")


def all_gather(topology: Topology, group: Sequence[str], num_bytes: float) -> float:
    """Seconds for a ring all-gather whose result is ``num_bytes`` on every rank, or at the
    pace measured for a group of its size (``measured_pace``: ``num_bytes / B + alpha``)."""
    return _ring_half(topology, "all_gather", group, num_bytes)


def reduce_scatter(topology: Topology, group: Sequence[str], num_bytes: float) -> float:
    """Seconds for a ring reduce-scatter of a ``num_bytes`` input per rank, or at the pace
    measured for a group of its size (``measured_pace``)."""
    return _ring_half(topology, "reduce_scatter", group, num_bytes)


def _ring_half(topology: Topology, operation: str, group: Sequence[str], num_bytes: float) -> float:
    """An all-gather or a reduce-scatter (half a ring all-reduce: the same bytes and
    steps), at ``operation``'s measured pace where there is one."""
    n = len(group)
    if n <= 1:
        return 0.0
    measured = measured_pace(topology, operation, group)
    if measured is not None:
        return _seconds(1.0, 1, num_bytes, measured)
    return _seconds((n - 1) / n, n - 1, num_bytes, ring_pace(topology, group))


def broadcast(topology: Topology, group: Sequence[str], num_bytes: float) -> float:
    """Seconds for a pipelined ring broadcast of ``num_bytes`` from ``group[0]``."""
    n = len(group)
    if n <= 1:
        return 0.0
    return _seconds(1.0, n - 1, num_bytes, ring_pace(topology, group))


def ring_exchange(topology: Topology, group: Sequence[str], num_bytes: float) -> float:
    """Seconds for every rank of ``group`` to send ``num_bytes`` to its successor in the
    ring at once (one step of ring attention): ``S/B + alpha`` at the ring's pace, or at
    the pace measured for a group of its size (``measured_pace``)."""
    if len(group) <= 1:
        return 0.0
    return _seconds(1.0, 1, num_bytes, measured_pace(topology, "ring_exchange", group) or ring_pace(topology, group))


def measured_pace(topology: Topology, operation: str, group: Sequence[str]) -> tuple[float, float] | None:
    """(bandwidth, latency) ``operation`` was measured at over groups of ``len(group)``
    ranks on this machine (``Topology.measured_collectives``), or None."""
    return topology.measured_collectives.get((operation, len(group)))


def all_to_all(topology: Topology, group: Sequence[str], num_bytes: float,
               concurrent: Sequence[Sequence[str]] = (), remote_share: float = 1.0) -> float:
    """Seconds for an all-to-all in which each rank of ``group`` holds ``num_bytes``, an
    equal piece for every member (see the module): the most loaded link's bytes over its
    bandwidth, plus the largest route latency; ``concurrent`` groups exchanging at the
    same moment load the links they share; pieces between devices of different nodes
    (``Topology.node_of``) carry ``remote_share`` of their bytes (node-limited routing).
    A group of a size measured on the machine (``measured_pace``) costs what was measured,
    ``num_bytes / B + alpha``."""
    if len(group) <= 1:
        return 0.0
    measured = measured_pace(topology, "all_to_all", group)
    if measured is not None:
        return _seconds(1.0, 1, num_bytes, measured)
    seconds_per_byte, latency = all_to_all_pace(topology, (tuple(group), *(tuple(other) for other in concurrent)),
                                                remote_share)
    return num_bytes * seconds_per_byte + latency


def all_to_all_pace(topology: Topology, groups: tuple[tuple[str, ...], ...],
                    remote_share: float = 1.0) -> tuple[float, float]:
    """(seconds per byte of S, latency) of an all-to-all over ``groups`` at once: each
    member sends ``1/n`` of S to every other member of its group (``remote_share / n``
    to a member on another node), so a link carries, per byte of S, the pieces routed
    over it. Kept per topology and groups: a step prices each stage's group once per layer."""
    key = (*_all_to_all_key(topology, groups), remote_share)
    cached = topology.pace_cache.get(key)
    if cached is None:
        load: dict[tuple[str, str], float] = {}
        bandwidth: dict[tuple[str, str], float] = {}
        latency = 0.0
        for members in groups:
            whole = 1.0 / len(members)
            for src in members:
                for dst in members:
                    if src == dst:
                        continue
                    piece = whole if remote_share == 1.0 or topology.node_of(src) == topology.node_of(dst) \
                        else whole * remote_share
                    latency = max(latency, _load_route(topology, src, dst, piece, load, bandwidth))
        per_byte = max((load[link] / bandwidth[link] for link in load), default=0.0)
        cached = topology.pace_cache[key] = (per_byte, latency)
    return cached


def _all_to_all_key(topology: Topology, groups: tuple[tuple[str, ...], ...]) -> tuple:
    """What an all-to-all's pace depends on. On a preset (a hierarchy) that is the shape
    of the groups, not the devices' names: every device's chains of uplinks with their
    nodes numbered in order of first appearance, so groups laid out alike on other nodes
    (each pipeline rank's, each layout's of a plan) share one computation of the
    ``n^2`` routes. Elsewhere, the devices themselves."""
    hierarchy = topology.hierarchy
    if hierarchy is None:
        return ("alltoall", groups)
    labels: dict[str, int] = {}
    shape = []
    for members in groups:
        for device in members:
            chains = hierarchy.uplinks(hierarchy.index[device])
            shape.append((labels.setdefault(device, len(labels)),
                          tuple(tuple((labels.setdefault(hop.node, len(labels)), hop.link) for hop in chain)
                                for chain in chains)))
    return ("alltoall-shape", tuple(len(members) for members in groups), tuple(shape))


def _link_bandwidths(route) -> tuple[float, ...]:
    """Each link's effective bandwidth on ``route`` (a route built without them: the
    route's pace on every link)."""
    return route.link_bandwidths or (route.bandwidth,) * len(route.links)


def bucket_runs(num_bytes: float, bucket_bytes: float) -> tuple[tuple[float, int], ...]:
    """``num_bytes`` cut into buckets of ``bucket_bytes``, the last one holding the rest, as
    ``(bytes, count)`` runs (full buckets, then the rest): a 70B stage has thousands of
    buckets of at most two sizes, which callers price once each."""
    if num_bytes <= 0:
        return ()
    if not bucket_bytes > 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    full, rest = divmod(num_bytes, bucket_bytes)
    return tuple(run for run in ((bucket_bytes, int(full)), (rest, 1)) if run[0] > 0 and run[1])


def bucket_sizes(num_bytes: float, bucket_bytes: float) -> tuple[float, ...]:
    """``bucket_runs`` listed bucket by bucket."""
    return listed(bucket_runs(num_bytes, bucket_bytes))


def listed(runs: tuple[tuple[float, int], ...]) -> tuple[float, ...]:
    """``(bytes, count)`` runs as one size per bucket, built by run (a tuple product each),
    not element by element."""
    sizes: tuple[float, ...] = ()
    for size, count in runs:
        sizes += (size,) * count
    return sizes


def bucketed_all_reduce(topology: Topology, group: Sequence[str], num_bytes: float, bucket_bytes: float,
                        algorithm: str = "ring") -> tuple[float, int]:
    """(seconds, buckets) for a gradient all-reduce done as DDP does it: ``num_bytes``
    cut into buckets of ``bucket_bytes`` reduced one after another, so the latency term
    is paid per bucket while the bandwidth term is the same as one big message."""
    if len(group) <= 1 or num_bytes <= 0:
        return 0.0, 0
    runs = bucket_runs(num_bytes, bucket_bytes)
    seconds = sum(count * all_reduce(topology, group, size, algorithm) for size, count in runs)
    return seconds, sum(count for _, count in runs)
