"""``compare``'s measured busy, idle and bubble are those of the step the measured Trace
holds, set against that step's own time: a tp 2 run whose last (traced) step was its
slowest once reported rank 1 busy 821.7 ms against the 803.9 ms median, an idle of
-17.7 ms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.model.costs import Costs, StageCost
from pipesim.sim.comparison import compare, launch_overheads, report_lines
from schedules.action import COMPUTE_KINDS
from schedules.generators import generate
from schedules.lowering import lower
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


def test_launch_overheads_count_each_compute_action_once_per_rank() -> None:
    # 1F1B, pp 2, 3 microbatches: each rank runs 3 F and 3 B; zbv, pp 2, 2 microbatches:
    # each rank holds 2 chunks and runs 2 F, 2 I and 2 W of each, 12 actions
    costs = Costs(stages=(StageCost(fwd=1e-3, bwd=2e-3),) * 4, action_overhead=1e-4)
    assert launch_overheads(generate("1f1b", 2, 3), costs) == pytest.approx([6e-4, 6e-4])
    assert launch_overheads(generate("zbv", 2, 2, 2), costs) == pytest.approx([12e-4, 12e-4])
    # the lowered programs' SEND/RECV pay comm_overhead, not this
    lowered = lower(generate("1f1b", 2, 3))
    assert launch_overheads(lowered, costs) == pytest.approx([6e-4, 6e-4])


def test_overlapped_pairs_with_a_measured_overlap_pay_one_launch() -> None:
    # dualpipev, pp 2, 4 microbatches: per rank 8 F, 8 B (or I and W) ...; each pair run
    # together (pairs_overlap) with a measured overlap_fb is charged one overhead, not two
    schedule = generate("dualpipev", 2, 4, 2)
    alone = Costs(stages=(StageCost(fwd=1e-3, bwd=2e-3),) * 4, action_overhead=1e-4)
    paired = replace(alone, stages=(StageCost(fwd=1e-3, bwd=2e-3, overlap_fb=2.5e-3),) * 4, pairs_overlap=True)
    for rank in range(2):
        compute = sum(1 for action in schedule.programs[rank] if action.kind in COMPUTE_KINDS)
        pairs = len(schedule.fused_pairs(rank))
        assert pairs > 0
        assert launch_overheads(schedule, alone)[rank] == pytest.approx(compute * 1e-4)
        assert launch_overheads(schedule, paired)[rank] == pytest.approx((compute - pairs) * 1e-4)


def test_the_predicted_busy_leaves_out_the_launch_overheads() -> None:
    # the same step on both sides, the prediction's events each 0.01 s longer for the
    # overhead it charges before them (2 a rank): busy and stretch agree once it is left out
    measured = tp_step("measured", tp=False)
    predicted = Trace([TraceEvent(0, "0F0", "F", 0, 0, 0.0, 0.31, "compute"),
                       TraceEvent(0, "0B0", "B", 0, 0, 0.5, 0.91, "compute"),
                       TraceEvent(1, "1F0", "F", 1, 0, 0.04, 0.45, "compute"),
                       TraceEvent(1, "1B0", "B", 1, 0, 0.46, 0.92, "compute")], {**META, "source": "simulated"})
    plain = compare(measured, STEP_TIMES, predicted, 1.0)
    assert [rank["predicted_busy"] for rank in plain["ranks"]] == pytest.approx([0.72, 0.87])
    fair = compare(measured, STEP_TIMES, predicted, 1.0, overheads=[0.02, 0.02])
    assert [rank["predicted_busy"] for rank in fair["ranks"]] == pytest.approx([0.7, 0.85])
    assert fair["compute_stretch"] == pytest.approx([1.0, 1.0])
