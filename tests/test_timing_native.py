"""zb-auto's loops in C (``schedules/_timing.c``) against their Python versions: the
as-soon-as-possible timing (``schedules.generators.timing``), the same step and rank
span to the last bit for the greedy and handcrafted orders zb-auto compares, with
uneven per-stage costs and hop times, and the same error for orders that deadlock; and
the greedy list scheduler (``greedy_zero_bubble``), the same orders for every limit,
warm-up cap and patience."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules.action import Action
from schedules.generators import timing, zb_h1, zb_h2
from schedules.generators.greedy_zero_bubble import _greedy_orders_in_python, greedy_orders
from schedules.schedule import looped_placement

pytestmark = pytest.mark.skipif(timing._native is None, reason="the C timing is not built")


def python_and_native(programs, pp, forward, backward_input, backward_weight, comm):
    placement = looped_placement(pp, 1)
    costs = {"F": forward, "I": backward_input, "W": backward_weight}

    def seconds(action: Action) -> float:
        return costs[action.kind][action.stage]

    python = timing.step_and_rank_span(programs, placement, seconds, comm)
    native = timing._native.step_and_rank_span(programs, placement, forward, backward_input, backward_weight, comm,
                                               timing._KINDS)
    return python, native


@settings(max_examples=100, deadline=None)
@given(pp=st.integers(1, 6), microbatches=st.integers(1, 10), seed=st.integers(0, 10_000),
       comm=st.sampled_from([0.0, 0.3, 1.7]), patient=st.booleans())
def test_the_c_timing_equals_python_on_zb_autos_candidates(pp, microbatches, seed, comm, patient):
    draw = random.Random(seed)
    forward = [draw.uniform(0.5, 2.0) for _ in range(pp)]
    backward_input = [draw.uniform(0.5, 2.0) for _ in range(pp)]
    backward_weight = [draw.uniform(0.1, 2.0) for _ in range(pp)]
    candidates = [greedy_orders(pp, microbatches, forward, backward_input, backward_weight, comm, pp,
                                patient_weights=patient),
                  zb_h1(pp, microbatches).programs, zb_h2(pp, microbatches).programs]
    for programs in candidates:
        python, native = python_and_native(programs, pp, forward, backward_input, backward_weight, comm)
        assert native == python


def test_a_deadlocking_order_is_named_the_same():
    # rank 1 runs its I before the F it needs, and rank 0's I needs rank 1's
    programs = [[Action(0, "F", 0), Action(0, "I", 0), Action(0, "W", 0)],
                [Action(1, "I", 0), Action(1, "F", 0), Action(1, "W", 0)]]
    messages = []
    for native in (False, True):
        with pytest.raises(ValueError, match="orders deadlock") as error:
            if native:
                timing._native.step_and_rank_span(programs, (0, 1), [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], 0.0,
                                                  timing._KINDS)
            else:
                timing.step_and_rank_span(programs, (0, 1), lambda action: 1.0)
        messages.append(str(error.value))
    assert messages[0] == messages[1] == "orders deadlock: no rank can run its next action (0I0, 1I0)"


def test_a_full_backward_is_left_to_python():
    # seconds() knows F, I and W only: an order with B is not the C version's
    programs = [[Action(0, "F", 0), Action(0, "B", 0)]]
    assert timing._native.step_and_rank_span(programs, (0,), [1.0], [1.0], [1.0], 0.0, timing._KINDS) is None


@settings(max_examples=150, deadline=None)
@given(pp=st.integers(1, 7), microbatches=st.integers(1, 12), seed=st.integers(0, 10_000),
       comm=st.sampled_from([0.0, 0.25, 2.0]), patient=st.booleans(), limit=st.integers(1, 14),
       cap=st.sampled_from([None, 1, 2, 3, 7]), per_rank=st.booleans())
def test_the_c_greedy_scheduler_gives_the_python_orders(pp, microbatches, seed, comm, patient, limit, cap, per_rank):
    draw = random.Random(seed)
    forward = [draw.uniform(0.5, 2.0) for _ in range(pp)]
    backward_input = [draw.uniform(0.5, 2.0) for _ in range(pp)]
    backward_weight = [draw.uniform(0.1, 2.0) for _ in range(pp)]
    limits = [draw.randint(1, limit) for _ in range(pp)] if per_rank else [limit] * pp
    python = _greedy_orders_in_python(pp, microbatches, forward, backward_input, backward_weight, comm, limits,
                                      patient, cap)
    native = timing._native.greedy_orders(pp, microbatches, forward, backward_input, backward_weight, comm, limits,
                                          patient, cap, ("F", "I", "W"), Action)
    assert native == python
    assert all(type(action) is Action for order in native for action in order)
