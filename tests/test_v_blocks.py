"""V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS
2024), and zbv-auto taking them below ZB-V's memory.

Expected values from another implementation: the authors' scheduler
(github.com/sail-sg/zero-bubble-pipeline-parallelism, ``megatron/core/pipeline_parallel/
zerobubble/scheduler/zbv_greedy.py`` at commit 064369d, ``PipelineGraph.schedule_from_pattern``
with its reordering), run on the same sizes: each rank's order is the same pass for pass
(checked on p 2-9 and m 1-24 while building), and its span, the longest rank's from its
first F to its last W timed eagerly with the costs and hops below, is the one listed here.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules.generators import zbv, zbv_auto
from schedules.generators.common import ScheduleUnavailableError
from schedules.generators.v_blocks import v_block_order, v_half_offsets, v_min_offsets
from schedules.generators.zb_auto import order_cost
from schedules.metrics import order_peak_stashes
from schedules.schedule import v_shape_placement
from schedules.validate import validate

# (block, pp, microbatches, F, I, W per chunk, hop, span by the authors' scheduler)
AUTHORS_SPANS = [
    ("v-half", 4, 8, 1, 1, 1, 0, 53), ("v-min", 4, 8, 1, 1, 1, 0, 59), ("v-min", 6, 12, 1, 1, 1, 0, 89),
    ("v-half", 6, 12, 1, 1, 1, 0, 83), ("v-half", 8, 24, 2, 3, 1, 1, 462), ("v-min", 8, 24, 2, 3, 1, 1, 634),
    ("v-half", 5, 10, 3, 2, 2, 1, 210), ("v-min", 9, 18, 1, 1, 1, 0, 137),
]


@pytest.mark.parametrize(("block", "pp", "microbatches", "forward", "backward_input", "backward_weight", "hop",
                          "span"), AUTHORS_SPANS)
def test_each_block_spans_what_the_authors_scheduler_gives(block, pp, microbatches, forward, backward_input,
                                                           backward_weight, hop, span):
    schedule = v_block_order(block, pp, microbatches)
    validate(schedule)
    stages = 2 * pp
    cost = order_cost(v_shape_placement(pp, 2), microbatches, [forward] * stages, [backward_input] * stages,
                      [backward_weight] * stages, hop)
    assert cost(schedule.programs)[0] == span


def test_the_blocks_offsets_are_the_papers():
    # V-Min at p 4: rank i's down F at i, up F at 2p - 1 - i, up I at 2p + i, down I at 4p - 1 - i
    assert v_min_offsets(4) == [[0, 7, 8, 15], [1, 6, 9, 14], [2, 5, 10, 13], [3, 4, 11, 12]]
    # at p 3 a gap of 2 slots keeps the blocks apart
    assert v_min_offsets(3) == [[0, 5, 8, 13], [1, 4, 9, 12], [2, 3, 10, 11]]
    # V-Half at p 3: down F at 2i, up F at 3p - 2 - i, up I at 3p + 2i - 1, down I at 6p - i - 2 (no gap, p odd)
    assert v_half_offsets(3) == [[0, 7, 8, 16], [2, 6, 10, 15], [4, 5, 12, 14]]


@pytest.mark.parametrize(("pp", "half", "least"), [(4, 6, 4), (8, 10, 8), (16, 18, 12), (32, 34, 24)])
def test_the_blocks_hold_about_a_half_and_a_third_of_zbvs_stashes(pp, half, least):
    """Chunk stashes on the fullest rank at m = 3p, counted as the authors' scheduler counts
    them (each F takes one, each W frees one): ZB-V 2p; V-Half p + 2; V-Min 2p/3 and a few."""
    microbatches = 3 * pp
    assert max(map(order_peak_stashes, zbv(pp, microbatches).programs)) == 2 * pp
    assert max(map(order_peak_stashes, v_block_order("v-half", pp, microbatches).programs)) == half
    assert max(map(order_peak_stashes, v_block_order("v-min", pp, microbatches).programs)) == least


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(2, 9), microbatches=st.integers(1, 30), block=st.sampled_from(["v-half", "v-min"]))
def test_every_block_order_is_valid_and_holds_what_it_says(pp, microbatches, block):
    schedule = v_block_order(block, pp, microbatches)
    validate(schedule)
    assert all(sum(action.microbatch == mb for action in program) == 6
               for program in schedule.programs for mb in range(microbatches))
    assert max(map(order_peak_stashes, schedule.programs)) == 2 * schedule.meta["memory_microbatches"]


@pytest.mark.parametrize(("block", "pp", "microbatches"), [("v-third", 4, 8), ("v-half", 1, 8), ("v-min", 4, 0)])
def test_a_block_that_cannot_be_built_is_refused_naming_it(block, pp, microbatches):
    with pytest.raises(ScheduleUnavailableError, match=block):
        v_block_order(block, pp, microbatches)


@pytest.mark.parametrize("block", ["v-half", "v-min"])
def test_zbv_auto_below_zbvs_memory_is_never_slower_than_the_block_that_fits(block):
    """At a block's own memory (V-Half: p/2 + 1 microbatches at p 8), zbv-auto has the block
    among its candidates: its step is no longer than the block's on the same costs (its
    greedy orders alone, before the blocks, were longer on these costs at both memories)."""
    pp, microbatches, forward, backward_input, backward_weight, hop = 8, 24, 1.0, 1.0, 0.5, 0.2
    limit = v_block_order(block, pp, microbatches).meta["memory_microbatches"]
    ours = zbv_auto(pp, microbatches, forward, backward_input, backward_weight, comm=hop, memory_limit=limit)
    stages = 2 * pp
    cost = order_cost(v_shape_placement(pp, 2), microbatches, [forward] * stages, [backward_input] * stages,
                      [backward_weight] * stages, hop)
    assert cost(ours.programs)[::-1] <= cost(v_block_order(block, pp, microbatches).programs)[::-1]
    assert max(map(order_peak_stashes, ours.programs)) <= 2 * limit
