"""What a schedule keeps of itself (``Schedule.derived``): built once, outside equality,
left out of pickles; and the direct engine's compiled programs read off the lowered
programs (checked against them by hand)."""

from __future__ import annotations

import pickle

from pipesim.direct import compiled_programs
from schedules import generate, lower
from schedules.action import Action, ActionKind


def test_derived_data_is_built_once_and_not_pickled():
    schedule = lower(generate("1f1b", 2, 2))
    calls = []

    def build(s):
        calls.append(s)
        return len(s.programs[0])

    assert schedule.derived("count", build) == schedule.derived("count", build) == len(schedule.programs[0])
    assert len(calls) == 1
    assert schedule == lower(generate("1f1b", 2, 2))  # equality ignores what was kept
    copy = pickle.loads(pickle.dumps(schedule))
    assert copy == schedule and "_derived" not in copy.__dict__
    assert schedule.program_items(1) is not schedule.program_items(1)  # callers get their own list


def test_compiled_programs_name_each_receives_group():
    # 1F1B, pp=2, m=1. Rank 1 runs RECV_F0, F, B, SEND_B0 (its groups: RECV_F, then SEND_B);
    # its F needs the receive of group 0, its B nothing from another rank.
    schedule = lower(generate("1f1b", 2, 1))
    rank1 = compiled_programs(schedule)[1]
    groups = [entry for entry in rank1 if entry[0] == 1]
    computes = [entry for entry in rank1 if entry[0] == 0]
    assert [entry[1] for entry in computes] == [Action(1, ActionKind.F, 0), Action(1, ActionKind.B, 0)]
    assert [entry[6] for entry in computes] == [0, -1]  # the forward waits for group 0
    (receive,) = groups[0][3]
    assert (receive[1], receive[5]) == (False, "1RECV_F0")
    # both ends of a transfer carry its number: rank 0's 0SEND_F0 and rank 1's 1RECV_F0
    sends = [transfer for entry in compiled_programs(schedule)[0] if entry[0] == 1 for transfer in entry[3]
             if transfer[5] == "0SEND_F0"]
    assert [send[0] for send in sends] == [receive[0]]
    assert compiled_programs(schedule) is compiled_programs(schedule)
