"""From communication timings to a link model: bandwidth figures with the nccl-tests
definitions, an alpha-beta fit, and the topology file ``simulate --topology`` reads.

Pure Python (no torch), so the simulator side can read and refit benchmark results;
the timings themselves come from ``executor.bench_comm``.

nccl-tests (doc/PERFORMANCE.md): ``algbw = size / time``; ``busbw = algbw * factor``
where the factor turns the algorithm's traffic into what each link carries, so busbw
is comparable with the link's line rate whatever the collective: all-reduce
``2(n-1)/n`` (it moves the data twice: reduce-scatter then all-gather), all-gather and
reduce-scatter ``(n-1)/n``, all-to-all ``(n-1)/n`` (``AlltoAllGetBw``), send/recv and
broadcast 1.

Send/recv fits the links of the topology file. The collectives the executor runs inside
its compute actions (``all_to_all``, ``ring_exchange``) are fitted as themselves: their
``alpha + beta * bytes`` is what the simulator charges them on this machine
(``measured_collectives``; ``pipesim.cluster.collectives`` prices a group of the
measured size by it). On gloo an all-to-all is one call with one posting and one wait,
not a send/recv pair per peer from Python, and its ranks exchange in pairs rather than
around the whole job's ring, so the links' latency is not its latency.
"""

from __future__ import annotations

from dataclasses import dataclass

# (bus factor, latency hops) per operation on n ranks: the ring formulas of
# DESIGN.md, ``time = hops * alpha + factor * size / busbw``.
RING = {
    "sendrecv": (lambda n: 1.0, lambda n: 1),
    "broadcast": (lambda n: 1.0, lambda n: 1),
    "all_reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "all_gather": (lambda n: (n - 1) / n, lambda n: n - 1),
    "reduce_scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
    "all_to_all": (lambda n: (n - 1) / n, lambda n: 1),
    "ring_exchange": (lambda n: 1.0, lambda n: 1),
}
# Collectives fitted as themselves into the topology file, over the groups they ran in
MEASURED_COLLECTIVES = ("all_to_all", "ring_exchange")
# ... and what a topology file's ``collectives`` may price: those, and the tp collectives
# ``compare`` calibrates on its run's own steps (``pipesim.cli.held_collectives``: the
# all-reduce, or with sequence parallelism the all-gather and reduce-scatter)
FILE_COLLECTIVES = (*MEASURED_COLLECTIVES, "all_reduce", "all_gather", "reduce_scatter")


def bus_factor(operation: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw for ``operation`` on ``ranks`` ranks."""
    if operation not in RING:
        raise ValueError(f"unknown operation {operation!r}; known: {', '.join(RING)}")
    if ranks < 2:
        raise ValueError(f"a collective needs at least 2 ranks, got {ranks}")
    return RING[operation][0](ranks)


def bandwidths(operation: str, ranks: int, num_bytes: float, seconds: float) -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes per second."""
    algbw = num_bytes / seconds
    return algbw, algbw * bus_factor(operation, ranks)


@dataclass(frozen=True)
class AlphaBeta:
    """``time = alpha + beta * bytes`` (seconds, seconds per byte)."""

    alpha: float
    beta: float

    def seconds(self, num_bytes: float) -> float:
        return self.alpha + self.beta * num_bytes

    @property
    def bandwidth(self) -> float:
        return 1.0 / self.beta if self.beta > 0 else float("inf")


def fit_alpha_beta(points: list[tuple[float, float]]) -> AlphaBeta:
    """Least squares of ``time = alpha + beta * bytes`` on relative error.

    Plain least squares on seconds would be decided by the largest messages alone
    (their times are 10^4 times larger) and could return a negative latency; weighting
    each point by ``1 / time^2`` fits every size to the same relative accuracy, so the
    latency comes from the small messages and the bandwidth from the large ones.
    Points fitted exactly by a line are reproduced exactly."""
    usable = [(float(size), float(seconds)) for size, seconds in points if seconds and seconds > 0]
    if len(usable) < 2 or len({size for size, _ in usable}) < 2:
        raise ValueError("an alpha-beta fit needs timings at two or more message sizes")
    sw = sx = sy = sxx = sxy = 0.0
    for size, seconds in usable:
        weight = 1.0 / (seconds * seconds)
        sw += weight
        sx += weight * size
        sy += weight * seconds
        sxx += weight * size * size
        sxy += weight * size * seconds
    determinant = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / determinant
    alpha = (sy - beta * sx) / sw
    if beta <= 0:
        # Timings that do not grow with size (noise on a busy machine, or sizes too small
        # to see the wire): the latency is the fastest timing, and the bandwidth the
        # slowest that still explains every point; if none grows at all, the largest
        # message in one latency (finite, so the topology file stays loadable).
        alpha = min(seconds for _, seconds in usable)
        largest = max(size for size, _ in usable)
        beta = max((seconds - alpha) / size for size, seconds in usable if size > 0)
        return AlphaBeta(alpha, beta if beta > 0 else alpha / largest)
    if alpha < 0:  # refit through the origin
        beta = sum(s * t / (t * t) for s, t in usable) / sum(s * s / (t * t) for s, t in usable)
        alpha = 0.0
    return AlphaBeta(alpha, beta)


def link_fit(operation: str, ranks: int, points: list[tuple[float, float]]) -> dict:
    """The per-link latency and bandwidth the ring formula of ``operation`` implies:
    ``alpha_link = alpha / hops``, ``bandwidth_link = factor / beta`` (busbw)."""
    fit = fit_alpha_beta(points)
    factor, hops = RING[operation][0](ranks), RING[operation][1](ranks)
    bandwidth = factor / fit.beta if fit.beta > 0 else float("inf")
    return {"alpha": fit.alpha, "beta": fit.beta, "latency": fit.alpha / hops, "bandwidth": bandwidth,
            "ranks": ranks}


def row_ranks(result: dict, row: dict) -> int:
    """The ranks ``row``'s operation ran over: its group (``all_to_all``, ``ring_exchange``),
    else the whole job."""
    return int(row.get("group", result["world"]))


def bench_table(result: dict) -> list[dict]:
    """Rows with time, algbw and busbw for every timed (operation, size)."""
    rows = []
    for row in result["rows"]:
        if row.get("seconds") is None:
            continue
        algbw, busbw = bandwidths(row["operation"], row_ranks(result, row), row["bytes"], row["seconds"])
        rows.append({**row, "algbw": algbw, "busbw": busbw})
    return rows


def fits_by_operation(result: dict) -> dict[str, dict]:
    """One alpha-beta link fit per operation that has two or more sizes."""
    points: dict[str, list[tuple[float, float]]] = {}
    ranks: dict[str, int] = {}
    for row in result["rows"]:
        if row.get("seconds"):
            points.setdefault(row["operation"], []).append((row["bytes"], row["seconds"]))
            ranks[row["operation"]] = row_ranks(result, row)
    return {name: link_fit(name, ranks[name], pts) for name, pts in points.items()
            if len({s for s, _ in pts}) >= 2}


def measured_collectives(fits: dict[str, dict]) -> list[dict]:
    """The topology file's ``collectives``: for each collective fitted as itself, the
    group size it ran over, its latency (``alpha``) and the bytes per second beyond it
    (``1 / beta``, bytes of each rank's message), so that ``S / bandwidth + latency``
    gives back the fitted time of a message of S bytes."""
    return [{"operation": name, "ranks": fits[name]["ranks"], "latency": fits[name]["alpha"],
             "bandwidth": 1.0 / fits[name]["beta"]}
            for name in MEASURED_COLLECTIVES if name in fits and fits[name]["beta"] > 0]


def topology_document(result: dict, fits: dict[str, dict]) -> dict:
    """A topology file: one device per rank and a link between every pair with the
    send/recv fit (pipeline traffic is point to point), the collectives fitted as
    themselves under ``collectives`` (``measured_collectives``), every fit kept under
    ``calibration`` for reference."""
    if "sendrecv" not in fits:
        raise ValueError("the topology's links come from the sendrecv fit: benchmark sendrecv at two or more sizes")
    ranks = int(result["world"])
    link = fits["sendrecv"]
    devices = [{"name": f"rank{rank}"} for rank in range(ranks)]
    links = [{"src": f"rank{a}", "dst": f"rank{b}", "bandwidth": link["bandwidth"], "latency": link["latency"],
              "medium": f"{result['backend']} measured"}
             for a in range(ranks) for b in range(a + 1, ranks)]
    document = {
        "description": f"measured by pipesim bench-comm: {ranks} ranks, {result['backend']} on {result['device']}",
        "devices": devices,
        "links": links,
        "calibration": {"backend": result["backend"], "device": result["device"], "ranks": ranks, "fits": fits},
    }
    collectives = measured_collectives(fits)
    if collectives:
        document["collectives"] = collectives
    return document


def calibrate_latency(measured: dict[tuple[str, int], tuple[float, float]], operation: str, ranks: int,
                      num_bytes: float, seconds: float) -> tuple[float, float] | None:
    """Set the latency of the ``operation`` measured over ``ranks`` (in
    ``Topology.measured_collectives``) so that a message of ``num_bytes`` costs
    ``seconds``, as the run's own calibration steps timed it, keeping the benchmark's
    bandwidth; return the new ``(bandwidth, latency)``, or None when the benchmark has no
    fit of it to keep. Why: inside a run the collective also waits for peers that the
    run's other ranks keep off the cores, which a benchmark of idle ranks cannot see
    (``docs/calibration.md``); the bandwidth, set by the large messages, is the wire's."""
    if (operation, ranks) not in measured:
        return None
    bandwidth = measured[operation, ranks][0]
    measured[operation, ranks] = bandwidth, max(0.0, seconds - num_bytes / bandwidth)
    return measured[operation, ranks]
