"""One rule of counting stashes (``schedules.metrics.stash_moves``): the planners' count on a
rank's order and the metrics' count on a timed Trace are the same count."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import uniform_costs
from pipesim.sim.engine import simulate
from schedules import generate
from schedules.action import parse_action
from schedules.generators import GENERATORS, MULTI_CHUNK
from schedules.metrics import order_peak_stashes, peak_stashes


def order(text: str):
    return [parse_action(cell) for cell in text.split()]


@pytest.mark.parametrize(("text", "expected"), [
    ("", 0),
    ("0F0 0F1 0B0 0F2 0B1 0B2", 2),  # 1F1B's steady state: B frees what F took
    ("0F0 0F1 0I0 0F2 0W0 0I1 0W1 0I2 0W2", 3),  # split: the stash stays until the W
    ("0F0 0I0 0F1 0I1", 1),  # an I with no W of its own frees at once
    ("0F0 3F0 3I0 0I0 0W0 3W0", 2),  # a V's two chunks: one stash each
])
def test_a_rank_order_counted_by_hand(text, expected):
    assert order_peak_stashes(order(text)) == expected


@pytest.mark.parametrize(("text", "kept", "expected"), [
    ("0F0 0I0 0F1 0W0 0I1 0W1", 0.4, 1.4),  # 1, 0.4, 1.4, 1.0, 0.4, 0
    ("0F0 0F1 0I0 0I1 0W0 0W1", 0.4, 2.0),  # both forwards before any I
    ("0F0 0B0 0F1 0B1", 0.4, 1.0),  # a whole backward frees the whole stash
    ("0F0 0I0 0F1 0W0 0I1 0W1", 1.0, 2.0),  # the whole stash until its W: the count above
])
def test_a_kept_share_counted_by_hand(text, kept, expected):
    """With ``kept`` an I frees all but that share of its stash, its W the rest."""
    assert order_peak_stashes(order(text), kept) == pytest.approx(expected)


def test_zb_autos_fit_check_counts_the_kept_share():
    """zb-h1's last rank at pp 4 runs F0 I0 F1 I1 F2 I2 F3 before its first W: 4 stashes
    counted whole, 1 + 3 x 0.4 = 2.2 with 0.4 kept, so a limit of 3 on it fails the whole
    count and passes the shared one (the other ranks keep their limit of 4)."""
    from schedules.generators.zb_auto import fits

    programs = generate("zb-h1", 4, 8).programs
    assert " ".join(f"{action.kind}{action.microbatch}" for action in programs[3][:8]) == "F0 I0 F1 I1 F2 I2 F3 I3"
    assert order_peak_stashes(programs[3]) == 4
    assert order_peak_stashes(programs[3], 0.4) == pytest.approx(2.2)
    assert not fits(programs, (4, 4, 4, 3)) and fits(programs, (4, 4, 4, 3), 0.4)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(GENERATORS)), pp=st.integers(2, 4), microbatches=st.integers(1, 8))
def test_the_order_count_is_the_timed_count(name, pp, microbatches):
    """Simulated with uniform costs, each rank's timed peak (the metrics' count on the
    Trace) is its order's peak (the planners' count on the program)."""
    chunks = 2 if name in MULTI_CHUNK else 1
    try:
        schedule = generate(name, pp, microbatches, chunks)
    except ValueError:  # sizes the schedule does not support
        return
    trace = simulate(schedule, uniform_costs(schedule, 1.0, 2.0, 1.0), ideal_topology())
    timed = peak_stashes(trace.columns, schedule.pp)
    assert timed.tolist() == [order_peak_stashes(program) for program in schedule.programs]
