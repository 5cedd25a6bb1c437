"""The CP-SAT bound on rendezvous-safe lowerings (``schedules.rendezvous_bound``) and
lowering held against it on small cases (p <= 4, m <= 8), and overlapped pairs timed as
one step with free-flowing transfers as in every lowered program.

The bound is checked against independent engine runs: it never exceeds the step of a
program that runs under rendezvous (so it bounds the best one) and never falls below the
free-flowing step of the same order (which only drops NCCL's rule)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import engine
from schedules.generators import MULTI_CHUNK, ScheduleUnavailableError, generate
from schedules.lowering import lower
from schedules.p2p import RENDEZVOUS
from tests.test_lowering_costs import NAMES, chain_timing

pytest.importorskip("ortools")
from schedules.rendezvous_bound import rendezvous_bound  # noqa: E402


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(NAMES), pp=st.integers(2, 4), data=st.data(), forward=st.sampled_from([0.5, 1.0, 1.5]),
       backward_input=st.sampled_from([0.5, 0.9, 1.2]), backward_weight=st.sampled_from([0.0, 0.3, 0.5]),
       hop=st.sampled_from([0.0, 0.1, 0.3, 0.6]))
def test_the_bound_lies_between_free_flow_and_any_rendezvous_program(name, pp, data, forward, backward_input,
                                                                      backward_weight, hop):
    microbatches = data.draw(st.integers(1, 2 * pp))
    try:
        schedule = generate(name, pp, microbatches, 2 if name in MULTI_CHUNK else 1)
    except ScheduleUnavailableError:
        return
    timing = chain_timing(schedule, forward, backward_input, backward_weight, hop)
    free = engine.run(schedule, timing, engine.FREE).makespan
    bound = rendezvous_bound(schedule, timing, seconds=10.0)
    assert bound.free == pytest.approx(free)
    assert free * (1 - 1e-9) <= bound.bound
    for repair_runs in (0, None):  # two different rendezvous-safe programs of the same order
        step = engine.run(lower(schedule, timing, repair_runs), timing, RENDEZVOUS)
        assert not step.stuck
        assert bound.bound <= step.makespan * (1 + 1e-9)


def test_the_stream_rule_shows_in_the_bound():
    """interleaved-zb, p 4, m 8, hops of 0.3 against chunk passes of 0.25-0.5: a rank's
    stream runs one group at a time, and no placement keeps every transfer on time, so
    the bound on any rendezvous program is above the free-flowing step (and below the
    step of the program lowering builds)."""
    schedule = generate("interleaved-zb", 4, 8, 2)
    timing = chain_timing(schedule, 1.0, 0.9, 0.5, 0.3)
    free = engine.run(schedule, timing, engine.FREE).makespan
    bound = rendezvous_bound(schedule, timing, seconds=20.0)
    lowered = engine.run(lower(schedule, timing), timing, RENDEZVOUS).makespan
    assert free * 1.001 < bound.bound <= lowered * (1 + 1e-9)


# Small cases where lowering comes within 1% of the bound, hence of the best rendezvous-safe
# program: every generator, hops short and long against chunk passes of 0.25-0.5
CELLS = [(name, 4, 8, hop) for name in NAMES for hop in (0.1, 0.3)]


@pytest.mark.parametrize(("name", "pp", "microbatches", "hop"), CELLS)
def test_lowering_is_within_one_percent_of_the_best_rendezvous_program(name, pp, microbatches, hop):
    schedule = generate(name, pp, microbatches, 2 if name in MULTI_CHUNK else 1)
    timing = chain_timing(schedule, 1.0, 0.9, 0.5, hop)
    nccl = engine.run(lower(schedule, timing), timing, RENDEZVOUS).makespan
    assert nccl <= 1.01 * rendezvous_bound(schedule, timing, seconds=20.0).bound


def test_an_overlapped_pair_is_one_step_with_free_flowing_transfers():
    """dualpipev: each pair's forward starts once both halves' inputs have arrived, and
    its forward's output leaves when the backward ends, as in the lowered program."""
    schedule = generate("dualpipev", 2, 4, 2)
    timing = chain_timing(schedule, 1.0, 0.9, 0.5, 0.3)
    step = engine.run(schedule, timing, engine.FREE)
    program = step.program
    pairs = 0
    for forward, backward in enumerate(program.compute_pair.tolist()):
        if backward <= forward:
            continue
        pairs += 1
        for half in (forward, backward):
            needed = int(program.compute_need[half])
            if needed >= 0:
                assert step.start[forward] >= step.arrival[needed]
        sent = int(program.compute_send[forward])
        if sent >= 0:
            assert step.departed[sent] == step.end[backward]
    assert pairs
    lowered = engine.run(lower(schedule, timing), timing, RENDEZVOUS).makespan
    assert step.makespan * (1 - 1e-9) <= lowered <= 1.01 * step.makespan
