"""The list schedulers' cutoff: a run stops once its order cannot be chosen.

A search that keeps the fastest of many runs (zbv-auto's greedy variants, zb-auto's
heuristics) stops a run when a rank has ended a pass at ``e`` with ``r`` seconds of
passes left and ``e + r`` exceeds the best step (or span) so far. That is exact only if
the scheduler's own times are the engine's free timing of its order. Checked here from
outside: a run given the step (or span) its own order takes on the engine as its cutoff
comes back whole, and one given a little less stops; and the searches choose the same
order with the cutoff as with it switched off.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from schedules import engine
from schedules.generators.common import Cutoff
from schedules.generators.greedy_zero_bubble import placed_greedy_orders
from schedules.generators.zb_heuristic import heuristic_orders
from schedules.schedule import Schedule, v_shape_placement

BELOW = 1 - 1e-6  # a cutoff this much under the order's own figure: past the margin


def free_timing(placement, microbatches, forward, backward_input, backward_weight, comm, orders):
    """(step, longest rank span) of ``orders`` on the engine with free-flowing transfers,
    each ``comm`` after its producer between ranks (the schedulers' model)."""
    seconds = np.array([[f, i + w, i, w] for f, i, w in zip(forward, backward_input, backward_weight, strict=True)])
    timing = engine.StepTiming(seconds, wires=engine.hop_wires(len(placement), comm))
    run = engine.run(Schedule(max(placement) + 1, microbatches, tuple(placement), orders), timing, engine.FREE)
    return run.makespan, float(run.rank_spans().max())


seconds = st.one_of(st.just(0.0), st.floats(0.05, 2.0))  # a pass of no time ties with its neighbours


@st.composite
def greedy_cases(draw):
    pp = draw(st.integers(1, 5))
    v_shape = draw(st.booleans())
    placement = v_shape_placement(pp, 2) if v_shape else tuple(range(pp))
    stages = len(placement)
    costs = [draw(st.lists(seconds, min_size=stages, max_size=stages)) for _ in range(3)]
    options = dict(patient_weights=draw(st.booleans()), reserve_all=draw(st.booleans()),
                   late_first=draw(st.booleans()), free_first=draw(st.booleans()),
                   warmup_cap=draw(st.sampled_from([None, pp, 2 * pp - 1])))
    if options["warmup_cap"] is not None and options["warmup_cap"] < 1:
        options["warmup_cap"] = None
    limit = draw(st.integers(2 if v_shape else 1, 2 * pp + 2))
    return placement, draw(st.integers(1, 10)), *costs, draw(st.sampled_from([0.0, 0.1, 0.7])), limit, options


@settings(max_examples=150, deadline=None)
@given(greedy_cases())
def test_a_greedy_run_stops_exactly_past_its_own_step_and_span(case):
    placement, microbatches, forward, backward_input, backward_weight, comm, limit, options = case
    orders = placed_greedy_orders(placement, microbatches, forward, backward_input, backward_weight, comm, limit,
                                  **options)
    assume(orders is not None)
    step, span = free_timing(placement, microbatches, forward, backward_input, backward_weight, comm, orders)

    def run(cutoff):
        return placed_greedy_orders(placement, microbatches, forward, backward_input, backward_weight, comm, limit,
                                    cutoff=cutoff, **options)

    assert run(Cutoff(step=step)) == orders
    assert run(Cutoff(span=span)) == orders
    if step > 0:  # (a step of no time has nothing below it)
        assert run(Cutoff(step=step * BELOW)) is None
    if span > 0:
        assert run(Cutoff(span=span * BELOW)) is None


@settings(max_examples=120, deadline=None)
@given(pp=st.integers(1, 5), microbatches=st.integers(1, 10), data=st.data(),
       comm=st.sampled_from([0.0, 0.1, 0.7]), weight_memory=st.sampled_from([1.0, 0.5]),
       switches=st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_a_heuristic_run_stops_exactly_past_its_own_step_and_span(pp, microbatches, data, comm, weight_memory,
                                                                   switches):
    forward, backward_input, backward_weight = (data.draw(st.lists(seconds, min_size=pp, max_size=pp))
                                                for _ in range(3))
    limit = data.draw(st.integers(1, 2 * pp))
    arguments = (pp, microbatches, forward, backward_input, backward_weight, comm, limit, weight_memory, *switches)
    orders = heuristic_orders(*arguments)
    assume(orders is not None)
    step, span = free_timing(tuple(range(pp)), microbatches, forward, backward_input, backward_weight, comm, orders)
    assert heuristic_orders(*arguments, cutoff=Cutoff(step=step)) == orders
    assert heuristic_orders(*arguments, cutoff=Cutoff(span=span)) == orders
    if min(forward + backward_input + backward_weight) > 0:  # passes of no time: no cutoff (the module says why)
        assert heuristic_orders(*arguments, cutoff=Cutoff(step=step * BELOW)) is None
        assert heuristic_orders(*arguments, cutoff=Cutoff(span=span * BELOW)) is None


def without_cutoff(function, *arguments, cache=None):
    """``function(*arguments)`` with every run's cutoff switched off (each run whole),
    the search's ``cache`` (if it keeps one) emptied before and after so neither answer is
    the other's."""
    original = Cutoff.with_margin
    Cutoff.with_margin = lambda self: (math.inf, math.inf)
    try:
        if cache is not None:
            cache.cache_clear()
        return function(*arguments)
    finally:
        Cutoff.with_margin = original
        if cache is not None:
            cache.cache_clear()


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 4), microbatches=st.integers(1, 12), data=st.data(),
       comm=st.sampled_from([0.0, 0.2, 0.6]), quick=st.booleans(), limit=st.sampled_from([None, 1, 1.5, 3]))
def test_zbv_auto_chooses_the_order_it_chooses_without_the_cutoff(pp, microbatches, data, comm, quick, limit):
    from schedules.generators.zbv_auto import _fastest_order, zbv_auto

    forward, backward_input, backward_weight = (data.draw(st.lists(seconds, min_size=2 * pp, max_size=2 * pp))
                                                for _ in range(3))
    arguments = (pp, microbatches, forward, backward_input, backward_weight, comm, limit, quick)
    _fastest_order.cache_clear()
    with_cutoff = zbv_auto(*arguments)
    assert without_cutoff(zbv_auto, *arguments, cache=_fastest_order).programs == with_cutoff.programs


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 5), microbatches=st.integers(1, 12), data=st.data(),
       comm=st.sampled_from([0.0, 0.2, 0.6]), weight_memory=st.sampled_from([1.0, 0.6]))
def test_zb_auto_keeps_the_heuristic_it_keeps_without_the_cutoff(pp, microbatches, data, comm, weight_memory):
    from schedules.generators.zb_auto import _best_heuristic

    forward, backward_input, backward_weight = (tuple(data.draw(st.lists(seconds, min_size=pp, max_size=pp)))
                                                for _ in range(3))
    limit = data.draw(st.integers(1, 2 * pp))
    arguments = (pp, microbatches, forward, backward_input, backward_weight, comm, limit, weight_memory)
    _best_heuristic.cache_clear()
    with_cutoff = _best_heuristic(*arguments)
    assert without_cutoff(_best_heuristic, *arguments, cache=_best_heuristic) == with_cutoff


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(2, 5), microbatches=st.integers(1, 10), data=st.data(),
       name=st.sampled_from(["zb-h1", "zb-h2"]), held=st.booleans())
def test_adapt_chooses_the_order_it_chooses_without_the_cutoff(pp, microbatches, data, name, held):
    # Timed on hops of their own per boundary, some holding the rank after a pass: the
    # heuristic plans with the slowest hop and stops on a clock of the quickest.
    from schedules import generate
    from schedules.generators.adaptive import adapt

    positive = st.floats(0.05, 2.0)
    forward, backward_input, backward_weight = (data.draw(st.lists(positive, min_size=pp, max_size=pp))
                                                for _ in range(3))
    hops = data.draw(st.lists(st.floats(0.0, 0.8), min_size=pp - 1, max_size=pp - 1))
    seconds = np.array([[f, i + w, i, w] for f, i, w in zip(forward, backward_input, backward_weight, strict=True)])
    hold = np.array(data.draw(st.lists(st.floats(0.0, 0.3), min_size=4 * pp, max_size=4 * pp))).reshape(pp, 4) \
        if held else None
    timing = engine.StepTiming(seconds, hold, wires=engine.hop_wires(pp, hops))
    schedule = generate(name, pp, microbatches)
    with_cutoff = adapt(schedule, timing)
    without = without_cutoff(adapt, schedule, timing)
    assert (with_cutoff.programs, with_cutoff.meta["order"]) == (without.programs, without.meta["order"])
