"""What a simulated step's charts need beyond its events, written into the Trace's
``meta["memory"]``: per rank, its memory verdict (peak, the usable limit it was judged
against, the capacity) and what it holds over the step (weights, gradients, optimizer
state and buffers, fixed; activations kept for the backward, over time), so the Gantt
can mark ranks out of memory and draw the memory panel under them (``viz.memory``)
from the saved Trace alone.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipesim.sim.memory import static_bytes

TIMELINE_POINTS = 2000  # per rank: a long step's stash changes thinned to this, peaks kept


def memory_meta(result) -> dict:
    """``{"memory": [...]}`` for ``result``'s ranks; nothing when the costs leave memory
    unknown. Weights, gradients and optimizer state are each the one rule
    (``pipesim.sim.memory.static_bytes``) taken with the other parts' bytes at zero."""
    if not result.memory:
        return {}
    parallel, costs, placement = result.parallel, result.costs, result.schedule.placement
    per_param = parallel.bytes_per_param
    shares = (replace(per_param, grads=0.0, optimizer=0.0), replace(per_param, optimizer=0.0), per_param)
    ranks = []
    for memory in result.memory:
        cumulative = [sum(static_bytes(cost, share, parallel.dp * parallel.cp, parallel.zero,
                                       parallel.dp * parallel.cp // parallel.ep)
                          for stage, cost in enumerate(costs.stages) if placement[stage] == memory.rank)
                      for share in shares]
        base = memory.static_bytes + memory.buffer_bytes
        ranks.append({
            "rank": memory.rank, "peak_bytes": memory.peak_bytes,
            "usable_bytes": memory.usable_bytes if math.isfinite(memory.usable_bytes) else None,
            "capacity_bytes": memory.capacity_bytes if math.isfinite(memory.capacity_bytes) else None,
            "oom": memory.oom,
            "parts": {"weights": cumulative[0], "gradients": cumulative[1] - cumulative[0],
                      "optimizer state": cumulative[2] - cumulative[1], "buffers": memory.buffer_bytes},
            "activations": thinned([(time, total - base) for time, total in memory.timeline]),
        })
    return {"memory": ranks}


def thinned(points: list[tuple[float, float]], limit: int = TIMELINE_POINTS) -> list[list[float]]:
    """At most about ``limit`` of ``points`` (time, bytes): in each of ``limit / 2`` runs,
    its first point and its highest, so the peak survives."""
    if len(points) <= limit:
        return [[time, value] for time, value in points]
    run = math.ceil(len(points) / (limit // 2))
    kept = []
    for start in range(0, len(points), run):
        chunk = points[start:start + run]
        highest = max(chunk, key=lambda point: point[1])
        kept += [list(chunk[0])] + ([list(highest)] if highest is not chunk[0] else [])
    return kept
