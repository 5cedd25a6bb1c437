"""Lowering's C construction (``schedules/_lowering.c``) against its Python version
(``schedules.lowering``): the same meeting points, so the same lowered programs and P2P
groups, for every generator and for shuffled compute orders (which may deadlock or lack
a producer; the C version then hands over to Python, which explains)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import generate, lowering
from schedules.action import Action
from schedules.generators import GENERATORS, MULTI_CHUNK, ScheduleUnavailableError
from schedules.schedule import Schedule
from tests.native_switch import accelerated

pytestmark = pytest.mark.skipif(lowering._native is None, reason="the C lowering is not built")


def lowering_loop(native: bool):
    return accelerated(lowering, native)


def both(schedule: Schedule) -> tuple[Schedule, Schedule]:
    with lowering_loop(False):
        python = lowering.lower(schedule)
    with lowering_loop(True):
        native = lowering.lower(schedule)
    return python, native


def native_result(schedule: Schedule):
    return lowering._native.lower(schedule.programs, tuple(schedule.placement), schedule.num_stages,
                                  schedule.microbatches, lowering._KINDS, Action)


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(sorted(GENERATORS)), pp=st.integers(1, 8), microbatches=st.integers(1, 12),
       chunks=st.integers(1, 3))
def test_the_c_lowering_gives_the_python_lowering_for_every_generator(name, pp, microbatches, chunks):
    try:
        schedule = generate(name, pp, microbatches, chunks if name in MULTI_CHUNK else 1)
    except ScheduleUnavailableError:
        return
    python, native = both(schedule)
    assert native == python
    assert native.joins == python.joins
    if not any(schedule.fused):  # overlapped pairs are lowered in Python; the rest in C, not handed over
        assert native_result(schedule) is not None


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv"]), pp=st.integers(2, 5),
       microbatches=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_shuffled_compute_orders_lower_the_same(name, pp, microbatches, seed):
    try:
        schedule = generate(name, pp, microbatches, 2 if name in MULTI_CHUNK else 1)
    except ScheduleUnavailableError:
        return
    shuffle = random.Random(seed)
    programs = []
    for program in schedule.programs:
        program = list(program)
        if len(program) > 1 and shuffle.random() < 0.7:  # swap two neighbours: some orders deadlock
            at = shuffle.randrange(len(program) - 1)
            program[at], program[at + 1] = program[at + 1], program[at]
        programs.append(program)
    shuffled = schedule.with_programs(programs)
    python, native = both(shuffled)
    assert native == python and native.joins == python.joins


def test_a_missing_consumer_is_handed_to_python():
    # stage 0's forward output has no consumer on stage 1: Python lowers naively, C hands over
    schedule = Schedule(pp=2, microbatches=1, placement=(0, 1),
                        programs=((Action(0, "F", 0), Action(0, "B", 0)), (Action(1, "B", 0),)))
    assert native_result(schedule) is None
    python, native = both(schedule)
    assert native == python
