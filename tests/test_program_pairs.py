"""Overlapped pairs are part of a schedule's programs: passes carry them, and a pass that
would lose one says so instead of dropping it (``Schedule.with_programs``)."""

from __future__ import annotations

import pytest

from schedules import generate, lower
from schedules.action import parse_action


@pytest.fixture(scope="module")
def dualpipev():
    return generate("dualpipev", 2, 4, 2)


def test_new_programs_keep_the_pairs_where_their_actions_stand(dualpipev):
    reversed_warmup = [list(program) for program in dualpipev.programs]
    reversed_warmup[0][:3] = reversed(reversed_warmup[0][:3])  # 0F2 0F1 0F0: no pair moves
    moved = dualpipev.with_programs(reversed_warmup)
    assert moved.fused == dualpipev.fused
    assert [moved.fused_pairs(rank) for rank in range(2)] == [dualpipev.fused_pairs(rank) for rank in range(2)]


def test_prepending_an_action_shifts_the_pairs_with_it(dualpipev):
    programs = [list(program) for program in dualpipev.programs]
    programs[1].insert(0, parse_action("1W9"))  # not a valid step; the pairs only move along
    shifted = dualpipev.with_programs(programs)
    assert shifted.fused[1] == frozenset(position + 1 for position in dualpipev.fused[1])
    assert shifted.fused_pairs(1) == dualpipev.fused_pairs(1)


def test_a_pair_pulled_apart_is_an_error_naming_it(dualpipev):
    programs = [list(program) for program in dualpipev.programs]
    forward, backward = dualpipev.fused_pairs(0)[0]
    position = programs[0].index(backward)
    programs[0][position - 1], programs[0][position - 2] = programs[0][position - 2], programs[0][position - 1]
    with pytest.raises(ValueError, match=rf"rank 0: .*\({forward};{backward}\)OVERLAP_F_B"):
        dualpipev.with_programs(programs)


def test_a_pair_left_out_is_an_error_unless_the_new_pairs_are_given(dualpipev):
    forward, backward = dualpipev.fused_pairs(1)[0]
    programs = [[action for action in program if action != backward] for program in dualpipev.programs]
    with pytest.raises(ValueError, match=rf"rank 1: .*\({forward};{backward}\)OVERLAP_F_B"):
        dualpipev.with_programs(programs)
    assert not any(dualpipev.with_programs(programs, fused=()).fused)


def test_lowering_and_back_keeps_every_pair(dualpipev):
    lowered = lower(dualpipev)
    assert [lowered.fused_pairs(rank) for rank in range(2)] == [dualpipev.fused_pairs(rank) for rank in range(2)]
    assert lowered.compute_only().fused == dualpipev.fused
