"""Measured against predicted: one step's time, per-rank busy and idle, bubble fraction,
and the signed relative error of the prediction.

Pure functions of Traces and step times, so they hold for any source of either. The
measured step time is the median over the run's steps after the warm-up ones: a single
step on a shared CPU can be preempted, and the prediction is of a typical step.

Idle time and the bubble and idle fractions are taken against the step time (not against
the span of the trace's events), so that what the step spends outside the pipeline
actions (the optimizer step, the loss all-reduce) counts as idle on both sides alike. The
bubble fraction is the pipeline bubble of the time accounting (``schedules.accounting``),
as ``pipesim simulate`` reports it; the idle fraction every moment not computing.
"""

from __future__ import annotations

import statistics

from schedules.metrics import step_metrics
from schedules.trace import Trace


def busy_per_rank(trace: Trace) -> list[float]:
    """Compute seconds of each rank (the ``compute`` stream)."""
    return [rank.busy for rank in step_metrics(trace).ranks]


def _busy_and_bubble(trace: Trace) -> tuple[list[float], float]:
    """Each rank's compute seconds, and the ranks' pipeline bubble summed (waiting for a
    peer's data, fill and drain: ``schedules.accounting``)."""
    ranks = step_metrics(trace).ranks
    return [rank.busy for rank in ranks], sum(rank.bubble for rank in ranks)


def measured_step_time(step_times: list[float], warmup_steps: int) -> float:
    """Median of the step times after the first ``warmup_steps`` (all of them if fewer)."""
    if not step_times:
        raise ValueError("the run recorded no step times")
    kept = step_times[warmup_steps:] or step_times
    return statistics.median(kept)


def compare(measured: Trace, step_times: list[float], predicted: Trace, predicted_step_time: float,
            warmup_steps: int = 1) -> dict:
    """The comparison document (``pipesim compare --json``)."""
    measured_time = measured_step_time(step_times, warmup_steps)
    measured_busy, measured_bubble = _busy_and_bubble(measured)
    predicted_busy, predicted_bubble = _busy_and_bubble(predicted)
    ranks = max(len(measured_busy), len(predicted_busy))
    measured_busy += [0.0] * (ranks - len(measured_busy))
    predicted_busy += [0.0] * (ranks - len(predicted_busy))
    meta = measured.meta
    return {
        "schedule": meta.get("schedule"),
        "pp": meta.get("pp"),
        "microbatches": meta.get("microbatches"),
        "virtual_stages": meta.get("virtual_stages"),
        "measured_step_time": measured_time,
        "predicted_step_time": predicted_step_time,
        "error": (predicted_step_time - measured_time) / measured_time,
        "measured_step_times": list(step_times),
        "warmup_steps": warmup_steps,
        "measured_bubble_fraction": measured_bubble / (ranks * measured_time),
        "predicted_bubble_fraction": predicted_bubble / (ranks * predicted_step_time),
        "measured_idle_fraction": 1 - sum(measured_busy) / (ranks * measured_time),
        "predicted_idle_fraction": 1 - sum(predicted_busy) / (ranks * predicted_step_time),
        "ranks": [
            {
                "rank": rank,
                "measured_busy": measured_busy[rank],
                "predicted_busy": predicted_busy[rank],
                "measured_idle": measured_time - measured_busy[rank],
                "predicted_idle": predicted_step_time - predicted_busy[rank],
            }
            for rank in range(ranks)
        ],
    }


def add_spread(document: dict, predicted_times) -> dict:
    """``document`` with the spread of the step time beside the prediction's under the
    what-if flags (``predicted_times``: the sampled steps): measured p50/p90/p99 over the
    kept steps, predicted over the samples, both as order statistics."""
    from pipesim.sim.whatif import step_quantiles

    kept = document["measured_step_times"][document["warmup_steps"]:] or document["measured_step_times"]
    document["measured_step_time_quantiles"] = step_quantiles(kept)
    document["predicted_step_time_quantiles"] = step_quantiles(predicted_times)
    document["predicted_samples"] = len(predicted_times)
    return document


def report_lines(document: dict) -> list[str]:
    """The comparison for the terminal, in milliseconds."""
    lines = [
        f"{document['schedule']}: pp={document['pp']} microbatches={document['microbatches']} "
        f"virtual_stages={document['virtual_stages']}",
        f"  step time   measured {document['measured_step_time'] * 1e3:9.2f} ms   "
        f"predicted {document['predicted_step_time'] * 1e3:9.2f} ms   error {document['error']:+.1%}",
        f"  bubble      measured {document['measured_bubble_fraction']:9.1%}      "
        f"predicted {document['predicted_bubble_fraction']:9.1%}   (waiting for a peer, fill and drain)",
        f"  idle        measured {document['measured_idle_fraction']:9.1%}      "
        f"predicted {document['predicted_idle_fraction']:9.1%}   (not computing)",
    ]
    if "predicted_step_time_quantiles" in document:
        measured, predicted = document["measured_step_time_quantiles"], document["predicted_step_time_quantiles"]
        kept = max(len(document["measured_step_times"]) - document["warmup_steps"], 0) or len(
            document["measured_step_times"])
        for name in measured:
            lines.append(f"  {name:<11} measured {measured[name] * 1e3:9.2f} ms   "
                         f"predicted {predicted[name] * 1e3:9.2f} ms   "
                         f"({kept} steps / {document['predicted_samples']} sampled steps)")
    for rank in document["ranks"]:
        lines.append(f"  rank {rank['rank']}: busy {rank['measured_busy'] * 1e3:8.2f} / "
                     f"{rank['predicted_busy'] * 1e3:8.2f} ms"
                     f"   idle {rank['measured_idle'] * 1e3:8.2f} / {rank['predicted_idle'] * 1e3:8.2f} ms"
                     "  (measured / predicted)")
    return lines
