"""validate(): every kind of bad schedule is rejected with a message naming the action,
its rank and position; good schedules pass."""

from __future__ import annotations

import networkx as nx
import pytest

from schedules import (
    Action,
    Schedule,
    ScheduleValidationError,
    dependency_graph,
    generate,
    is_valid,
    lower,
    parse_action,
    validate,
)


def make(rows: list[str], microbatches: int, placement: tuple[int, ...] | None = None) -> Schedule:
    """A schedule from one line of action text per rank; placement looped by default."""
    programs = [[parse_action(cell) for cell in row.split()] for row in rows]
    if placement is None:
        stages = 1 + max(action.stage for program in programs for action in program)
        placement = tuple(stage % len(rows) for stage in range(stages))
    return Schedule(len(rows), microbatches, placement, programs, name="test")


def error_of(schedule: Schedule) -> ScheduleValidationError:
    with pytest.raises(ScheduleValidationError) as caught:
        validate(schedule)
    assert isinstance(caught.value, ValueError)
    return caught.value


ONE_F_ONE_B = ["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]


@pytest.mark.parametrize(
    ("name", "pp", "microbatches", "virtual_stages"),
    [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("1f1b", 3, 1, 1), ("interleaved-1f1b", 4, 8, 2),
     ("interleaved-1f1b", 3, 2, 3), ("1f1b", 1, 3, 1)],
)
def test_generated_schedules_pass_compute_only_and_lowered(name, pp, microbatches, virtual_stages):
    schedule = generate(name, pp, microbatches, virtual_stages)
    validate(schedule)
    validate(lower(schedule))
    assert is_valid(schedule)


def test_split_backward_with_i_and_w_passes():
    schedule = make(["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1F1 1I1 1W0 1W1"], 2)
    validate(schedule)
    validate(lower(schedule))


def test_unknown_kind_names_action_rank_and_position():
    schedule = make(ONE_F_ONE_B, 2)
    programs = [list(program) for program in schedule.programs]
    programs[1][2] = Action(1, "X", 1)
    error = error_of(schedule.with_programs(programs))
    assert "rank 1, position 2: 1X1 has unknown kind 'X'" in str(error)
    assert "SEND_F" in str(error)  # lists what is valid
    assert (error.rank, error.position, error.action) == (1, 2, Action(1, "X", 1))


def test_stage_out_of_range():
    schedule = make(ONE_F_ONE_B, 2)
    programs = [list(program) for program in schedule.programs]
    programs[0][1] = Action(5, "F", 1)
    error = error_of(schedule.with_programs(programs))
    assert "rank 0, position 1: 5F1 names stage 5, but the schedule has 2 stages (0..1)" in str(error)


def test_microbatch_out_of_range():
    error = error_of(make(["0F0 0F2 0B0 0B2", "1F0 1B0 1F2 1B2"], 2))
    assert "rank 0, position 1: 0F2 names microbatch 2, but the schedule has 2 microbatches (0..1)" in str(error)
    assert error.action == Action(0, "F", 2)


def test_action_on_a_rank_that_does_not_hold_its_stage():
    error = error_of(make(["0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"], 2, placement=(0, 1)))
    assert "rank 0, position 4: 1F0 runs stage 1, which is placed on rank 1" in str(error)
    assert "belongs in rank 1's program" in str(error)
    assert error.rank == 0


def test_missing_forward():
    error = error_of(make(["0F0 0B0 0B1", "1F0 1B0 1F1 1B1"], 2))
    assert "rank 0's program has no 0F1" in str(error)
    assert error.action == Action(0, "F", 1) and error.rank == 0 and error.position is None


def test_missing_backward_says_b_or_i_plus_w():
    error = error_of(make(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1"], 2))
    assert "rank 1's program has no 1B1" in str(error)
    assert "1I1 followed by 1W1" in str(error)


def test_missing_w_after_i():
    error = error_of(make(["0F0 0F1 0B0 0B1", "1F0 1I0 1F1 1B1"], 2))
    assert "rank 1's program has no 1W0" in str(error)


def test_b_and_i_for_the_same_microbatch():
    error = error_of(make(["0F0 0F1 0B0 0B1", "1F0 1B0 1I0 1W0 1F1 1B1"], 2))
    assert "rank 1, position 2: 1I0" in str(error)
    assert "1B0 (position 1) already does the full backward" in str(error)


def test_duplicated_action():
    error = error_of(make(["0F0 0F1 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"], 2))
    assert "rank 0, position 2: 0F1 appears twice in rank 0's program (positions 1 and 2)" in str(error)


def test_backward_before_its_forward():
    error = error_of(make(["0F0 0B1 0F1 0B0", "1F0 1B0 1F1 1B1"], 2))
    assert "rank 0, position 1: 0B1 comes before 0F1 (position 2)" in str(error)
    assert "move it after 0F1" in str(error)


def test_w_before_its_i():
    error = error_of(make(["0F0 0F1 0B0 0B1", "1F0 1W0 1I0 1F1 1B1"], 2))
    assert "rank 1, position 1: 1W0 comes before 1I0 (position 2)" in str(error)


def test_w_without_any_i():
    error = error_of(make(["0F0 0F1 0B0 0B1", "1F0 1W0 1F1 1B1 1B0"], 2))
    assert "rank 1, position 1: 1W0 but 1B0 (position 4) already computes the weight gradient" in str(error)


def lowered_1f1b() -> Schedule:
    return lower(make(ONE_F_ONE_B, 2))


def without(schedule: Schedule, text: str) -> Schedule:
    action = parse_action(text)
    return schedule.with_programs([[a for a in program if a != action] for program in schedule.programs])


def test_recv_without_matching_send():
    error = error_of(without(lowered_1f1b(), "0SEND_F1"))
    assert "rank 1, position" in str(error) and "1RECV_F1 has no matching 0SEND_F1 on rank 0" in str(error)
    assert error.action == Action(1, "RECV_F", 1) and error.rank == 1


def test_send_without_matching_recv():
    error = error_of(without(lowered_1f1b(), "0RECV_B0"))
    assert "1SEND_B0 has no matching 0RECV_B0 on rank 0" in str(error)
    assert "add 0RECV_B0 before 0B0" in str(error)
    assert error.rank == 1


def test_cross_rank_dependency_without_transfer():
    error = error_of(without(without(lowered_1f1b(), "0SEND_F0"), "1RECV_F0"))
    assert "1F0 needs 0F0 from rank 0, but there is no 0SEND_F0/1RECV_F0 pair" in str(error)
    assert error.rank == 1 and error.action == Action(1, "F", 0)


def test_transfer_between_stages_on_the_same_rank():
    schedule = make(["0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0"], 1, placement=(0, 0))
    error = error_of(schedule)
    assert "rank 0, position 1: 0SEND_F0 sends to stage 1, which is on the same rank 0" in str(error)


def test_recv_from_a_stage_that_does_not_exist():
    schedule = make(["0RECV_F0 0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], 1)
    error = error_of(schedule)
    assert "rank 0, position 0: 0RECV_F0 receives from stage -1, which does not exist" in str(error)


def test_recv_after_its_consumer():
    schedule = make(
        ["0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1RECV_F0 1B0 1SEND_B0"], 1
    )
    error = error_of(schedule)
    assert "rank 1, position 1: 1RECV_F0 comes after 1F0 (position 0)" in str(error)


def test_send_before_its_producer():
    schedule = make(["0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], 1)
    error = error_of(schedule)
    assert "rank 0, position 0: 0SEND_F0 comes before 0F0 (position 1)" in str(error)


# Rank 0 runs its first backward after a single forward, but rank 1 wants a second
# forward before it sends that backward's gradient back: each waits for the other.
DEADLOCK = ["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]


def assert_real_cycle(schedule: Schedule, error: ScheduleValidationError) -> None:
    """The named cycle is a cycle of the dependency graph: each wait is an edge, and each
    awaited action is reachable from the next waiting one."""
    graph = dependency_graph(schedule)
    pairs = list(zip(error.cycle[::2], error.cycle[1::2], strict=True))
    for index, (waiting, awaited) in enumerate(pairs):
        assert graph.has_edge(awaited, waiting)
        next_waiting = pairs[(index + 1) % len(pairs)][0]
        assert nx.has_path(graph, next_waiting, awaited)


def test_deadlock_compute_only_names_the_cycle():
    schedule = make(DEADLOCK, 2)
    error = error_of(schedule)
    text = str(error)
    assert text.startswith("deadlock: rank 0 waits at 0B0 (position 1) for 1B0 on rank 1")
    assert "which rank 1 only reaches after 1F1" in text
    assert "rank 1 waits at 1F1 (position 1) for 0F1 on rank 0" in text
    assert error.cycle == tuple(map(parse_action, ["0B0", "1B0", "1F1", "0F1"]))
    assert (error.rank, error.action, error.position) == (0, Action(0, "B", 0), 1)
    assert_real_cycle(schedule, error)


def test_deadlock_lowered_names_the_send_and_recv():
    schedule = lower(make(DEADLOCK, 2))
    with pytest.raises(ScheduleValidationError) as caught:
        validate(schedule, p2p="buffered")
    text = str(caught.value)
    assert "under buffered semantics" in text
    assert "rank 0 waits at 0RECV_B0 (position 2) for rank 1 to send 1SEND_B0 (position 5)" in text
    assert "which rank 1 only reaches after 1RECV_F1 (position 2)" in text
    assert "rank 1 waits at 1RECV_F1 (position 2) for rank 0 to send 0SEND_F1" in text
    assert_real_cycle(schedule, caught.value)
    assert not is_valid(schedule, p2p="buffered")


def test_deadlock_lowered_under_rendezvous_names_the_groups_on_the_cycle():
    schedule = lower(make(DEADLOCK, 2))
    text = str(error_of(schedule))
    assert text.startswith("deadlock under rendezvous semantics")
    assert ("rank 0's group 0RECV_B0 (position 2) waits for rank 1 to post 1SEND_B0 (in 1SEND_B0, position 5), "
            "which cannot start before rank 1's earlier group 1RECV_F1 (position 2) completes") in text
    assert ("rank 1's group 1RECV_F1 (position 2) waits for rank 0 to post 0SEND_F1 (in 0SEND_F1, position 5), "
            "which cannot start before rank 0's earlier group 0RECV_B0 (position 2) completes") in text


def test_deadlock_on_three_ranks_leaves_out_ranks_not_on_the_cycle():
    # Ranks 1 and 2 deadlock with each other; rank 0 is merely stuck behind them.
    schedule = lower(make(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1", "2F0 2F1 2B0 2B1"], 2))
    with pytest.raises(ScheduleValidationError) as caught:
        validate(schedule, p2p="buffered")
    error = caught.value
    assert "rank 1 waits at" in str(error) and "rank 2 waits at" in str(error)
    assert "rank 0 waits" not in str(error)
    assert_real_cycle(schedule, error)
    text = str(error_of(schedule))
    assert "rank 1's group" in text and "rank 2's group" in text and "rank 0's group" not in text


def test_deadlock_within_one_rank_between_two_of_its_stages():
    # V-shaped placement: stages 1 and 2 share rank 1, and rank 1 runs 2F0 before 1F0.
    schedule = make(["0F0 3F0 3B0 0B0", "2F0 1F0 2B0 1B0"], 1, placement=(0, 1, 1, 0))
    error = error_of(schedule)
    assert "rank 1 waits at 2F0 (position 0) for 1F0, which comes later in its own program (position 1)" in str(
        error
    )


def test_dependency_graph_edges_and_attributes():
    schedule = lower(make(ONE_F_ONE_B, 2))
    graph = dependency_graph(schedule)
    assert graph.number_of_nodes() == schedule.num_actions
    assert graph.nodes[parse_action("1RECV_F0")] == {"rank": 1, "position": 0}
    assert graph.edges[parse_action("0SEND_F0"), parse_action("1RECV_F0")]["kind"] == "comm"
    assert graph.edges[parse_action("1RECV_F0"), parse_action("1F0")]["kind"] == "data"
    assert graph.edges[parse_action("0F0"), parse_action("0B0")]["kind"] == "data"
    assert graph.edges[parse_action("0F1"), parse_action("0SEND_F1")]["kind"] == "data"
    assert nx.is_directed_acyclic_graph(graph)
    compute_only = dependency_graph(make(ONE_F_ONE_B, 2))
    assert compute_only.edges[parse_action("0F0"), parse_action("1F0")]["kind"] == "data"
    assert compute_only.edges[parse_action("1B0"), parse_action("0B0")]["kind"] == "data"
    assert compute_only.edges[parse_action("0F0"), parse_action("0F1")]["kind"] == "program"
    assert not nx.is_directed_acyclic_graph(dependency_graph(make(DEADLOCK, 2)))
