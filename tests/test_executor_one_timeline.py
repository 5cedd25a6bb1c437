"""CPU ranks on one host put their events on one timeline (``executor.clock``): each
rank's marks count from the earliest rank's step start, not from its own, so a
receive's wait never ends before its send was posted and every event lies inside the
step's time. Counted from their own zeros, 2-rank gloo runs drew waits ending 0.39 to
0.69 ms before their sends began (ranks leave the step's barrier that far apart)."""

from __future__ import annotations

import pytest

from executor.clock import shifted
from executor.config import RunConfig
from executor.launch import launch
from schedules.action import ActionKind
from schedules.trace import TraceEvent

pytestmark = pytest.mark.timeout(300)


def test_a_shift_moves_both_ends_of_every_event():
    events = [TraceEvent(0, "0F0", ActionKind.F, 0, 0, 0.5, 1.5, "compute")]
    (moved,) = shifted(events, 0.25)
    assert (moved.start, moved.end) == (0.75, 1.75)
    assert moved._replace(start=0.5, end=1.5) == events[0]


def test_every_wait_ends_after_its_send_and_inside_the_step():
    # GPipe on 2 gloo ranks: every forward of rank 1 and backward of rank 0 waits on a peer
    config = RunConfig(schedule="gpipe", pp=2, microbatches=4, hidden=16, layers=2, batch_size=8, steps=2,
                       backend="gloo", timeout=60)
    (result,) = launch(config)
    events = result["trace"].events
    sends = {(event.kind, event.stage, event.microbatch): event for event in events if event.stream == "send"}
    checked = 0
    for event in (event for event in events if event.stream == "recv"):
        kind = ActionKind.SEND_F if event.kind == ActionKind.RECV_F else ActionKind.SEND_B
        sender = sends[kind, event.stage - 1 if event.kind == ActionKind.RECV_F else event.stage + 1,
                       event.microbatch]
        assert event.end >= sender.start, (event.action, event.end, sender.start)
        checked += 1
    assert checked == 2 * 4  # rank 1's forwards' receives and rank 0's backwards' receives
    assert min(event.start for event in events) >= 0.0
    # the pipeline's events (each rank's own close, executor.step_tail, ends with its own step)
    assert max(event.end for event in events if event.stream != "step") <= result["step_times"][-1]
