"""What a step's charts need beyond its events, written into the Trace's
``meta["memory"]``: per rank, its memory verdict (peak, the usable limit it was judged
against, the capacity) and what it holds (weights, gradients, optimizer state and
buffers; activations kept for the backward), so the Gantt can mark ranks out of memory
and draw the memory panel under them from the saved Trace alone.

One shape for a simulated step (``memory_meta``: the activations over time, drawn by
``viz.memory``) and a measured one (``measured_memory_meta``: the parts at the peak and
the prediction beside them, drawn by ``viz.measured_memory``); ``source`` says which
(``simulated``; ``tracked``, the tensors the executor counts on a CPU; ``cuda``, the
allocator's peak). The keys are listed in docs/charts.md.
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
                                       parallel.expert_holders(parallel.dp * parallel.cp))
                          for stage, cost in enumerate(costs.stages) if placement[stage] == memory.rank)
                      for share in shares]
        base = memory.static_bytes + memory.buffer_bytes
        ranks.append({
            "rank": memory.rank, "source": "simulated", "peak_bytes": memory.peak_bytes,
            "usable_bytes": memory.usable_bytes if math.isfinite(memory.usable_bytes) else None,
            "capacity_bytes": memory.capacity_bytes if math.isfinite(memory.capacity_bytes) else None,
            "oom": memory.oom,
            "parts": {"weights": cumulative[0], "gradients": cumulative[1] - cumulative[0],
                      "optimizer state": cumulative[2] - cumulative[1], "buffers": memory.buffer_bytes},
            "activations": thinned([(time, total - base) for time, total in memory.timeline]),
        })
    return {"memory": ranks}


def measured_memory_meta(rows: list[dict] | None, not_predicted: str | None = None) -> dict:
    """``{"memory": [...]}`` for a run's memory rows (``pipesim run --json``'s ``memory``,
    with ``predicted_*`` where ``pipesim.cli.run_memory`` added them), in the shape
    ``memory_meta`` writes: per rank the measured ``peak_bytes``, its ``parts`` and
    ``activations_at_peak`` (tracked on a CPU; none on a GPU, whose allocator gives the
    peak only), the most activations held at once, and the prediction
    (``predicted_peak_bytes``, ``predicted_activations_bytes``, ``predicted_static_bytes``,
    ``None`` when not made) or ``not_predicted``, why not. No device limit: a run that
    finished did not run out of memory."""
    if not rows:
        return {}
    ranks = []
    for row in rows:
        tracked = row["source"] == "tracked"
        predicted = row.get("predicted_peak")
        why = None
        if predicted is None:
            why = not_predicted or "no prediction for this run"
        ranks.append({
            "rank": row["rank"], "source": row["source"], "peak_bytes": row["peak"],
            "usable_bytes": None, "capacity_bytes": None, "oom": False,
            "parts": {"weights": row["params"], "gradients": row["grads"], "optimizer state": row["optimizer"],
                      "buffers": row["buffers"]} if tracked else {},
            "activations": [],  # no timeline: the executor keeps the peak's parts, not the step's course
            "activations_at_peak": row["activations"] if tracked else None,
            "most_activations_bytes": row["activations_peak"] if tracked else None,
            "predicted_peak_bytes": predicted,
            "predicted_activations_bytes": row.get("predicted_activations"),
            "predicted_static_bytes": row.get("predicted_static"),
            "not_predicted": why,
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
