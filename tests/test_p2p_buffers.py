"""The pipeline's transfer buffers in a rank's memory: two boundary activations (one
activation, one gradient) per link, a neighbouring rank in one direction, however many
stages the rank holds. Interleaving v chunks shares the rank's two links, as Megatron-Core
posts one exchange per neighbour and frees each received tensor once used
(``pipesim.sim.memory.p2p_buffer_bytes``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.model.costs import Costs, StageCost
from pipesim.sim.memory import memory_report, p2p_buffer_bytes, p2p_links, program_order_trace
from schedules import generate

ACT = 3e6


def boundary_costs(num_stages: int, act_bytes=ACT) -> Costs:
    """Stages that keep nothing but send ``act_bytes`` (one figure or one per stage)."""
    sizes = [act_bytes] * num_stages if isinstance(act_bytes, float) else act_bytes
    return Costs(stages=tuple(StageCost(fwd=1.0, bwd=2.0, stash_bytes=1.0, act_bytes=size) for size in sizes))


def links_by_hand(pp: int, virtual_stages: int, rank: int) -> int:
    """A looped placement (stage s on rank s % pp): rank r receives from r - 1 and sends to
    r + 1; with more than one chunk a rank also wraps round, rank 0 receiving from the last
    rank and the last sending to rank 0; with one chunk the ends have one link each."""
    if virtual_stages > 1:
        return 2
    return (rank > 0) + (rank < pp - 1)


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(2, 6), virtual_stages=st.integers(1, 3), microbatches_per_rank=st.integers(1, 2))
def test_each_rank_holds_two_boundaries_per_link_whatever_the_chunks(pp, virtual_stages, microbatches_per_rank):
    name = "1f1b" if virtual_stages == 1 else "interleaved-1f1b"
    schedule = generate(name, pp, pp * microbatches_per_rank, virtual_stages)
    costs = boundary_costs(schedule.num_stages)
    report = memory_report(program_order_trace(schedule), costs, schedule.placement, ["gpu"] * pp,
                           [float("inf")] * pp, timelines=False)
    for rank in report:
        assert rank.buffer_bytes == pytest.approx(2 * ACT * links_by_hand(pp, virtual_stages, rank.rank))


def test_interleaving_does_not_multiply_the_buffers_by_the_chunks():
    """pp 4, v 4: rank 1 holds stages 1, 5, 9, 13, each receiving from rank 0 and sending
    to rank 2; counted per stage that was 4 x 2 x 2 boundaries, per link it is 2 x 2."""
    schedule = generate("interleaved-1f1b", 4, 8, 4)
    links = p2p_links(schedule.placement, 1)
    assert links == {(0, "in"): [0, 4, 8, 12], (2, "out"): [1, 5, 9, 13]}
    assert p2p_buffer_bytes(boundary_costs(16), schedule.placement, 1) == 4 * ACT


def test_a_link_keeps_the_largest_boundary_it_carries():
    """Boundaries of different sizes over one link: the buffer is sized by the largest
    (stage 4's output, 7 MB, carried from rank 0 to rank 1 beside stage 0's 3 MB)."""
    schedule = generate("interleaved-1f1b", 4, 8, 2)
    sizes = [ACT] * 8
    sizes[4] = 7e6
    assert p2p_buffer_bytes(boundary_costs(8, sizes), schedule.placement, 1) == 2 * 7e6 + 2 * ACT
    assert p2p_buffer_bytes(boundary_costs(8, sizes), schedule.placement, 0) == 2 * 7e6 + 2 * ACT  # out: 0 and 4


def test_two_ranks_interleaved_keep_both_directions_to_their_one_peer():
    """pp 2, v 2: rank 0 sends stage 0's output to rank 1 and receives stage 1's from it:
    one peer, two links."""
    schedule = generate("interleaved-1f1b", 2, 4, 2)
    assert set(p2p_links(schedule.placement, 0)) == {(1, "in"), (1, "out")}
    assert p2p_buffer_bytes(boundary_costs(4), schedule.placement, 0) == 4 * ACT


def test_a_v_shaped_placement_has_a_link_each_way_on_its_ends():
    """ZB-V, pp 4: rank 0 holds stages 0 and 7 (sends 0 -> 1 on rank 1, receives 6 -> 7
    from rank 1); stages 3 and 4 meet on rank 3, which sends no activation across."""
    schedule = generate("zbv", 4, 8, 2)
    assert set(p2p_links(schedule.placement, 0)) == {(1, "out"), (1, "in")}
    assert set(p2p_links(schedule.placement, 3)) == {(2, "in"), (2, "out")}
