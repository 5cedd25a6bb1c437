"""The collectives a ``pipesim compare`` run holds its ranks for inside its compute
actions (ep's all-to-alls, the cp ring's K/V steps): which to benchmark, at which sizes,
and the seconds the run's calibration steps timed them at (docs/calibration.md, "How the
all-to-all and the ring step are priced"). tp's collectives keep the links' price.
"""

from __future__ import annotations

# beside the run's own message sizes, the sizes its held collectives are timed at for the bandwidth
BANDWIDTH_SIZES = (2**20, 2**24)


def held_collectives(config) -> dict[str, int]:
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


def held_message_sizes(config, num_stages: int) -> dict[str, list[int]]:
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


def calibrate_held(topology, config, costs, calibrated: list[dict]) -> dict[str, dict]:
    """Give the held collectives the seconds the calibration steps timed them at, at the
    run's message, keeping the benchmark's bandwidth
    (``pipesim.cluster.comm_fit.calibrate_latency``): the all-to-all (``ep``) its mean
    at ``dispatch_bytes``; a ring step (``cp``) the transfer behind its forward waits,
    each what a ``kv_bytes`` block's transfer added to the step's share of the attention
    (``pipesim.sim.comm_overlap.comm_behind``, the inverse of the simulator's overlap
    rule). What was set, and what the benchmark had priced it at (``benchmark_seconds``),
    for ``--json``."""
    from executor.run_costs import held_seconds  # noqa: PLC0415
    from pipesim.cli.compare import replicas  # noqa: PLC0415 - the parallelism compare predicts with
    from pipesim.cluster.comm_fit import calibrate_latency  # noqa: PLC0415
    from pipesim.sim.comm_overlap import comm_behind  # noqa: PLC0415
    from schedules.action import ActionKind  # noqa: PLC0415

    traces = [result["trace"] for result in calibrated]
    timed = {}  # operation -> (group, bytes, seconds)
    sizes = {stage.dispatch_bytes for stage in costs.stages if stage.moe_layers and stage.dispatch_bytes}
    seconds = held_seconds(traces, "ep") if config.ep > 1 else None
    if seconds is not None and len(sizes) == 1:
        timed["all_to_all"] = (config.ep, *sizes, seconds)
    ring = [stage for stage in costs.stages if stage.attention_layers and stage.kv_bytes]
    wait = held_seconds(traces, "cp", ActionKind.F) if config.cp > 1 and ring else None
    if wait is not None and len({stage.kv_bytes for stage in ring}) == 1:
        step = sum(stage.attention_fwd for stage in ring) / len(ring) / config.cp  # one step's share, per layer
        timed["ring_exchange"] = (config.cp, ring[0].kv_bytes,
                                  comm_behind(step, wait, replicas(config).overlap_slowdown))
    calibrated_paces = {}
    for operation, (ranks, size, seconds) in timed.items():
        benchmark = topology.measured_collectives.get((operation, ranks))
        pace = calibrate_latency(topology.measured_collectives, operation, ranks, size, seconds)
        if pace is not None:
            calibrated_paces[operation] = {"ranks": ranks, "bytes": size, "seconds": seconds, "bandwidth": pace[0],
                                           "latency": pace[1],
                                           "benchmark_seconds": size / benchmark[0] + benchmark[1]}
    return calibrated_paces
