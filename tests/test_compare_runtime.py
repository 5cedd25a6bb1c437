"""``compare``'s runtime line (``pipesim.sim.comparison.runtime_per_rank``): the
runtime's own time between a rank's compute actions, measured off the step's Trace with
its marked waits taken out, against what the costs' overheads charge there. Hand-built
steps of 1F1B, pp 2, 4 microbatches, whose every gap, post and wait is known."""

from __future__ import annotations

import pytest

from pipesim.model.costs import Costs, StageCost
from pipesim.sim.comparison import compare, p2p_deliveries, report_lines, runtime_per_rank
from schedules.action import ActionKind
from schedules.generators import generate
from schedules.lowering import lower
from schedules.trace import Trace, TraceEvent
from tests.test_run_costs import timeline

SCHEDULE = lower(generate("1f1b", 2, 4))
COSTS = Costs(stages=(StageCost(fwd=3.0, bwd=5.0), StageCost(fwd=4.0, bwd=6.0)), action_overhead=0.25,
              comm_overhead=0.125)


def test_the_measured_runtime_leaves_out_the_waits_and_the_predicted_counts_the_posts_between():
    """By hand (the programs of ``tests/test_run_costs.py``'s count): rank 0 runs 8
    compute actions with 8 P2P actions between its first and last (SEND_F0..3, RECV_B0..3)
    and 4 waits; rank 1 runs 8 with 6 between (RECV_F1..3, SEND_B0..2; RECV_F0 is before
    its first, SEND_B3 after its last) and 3 waits in its gaps. A runtime of 0.25 s per
    action and 0.125 s per post, 7 s blocked per wait and 0.5 s of bookkeeping after it."""
    trace = timeline(SCHEDULE, action_gap=0.25, post=0.125, wait=7.0, bookkeeping=0.5, timed_waits=True)
    (measured_0, predicted_0), (measured_1, predicted_1) = runtime_per_rank(trace, SCHEDULE, COSTS)
    assert measured_0 == pytest.approx(7 * 0.25 + 8 * 0.125 + 4 * 0.5)
    assert predicted_0 == pytest.approx(7 * 0.25 + 8 * 0.125)
    assert measured_1 == pytest.approx(7 * 0.25 + 6 * 0.125 + 3 * 0.5)
    assert predicted_1 == pytest.approx(7 * 0.25 + 6 * 0.125)


def test_the_runtime_is_reported_beside_busy_and_only_when_given():
    trace = timeline(SCHEDULE, action_gap=0.25, post=0.125, wait=7.0, bookkeeping=0.5, timed_waits=True)
    last = max(event.end for event in trace.events)
    predicted = Trace([event for event in trace.events if event.stream == "compute"], {"pp": 2})
    runtime = runtime_per_rank(trace, SCHEDULE, COSTS)
    document = compare(trace, [last] * 6, predicted, last, runtime=runtime)
    assert [rank["measured_runtime"] for rank in document["ranks"]] == pytest.approx([4.75, 4.0])
    rank_lines = [line for line in report_lines(document) if line.startswith("  rank")]
    assert "runtime 4750.00 / 2750.00 ms" in rank_lines[0]
    without = compare(trace, [last] * 6, predicted, last)
    assert all("runtime" not in line for line in report_lines(without))


def test_a_transfer_waited_through_is_measured_from_its_post_against_the_post_and_wire_predicted():
    # rank 1 waits from 0.5 s for 1RECV_F0, posted by rank 0 at 1.0 s and arriving at 1.3 s;
    # 1RECV_F1's wait starts after its send (1.5 s > 1.4 s): its delivery is not all seen
    measured = Trace([
        TraceEvent(0, "0SEND_F0", ActionKind.SEND_F, 0, 0, 1.0, 2.0, "send"),
        TraceEvent(0, "0SEND_F1", ActionKind.SEND_F, 0, 1, 1.4, 2.0, "send"),
        TraceEvent(1, "1RECV_F0", ActionKind.RECV_F, 1, 0, 0.5, 1.3, "recv"),
        TraceEvent(1, "1RECV_F1", ActionKind.RECV_F, 1, 1, 1.5, 1.6, "recv"),
    ], {"pp": 2, "one_timeline": True})
    # predicted: a 0.05 s post, then 0.2 s from departure to arrival
    predicted = Trace([TraceEvent(0, "0SEND_F0", ActionKind.SEND_F, 0, 0, 3.0, 3.2, "send"),
                       TraceEvent(0, "0SEND_F1", ActionKind.SEND_F, 0, 1, 4.0, 4.2, "send")], {"pp": 2})
    deliveries = p2p_deliveries(measured, predicted, posting=0.05)
    assert deliveries == {"transfers": 1, "measured": pytest.approx(0.3), "predicted": pytest.approx(0.25)}
    # ranks counted from their own zeros cannot be set against each other
    apart = Trace(measured.events, {"pp": 2, "one_timeline": False})
    assert p2p_deliveries(apart, predicted, posting=0.05) is None
