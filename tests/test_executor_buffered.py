"""gloo as it is (``--p2p buffered``): a receive is posted at its place in the program
and waited for right before the compute action that needs its data, as ``irecv`` then
``wait``, so the rank computes while its data is on the way (the engine's buffered rule,
``schedules.engine``). Numerics equal the one-process reference (float64, 1e-10)."""

from __future__ import annotations

import pytest

from executor.config import RunConfig
from executor.launch import launch
from executor.reference import reference_run
from schedules.action import parse_action
from schedules.schedule import Schedule

pytestmark = pytest.mark.timeout(300)


def early_receive_order() -> Schedule:
    """1F1B at pp=2, m=2 with rank 1 posting both forward receives before any compute:
    1RECV_F1's data is needed only by 1F1, after 1F0 and 1B0."""
    rows = ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"]
    return Schedule(pp=2, microbatches=2, placement=(0, 1), name="hand",
                    programs=[[parse_action(cell) for cell in row.split()] for row in rows])


def test_a_receive_is_waited_for_right_before_the_action_that_needs_it() -> None:
    config = RunConfig(schedule="hand", pp=2, microbatches=2, hidden=8, layers=2, batch_size=5, steps=1,
                       dtype="float64", return_grads=True, custom_schedule=early_receive_order(), p2p="buffered",
                       prefetch_recvs=False, timeout=60)
    (result,) = launch(config)
    reference = reference_run(config)
    assert result["losses"][0] == pytest.approx(reference["losses"][0], abs=1e-10, rel=0)
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name
    events = {event.action: event for event in result["trace"].of_rank(1)}
    # posted first, waited for after 1F0 and 1B0 ran: the wait starts once 1B0 has ended
    # and 1F1 starts once it is over
    assert events["1RECV_F1"].start >= events["1B0"].end
    assert events["1F1"].start >= events["1RECV_F1"].end
    assert events["1RECV_F0"].end <= events["1F0"].start
