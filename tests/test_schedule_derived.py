"""What a schedule keeps of itself (``Schedule.derived``): built once, outside equality,
left out of pickles; and the direct engine's compiled programs read off the lowered
programs (checked against them by hand), the same from C as from Python."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.sim import direct
from pipesim.sim.direct import compiled_programs
from schedules import generate, lower
from schedules.action import Action, ActionKind, parse_action
from schedules.generators import GENERATORS, MULTI_CHUNK, ScheduleUnavailableError
from schedules.schedule import Schedule


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


def test_a_sends_wire_slot_names_its_route_on_both_ends():
    # 1F1B, pp=2, m=1: 0SEND_F0 and 1RECV_F0 share wire slot 0 * 2 + 0 (stage 0's SEND_F);
    # 1SEND_B0 and 0RECV_B0 share 1 * 2 + 1 (stage 1's SEND_B)
    programs = compiled_programs(lower(generate("1f1b", 2, 1)))
    wires = {transfer[5]: transfer[6] for program in programs for entry in program if entry[0] == 1
             for transfer in entry[3]}
    assert wires == {"0SEND_F0": 0, "1RECV_F0": 0, "1SEND_B0": 3, "0RECV_B0": 3}


@pytest.mark.skipif(not direct._native, reason="the C loop is not built")
@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(GENERATORS)), pp=st.integers(1, 6), microbatches=st.integers(1, 9),
       chunks=st.integers(1, 3), from_text=st.booleans())
def test_the_c_compile_gives_the_python_compile(name, pp, microbatches, chunks, from_text):
    try:
        schedule = lower(generate(name, pp, microbatches, chunks if name in MULTI_CHUNK else 1))
    except ScheduleUnavailableError:
        schedule = lower(generate("1f1b", pp, microbatches))
    if from_text:  # kinds parsed from text are equal strings, not the same objects
        schedule = replace(schedule, programs=tuple(tuple(parse_action(str(action)) for action in program)
                                                    for program in schedule.programs))
    native = direct._native.compile(schedule.programs, tuple(schedule.joins), schedule.num_stages,
                                    schedule.microbatches, direct._KINDS)
    assert native == direct._compile_in_python(schedule)


@pytest.mark.skipif(not direct._native, reason="the C loop is not built")
def test_an_action_outside_the_schedule_is_compiled_in_python():
    # a receive from stage -1 (no such sender): C hands the schedule back, Python compiles it
    schedule = Schedule(pp=1, microbatches=1, placement=(0,),
                        programs=((Action(0, ActionKind.RECV_F, 0), Action(0, ActionKind.F, 0)),))
    assert direct._native.compile(schedule.programs, tuple(schedule.joins), 1, 1, direct._KINDS) is None
    assert compiled_programs(schedule) == direct._compile_in_python(schedule)[0]
