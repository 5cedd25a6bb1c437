"""Interleaved 1F1B with Megatron-Core's microbatch group size N
(``--microbatch-group-size-per-virtual-pipeline-stage``; Meta's flexible N, Llama 3
section 3.3.2): the order is Megatron's action by action, the default is the order
pipesim always generated, the warm-up count is Megatron's, and memory falls with N."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipesim
from schedules import ScheduleUnavailableError, generate, is_valid, lower, validate
from schedules.generators.interleaved import grouped_order, schedule_table, valid_microbatch_groups
from schedules.metrics import order_peak_stashes


def program_text(schedule) -> list[str]:
    return [" ".join(map(str, program)) for program in schedule.programs]


def megatron_range(pp: int, microbatches: int) -> list[int]:
    """The check at the top of Megatron-Core's forward_backward_pipelining_with_interleaving,
    written out: PP <= N <= M, and M % N zero or >= PP (plus the one group of m < p)."""
    return [group for group in range(1, microbatches + 1)
            if (pp <= group or group == microbatches) and (microbatches % group == 0 or microbatches % group >= pp)]


def test_table_is_megatrons_docstring_example():
    # Megatron-Core's get_schedule_table comment: "PP2 N3M5 with VP2"
    # microbatch_id 0 1 2 0 1 2 3 4 3 4, model_chunk_id 0 0 0 1 1 1 0 0 1 1
    microbatch, chunk = schedule_table(5, 2, 3)
    assert microbatch.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert chunk.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


# Derived by hand from Megatron-Core's schedules.py: warm-up 2(p-r-1) + (v-1)N forwards from
# the table, then forward (warm-up + k) and backward k, then the remaining backwards; the
# k-th backward runs table entry k on chunk v-1-chunk. Stage = chunk * p + rank.
HAND_ORDERS = {
    (2, 2, 6, 3): [
        "0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 0F5 0B0 2F3 0B1 2F4 0B2 2F5 2B3 2B4 2B5 0B3 0B4 0B5",
        "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 1F5 1B2 3F3 3B3 3F4 3B4 3F5 3B5 1B3 1B4 1B5",
    ],
    # m = 5 is not a multiple of N = 3: a last group of 2 (= p, which Megatron accepts)
    (2, 2, 5, 3): [
        "0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1 0B2 2B3 2B4 0B3 0B4",
        "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 3F3 1B2 3F4 3B3 3B4 1B3 1B4",
    ],
    # N = m: breadth-first; rank 0 runs 2 + 4 forwards first
    (2, 2, 4, 4): [
        "0F0 0F1 0F2 0F3 2F0 2F1 2F2 2B0 2F3 2B1 2B2 2B3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1F3 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 1B0 1B1 1B2 1B3",
    ],
}


@pytest.mark.parametrize("size", sorted(HAND_ORDERS))
def test_orders_match_megatrons_action_by_action(size):
    pp, virtual, microbatches, group = size
    schedule = generate("interleaved-1f1b", pp, microbatches, virtual, microbatch_group=group)
    assert program_text(schedule) == HAND_ORDERS[size]
    assert schedule.meta["microbatch_group"] == group
    assert pipesim.schedule("interleaved-1f1b", pp, microbatches, virtual, microbatch_group=group).programs == \
        schedule.programs


def default_order(pp: int, microbatches: int, virtual: int) -> list[list[str]]:
    """The order pipesim generated before N could be set, written from its closed form:
    rounds of g = m / max(1, m // p); the j-th forward runs chunk (j // g) % v on
    microbatch (j // gv) g + j % g, after 2(p-r-1) + (v-1)g warm-up forwards."""
    rounds = max(1, microbatches // pp)
    group, total = microbatches // rounds, microbatches * virtual
    programs = []
    for rank in range(pp):
        def visit(kind: str, step: int, rank: int = rank) -> str:
            chunk = (step // group) % virtual
            chunk = chunk if kind == "F" else virtual - 1 - chunk
            return f"{chunk * pp + rank}{kind}{step // (group * virtual) * group + step % group}"
        warmup = min(2 * (pp - 1 - rank) + (virtual - 1) * group, total)
        program = [visit("F", step) for step in range(warmup)]
        for step in range(total - warmup):
            program += [visit("F", warmup + step), visit("B", step)]
        programs.append(program + [visit("B", step) for step in range(total - warmup, total)])
    return programs


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 8), virtual=st.integers(1, 4), microbatches=st.integers(1, 40))
def test_the_default_is_the_order_generated_before(pp, virtual, microbatches):
    if microbatches % max(1, microbatches // pp):
        return  # refused as before (test_generators_property)
    schedule = generate("interleaved-1f1b", pp, microbatches, virtual)
    assert [list(map(str, program)) for program in schedule.programs] == default_order(pp, microbatches, virtual)
    assert "microbatch_group" not in schedule.meta
    if microbatches % pp == 0:  # Megatron's default N = p is the same order
        explicit = generate("interleaved-1f1b", pp, microbatches, virtual, microbatch_group=pp)
        assert explicit.programs == schedule.programs


@st.composite
def grouped_sizes(draw):
    pp = draw(st.integers(1, 6))
    virtual = draw(st.integers(1, 3))
    microbatches = draw(st.integers(1, 24))
    group = draw(st.sampled_from(megatron_range(pp, microbatches)))
    return pp, virtual, microbatches, group


@settings(max_examples=60, deadline=None)
@given(grouped_sizes())
def test_every_order_in_megatrons_range_validates_lowers_and_finishes(size):
    pp, virtual, microbatches, group = size
    schedule = generate("interleaved-1f1b", pp, microbatches, virtual, microbatch_group=group)
    validate(schedule, "buffered")
    validate(lower(schedule), "rendezvous")
    total = microbatches * virtual
    for rank, program in enumerate(schedule.programs):
        warmup = min(2 * (pp - rank - 1) + (virtual - 1) * group, total)
        leading = next((index for index, action in enumerate(program) if action.kind == "B"), len(program))
        # the warm-up forwards, then the steady state opens with one more forward
        assert leading == min(warmup + 1, total)
        expected = sorted((stage, kind, microbatch) for stage in schedule.stages_of(rank)
                          for kind in "BF" for microbatch in range(microbatches))
        assert sorted(tuple(action) for action in program) == expected


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 8), microbatches=st.integers(1, 30))
def test_the_accepted_groups_are_megatrons_range(pp, microbatches):
    assert valid_microbatch_groups(pp, microbatches) == megatron_range(pp, microbatches)
    for group in range(1, microbatches + 1):
        if group in megatron_range(pp, microbatches):
            continue
        with pytest.raises(ScheduleUnavailableError, match=f"microbatch group {group} "):
            generate("interleaved-1f1b", pp, microbatches, 2, microbatch_group=group)


@pytest.mark.parametrize("size", [(3, 2, 6, 1), (4, 2, 8, 2), (4, 3, 5, 4)])
def test_outside_the_range_the_order_deadlocks(size):
    """Why the range is kept: N = 1 on p = 3, N = 2 on p = 4, and a last group of 1 on
    p = 4 each put a chunk's forward before its input can arrive."""
    pp, virtual, microbatches, group = size
    assert not is_valid(grouped_order(pp, microbatches, virtual, group), "buffered")


def test_bad_groups_name_the_value_and_the_range():
    with pytest.raises(ScheduleUnavailableError, match=r"microbatch group 2 must be between pp=4 and the 8 "
                       r"microbatches.*valid: 4, 8"):
        generate("interleaved-1f1b", 4, 8, 2, microbatch_group=2)
    with pytest.raises(ScheduleUnavailableError, match=r"microbatch group 9 is more than the 8 microbatches"):
        generate("interleaved-1f1b", 4, 8, 2, microbatch_group=9)
    with pytest.raises(ScheduleUnavailableError, match=r"last group of 1 microbatches \(9 mod 4\)"):
        generate("interleaved-1f1b", 4, 9, 2, microbatch_group=4)
    with pytest.raises(ScheduleUnavailableError, match="applies to interleaved-1f1b only; 1f1b"):
        generate("1f1b", 4, 8, 1, microbatch_group=4)


def test_rank_zero_holds_fewer_stashes_as_n_falls():
    # p = 4, v = 2, m = 16: rank 0 runs 2(p-1) + (v-1)N = 6 + N forwards, then one more
    # before its first backward: 11, 15 and 23 chunk stashes for N = 4, 8, 16.
    peaks = {group: order_peak_stashes(generate("interleaved-1f1b", 4, 16, 2, microbatch_group=group).programs[0])
             for group in (16, 8, 4)}
    assert peaks == {16: 23, 8: 15, 4: 11}


@pytest.mark.parametrize("pp, microbatches, group", [(4, 8, 8), (4, 16, 8), (2, 6, 3), (4, 12, 6)])
def test_groups_larger_than_p_keep_the_interleaved_makespan(pp, microbatches, group):
    """With free links and chunks costing F/v and B/v, a group of at least p that divides m
    runs in the closed form m(F+B) + (p-1)(F+B)/v, as N = p does."""
    virtual, forward, backward = 2, 1e-3, 2e-3
    schedule = generate("interleaved-1f1b", pp, microbatches, virtual, microbatch_group=group)
    makespan = pipesim.simulate(schedule, pipesim.uniform_costs(schedule, forward, backward)).metrics.makespan
    assert makespan == pytest.approx(microbatches * (forward + backward) + (pp - 1) * (forward + backward) / virtual)
