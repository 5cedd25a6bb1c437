"""What the plan tests of mixture-of-experts layouts share: an evaluator of Mixtral (8
layers, 1,024-token sequences) on two InfiniBand nodes, and the check that a plan row is
what ``pipesim simulate`` prints for its layout."""

from __future__ import annotations

from pipesim.job import Job, simulate_job
from pipesim.plan.evaluate import LayoutEvaluator
from pipesim.plan.layouts import Layout


def mixtral_evaluator() -> LayoutEvaluator:
    return LayoutEvaluator(Job(model="mixtral-8x7b", topology="ib", nodes=2, seq_len=1024, layers=8))


def row_as_simulated(evaluator: LayoutEvaluator, layout: Layout) -> dict:
    """The plan's row of ``layout``, after checking its step and peak memory are
    ``simulate``'s for the same job."""
    row = evaluator.evaluate(layout)
    simulated = simulate_job(evaluator.layout_job(layout))
    assert row["step_time"] == simulated.metrics.makespan
    assert row["peak_memory_bytes"] == max(memory.peak_bytes for memory in simulated.memory)
    return row
