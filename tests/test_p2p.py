"""P2P groups and the two point-to-point semantics: lowering is deadlock-free under
NCCL's rendezvous rule for every generator, the validator rejects what would hang on
NCCL (and only that), groups survive CSV, and the simulator models the rule."""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import uniform_costs
from pipesim.sim.engine import simulate
from schedules import (
    Action,
    Schedule,
    ScheduleUnavailableError,
    ScheduleValidationError,
    generate,
    lower,
    parse_action,
    schedule_from_csv,
    schedule_to_csv,
    validate,
)
from schedules.action import COMM_KINDS, ActionKind, parse_group
from schedules.metrics import makespan
from schedules.p2p import BUFFERED, RENDEZVOUS, default_semantics

GENERATED = ("gpipe", "1f1b", "interleaved-1f1b")


def split_backward(schedule: Schedule) -> Schedule:
    """The same order with each B split into I then W, W right after I."""
    programs = []
    for program in schedule.programs:
        split = []
        for action in program:
            if action.kind == ActionKind.B:
                split += [Action(action.stage, ActionKind.I, action.microbatch),
                          Action(action.stage, ActionKind.W, action.microbatch)]
            else:
                split.append(action)
        programs.append(split)
    return schedule.with_programs(programs)


def grouped_as_before(schedule: Schedule) -> Schedule:
    """The lowering this project used before groups were data: each RECV right before its
    consumer, each SEND right after its producer, consecutive transfers batched together."""
    placement, last = schedule.placement, schedule.num_stages - 1
    programs, joins = [], []
    for rank, program in enumerate(schedule.programs):
        lowered: list[Action] = []
        for action in program:
            stage, kind, microbatch = action
            if kind == ActionKind.F and stage > 0 and placement[stage - 1] != rank:
                lowered.append(Action(stage, ActionKind.RECV_F, microbatch))
            if kind == ActionKind.B and stage < last and placement[stage + 1] != rank:
                lowered.append(Action(stage, ActionKind.RECV_B, microbatch))
            lowered.append(action)
            if kind == ActionKind.F and stage < last and placement[stage + 1] != rank:
                lowered.append(Action(stage, ActionKind.SEND_F, microbatch))
            if kind == ActionKind.B and stage > 0 and placement[stage - 1] != rank:
                lowered.append(Action(stage, ActionKind.SEND_B, microbatch))
        programs.append(lowered)
        joins.append(frozenset(index for index in range(1, len(lowered))
                                if lowered[index].kind in COMM_KINDS and lowered[index - 1].kind in COMM_KINDS))
    return schedule.with_programs(programs, joins)


def rows(text: list[str], microbatches: int, placement: tuple[int, ...]) -> Schedule:
    """A lowered schedule from one line of cells per rank (groups joined by '+')."""
    programs, joins = [], []
    for line in text:
        program: list[Action] = []
        joined: set[int] = set()
        for cell in line.split():
            group = parse_group(cell)
            joined.update(range(len(program) + 1, len(program) + len(group)))
            program.extend(group)
        programs.append(program)
        joins.append(frozenset(joined))
    return Schedule(len(text), microbatches, placement, programs, name="test", joins=joins)


# --- lowering is rendezvous-safe for every generator ------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(GENERATED),
    pp=st.integers(1, 8),
    data=st.data(),
    split=st.booleans(),
)
def test_every_generated_schedule_passes_the_rendezvous_check(name, pp, data, split):
    microbatches = data.draw(st.integers(1, 4 * pp))
    chunks = data.draw(st.integers(2, 4)) if name == "interleaved-1f1b" else 1
    try:
        schedule = generate(name, pp, microbatches, chunks)
    except ScheduleUnavailableError:
        return
    if split:
        schedule = split_backward(schedule)
    lowered = lower(schedule)
    validate(lowered, RENDEZVOUS)
    validate(lowered, BUFFERED)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(("zb-auto", "zbv-auto")),
    pp=st.integers(1, 6),
    data=st.data(),
    costs=st.tuples(*(st.sampled_from([0.5, 1.0, 2.0]) for _ in range(3)), st.sampled_from([0.0, 0.3])),
)
def test_every_cost_aware_schedule_passes_the_rendezvous_check(name, pp, data, costs):
    """The generators that need costs (not in ``GENERATORS``), lowered, at every memory
    they accept down to their least."""
    from schedules.generators import zb_auto, zbv_auto

    microbatches = data.draw(st.integers(1, 3 * pp))
    if name == "zb-auto":
        schedule = zb_auto(pp, microbatches, *costs, data.draw(st.integers(1, 2 * pp)), search_seconds=0)
    else:
        schedule = zbv_auto(pp, microbatches, *costs, data.draw(st.sampled_from([1, 1.5, max(1, pp / 2), pp, 2 * pp])))
    lowered = lower(schedule)
    validate(lowered, RENDEZVOUS)
    validate(lowered, BUFFERED)


def test_the_previous_grouping_hangs_on_nccl_but_not_on_gloo():
    # The order the issue found: interleaved pp=2 m=4, rank 0 stuck on 2SEND_B0, rank 1 on
    # 3SEND_B1+1RECV_F2. gloo's buffered sends hide it.
    old = grouped_as_before(generate("interleaved-1f1b", 2, 4, 2))
    validate(old, BUFFERED)
    with pytest.raises(ScheduleValidationError) as caught:
        validate(old, RENDEZVOUS)
    text = str(caught.value)
    assert text.startswith("deadlock under rendezvous semantics")
    assert "2SEND_B0" in text and "3SEND_B1+1RECV_F2" in text
    assert caught.value.rank in (0, 1)


@pytest.mark.parametrize("pp,microbatches,chunks", [(4, 8, 2), (8, 16, 2), (2, 4, 2), (4, 12, 3)])
def test_quick_start_interleaved_is_rendezvous_safe_now(pp, microbatches, chunks):
    validate(lower(generate("interleaved-1f1b", pp, microbatches, chunks)), RENDEZVOUS)


def test_lowered_1f1b_meets_at_the_first_moment_both_ranks_are_free():
    # Nominal timeline (F=1, B=2): rank 0 runs 0F0 [0,1] 0F1 [1,2] 0B0 [4,6] 0F2 [6,7]
    # 0B1 [7,9] 0B2 [10,12]; rank 1 runs 1F0 [1,2] 1B0 [2,4] 1F1 [4,5] 1B1 [5,7] 1F2 [7,8]
    # 1B2 [8,10]. 0F1's output is ready at 2, when rank 1 is between 1F0 and 1B0: both
    # post it there. 1B0's gradient is ready at 4, when rank 0 is idle before 0B0 and rank 1
    # is between 1B0 and 1F1; 0F2's output (ready 7) meets 1B1's gradient (ready 7) in one
    # group on each side: Megatron's send_backward_recv_forward / send_forward_recv_backward.
    lowered = lower(generate("1f1b", 2, 3))
    assert lowered.program_text(0) == ["0F0", "0SEND_F0", "0F1", "0SEND_F1+0RECV_B0", "0B0", "0F2",
                                       "0SEND_F2+0RECV_B1", "0B1", "0RECV_B2", "0B2"]
    assert lowered.program_text(1) == ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1",
                                       "1RECV_F2+1SEND_B1", "1F2", "1B2", "1SEND_B2"]


# --- the validator under each semantics --------------------------------------------------


def test_pair_order_mismatch_names_both_actions():
    # Rank 0 sends microbatch 1 before 0; rank 1 receives 0 first: NCCL would put 0F1's
    # output in 1RECV_F0's buffer. gloo matches by tag and is fine.
    schedule = rows(["0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1",
                     "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"], 2, (0, 1))
    validate(schedule, BUFFERED)
    with pytest.raises(ScheduleValidationError) as caught:
        validate(schedule, RENDEZVOUS)
    text = str(caught.value)
    assert "0SEND_F1 is rank 0's send number 1 to rank 1" in text
    assert "rank 1's receive number 1 from rank 0 is 1RECV_F0" in text
    assert (caught.value.rank, caught.value.action) == (0, parse_action("0SEND_F1"))


def test_lone_sends_facing_each_other_hang_under_rendezvous_only():
    # Both ranks first post a send-only group, then a receive-only group: on NCCL each rank's
    # stream is stuck behind its send, whose receive sits behind the peer's send.
    schedule = rows(["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], 1, (0, 1))
    validate(schedule, BUFFERED)
    validate(schedule, RENDEZVOUS)  # a chain, not a cycle: fine on both
    crossed = rows(["0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                    "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"], 2, (0, 1))
    validate(crossed, BUFFERED)
    with pytest.raises(ScheduleValidationError, match="deadlock under rendezvous semantics"):
        validate(crossed, RENDEZVOUS)


def test_backend_defaults():
    assert default_semantics("nccl") == RENDEZVOUS
    assert default_semantics("gloo") == BUFFERED
    with pytest.raises(ValueError, match="unknown P2P semantics 'eager'"):
        validate(lower(generate("1f1b", 2, 2)), "eager")


def test_a_compute_action_cannot_join_a_group():
    with pytest.raises(ValueError, match="rank 0, position 1: 0F0 is a compute action and cannot be part of a P2P"):
        Schedule(1, 2, (0,), [[parse_action("0F0"), parse_action("0F1")]], joins=[frozenset({1})])


# --- CSV keeps the groups ------------------------------------------------------------------


def test_groups_round_trip_through_csv():
    lowered = lower(generate("interleaved-1f1b", 4, 8, 2))
    buffer = io.StringIO()
    schedule_to_csv(lowered, buffer)
    assert "+" in buffer.getvalue()
    buffer.seek(0)
    back = schedule_from_csv(buffer)
    assert back.programs == lowered.programs
    assert back.joins == lowered.joins
    validate(back, RENDEZVOUS)


# --- the simulator models the same rule ----------------------------------------------------


def one_link(latency: float = 0.0, bandwidth: float = 1e9) -> object:
    return topology_from_dict({
        "devices": [{"name": "g0"}, {"name": "g1"}],
        "links": [{"src": "g0", "dst": "g1", "bandwidth": bandwidth, "latency": latency},
                  {"src": "g1", "dst": "g0", "bandwidth": bandwidth, "latency": latency}],
    })


def test_under_rendezvous_a_send_leaves_only_when_its_receive_is_posted_and_receives_wait_late():
    # Lowered 1F1B pp=2 m=2, F=1, B=2, one second on the wire per transfer, no latency:
    #   rank 0: 0F0 0SEND_F0 0F1 0SEND_F1+0RECV_B0 0B0 0RECV_B1 0B1
    #   rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1
    # Rendezvous: 0SEND_F0 [1,2]; rank 0 posts 0SEND_F1+0RECV_B0 at 2, but 0SEND_F1 leaves
    # only when rank 1 posts 1RECV_F1 after 1F0 [2,3]: [3,4]. Rank 1 waits for a receive only
    # before the action that needs it, so 1B0 runs at once [3,5]; 1SEND_B0 [5,6] (rank 1's
    # stream finished 1RECV_F1 at 4), which completes rank 0's group: 0B0 [6,8]. 1F1 [5,6],
    # 1B1 [6,8]; 1SEND_B1 [8,9], for which rank 1 waits before the step ends; 0B1 [9,11].
    # Buffered: 0SEND_F1 leaves at once [2,3]; 1B0 [3,5], 1SEND_B0 [5,6], 1F1 [5,6],
    # 1B1 [6,8], 1SEND_B1 [8,9]; 0B0 [6,8], 0B1 [9,11].
    schedule = lower(generate("1f1b", 2, 2))
    assert schedule.program_text(1) == ["1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"]
    costs = uniform_costs(2, 1.0, 2.0, act_bytes=1e9)
    traces = {mode: simulate(schedule, costs, one_link(), p2p=mode) for mode in (RENDEZVOUS, BUFFERED)}
    sends = {mode: {e.action: (e.start, e.end) for e in trace.events if e.stream == "send"}
             for mode, trace in traces.items()}
    # a send's event runs from posting (its data ready) to arrival: 0SEND_F1 posted at 2
    assert sends[RENDEZVOUS]["0SEND_F1"] == pytest.approx((2.0, 4.0))
    assert sends[RENDEZVOUS]["1SEND_B0"] == pytest.approx((5.0, 6.0))
    assert sends[RENDEZVOUS]["1SEND_B1"] == pytest.approx((8.0, 9.0))
    waits = [(e.rank, e.start, e.end) for e in traces[RENDEZVOUS].events if e.stream == "wait"]
    assert waits == [(1, 8.0, 9.0)]
    computes = {e.action: (e.start, e.end) for e in traces[RENDEZVOUS].events if e.stream == "compute"}
    assert computes["1B0"] == pytest.approx((3.0, 5.0)) and computes["0B0"] == pytest.approx((6.0, 8.0))
    assert makespan(traces[RENDEZVOUS]) == pytest.approx(11.0)
    assert sends[BUFFERED]["0SEND_F1"] == pytest.approx((2.0, 3.0))
    assert sends[BUFFERED]["1SEND_B1"] == pytest.approx((8.0, 9.0))
    assert makespan(traces[BUFFERED]) == pytest.approx(11.0)


def test_a_ranks_groups_run_one_after_another_on_its_stream():
    # Rank 0 posts two send-only groups; the second cannot start before the first completes,
    # and then waits for rank 1 to post its receive after its forward.
    schedule = rows(["0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
                     "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"], 2, (0, 1))
    validate(schedule, RENDEZVOUS)
    costs = uniform_costs(2, 1.0, 2.0, act_bytes=1e9)
    trace = simulate(schedule, costs, one_link(), p2p=RENDEZVOUS)
    sends = {e.action: (e.start, e.end) for e in trace.events if e.stream == "send"}
    # 0F0 [0,1], 0F1 [1,2]; 0SEND_F0 pairs with 1RECV_F0 at 2 -> [2,3]; 1F0 [3,4]; rank 1 posts
    # 1RECV_F1 at 4; 0SEND_F1's group started at 3 (after the first completed) -> [4,5].
    # (send events run from posting, both at 2, to arrival)
    assert sends["0SEND_F0"] == pytest.approx((2.0, 3.0))
    assert sends["0SEND_F1"] == pytest.approx((2.0, 5.0))


@pytest.mark.parametrize("name,pp,microbatches,chunks", [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 3, 1), ("interleaved-1f1b", 4, 8, 2),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 8, 16, 2), ("interleaved-1f1b", 5, 10, 3),
])
def test_closed_forms_hold_under_both_semantics(name, pp, microbatches, chunks):
    # (m+p-1)(F+B) for gpipe and 1f1b; m(F+B) + (p-1)(F+B)/v for interleaved (m a multiple of p).
    schedule = generate(name, pp, microbatches, chunks)
    costs = uniform_costs(schedule.num_stages, 1.0, 2.0, virtual_stages=chunks)
    if chunks == 1:
        expected = (microbatches + pp - 1) * 3.0
    else:
        expected = microbatches * 3.0 + (pp - 1) * 3.0 / chunks
    for mode in (RENDEZVOUS, BUFFERED):
        assert makespan(simulate(schedule, costs, ideal_topology(), p2p=mode)) == pytest.approx(expected, rel=1e-9)
