"""ZeRO-3's collectives in the measured Trace: FSDP2's parameter all-gathers and gradient
reduce-scatters drawn on the ``dp`` stream, each inside the compute action it serves
(``executor.fsdp_timing``), counted by hand from the layout and the schedule, while the
run still equals the one-process reference.

What FSDP2 does, unit by unit (a stage's blocks ``L0, L1, ...`` and the stage itself,
``root``: the embedding on the first stage, the final norm and head on the last, nothing
on the others): a block is gathered before each forward and freed
after it, gathered again before each backward, and its gradient reduce-scattered once per
backward; the root is kept gathered from a forward to the end of the next backward (FSDP2
does not free the root after forward), so it is gathered by the stage's first action and
by each action that follows a backward of the stage, and reduce-scattered once per
backward. A backward may gather a block once more: FSDP2's implicit backward prefetch
follows the order of the forwards, so with two microbatches forwarded it can prefetch the
next microbatch's unit, which the end of the backward frees again.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.config import even_layout
from executor.data_parallel import PARAM_GATHER, REDUCE_SCATTER
from executor.fsdp_timing import FsdpTimer, hooks_available, time_unit
from executor.gather import ROOT_UNIT, decode, dp_event, encode, fsdp_event, inside_event
from executor.reference import reference_run
from schedules.action import Action
from schedules.generators import generate
from tests.launched_cases import LaunchedCases, assert_equals_reference, assert_weights_equal_reference

pytestmark = pytest.mark.timeout(300)

BASE = {"model": "gpt", "hidden": 8, "heads": 2, "seq_len": 4, "vocab": 11, "batch_size": 4, "steps": 2,
        "dtype": "float64", "optimizer": "adamw", "lr": 0.05, "return_grads": True, "microbatches": 2,
        "pp": 2, "dp": 2, "zero": 3}
LAUNCHED = LaunchedCases(BASE, {4: {
    "1f1b": {"schedule": "1f1b", "layers": 3},  # stage 0: embedding + 2 blocks, stage 1: 1 block + head
    "interleaved-1f1b": {"schedule": "interleaved-1f1b", "virtual_stages": 2, "layers": 5},
}})


@pytest.mark.parametrize("name", LAUNCHED.cases)
def test_zero_3_with_its_collectives_timed_equals_the_one_process_reference(name: str) -> None:
    result, reference = LAUNCHED.result(name), reference_run(LAUNCHED.config(name))
    assert_equals_reference(result, reference)
    assert_weights_equal_reference(result, reference)  # after both AdamW steps


def unit_and_action(event) -> tuple[str, str]:
    """``("L1", "0F0")`` from ``0ALLGATHER_PARAMS[L1](0F0)``."""
    unit, action = event.action.split("[", 1)[1].split("](")
    return unit, action[:-1]


@pytest.mark.parametrize("name", LAUNCHED.cases)
def test_each_unit_is_gathered_and_reduced_as_fsdp2_does_it(name: str) -> None:
    config = LAUNCHED.config(name)
    schedule = generate(config.schedule, config.pp, config.microbatches, config.virtual_stages)
    blocks = even_layout(config.layers, schedule.num_stages)
    events = LAUNCHED.result(name)["trace"].events
    fsdp = [e for e in events if e.stream == "dp"]
    assert {e.kind for e in fsdp} == {PARAM_GATHER, REDUCE_SCATTER}
    gathers = Counter(unit_and_action(e) for e in fsdp if e.kind == PARAM_GATHER)
    reductions = Counter(unit_and_action(e) for e in fsdp if e.kind == REDUCE_SCATTER)
    expected_gathers, expected_reductions, extra = Counter(), Counter(), 0
    for rank in range(schedule.pp):
        program = [a for a in schedule.programs[rank] if a.kind in ("F", "B")]
        for stage in schedule.stages_of(rank):
            actions = [a for a in program if a.stage == stage]
            has_root = stage in (0, schedule.num_stages - 1)  # the embedding, the head: a middle stage's root is empty
            for position, action in enumerate(actions):
                after_backward = position == 0 or actions[position - 1].kind == "B"
                expected_gathers[("root", str(action))] = int(after_backward and has_root)
                for block in range(blocks[stage]):
                    expected_gathers[(f"L{block}", str(action))] = 1
                    if action.kind == "B":
                        expected_reductions[(f"L{block}", str(action))] = 1
                        extra += 1  # at most one prefetch for the next backward
                if action.kind == "B" and has_root:
                    expected_reductions[("root", str(action))] = 1
    assert reductions == expected_reductions
    expected_gathers = +expected_gathers  # drop the roots' zeros
    # forwards and roots exactly; a block's backward once, or twice when prefetched
    assert {key: count for key, count in gathers.items() if "F" in key[1] or key[0] == "root"} == \
        {key: count for key, count in expected_gathers.items() if "F" in key[1] or key[0] == "root"}
    backward = {key: count for key, count in gathers.items() if "B" in key[1] and key[0] != "root"}
    assert set(backward) == {key for key in expected_gathers if "B" in key[1] and key[0] != "root"}
    assert all(1 <= count <= 2 for count in backward.values())
    assert sum(backward.values()) - len(backward) <= extra


@pytest.mark.parametrize("name", LAUNCHED.cases)
def test_each_collective_lies_inside_the_action_it_serves(name: str) -> None:
    events = LAUNCHED.result(name)["trace"].events
    compute = {(e.rank, e.action): e for e in events if e.stream == "compute"}
    fsdp = [e for e in events if e.stream == "dp"]
    assert fsdp
    for event in fsdp:
        served = compute[(event.rank, unit_and_action(event)[1])]
        assert (event.stage, event.microbatch) == (served.stage, served.microbatch)
        assert served.start <= event.start <= event.end <= served.end, event
    # on CPU they held the rank there (synchronous on gloo): the chart draws them over the bar
    assert LAUNCHED.result(name)["trace"].meta["dp_held_inside_actions"] is True


def test_the_summary_says_the_dp_time_was_spent_inside_compute_actions() -> None:
    from executor.report import summary, summary_lines  # noqa: PLC0415

    result = LAUNCHED.result("1f1b")
    document = summary(result)
    dp = document["comm"]["dp"]
    # every dp event of a ZeRO-3 run is FSDP's, each inside a compute action: all of it is
    # held there, none of it is exposed (the accounting gives the overlap to compute)
    assert dp["inside_actions"] == pytest.approx(dp["total"]) and dp["total"] > 0
    assert dp["exposed"] == pytest.approx(0.0, abs=1e-12)
    line = next(line for line in summary_lines(result, document) if line.startswith("measured communication"))
    assert "ZeRO-3's gathers and reduce-scatters" in line and "inside compute actions" in line


def test_fsdp_events_travel_to_rank_0_as_numbers_and_back() -> None:
    program = (Action(0, "F", 0), Action(0, "B", 0))
    events = [fsdp_event(1, PARAM_GATHER, 1, Action(0, "F", 0), 0.5, 0.75),
              fsdp_event(1, REDUCE_SCATTER, ROOT_UNIT, Action(0, "B", 0), 1.0, 1.25),
              dp_event(1, 0, 2.0, 2.5, PARAM_GATHER, 3),  # ZeRO-1/2's bucket after the optimizer
              inside_event(1, Action(0, "F", 0), 0.25, 0.5)]
    assert events[0].action == "0ALLGATHER_PARAMS[L1](0F0)" and events[1].action == "0REDUCE_SCATTER_DP[root](0B0)"
    assert (events[0].stream, events[0].stage, events[0].microbatch) == ("dp", 0, 0)
    assert decode(1, program, encode(program, events)) == events


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from((PARAM_GATHER, REDUCE_SCATTER)), st.integers(-1, 7),
                          st.integers(0, 5), st.sampled_from("FBIW"), st.integers(0, 9),
                          st.floats(0, 10, allow_nan=False), st.floats(0, 1, allow_nan=False)), max_size=12))
def test_any_fsdp_events_survive_the_gather_encoding(rows: list) -> None:
    events = [fsdp_event(0, kind, unit, Action(stage, served, microbatch), start, start + length)
              for kind, unit, stage, served, microbatch, start, length in rows]
    assert decode(0, (), encode((), events)) == events


def test_a_module_without_fsdp_hooks_is_left_as_it_is() -> None:
    from torch import nn

    layer = nn.Linear(2, 2)
    assert not hooks_available(layer)
    time_unit(layer, FsdpTimer(lambda: None), 0, 0)  # what a torch before the hooks gets: nothing
    assert not hasattr(layer, "_fsdp_state")


def test_the_timer_records_the_action_running_when_a_collective_is_issued() -> None:
    ticks = iter(range(10))
    running = [Action(0, "F", 0)]
    timer = FsdpTimer(lambda: running[0], lambda: next(ticks))
    assert timer.timed(PARAM_GATHER, 0, 1, lambda: "work") == "work"
    running[0] = Action(0, "B", 0)
    timer.timed(REDUCE_SCATTER, 0, ROOT_UNIT, lambda: None)
    assert timer.take() == [(PARAM_GATHER, 0, 1, Action(0, "F", 0), 0, 1),
                            (REDUCE_SCATTER, 0, ROOT_UNIT, Action(0, "B", 0), 2, 3)]
    assert timer.take() == []


def test_the_gpu_check_finds_the_collectives_and_fails_without_them() -> None:
    """``scripts/gpu_check.py zero-ep`` runs this on NCCL, where the marks are CUDA events
    on FSDP's own streams; here its verdict on a gloo Trace, and on one without them."""
    from schedules.trace import Trace
    from tests.test_gpu_check import gpu_check_module

    drawn = gpu_check_module().fsdp_collectives_drawn
    trace = LAUNCHED.result("1f1b")["trace"]
    assert drawn({"trace": trace}) == 0
    assert drawn({"trace": Trace([e for e in trace.events if e.stream != "dp"], trace.meta)}) == 1
