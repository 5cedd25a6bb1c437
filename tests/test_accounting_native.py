"""The time accounting's C loop (``schedules/_accounting.c``) against its Python version
(``schedules.accounting``): the same rule and the same floating-point operations, so
the same seconds to the last bit, on simulated steps of every kind (tp, dp, ZeRO,
both P2P semantics, zero-bubble and V schedules) and on hand-made traces (overlapping
waits, sends that hold the rank, a trace of one rank, text-only events)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from pipesim.model.costs import uniform_costs
from pipesim.sim.engine import simulate
from pipesim.sim.memory import memory_report
from schedules import accounting
from schedules.accounting import RankTime, time_accounting
from schedules.metrics import StepMetrics, step_metrics
from schedules.trace import Trace, TraceEvent
from tests.native_switch import accelerated
from tests.test_engine_fast import cases

pytestmark = pytest.mark.skipif(accounting._native is None, reason="the C accounting is not built")


def accounting_loop(native: bool):
    return accelerated(accounting, native)


def both(trace: Trace) -> tuple[list[RankTime], list[RankTime]]:
    with accounting_loop(False):
        python = time_accounting(trace)
    with accounting_loop(True):
        native = time_accounting(trace)
    return python, native


def both_metrics(trace: Trace) -> tuple[StepMetrics, StepMetrics]:
    with accounting_loop(False):
        python = step_metrics(trace)
    with accounting_loop(True):
        native = step_metrics(trace)
    return python, native


@settings(max_examples=150, deadline=None)
@given(cases())
def test_the_c_accounting_equals_python_on_simulated_steps(case):
    lowered, costs, topology, devices, plan, p2p = case
    trace = simulate(lowered, costs, topology, devices, plan, p2p)
    python, native = both(trace)
    assert native == python  # float for float
    python_metrics, native_metrics = both_metrics(trace)  # the one-pass summary: spans, comm, stashes too
    assert native_metrics == python_metrics
    if costs.memory_known:  # the memory timelines: stash bytes per stage, merged moments
        devices = [f"d{rank}" for rank in range(lowered.pp)]
        capacities = [80e9] * lowered.pp
        with accounting_loop(False):
            python_memory = memory_report(trace, costs, lowered.placement, devices, capacities, dp=2, zero=1)
        with accounting_loop(True):
            native_memory = memory_report(trace, costs, lowered.placement, devices, capacities, dp=2, zero=1)
        assert native_memory == python_memory


def event(rank, action, kind, stage, microbatch, start, end, stream):
    return TraceEvent(rank, action, kind, stage, microbatch, start, end, stream)


def test_overlapping_waits_and_held_sends_go_to_the_sweep_with_the_same_result():
    # rank 1 waits on two receives at once (overlapping), rank 0's send is held until
    # rank 1 posts its receive; tp overlaps compute on rank 0: both the C and the Python
    # path must agree, whichever decides
    events = [
        event(0, "0F0", "F", 0, 0, 0.0, 1.0, "compute"),
        event(0, "tp(0F0)", "tp", 0, 0, 0.5, 1.5, "tp"),
        event(0, "0SEND_F0", "SEND_F", 0, 0, 1.5, 3.0, "send"),
        event(1, "1RECV_F0", "RECV_F", 1, 0, 0.0, 3.0, "recv"),
        event(1, "1RECV_F1", "RECV_F", 1, 1, 1.0, 3.5, "recv"),
        event(1, "1F0", "F", 1, 0, 3.5, 4.5, "compute"),
        event(1, "dp", "dp", 1, 0, 4.0, 6.0, "dp"),
        event(0, "step", "step", 0, 0, 5.0, 5.5, "step"),
    ]
    trace = Trace(events, {"pp": 2, "p2p": "rendezvous"})
    python, native = both(trace)
    assert native == python
    assert both_metrics(trace)[0] == both_metrics(trace)[1]
    assert sum(python[0].__dict__.values()) == pytest.approx(6.0)  # parts sum to the makespan


@pytest.mark.parametrize("p2p", ["rendezvous", "buffered"])
def test_a_one_rank_trace_and_unmatched_transfers_agree(p2p):
    # sends with no matching receive in the trace and receives with no send (one rank's own trace)
    events = [
        event(0, "1RECV_F0", "RECV_F", 1, 0, 0.0, 2.0, "recv"),
        event(0, "1F0", "F", 1, 0, 2.0, 3.0, "compute"),
        event(0, "1SEND_F0", "SEND_F", 1, 0, 3.0, 3.5, "send"),
        event(0, "1RECV_B0", "RECV_B", 1, 0, 3.5, 6.0, "recv"),
        event(0, "1B0", "B", 1, 0, 6.0, 8.0, "compute"),
        event(0, "1SEND_B0", "SEND_B", 1, 0, 8.0, 8.2, "send"),
        event(0, "end", "wait", 1, 0, 8.2, 9.0, "wait"),
    ]
    python, native = both(Trace(events, {"pp": 1, "p2p": p2p}))
    assert native == python
    python_metrics, native_metrics = both_metrics(Trace(events, {"pp": 1, "p2p": p2p}))
    assert native_metrics == python_metrics and native_metrics.ranks[0].comm == pytest.approx(0.7)
    # waits 0-2, 3.5-6 and 8.2-9 (no send in the trace: ready at once, so exposed); the
    # sends' 0.5 and 0.2 s between the rank's own events are overhead
    assert python[0].busy == 3.0 and python[0].exposed_comm == pytest.approx(2.0 + 2.5 + 0.8)
    assert python[0].overhead == pytest.approx(0.7)


def test_a_later_event_of_the_same_text_wins_in_both():
    # two sends of one text (a measured trace can repeat one): the dict keeps the later
    events = [
        event(0, "0SEND_F0", "SEND_F", 0, 0, 1.0, 1.2, "send"),
        event(0, "0SEND_F0", "SEND_F", 0, 0, 2.0, 2.2, "send"),
        event(1, "1RECV_F0", "RECV_F", 1, 0, 0.0, 3.0, "recv"),
        event(1, "1F0", "F", 1, 0, 3.0, 4.0, "compute"),
    ]
    python, native = both(Trace(events, {"pp": 2}))
    assert native == python
    assert python[1].bubble == pytest.approx(2.0)  # data ready at 2.0 (the later send), not 1.0


def test_stashes_held_and_a_rank_without_events_agree():
    # rank 0: F0, F1, then B0 (no W: releases at its end), W-split microbatch 1: I1 then
    # W1 (released by the W); rank 2 recorded nothing: 3 ranks in meta
    events = [
        event(0, "0F0", "F", 0, 0, 0.0, 1.0, "compute"),
        event(0, "0F1", "F", 0, 1, 1.0, 2.0, "compute"),
        event(0, "0B0", "B", 0, 0, 2.0, 4.0, "compute"),
        event(0, "0I1", "I", 0, 1, 4.0, 5.0, "compute"),
        event(0, "0W1", "W", 0, 1, 5.0, 6.0, "compute"),
        event(1, "1F0", "F", 1, 0, 0.5, 1.5, "compute"),
    ]
    trace = Trace(events, {"pp": 3})
    python, native = both_metrics(trace)
    assert native == python
    assert [rank.peak_inflight_microbatches for rank in python.ranks] == [2.0, 1.0, 0.0]
    # rank 0's memory timeline with 10 B per stash: F0 at 0.0 (merged into the starting
    # point), F1 at 1.0, B0 releases at 4.0, W1 at 6.0
    costs = uniform_costs(2, 1.0, 2.0, stash_bytes=10.0, param_bytes=0.0)
    reports = []
    for native_loop in (False, True):
        with accounting_loop(native_loop):
            reports.append(memory_report(trace, costs, (0, 1, 1), ["a", "b", "c"], [1e3] * 3))
    assert reports[0] == reports[1]
    assert reports[0][0].timeline == ((0.0, 10.0), (1.0, 20.0), (4.0, 10.0), (6.0, 0.0))
    assert reports[0][0].peak_stash_bytes == 20.0
    assert python.ranks[2].bubble == python.makespan == 6.0  # nothing recorded: all of it waiting


def test_a_rank_number_outside_the_trace_is_left_to_python():
    events = [event(-1, "0F0", "F", 0, 0, 0.0, 1.0, "compute"), event(0, "0F1", "F", 0, 1, 1.0, 2.0, "compute")]
    python, native = both_metrics(Trace(events, {"pp": 1}))
    assert native == python
