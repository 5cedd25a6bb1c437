"""``compare``'s measured busy, idle and bubble are those of the step the measured Trace
holds, set against that step's own time: a tp 2 run whose last (traced) step was its
slowest once reported rank 1 busy 821.7 ms against the 803.9 ms median, an idle of
-17.7 ms."""

from __future__ import annotations

import pytest

from pipesim.sim.comparison import compare, report_lines
from schedules.trace import Trace, TraceEvent

META = {"pp": 2, "schedule": "1f1b", "microbatches": 1, "virtual_stages": 1}
# warm-up 2.0 s, then 0.8, 0.8, 0.85 and the traced step, the slowest, 1.0 s: median 0.825 s
STEP_TIMES = [2.0, 0.8, 0.8, 0.85, 1.0]


def tp_step(source: str, tp: bool) -> Trace:
    """Rank 0 computes [0, 0.3] and [0.5, 0.9] (busy 0.7 s), rank 1 [0.05, 0.45] and
    [0.45, 0.9] (busy 0.85 s, more than the median step); with ``tp`` the executor's tp
    all-reduces inside rank 1's actions, which hold the rank once, not twice."""
    events = [
        TraceEvent(0, "0F0", "F", 0, 0, 0.0, 0.3, "compute"),
        TraceEvent(0, "0B0", "B", 0, 0, 0.5, 0.9, "compute"),
        TraceEvent(1, "1F0", "F", 1, 0, 0.05, 0.45, "compute"),
        TraceEvent(1, "1B0", "B", 1, 0, 0.45, 0.9, "compute"),
    ]
    if tp:
        events += [TraceEvent(1, "TP(1F0)", "TP", 1, 0, 0.2, 0.3, "tp"),
                   TraceEvent(1, "TP(1B0)", "TP", 1, 0, 0.6, 0.7, "tp")]
    return Trace(events, {**META, "source": source, "step": 4} if source == "measured" else {**META, "source": source})


def test_idle_is_the_traced_steps_time_less_its_busy_never_negative() -> None:
    document = compare(tp_step("measured", tp=True), STEP_TIMES, tp_step("simulated", tp=False), 0.95)
    assert document["measured_step_time"] == pytest.approx(0.825)  # median of 0.8, 0.8, 0.85, 1.0
    assert document["error"] == pytest.approx((0.95 - 0.825) / 0.825)
    assert (document["measured_traced_step"], document["measured_traced_step_time"]) == (4, 1.0)
    ranks = document["ranks"]
    assert [rank["measured_busy"] for rank in ranks] == pytest.approx([0.7, 0.85])
    # by hand: 1.0 - 0.7 and 1.0 - 0.85 (against the median: 0.125 and -0.025)
    assert [rank["measured_idle"] for rank in ranks] == pytest.approx([0.3, 0.15])
    assert document["measured_idle_fraction"] == pytest.approx(1 - 1.55 / 2.0)
    # rank 1 starts 0.05 s after the step's first event: its fill bubble, over 2 ranks x 1.0 s
    assert document["measured_bubble_fraction"] == pytest.approx(0.05 / 2.0)
    # the predicted side keeps its own step: 0.95 - busy
    assert [rank["predicted_idle"] for rank in ranks] == pytest.approx([0.25, 0.1])


def test_the_report_says_which_step_the_measured_idle_is_of() -> None:
    document = compare(tp_step("measured", tp=True), STEP_TIMES, tp_step("simulated", tp=False), 0.95)
    lines = report_lines(document)
    assert ("  traced      step 4, 1000.00 ms: the measured bubble, idle and busy below are this step's"
            in lines)
    assert any(line.startswith("  rank 1: busy   850.00 /   850.00 ms   idle   150.00 /   100.00 ms")
               for line in lines)


def test_a_trace_of_an_earlier_step_is_set_against_that_steps_time() -> None:
    measured = tp_step("measured", tp=False)
    earlier = Trace(measured.events, {**measured.meta, "step": 3})
    document = compare(earlier, STEP_TIMES, tp_step("simulated", tp=False), 0.95)
    assert [rank["measured_idle"] for rank in document["ranks"]] == pytest.approx([0.85 - 0.7, 0.0])
    without_step = Trace(measured.events, {k: v for k, v in measured.meta.items() if k != "step"})
    assert compare(without_step, STEP_TIMES, tp_step("simulated", tp=False), 0.95)["measured_traced_step"] == 4


def test_a_trace_of_a_step_the_run_did_not_time_is_refused() -> None:
    measured = tp_step("measured", tp=False)
    with pytest.raises(ValueError, match="holds step 7, but the run recorded 5 step times"):
        compare(Trace(measured.events, {**measured.meta, "step": 7}), STEP_TIMES, tp_step("simulated", tp=False),
                0.95)
