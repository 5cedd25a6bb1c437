"""zbv-auto: the V-shaped zero-bubble order built for the costs under a memory limit.

Expected values come from the handcrafted zbv order timed by the engine, from hand
bounds, or from counting the orders' stashes here; never from zbv-auto itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import uniform_costs
from pipesim.sim.cost_aware import build_cost_aware
from schedules import engine, generate, lower, validate
from schedules.generators import (
    COST_AWARE,
    MULTI_CHUNK,
    SCHEDULE_NAMES,
    V_SHAPED,
    ScheduleUnavailableError,
    placement_of,
    zbv_auto,
)
from schedules.generators.greedy_zero_bubble import placed_greedy_orders
from schedules.p2p import BUFFERED, RENDEZVOUS
from schedules.schedule import v_shape_placement
from schedules.torch_compat import torch_class_for


def step(schedule, forward, backward_input, backward_weight, comm) -> engine.StepRun:
    """The order under free-flowing transfers: every one of the 2p stages costs the same,
    a hop between ranks ``comm`` (the engine sends nothing between stages on one rank)."""
    stages = schedule.num_stages
    seconds = np.tile([forward, backward_input + backward_weight, backward_input, backward_weight], (stages, 1))
    return engine.run(schedule, engine.StepTiming(seconds, wires=engine.hop_wires(stages, comm)), engine.FREE)


def chunk_stashes(program) -> int:
    """Most chunk stashes one rank holds, counted here: +1 at F, -1 at W."""
    held = peak = 0
    for action in program:
        held += {"F": 1, "W": -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


costs = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), costs, costs, costs, st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_never_slower_than_zbv_and_within_zbvs_memory(pp, microbatches, forward, backward_input, backward_weight,
                                                        comm):
    ours = zbv_auto(pp, microbatches, forward, backward_input, backward_weight, comm)
    theirs = generate("zbv", pp, microbatches, 2)
    assert ours.placement == theirs.placement == v_shape_placement(pp, 2)
    assert (step(ours, forward, backward_input, backward_weight, comm).makespan
            <= step(theirs, forward, backward_input, backward_weight, comm).makespan + 1e-9)
    assert max(map(chunk_stashes, ours.programs)) <= 2 * pp  # p microbatches on the rank's two chunks
    validate(ours)


@pytest.mark.parametrize("limit", [1, 1.5, 2, 2.5, 3, 4])
@pytest.mark.parametrize(("pp", "microbatches"), [(4, 8), (4, 12), (3, 9)])
def test_a_lower_limit_gives_an_order_within_it(limit, pp, microbatches):
    schedule = zbv_auto(pp, microbatches, 1.0, 0.9, 0.5, 0.3, limit)
    assert max(map(chunk_stashes, schedule.programs)) <= int(2 * limit)
    assert schedule.meta["memory_microbatches"] == int(2 * limit) / 2
    validate(schedule)
    lowered = lower(schedule)
    validate(lowered, RENDEZVOUS)
    validate(lowered, BUFFERED)


def shared_stashes(program, share: float) -> float:
    """Most chunk stashes one rank holds when an ``I`` frees all but ``share`` of its
    stash and the ``W`` the rest, counted here: +1 at F, -(1 - share) at I, -share at W."""
    held = peak = 0.0
    for action in program:
        held += {"F": 1.0, "I": share - 1.0, "W": -share}.get(action.kind, 0.0)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize(("share", "expected"), [
    (0.0, "F0 I0 F1 I1 W0 W1"),  # the I frees the whole stash: the next forward fits at once
    (0.5, "F0 I0 W0 F1 I1 W1"),  # half of it stays until the W: the forward waits for it
    (1.0, "F0 I0 W0 F1 I1 W1"),
])
def test_the_greedy_counts_the_share_an_i_keeps_until_its_w(share, expected):
    """One stage, one stash of room, every pass 1 s: by hand, after ``I0`` the rank holds
    ``share`` of a stash, so ``F1`` fits before ``W0`` only when nothing is kept."""
    (program,) = placed_greedy_orders((0,), 2, [1.0], [1.0], [1.0], 0.0, 1, weight_memory=share)
    assert " ".join(f"{action.kind}{action.microbatch}" for action in program) == expected


@settings(max_examples=30, deadline=None)
@given(pp=st.integers(2, 4), microbatches=st.integers(2, 10), limit=st.sampled_from([1, 1.5, 2, 3]),
       share=st.sampled_from([0.0, 0.25, 0.4, 0.75, 1.0]), forward=costs, backward_input=costs,
       backward_weight=costs)
def test_a_shared_stash_order_holds_its_limit_as_the_memory_model_counts(pp, microbatches, limit, share, forward,
                                                                          backward_input, backward_weight):
    """Below 1 the share lets more forwards run between an I and its W, and the order
    still holds at most ``2 limit`` chunk stashes counted with the share (rounded up to a
    tenth, as the scheduler counts it)."""
    schedule = zbv_auto(pp, microbatches, forward, backward_input, backward_weight, 0.1, limit, weight_memory=share)
    counted = np.ceil(share * 10 - 1e-9) / 10
    assert schedule.meta["weight_memory"] == counted
    assert max(shared_stashes(program, counted) for program in schedule.programs) <= int(2 * limit) + 1e-9
    validate(schedule)
    lowered = lower(schedule)  # its transfers hold under NCCL's rule as under gloo's
    validate(lowered, RENDEZVOUS)
    validate(lowered, BUFFERED)


@settings(max_examples=25, deadline=None)
@given(pp=st.integers(2, 4), microbatches=st.integers(2, 10), limit=st.sampled_from([1, 1.5, 2, 3]),
       share=st.sampled_from([0.0, 0.4, 0.75]), forward=costs, backward_input=costs, backward_weight=costs)
def test_counting_the_kept_share_never_lengthens_the_step(pp, microbatches, limit, share, forward, backward_input,
                                                          backward_weight):
    """The orders of the whole count stay candidates, so the share's step is at most theirs."""
    args = (pp, microbatches, forward, backward_input, backward_weight, 0.1, limit)
    shared, whole = zbv_auto(*args, weight_memory=share), zbv_auto(*args)
    assert (step(shared, forward, backward_input, backward_weight, 0.1).makespan
            <= step(whole, forward, backward_input, backward_weight, 0.1).makespan + 1e-9)


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_a_weight_memory_outside_a_share_is_refused(share):
    with pytest.raises(ScheduleUnavailableError, match="weight memory must be a share"):
        zbv_auto(4, 8, 1.0, 1.0, 1.0, 0.0, weight_memory=share)


def test_less_memory_costs_time():
    times = [step(zbv_auto(4, 12, 1.0, 0.9, 0.5, 0.3, limit), 1.0, 0.9, 0.5, 0.3).makespan for limit in (1, 2, 4)]
    assert times[0] > times[1] > times[2]


@pytest.mark.parametrize("limit", [0.5, 0, -1])
def test_a_limit_below_one_microbatch_is_refused_by_value(limit):
    with pytest.raises(ScheduleUnavailableError, match=f"--memory-limit {limit:g} is below the least"):
        zbv_auto(4, 8, 1, 1, 1, 0.0, limit)


def test_costs_must_cover_the_vs_stages():
    with pytest.raises(ScheduleUnavailableError, match=r"3 forward costs given for the V's 2 x pp=4 = 8 stages"):
        zbv_auto(4, 8, [1, 1, 1], 1, 1)
    with pytest.raises(ScheduleUnavailableError, match="communication time must be >= 0"):
        zbv_auto(4, 8, 1, 1, 1, -0.1)


@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (3, 6), (4, 8), (4, 12), (6, 12)])
def test_unit_costs_on_free_links_match_zbvs_optimal_step(pp, microbatches):
    """F = I = W = 1 per chunk, no hop time, m >= 2p: rank p - 1 cannot start before p - 1
    forwards reach it and then has 6m of work, so no order ends before 6m + p - 1; zbv
    ends there (every rank computes without a gap from its first action to its last)."""
    bound = 6 * microbatches + pp - 1
    assert step(generate("zbv", pp, microbatches, 2), 1, 1, 1, 0).makespan == bound
    assert step(zbv_auto(pp, microbatches, 1, 1, 1, 0.0), 1, 1, 1, 0).makespan == bound


def test_beats_zbv_where_hops_take_time():
    """p 4, m 8, per chunk F = I = W = 1, hops 0.5, zbv's memory (the engine's timing of
    both orders): zbv's fixed order waits 1.5 longer on its transfers than the order
    built for them."""
    ours = zbv_auto(4, 8, 1.0, 1.0, 1.0, 0.5)
    theirs = generate("zbv", 4, 8, 2)
    assert step(theirs, 1.0, 1.0, 1.0, 0.5).makespan == pytest.approx(ZBV_STEP)
    assert step(ours, 1.0, 1.0, 1.0, 0.5).makespan == pytest.approx(ZBV_AUTO_STEP)
    assert max(map(chunk_stashes, ours.programs)) <= 8


# engine timings of the two orders in the test above (work per rank 8 x 2 x 3 = 48)
ZBV_STEP = 57.5
ZBV_AUTO_STEP = 56.0


def test_the_greedy_on_one_stage_per_rank_is_the_looped_one():
    """``placed_greedy_orders`` with the identity placement is ``greedy_orders``' engine."""
    from schedules.generators.greedy_zero_bubble import greedy_orders

    for limit in (1, 3, 4, 7):
        assert greedy_orders(4, 8, [1.0] * 4, [1.2] * 4, [0.5] * 4, 0.2, limit, True, 3) == placed_greedy_orders(
            (0, 1, 2, 3), 8, [1.0] * 4, [1.2] * 4, [0.5] * 4, 0.2, limit, patient_weights=True, warmup_cap=3)


# --- wiring -------------------------------------------------------------------------------


def test_registered_like_zb_auto():
    assert {"zb-auto", "zbv-auto"} <= COST_AWARE
    assert "zbv-auto" in V_SHAPED and "zbv-auto" in MULTI_CHUNK and "zbv-auto" in SCHEDULE_NAMES
    assert placement_of("zbv-auto", 4, 2) == v_shape_placement(4, 2)
    with pytest.raises(ValueError, match=r"zbv-auto builds its order from stage costs.*zbv_auto\(pp, m"):
        generate("zbv-auto", 4, 8)


def test_torch_class_is_zbvs():
    assert torch_class_for(zbv_auto(4, 8, 1.0, 1.0, 0.5, 0.5)).name == "ZBVZeroBubble"


def test_built_from_costs_of_the_vs_stages():
    costs = uniform_costs(8, 1.0, 1.5, 0.5, virtual_stages=2)
    schedule = build_cost_aware("zbv-auto", 4, 8, costs, ideal_topology(), memory_limit=2)
    assert schedule.name == "zbv-auto" and schedule.placement == v_shape_placement(4, 2)
    assert max(map(chunk_stashes, schedule.programs)) <= 4
    with pytest.raises(ValueError, match=r"costs describe 4 stages but pp=4 needs 8 \(two stages per rank"):
        build_cost_aware("zbv-auto", 4, 8, uniform_costs(4, 1.0, 1.5, 0.5), ideal_topology())


def test_from_the_command_line_within_its_memory_limit(tmp_path, capsys):
    out = tmp_path / "result.json"
    assert main(["simulate", "--schedule", "zbv-auto", "--pp", "4", "-m", "8", "--fwd", "1e-3", "--bwd", "2e-3",
                 "--wgrad", "0.7e-3", "--memory-limit", "2.5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schedule"] == "zbv-auto"
    assert max(rank["peak_inflight_microbatches"] for rank in result["ranks"]) <= 2.5
    assert main(["simulate", "--schedule", "zbv-auto", "--pp", "4", "-m", "8", "--virtual-stages", "4"]) == 2
    assert "zbv-auto places exactly 2 stages per rank in a V; virtual stages=4" in capsys.readouterr().err


@settings(max_examples=25, deadline=None)
@given(pp=st.integers(2, 5), microbatches=st.integers(2, 10), forward=st.floats(0.2, 2.0),
       backward_input=st.floats(0.2, 2.0), backward_weight=st.floats(0.05, 2.0), comm=st.floats(0.0, 0.6))
def test_the_quick_search_a_planner_screens_with_is_never_faster_than_the_full_one(
        pp, microbatches, forward, backward_input, backward_weight, comm):
    # the quick variants are a subset of the full search's, so its step can only be longer
    full = zbv_auto(pp, microbatches, forward, backward_input, backward_weight, comm)
    quick = zbv_auto(pp, microbatches, forward, backward_input, backward_weight, comm, quick=True)
    assert step(full, forward, backward_input, backward_weight, comm).makespan <= \
        step(quick, forward, backward_input, backward_weight, comm).makespan + 1e-9


@pytest.mark.parametrize(("forward", "backward_input", "backward_weight", "comm", "named"), [
    ([1.0, -0.1], [1.0, 1.0], [1.0, 1.0], 0.0, "forward"),
    ([1.0, 1.0], [1.0, 1.0], [-2.0, 1.0], 0.0, "weight-gradient"),
    ([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], -0.5, "communication"),
])
def test_the_greedy_scheduler_refuses_negative_seconds(forward, backward_input, backward_weight, comm, named):
    with pytest.raises(ValueError, match=f"{named} seconds must be >= 0"):
        placed_greedy_orders((0, 1), 2, forward, backward_input, backward_weight, comm, 2)
