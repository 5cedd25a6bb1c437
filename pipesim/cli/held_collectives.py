"""The collectives a ``pipesim compare`` run holds its ranks for inside its compute
actions (ep's all-to-alls, the cp ring's K/V steps, tp's collectives): which to
benchmark, at which sizes, and the seconds the run's calibration steps timed them at
(docs/calibration.md, "How the all-to-all and the ring step are priced"): the
all-to-all and the ring step at the benchmark's bandwidth, the tp all-reduce, or with
sequence parallelism tp's all-gathers and reduce-scatters, at the links' ring bandwidth;
and beside the actions, the dp group's collectives (``dp_collectives``) the same way.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executor.config import RunConfig
    from pipesim.cluster.topology import Topology
    from pipesim.model.costs import Costs
    from schedules.schedule import Schedule
    from schedules.trace import Trace

# beside the run's own message sizes, the sizes its held collectives are timed at for the bandwidth
BANDWIDTH_SIZES = (2**20, 2**24)


def held_collectives(config: RunConfig) -> dict[str, int]:
    """The collectives the run holds its ranks for inside compute actions that the
    simulator prices from the benchmark, each with its group size: ep's all-to-alls
    (``all_to_all_single`` over each ep group) and the ring's K/V steps (a batched
    send/recv to the cp group's neighbours; ``--cp-comm all-gather`` keeps its gathers
    in the measured compute)."""
    held = {}
    if config.ep > 1:
        held["all_to_all"] = config.ep
    if config.cp > 1 and config.cp_comm == "p2p":
        held["ring_exchange"] = config.cp
    return held


def held_message_sizes(config: RunConfig, num_stages: int) -> dict[str, list[int]]:
    """The sizes to time each of ``held_collectives`` at: the messages the run sends
    (each stage's ``dispatch_bytes`` for the all-to-all; its ``kv_bytes``, and twice that
    for the backward's middle steps, for the ring), so that the fit is pinned where the
    run uses it (on a shared CPU a fit over 1 kB..16 MB put an 8 kB all-to-all at half
    what it measured: the relative-error fit follows the fastest small size), and
    ``BANDWIDTH_SIZES`` for the bytes term."""
    held = held_collectives(config)
    if not held:
        return {}
    from executor.run_costs import stage_bytes  # noqa: PLC0415 - builds the model to count it

    entries = stage_bytes(config, num_stages)
    blocks = {entry.get("kv_bytes", 0.0) for entry in entries}
    run = {"all_to_all": {entry.get("dispatch_bytes", 0.0) for entry in entries},
           "ring_exchange": blocks | ({2 * size for size in blocks} if config.cp > 2 else set())}
    return {name: sorted({int(size) for size in run[name] if size > 0} | set(BANDWIDTH_SIZES)) for name in held}


def calibrate_held(topology: Topology, config: RunConfig, schedule: Schedule, costs: Costs,
                   calibrated: list[dict], links_benchmarked: bool = True) -> dict[str, dict]:
    """Give the held collectives the seconds the calibration steps timed them at, keeping
    the benchmark's bandwidth: the all-to-all (``ep``) its mean at ``dispatch_bytes``
    (``pipesim.cluster.comm_fit.calibrate_latency``); the ring step (``cp``) the latency
    at which the simulator's own rule charges the calibration steps the ring waits they
    measured (``ring_latency``); the tp all-reduce its mean at ``tp_message_bytes``
    (``tp_all_reduce``, at the links' bandwidth), or with sequence parallelism the tp
    all-gather and reduce-scatter the price at which the simulator charges the steps the
    seconds they held their ranks in them (``tp_gather_scatter``), where
    ``links_benchmarked`` (compare measured the links itself; a ``--topology`` file's
    links are the user's to keep).
    What was set, and what the benchmark
    had priced the run's message at (``benchmark_seconds``), for ``--json``."""
    from executor.run_costs import held_seconds  # noqa: PLC0415
    from pipesim.cluster.comm_fit import calibrate_latency  # noqa: PLC0415

    traces = [result["trace"] for result in calibrated]
    measured = topology.measured_collectives
    paces = {}
    sizes = {stage.dispatch_bytes for stage in costs.stages if stage.moe_layers and stage.dispatch_bytes}
    key = ("all_to_all", config.ep)
    seconds = held_seconds(traces, "ep") if config.ep > 1 and key in measured else None
    if seconds is not None and len(sizes) == 1:
        (size,) = sizes
        benchmark = size / measured[key][0] + measured[key][1]
        bandwidth, latency = calibrate_latency(measured, *key, size, seconds)
        paces["all_to_all"] = {"ranks": config.ep, "bytes": size, "seconds": seconds, "bandwidth": bandwidth,
                               "latency": latency, "benchmark_seconds": benchmark}
    tp = tp_all_reduce(topology, config, costs, traces) if links_benchmarked else None
    if tp is not None:
        paces["all_reduce"] = tp
    if links_benchmarked:
        paces.update(tp_gather_scatter(topology, config, schedule, costs, traces))
        for operation, pace in dp_collectives(topology, config, schedule, costs, traces).items():
            paces.setdefault(operation, pace)  # a tp group of the dp group's size keeps tp's price
    key = ("ring_exchange", config.cp)
    ring = [stage.kv_bytes for stage in costs.stages if stage.attention_layers and stage.kv_bytes]
    if config.cp > 1 and config.cp_comm == "p2p" and ring and key in measured:
        bandwidth, benchmark_latency = measured[key]
        latency = ring_latency(topology, config, schedule, costs, traces)
        if latency is not None:
            paces["ring_exchange"] = {"ranks": config.cp, "bytes": ring[0], "seconds": ring[0] / bandwidth + latency,
                                      "bandwidth": bandwidth, "latency": latency,
                                      "benchmark_seconds": ring[0] / bandwidth + benchmark_latency}
    return paces


def tp_all_reduce(topology: Topology, config: RunConfig, costs: Costs, traces: list[Trace]) -> dict | None:
    """Give the tp all-reduce (over groups of ``config.tp``, in
    ``Topology.measured_collectives``) the seconds the calibration steps timed one at
    (``held_seconds`` of the ``tp`` stream, the median over steps of each step's mean),
    at the bandwidth the links give a ring all-reduce of the group (``2(n-1)/n`` of the
    bytes at the ring's pace); return what was set, beside the links' price of the same
    message, or None where the run has no tp all-reduce to time, or several sizes of it.
    Why: each all-reduce the executor times also waits for its peer, which the run's
    other ranks keep off the cores; priced from the send/recv links, a run's tp
    all-reduces came out 14% long (256 in one step: 3.380 ms predicted against 2.955 ms
    measured each) and every tp 2 compare long with them. With sequence parallelism the
    all-gathers and reduce-scatters are ``tp_gather_scatter``'s."""
    from executor.run_costs import held_seconds  # noqa: PLC0415
    from pipesim.cli.compare import replicas  # noqa: PLC0415 - the parallelism compare predicts with
    from pipesim.cluster.mapping import map_ranks  # noqa: PLC0415

    sizes = {stage.tp_message_bytes for stage in costs.stages if stage.layers and stage.tp_message_bytes}
    if config.tp < 2 or config.sequence_parallel or len(sizes) != 1:
        return None
    seconds = held_seconds(traces, "tp")
    if seconds is None:
        return None
    (size,) = sizes
    parallel = replicas(config)
    group = map_ranks(topology, parallel.dp, config.pp, parallel.tp, parallel.rank_order, parallel.cp,
                      parallel.ep, parallel.etp).tp_group(0, 0)
    return timed_pace(topology, "all_reduce", group, size, seconds)


def tp_gather_scatter(topology: Topology, config: RunConfig, schedule: Schedule, costs: Costs,
                      traces: list[Trace]) -> dict[str, dict]:
    """With sequence parallelism, give the tp all-gather and reduce-scatter (over groups
    of ``config.tp``, in ``Topology.measured_collectives``) one price: at the bandwidth
    the links give a ring all-gather of the group (``(n-1)/n`` of the bytes at the
    ring's pace), the latency at which the simulator's rule
    (``pipesim.sim.parallel.tp_collective_seconds``) charges a calibration step's compute
    actions the seconds its ``tp`` stream held the ranks, the median over the steps of
    their totals (``matching_latency``), floored at 0. Return what was set, for each of
    the two beside the links' price of the same message and the mean of one collective
    as timed (``timed_seconds``); nothing where the run has no sequence-parallel
    collective to time, or several sizes of them.

    Why one price for both: the executor's ``tp`` events do not say which collective
    each is (``executor.tensor_parallel.TpTimer`` times DTensor's functional
    collectives alike), and the simulator charges them only as a pair (an all-gather
    and a reduce-scatter, the same ring cost), so separate prices would change no
    prediction. Why the held total, not the mean of one collective as ``tp_all_reduce``
    takes: the executor's collectives are not all the ones the simulator charges. It
    issues Megatron's four a block forward and six backward (the sublayers' inputs
    gathered again, ``tp_regathers``), which the simulator charges, but also one per
    microbatch where the sequence is cut (the first stage's backward) and joined (the
    last stage's forward) (``executor.tensor_parallel.shard_residual_stream``), which it
    does not. A mean per collective would leave those out of the prediction; the held
    total spreads them over the charged ones."""
    from executor.run_costs import held_seconds  # noqa: PLC0415
    from pipesim.cli.compare import replicas  # noqa: PLC0415 - the parallelism compare predicts with
    from pipesim.cluster.collectives import all_gather, ring_pace  # noqa: PLC0415
    from pipesim.cluster.mapping import map_ranks  # noqa: PLC0415
    from pipesim.sim.parallel import tp_collective_seconds  # noqa: PLC0415

    sizes = {stage.tp_message_bytes for stage in costs.stages if stage.layers and stage.tp_message_bytes}
    held = [sum(event.duration for event in trace.events if event.stream == "tp") for trace in traces]
    if config.tp < 2 or not config.sequence_parallel or len(sizes) != 1 or not any(held):
        return {}
    (size,) = sizes
    parallel = replicas(config)
    mapping = map_ranks(topology, parallel.dp, schedule.pp, parallel.tp, parallel.rank_order, parallel.cp,
                        parallel.ep, parallel.etp)
    group = mapping.tp_group(0, 0)
    links_price = all_gather(topology, group, size)
    bandwidth = ring_pace(topology, group)[0] * config.tp / (config.tp - 1)
    actions = Counter((event.stage, event.kind) for event in traces[0].events if event.stream == "compute")

    def charged(latency: float) -> float:
        for operation in ("all_gather", "reduce_scatter"):
            topology.measured_collectives[operation, config.tp] = (bandwidth, latency)
        seconds = tp_collective_seconds(schedule, costs, topology, mapping, parallel.algorithm, parallel.overlap_tp,
                                        parallel.overlap_slowdown)
        return sum(count * seconds.get(action, 0.0) for action, count in actions.items())

    latency = matching_latency(charged, statistics.median(held))
    if latency is None:
        for operation in ("all_gather", "reduce_scatter"):
            topology.measured_collectives.pop((operation, config.tp), None)
        return {}
    pace = {"ranks": config.tp, "bytes": size, "seconds": size / bandwidth + latency, "bandwidth": bandwidth,
            "latency": latency, "benchmark_seconds": links_price, "timed_seconds": held_seconds(traces, "tp")}
    return {"all_gather": pace, "reduce_scatter": dict(pace)}


def matching_latency(charged: Callable[[float], float], target: float) -> float | None:
    """The latency at which ``charged`` (seconds the simulator charges a step's actions,
    growing with the latency it sets, and setting it) reaches ``target``, found by
    bisection and left set; 0 when the charge at no latency reaches it already; None
    when no latency does (the caller restores what stood before)."""
    low, high = 0.0, target
    if charged(low) >= target:
        high = low
    else:
        for _ in range(64):  # every collective charges at least the latency less what hides it
            if charged(high) >= target:
                break
            high *= 2
        else:
            return None
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if charged(middle) < target else (low, middle)
    charged(high)
    return high


def ring_latency(topology: Topology, config: RunConfig, schedule: Schedule, costs: Costs,
                 traces: list[Trace]) -> float | None:
    """Set, and return, the latency of the ring step measured over ``config.cp`` ranks
    (its bandwidth kept) at which the simulator's rule for ring attention
    (``pipesim.sim.context_parallel.cp_collective_seconds``: per action, each step's
    transfer beyond its share of the attention, forward and backward) charges a
    calibration step's compute actions the ring waits the step measured, the median over
    the steps of their totals; None when the steps timed none. Found by bisection: the
    charge grows with the latency. Why not each wait's own transfer: the backward's waits
    ran shorter than the forward's (0.5 against 1.1 ms in one run), so a transfer read off
    the forward alone overcharged every backward."""
    from pipesim.cli.compare import replicas  # noqa: PLC0415 - the parallelism compare predicts with
    from pipesim.cluster.mapping import map_ranks  # noqa: PLC0415
    from pipesim.sim.context_parallel import cp_collective_seconds  # noqa: PLC0415

    waited = [sum(event.duration for event in trace.events if event.stream == "cp") for trace in traces]
    if not any(waited):
        return None
    target = statistics.median(waited)
    actions = Counter((event.stage, event.kind) for event in traces[0].events if event.stream == "compute")
    parallel = replicas(config)
    mapping = map_ranks(topology, parallel.dp, schedule.pp, parallel.tp, parallel.rank_order, parallel.cp,
                        parallel.ep, parallel.etp)
    key = ("ring_exchange", config.cp)
    benchmark = topology.measured_collectives[key]
    bandwidth = benchmark[0]

    def charged(latency: float) -> float:
        topology.measured_collectives[key] = (bandwidth, latency)
        held = cp_collective_seconds(schedule, costs, topology, mapping, config.cp_comm, parallel.overlap_slowdown)
        return sum(count * held.get(action, 0.0) for action, count in actions.items())

    latency = matching_latency(charged, target)
    if latency is None:  # the benchmark's price stands
        topology.measured_collectives[key] = benchmark
    return latency


# the executor's dp events (``executor.data_parallel``), by kind, and the collective each is
DP_COLLECTIVES = {"ALLREDUCE_DP": "all_reduce", "REDUCE_SCATTER_DP": "reduce_scatter",
                  "ALLGATHER_PARAMS": "all_gather"}


def dp_collectives(topology: Topology, config: RunConfig, schedule: Schedule, costs: Costs,
                   traces: list[Trace]) -> dict[str, dict]:
    """Give the dp group's collectives (over groups of ``dp x cp`` ranks, with DualPipe's
    two copies the holders of both, in ``Topology.measured_collectives``) the seconds the
    calibration steps timed them at: for each the run issued (DDP's all-reduce; under
    ZeRO-1 and 2 the reduce-scatter and the parameter all-gather after the optimizer),
    ``timed_pace`` at the mean over the simulator's buckets
    (``pipesim.sim.parallel.gradient_buckets``, every stage's) and the mean the steps
    timed one at (the median over steps of each step's mean).
    Return what was set, beside the links' price of the mean bucket; nothing for a
    collective the steps did not time, under ZeRO-3 (FSDP2's collectives,
    ``pipesim.cli.compare.zero3_collectives``) or with expert parallelism (its experts
    reduce over groups of another size), or where a tp group of the same size already
    has a price from the steps (one price per group size: the caller keeps tp's).

    Why: gloo runs a reduce-scatter or an all-gather in about the time of an all-reduce
    of the same buffer, not the half that a ring (and NCCL) takes: timed alone on 2
    ranks, 3.2 MB took 5.3 ms to reduce-scatter, 4.1 ms to all-gather and 4.8 ms to
    all-reduce, where the send/recv links priced each half at 2.8 ms; and a
    collective in the run waits for cores the pipeline's other ranks hold. Priced from
    the links, every ZeRO-1 compare at dp 2 came out 26% short (the step's
    reduce-scatter tail and all-gather measured 43 and 26 ms against 2.8 ms each)."""
    from pipesim.cli.compare import replicas  # noqa: PLC0415 - the parallelism compare predicts with
    from pipesim.cluster.mapping import map_ranks  # noqa: PLC0415
    from pipesim.sim.parallel import gradient_buckets, stage_dp_group  # noqa: PLC0415

    ranks = config.gradient_holders  # with DualPipe, each stage's replicas and its other copy's
    if ranks < 2 or config.zero == 3 or config.ep > 1:
        return {}
    parallel = replicas(config)
    mapping = map_ranks(topology, parallel.dp, schedule.pp, parallel.tp, parallel.rank_order, parallel.cp,
                        parallel.ep, parallel.etp)
    group = stage_dp_group(schedule, 0, mapping)
    buckets = [run for stage in costs.stages for run in gradient_buckets(stage, min(config.zero, 1),
                                                                         parallel.bucket_bytes)]
    count = sum(number for _, number in buckets)
    if not count:
        return {}
    mean_bytes = sum(size * number for size, number in buckets) / count
    paces = {}
    for kind, operation in DP_COLLECTIVES.items():
        means = []
        for trace in traces:
            timed = [event.duration for event in trace.events if event.stream == "dp" and event.kind == kind]
            if timed:
                means.append(sum(timed) / len(timed))
        if not means or (ranks == config.tp and (operation, ranks) in topology.measured_collectives):
            continue
        paces[operation] = {**timed_pace(topology, operation, group, mean_bytes, statistics.median(means)),
                            "group": "dp"}
    return paces


def timed_pace(topology: Topology, operation: str, group: list[str], size: float, seconds: float) -> dict:
    """Set ``operation``'s pace over groups of ``len(group)`` (``Topology.measured_collectives``)
    so that ``size`` bytes cost ``seconds``, the run's timing: at the bandwidth the links
    give that ring collective over ``group`` (``2(n-1)/n`` of the bytes at the ring's pace
    for an all-reduce, ``(n-1)/n`` for an all-gather or a reduce-scatter), the latency the
    rest, floored at 0. Return what was set, beside the links' price of the same message
    (``benchmark_seconds``)."""
    from pipesim.cluster import collectives  # noqa: PLC0415
    from pipesim.cluster.collectives import ring_pace  # noqa: PLC0415

    ranks = len(group)
    links_price = getattr(collectives, operation)(topology, group, size)  # before the pace is set
    share = (ranks - 1) / ranks * (2 if operation == "all_reduce" else 1)
    bandwidth = ring_pace(topology, group)[0] / share
    latency = max(0.0, seconds - size / bandwidth)
    topology.measured_collectives[operation, ranks] = bandwidth, latency
    return {"ranks": ranks, "bytes": size, "seconds": size / bandwidth + latency, "bandwidth": bandwidth,
            "latency": latency, "benchmark_seconds": links_price}
