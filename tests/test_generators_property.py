"""Every schedule the generators produce is valid, lowers to a valid schedule and
round-trips through CSV; refusals explain themselves; the program structure matches the
closed forms of the papers."""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    Action,
    ScheduleUnavailableError,
    generate,
    is_valid,
    lower,
    schedule_from_csv,
    schedule_to_csv,
    validate,
)
from schedules.generators import zb_auto, zbv_auto
from schedules.p2p import P2P_SEMANTICS
from schedules.schedule import Schedule

NAMES = ("gpipe", "1f1b", "interleaved-1f1b")


@st.composite
def sizes(draw):
    name = draw(st.sampled_from(NAMES))
    pp = draw(st.integers(1, 16))
    microbatches = draw(st.integers(1, 64))
    virtual_stages = draw(st.integers(1, 4)) if name == "interleaved-1f1b" else 1
    return name, pp, microbatches, virtual_stages


def round_trip(schedule: Schedule) -> Schedule:
    buffer = io.StringIO()
    schedule_to_csv(schedule, buffer)
    buffer.seek(0)
    return schedule_from_csv(buffer)


def assert_same(left: Schedule, right: Schedule) -> None:
    assert (left.pp, left.microbatches, left.placement, left.programs) == (
        right.pp, right.microbatches, right.placement, right.programs
    )


@settings(max_examples=80, deadline=None)
@given(sizes())
def test_generated_schedules_validate_lower_and_round_trip(size):
    name, pp, microbatches, virtual_stages = size
    try:
        schedule = generate(name, pp, microbatches, virtual_stages)
    except ScheduleUnavailableError as error:
        # Only interleaving refuses sizes, and it says which and what would work.
        assert name == "interleaved-1f1b"
        text = str(error)
        assert f"{microbatches} microbatches on pp={pp}" in text
        assert "nearby counts that work:" in text
        nearby = [int(count) for count in text.split("nearby counts that work: ")[1].split(", ")]
        assert nearby and microbatches not in nearby
        for count in nearby:  # the suggestions really are accepted
            generate(name, pp, count, virtual_stages)
        return
    assert schedule.num_stages == pp * virtual_stages
    validate(schedule)
    lowered = lower(schedule)
    validate(lowered)
    assert_same(round_trip(schedule), schedule)
    assert_same(round_trip(lowered), lowered)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_single_chunk_schedules_refuse_virtual_stages_by_name(name):
    with pytest.raises(ScheduleUnavailableError, match=f"{name} places one stage per rank; virtual stages=2"):
        generate(name, 4, 8, 2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("pp", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 7, 8, 16])
def test_each_stage_runs_each_microbatch_forward_and_backward_once(name, pp, microbatches):
    virtual_stages = 2 if name == "interleaved-1f1b" else 1
    try:
        schedule = generate(name, pp, microbatches, virtual_stages)
    except ScheduleUnavailableError:
        assert name == "interleaved-1f1b"
        return
    for rank, program in enumerate(schedule.programs):
        expected = sorted(
            (stage, kind, microbatch)
            for stage in schedule.stages_of(rank)
            for kind in ("B", "F")
            for microbatch in range(microbatches)
        )
        assert sorted(tuple(action) for action in program) == expected


def leading_forwards(program) -> int:
    count = 0
    for action in program:
        if action.kind != "F":
            break
        count += 1
    return count


def peak_inflight(program) -> int:
    held = peak = 0
    for action in program:
        held += 1 if action.kind == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp", [1, 2, 4, 7])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 6, 12])
def test_1f1b_warmup_and_steady_state(pp, microbatches):
    schedule = generate("1f1b", pp, microbatches)
    for rank, program in enumerate(schedule.programs):
        warmup = min(pp - rank - 1, microbatches)
        # warm-up forwards, then the steady state opens with one more forward
        assert leading_forwards(program) == min(warmup + 1, microbatches)
        steady = program[warmup: warmup + 2 * (microbatches - warmup)]
        assert [action.kind for action in steady] == ["F", "B"] * (microbatches - warmup)
        assert [action.microbatch for action in program if action.kind == "B"] == list(range(microbatches))
        assert peak_inflight(program) == min(pp - rank, microbatches)


@pytest.mark.parametrize("pp", [1, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 4, 9])
def test_gpipe_runs_every_forward_before_any_backward(pp, microbatches):
    for program in generate("gpipe", pp, microbatches).programs:
        assert leading_forwards(program) == microbatches
        assert peak_inflight(program) == microbatches


def torch_pipelining():
    """torch's pipelining schedules, or skip only the test that needs them (a
    module-level importorskip would skip the torch-free tests of this file too)."""
    return pytest.importorskip("torch.distributed.pipelining.schedules")


def torch_interleaved_order(pp: int, microbatches: int, virtual_stages: int) -> list[list[str]]:
    """torch's own interleaved 1F1B compute order per rank (idle slots dropped), built
    without process groups or model stages: its order calculation is what is compared."""
    generator_class = torch_pipelining().ScheduleInterleaved1F1B
    generator = generator_class.__new__(generator_class)
    generator.pp_group_size = pp
    generator.n_local_stages = virtual_stages
    generator._n_microbatches = microbatches
    generator.number_of_rounds = max(1, microbatches // pp)
    generator.microbatches_per_round = microbatches // generator.number_of_rounds
    return [[str(action) for action in generator._calculate_single_rank_operations(rank) if action is not None]
            for rank in range(pp)]


@pytest.mark.parametrize(("pp", "microbatches", "virtual_stages"),
                         [(4, 8, 2), (4, 4, 3), (2, 6, 2), (4, 2, 2), (3, 6, 2), (4, 12, 2)])
def test_interleaved_warmup_and_order_match_torch(pp, microbatches, virtual_stages):
    schedule = generate("interleaved-1f1b", pp, microbatches, virtual_stages)
    theirs = torch_interleaved_order(pp, microbatches, virtual_stages)
    for rank, program in enumerate(schedule.programs):
        ours = [str(action) for action in program]
        their_warmup = next((index for index, text in enumerate(theirs[rank]) if "F" not in text), len(theirs[rank]))
        assert leading_forwards(program) == their_warmup
        assert ours == theirs[rank]


def test_interleaved_refusal_names_the_sizes_and_suggests_counts():
    with pytest.raises(ScheduleUnavailableError) as caught:
        generate("interleaved-1f1b", 16, 33, 2)
    text = str(caught.value)
    assert "33 microbatches on pp=16 do not split into 2 equal rounds" in text
    assert "nearby counts that work: 17, 18, 19" in text


@st.composite
def shuffled_orders(draw):
    """A random compute order per rank with every backward after its own forward:
    structurally valid, but often deadlocking."""
    pp = draw(st.integers(2, 4))
    virtual_stages = draw(st.integers(1, 2))
    microbatches = draw(st.integers(1, 4))
    placement = tuple(stage % pp for stage in range(pp * virtual_stages))
    programs = []
    for rank in range(pp):
        stages = [stage for stage, owner in enumerate(placement) if owner == rank]
        actions = [(stage, kind, microbatch) for stage in stages for kind in "FB" for microbatch in range(microbatches)]
        order = list(draw(st.permutations(actions)))
        for stage in stages:
            for microbatch in range(microbatches):
                at_f, at_b = order.index((stage, "F", microbatch)), order.index((stage, "B", microbatch))
                if at_b < at_f:
                    order[at_f], order[at_b] = order[at_b], order[at_f]
        programs.append([Action(*action) for action in order])
    return Schedule(pp, microbatches, placement, programs)




@settings(max_examples=100, deadline=None)
@given(shuffled_orders())
def test_deadlock_verdict_agrees_with_torch_dry_run(schedule):
    torch_schedules = torch_pipelining()
    lowered = lower(schedule)
    ours = is_valid(lowered)
    assert is_valid(schedule) == ours  # compute-only and lowered forms deadlock alike
    order = {
        rank: [torch_schedules._Action.from_str(str(action)) for action in program]
        for rank, program in enumerate(lowered.programs)
    }
    try:
        torch_schedules._simulate_comms_compute(order, lambda stage: lowered.placement[stage], lowered.num_stages)
        theirs = True
    except (ValueError, IndexError):
        # ValueError("Schedule is not progressing"); when no rank can even start, torch's
        # own table printer fails with IndexError on the way to raising it.
        theirs = False
    assert ours == theirs


# --- the zero-bubble family and V-shaped pipelines --------------------------------------

ZERO_BUBBLE_NAMES = ("zb-h1", "zb-h2", "zbv", "interleaved-zb", "looped-bfs", "zb-auto", "dualpipev", "zbv-auto")


@st.composite
def zero_bubble_sizes(draw):
    name = draw(st.sampled_from(ZERO_BUBBLE_NAMES))
    pp = draw(st.integers(1, 8))
    microbatches = draw(st.integers(1, 24))
    if name in ("zbv", "dualpipev", "zbv-auto"):
        chunks = 2
    elif name in ("interleaved-zb", "looped-bfs"):
        chunks = draw(st.integers(1, 3))
    else:
        chunks = 1
    return name, pp, microbatches, chunks


def build(name: str, pp: int, microbatches: int, chunks: int, draw_costs=(1.0, 1.0, 1.0, 0.0)) -> Schedule:
    if name == "zb-auto":
        forward, backward_input, backward_weight, hop = draw_costs
        return zb_auto(pp, microbatches, forward, backward_input, backward_weight, hop, max(1, pp - 1))
    if name == "zbv-auto":  # below zbv's memory: the greedy orders
        forward, backward_input, backward_weight, hop = draw_costs
        return zbv_auto(pp, microbatches, forward, backward_input, backward_weight, hop, max(1, pp / 2))
    return generate(name, pp, microbatches, chunks)


def program_peak_stash(program) -> int:
    """Most stashes a sequential rank holds: +1 at each F, -1 at the pass that frees it
    (B, or W when that microbatch's backward is split)."""
    held = peak = 0
    for action in program:
        if action.kind == "F":
            held += 1
            peak = max(peak, held)
        elif action.kind in ("B", "W"):
            held -= 1
    return peak


@settings(max_examples=120, deadline=None)
@given(zero_bubble_sizes(), st.tuples(*(st.sampled_from([0.5, 1.0, 2.0]) for _ in range(3)),
                                      st.sampled_from([0.0, 0.3])))
def test_zero_bubble_generators_run_each_pass_once_in_order_within_their_memory(size, costs):
    name, pp, microbatches, chunks = size
    try:
        schedule = build(name, pp, microbatches, chunks, costs)
    except ScheduleUnavailableError as error:
        assert (name == "interleaved-zb" and "do not split into" in str(error)) or (
            name == "dualpipev" and microbatches < 2 * pp and f"use m >= {2 * pp}" in str(error))
        return
    for rank, program in enumerate(schedule.programs):
        passes: dict[tuple[int, int], list[str]] = {}
        for stage, kind, microbatch in program:
            passes.setdefault((stage, microbatch), []).append(kind)
        assert sorted(passes) == [(stage, microbatch) for stage in schedule.stages_of(rank)
                                  for microbatch in range(microbatches)]
        for kinds in passes.values():  # F once, then B once or I then W
            assert kinds in (["F", "B"], ["F", "I", "W"]) if name != "looped-bfs" else kinds == ["F", "B"]
        if name not in ("looped-bfs", "dualpipev"):
            assert all(kinds == ["F", "I", "W"] for kinds in passes.values())
    validate(schedule)  # dependency order (F before I before W, across stages) and no deadlock
    lowered = lower(schedule)
    for semantics in P2P_SEMANTICS:  # gloo's buffered sends and NCCL's rendezvous
        validate(lowered, semantics)
    assert [len(pairs) for pairs in lowered.fused] == [
        len(pairs) for pairs in schedule.fused]  # overlapped pairs survive lowering, still adjacent
    assert_same(round_trip(schedule), schedule)
    assert_same(round_trip(lowered), lowered)
    assert round_trip(schedule).fused == schedule.fused
    stated = schedule.meta["memory_microbatches"]
    if name == "zb-auto":
        stated = max(1, pp - 1)
    if name == "zbv-auto":
        stated = max(1, pp / 2)
    for program in schedule.programs:
        assert program_peak_stash(program) / schedule.virtual_stages <= stated + 1e-12


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_zbv_places_stage_s_and_2p_minus_1_minus_s_on_one_rank(pp):
    schedule = generate("zbv", pp, 2 * pp, 2)
    for rank in range(pp):
        assert schedule.stages_of(rank) == (rank, 2 * pp - 1 - rank)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_v_schedules_refuse_other_chunk_counts_by_name(name, chunks):
    with pytest.raises(ScheduleUnavailableError, match=f"{name} places exactly 2 stages per rank"):
        generate(name, 4, 8, chunks)
