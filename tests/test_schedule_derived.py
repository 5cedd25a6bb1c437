"""What a schedule keeps of itself (``Schedule.derived``): built once, outside equality,
left out of pickles; and the engine's compiled programs read off the lowered programs,
checked against them by hand."""

from __future__ import annotations

import dataclasses
import gc
import pickle
import weakref

import numpy as np

from schedules import generate, lower
from schedules.engine import StepTiming, compile_program, run
from schedules.program_arrays import program_arrays


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


def test_the_engine_program_names_what_each_compute_action_waits_for():
    # 1F1B, pp=2, m=1. Rank 1 runs RECV_F0, F, B, SEND_B0 (its groups: RECV_F, then SEND_B);
    # its F waits for the group holding 1RECV_F0, its B for nothing from another rank.
    schedule = lower(generate("1f1b", 2, 1))
    program = compile_program(schedule, "rendezvous")
    rank1_computes = np.flatnonzero(program.compute_rank == 1)
    assert program.compute_need[rank1_computes].tolist() == [program.group_rank.tolist().index(1), -1]
    # buffered: the F waits for the transfer itself, numbered as both ends name it:
    # stage 0's forward (direction 0) of microbatch 0, (0 * 2 + 0) * 1 + 0
    buffered = compile_program(schedule, "buffered")
    assert buffered.compute_need[np.flatnonzero(buffered.compute_rank == 1)].tolist() == [0, -1]
    ends = dict(zip(buffered.endpoint_row.tolist(), buffered.endpoint_transfer.tolist(), strict=True))
    rows = {str(action): row for row, action in enumerate(a for p in schedule.programs for a in p)}
    assert ends[rows["0SEND_F0"]] == ends[rows["1RECV_F0"]] == 0
    # stage 1's backward (direction 1): (1 * 2 + 1) * 1 + 0
    assert ends[rows["1SEND_B0"]] == ends[rows["0RECV_B0"]] == 3
    assert compile_program(schedule, "rendezvous") is program  # kept with the schedule


def test_free_programs_send_each_output_from_its_producer():
    # compute-only 1F1B, pp=2, m=2: rank 0's forwards send stage 0's activations, rank 1's
    # backwards send stage 1's input gradients; rank 0's backwards wait for those
    schedule = generate("1f1b", 2, 2)
    program = compile_program(schedule, "free")
    sent = {str(schedule.programs[rank][position]): int(send)
            for rank, position, send in zip(program.compute_rank.tolist(), program.arrays.position[
                program.compute_row].tolist(), program.compute_send.tolist(), strict=True) if send >= 0}
    assert sent == {"0F0": 0, "0F1": 1, "1B0": 6, "1B1": 7}  # (stage * 2 + direction) * 2 + microbatch


def test_arrays_kept_by_generation_and_lowering_are_those_of_their_programs():
    # interleaved-1f1b and lowering keep the arrays they built the programs from; a copy
    # (``replace`` keeps nothing) reads them back from the Action tuples
    for pp, microbatches, chunks, timing in ((2, 4, 2, None), (4, 10, 2, None), (3, 6, 3, None),
                                             (4, 8, 2, StepTiming.uniform(8, 1.0, 2.5, hop=0.7))):
        generated = generate("interleaved-1f1b", pp, microbatches, chunks)
        for schedule in (generated, lower(generated, timing, 20)):
            kept, read = program_arrays(schedule), program_arrays(dataclasses.replace(schedule))
            assert kept is not read
            for name in ("rank", "stage", "kind", "microbatch", "position", "rank_start"):
                assert getattr(kept, name).dtype == getattr(read, name).dtype
                assert np.array_equal(getattr(kept, name), getattr(read, name)), name


def test_a_schedule_and_what_it_keeps_are_freed_by_reference_count():
    # the kept arrays and compiled programs point back to their schedule weakly: dropping
    # the schedule frees it at once, with the cyclic collector off (a planner's lowering
    # searches drop hundreds of candidate schedules); a step run holds its schedule
    collector_was_on = gc.isenabled()
    gc.disable()
    try:
        schedule = lower(generate("interleaved-1f1b", 4, 8, 2), StepTiming.uniform(8, 1.0, 2.0, hop=0.5))
        step = run(schedule, StepTiming.uniform(8, 1.0, 2.0, hop=0.5), "rendezvous")
        freed = weakref.ref(schedule)
        del schedule
        assert freed() is not None and step.program.arrays.schedule is freed()  # the run keeps it
        del step
        assert freed() is None
    finally:
        if collector_was_on:
            gc.enable()
