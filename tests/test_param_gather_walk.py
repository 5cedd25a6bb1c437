"""ZeRO-1 and 2's parameter all-gathers in the engine's walk (``schedules.dp_channel``,
``Reductions.gathers``): issued at the step's start, first on each rank's dp channel, one
collective per layer holding the stage's links; a stage's first forward starts no earlier
than its first layer's gather ends and ends no earlier than its last layer's gather's end
plus one layer's share of it.

Hand-computed steps check the rule (in the compiled walk and the SimPy specification
alike: ``two_rank_step`` compares every moment of both)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipesim.api import model_costs
from pipesim.cluster import presets
from pipesim.sim.engine import price_step
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import comm_plan_of, run_simulation
from schedules import dataflow, engine, generate, lower
from schedules.dp_channel import AT_STEP_START, Reductions, channel_arrays
from tests.test_dp_channel import two_rank_step

pytestmark = pytest.mark.skipif(engine._compiled is None, reason="the compiled engine is not built")

ACTIVATION = dataflow.transfer_key(0, dataflow.FORWARD, 0, 1)  # stage 0's output to stage 1


def forward_of_stage_1(step: engine.StepRun) -> tuple[float, float]:
    program = step.program
    (row,) = np.flatnonzero((program.compute_stage == 1) & (program.compute_kind == 0))
    return float(step.start[row]), float(step.end[row])


def test_gathers_on_links_of_their_own_hold_the_first_forward_as_the_closed_form_says():
    # Stage 1 gathers two layers of 1.5 s each on link 7 (nothing else crosses it): 0 to
    # 1.5 and 1.5 to 3. Its forward (1 s, 0.5 s a layer) has its input at 1.5 (0F0 0..1,
    # the activation on link 0 1..1.5). The closed form with nothing issued before (P = 0),
    # g = 1.5, c = 0.5, U = 2: P + g + (U - 1) max(0, g - c) = 1.5 + 1 = 2.5: the forward
    # runs 2.5..3.5, its second layer starting as that layer's gather ends (3.0).
    # Then 1B0 3.5..5.5, the gradient on link 1 5.5..6, 0B0 6..8.
    step, _ = two_rank_step(Reductions({}, {1: (7,)}, gathers={1: (1.5, 1.5)}))
    assert step.collective_ready.tolist() == [0.0, 0.0]
    assert (step.collective_start.tolist(), step.collective_end.tolist()) == ([0.0, 1.5], [1.5, 3.0])
    assert step.arrival[ACTIVATION] == 1.5
    assert forward_of_stage_1(step) == (2.5, 3.5)
    assert step.makespan == 8.0


def test_a_layer_of_gather_longer_than_the_wait_for_the_input_holds_the_forward_from_its_end():
    # one layer of 3 s: the forward cannot start before it ends (3), its input there at 1.5
    step, _ = two_rank_step(Reductions({}, {1: (7,)}, gathers={1: (3.0,)}))
    assert forward_of_stage_1(step) == (3.0, 4.0)
    assert step.makespan == 8.5  # everything after 1F0 half a second later than above


def test_a_gather_on_the_link_a_send_wants_delays_the_send_by_exactly_the_overlap():
    # The same two 1.5 s gathers of stage 1, now on link 0, the one stage 0's activation
    # crosses. The activation leaves at 1 (0F0 0..1) and wants link 0 for 0.5 s; the first
    # gather holds it 0..1.5, so the send waits 1.5 - 1 = 0.5 s (the overlap of the two)
    # and holds link 0 1.5..2.0, arriving at 2.0 instead of 1.5. The second gather, which
    # the channel would start at 1.5, finds the link taken and runs 2.0..3.5. Stage 1's
    # forward: its input at 2.0, its first gather's end 1.5, its last one's 3.5 plus a
    # layer's 0.5 less the forward's 1 s: 3.0. So 1F0 3.0..4.0, 1B0 4..6, the gradient
    # on link 1 6..6.5, 0B0 6.5..8.5.
    step, specified = two_rank_step(Reductions({}, {1: (0,)}, gathers={1: (1.5, 1.5)}))
    assert (step.departed[ACTIVATION], step.arrival[ACTIVATION]) == (1.0, 2.0)
    assert (step.collective_start.tolist(), step.collective_end.tolist()) == ([0.0, 2.0], [1.5, 3.5])
    assert forward_of_stage_1(step) == (3.0, 4.0)
    assert step.makespan == specified.makespan == 8.5


def test_gathers_come_first_on_the_channel_and_a_reduction_waits_behind_them():
    # stage 1's one reduction (3 s, full half-way through 1B0) and two layers' gathers of
    # 4 s each on link 7: the gathers run 0..4 and 4..8; the forward is held to start at
    # 8 + 0.5 - 1 = 7.5 (7.5..8.5), 1B0 8.5..10.5 releases the reduction at 9.5, which runs
    # 9.5..12.5 once the channel is free (it is, since 8)
    step, _ = two_rank_step(Reductions({1: ((0.5, (3.0,)),)}, {1: (7,)}, gathers={1: (4.0, 4.0)}))
    channels = step.channels
    assert channels.mode.tolist() == [AT_STEP_START, AT_STEP_START, 0]
    assert forward_of_stage_1(step) == (7.5, 8.5)
    assert step.collective_start.tolist() == [0.0, 4.0, 9.5] and step.collective_end.tolist() == [4.0, 8.0, 12.5]


def test_each_ranks_stages_gather_in_the_order_its_program_first_runs_their_forwards():
    # ZBV on two ranks: rank 0 holds stages 0 and 3 (V-shaped), and runs a forward of 0
    # before any of 3; rank 1 holds 1 and 2, 1's first. Each stage's layers' gathers lie
    # together, rank 0's channel first, and each first forward waits for its own stage's.
    schedule = lower(generate("zbv", 2, 4, 2))
    assert schedule.placement == (0, 1, 1, 0)
    program = engine.compile_program(schedule, "rendezvous")
    gathers = {0: (1.0, 1.0), 1: (2.0,), 2: (3.0, 3.0, 3.0), 3: (4.0,)}
    channels = channel_arrays(program, Reductions({}, {stage: (stage,) for stage in range(4)}, gathers=gathers))
    assert channels.channel_start.tolist() == [0, 3, 7]
    assert channels.stage.tolist() == [0, 0, 3, 1, 2, 2, 2]
    assert channels.seconds.tolist() == [1.0, 1.0, 4.0, 2.0, 3.0, 3.0, 3.0]
    forwards = np.flatnonzero(program.compute_kind == 0)
    for stage, (first, last) in {0: (0, 1), 3: (2, 2), 1: (3, 3), 2: (4, 6)}.items():
        row = forwards[program.compute_stage[forwards] == stage].min()
        assert (channels.gate_first[row], channels.gate_last[row]) == (first, last)
    assert (channels.gate_last >= 0).sum() == 4


# -- on a modelled cluster: links of their own give the previous closed form's step ---------

def closed_form_waits(after) -> tuple[dict[int, float], dict[int, float]]:
    """The previous model's step, restated from a run whose gathers follow the optimizer
    (``after``, the pipeline and the reductions the same as with no gathers at all): per
    rank, its stages' gathers issued back to back from the step's start in the order of
    their first forwards' starts, stage ``s`` of ``U`` layers (gathers of ``g`` seconds a
    layer, forwards of ``c``) with ``P_s`` seconds issued before it, its first forward at
    ``a_s``, waiting ``P_s + g + (U - 1) max(0, g - c) - a_s``; the rank's longest wait
    (0 if none is positive) added after its optimizer, the step the latest rank's end.
    Per rank, its end without the gathers and its wait."""
    columns, plan, placement = after.trace.columns, after.plan, after.schedule.placement
    ends: dict[int, float] = {}
    kept = columns.kind != columns.kind_code("ALLGATHER_PARAMS")
    for rank, end in zip(columns.rank[kept].tolist(), columns.end[kept].tolist(), strict=True):
        ends[rank] = max(ends.get(rank, 0.0), end)
    forwards = np.flatnonzero(columns.on_stream("compute") & (columns.kind == columns.kind_code("F")))
    first: dict[int, tuple[float, float]] = {}
    for row in forwards[np.argsort(columns.start[forwards], kind="stable")].tolist():
        start, end = float(columns.start[row]), float(columns.end[row])
        first.setdefault(int(columns.stage[row]), (start, end - start))
    issued = {rank: 0.0 for rank in ends}
    waits = {rank: 0.0 for rank in ends}
    for stage in sorted(first, key=lambda stage: first[stage][0]):
        seconds = plan.gather_bucket_seconds.get(stage, ())
        if not seconds or stage not in plan.dp_bucket_seconds:
            continue
        start, forward = first[stage]
        layers = max(plan.stage_layers.get(stage, 0), 1)
        gather, compute = math.fsum(seconds) / layers, forward / layers
        rank = placement[stage]
        waits[rank] = max(waits[rank], issued[rank] + gather + (layers - 1) * max(0.0, gather - compute) - start)
        issued[rank] += math.fsum(seconds)
    return ends, waits


def closed_form_step(after) -> float:
    """The previous model's step (``closed_form_waits``): the latest rank's end plus its wait."""
    ends, waits = closed_form_waits(after)
    return max(ends[rank] + waits[rank] for rank in ends)


WALK_LAYOUTS = [  # (preset, nodes, schedule, pp, v, dp, tp, rank order): dp rings on links no P2P send crosses
    ("ib", 4, "1f1b", 4, 1, 4, 2, "tp-pp-dp"),
    ("ib", 4, "interleaved-1f1b", 4, 2, 4, 2, "tp-dp-pp"),
    ("ethernet", 2, "zb-h1", 2, 1, 2, 4, "tp-pp-dp"),
    ("ib", 4, "gpipe", 2, 1, 4, 4, "tp-pp-dp"),
    ("ib", 8, "interleaved-1f1b", 8, 3, 4, 2, "tp-dp-pp"),
]


@pytest.mark.parametrize("layout", WALK_LAYOUTS, ids=lambda layout: f"{layout[0]}-{layout[2]}-v{layout[4]}")
@pytest.mark.parametrize(("zero", "overlap_dp", "microbatches"), [(1, True, 8), (2, True, 4), (1, False, 6)])
def test_gathers_on_links_of_their_own_give_the_previous_closed_forms_step(layout, zero, overlap_dp, microbatches):
    walked, after = walked_and_after(layout, zero, overlap_dp, microbatches)
    assert walked.metrics.makespan == pytest.approx(closed_form_step(after), rel=1e-12, abs=0.0)


def walked_and_after(layout: tuple, zero: int, overlap_dp: bool, microbatches: int):
    """The step with its gathers in the walk, and with them after the optimizer (``.plan``
    set: the plan both ran), checking the gathers' links are no P2P send's."""
    preset, nodes, name, pp, v, dp, tp, order = layout
    schedule = generate(name, pp, microbatches, v)
    topology = presets.PRESETS[preset](nodes)
    costs = model_costs(schedule, "gpt3-1.3b", topology, tp=tp)

    def run(overlap_param_gather: bool):
        parallel = ParallelConfig(dp=dp, tp=tp, rank_order=order, zero=zero, overlap_dp=overlap_dp,
                                  overlap_param_gather=overlap_param_gather, overlap_slowdown=0.0)
        return run_simulation(schedule, costs, topology, parallel=parallel), parallel

    walked, parallel = run(True)
    plan = comm_plan_of(walked.schedule, costs, topology, walked.mapping, parallel)
    timing = price_step(walked.schedule, costs, topology, walked.devices, plan).timing
    wire_links = {link for routes in timing.wires for links, _, _ in routes or () for link in links}
    gather_links = {link for stage in timing.reductions.gathers for link in timing.reductions.links[stage]}
    assert gather_links and not wire_links & gather_links  # the case these tests are about
    after, _ = run(False)
    after.plan = plan
    return walked, after


def test_a_ranks_wait_for_its_gathers_delays_the_ranks_that_depend_on_it():
    # ZBV, pp 4, m 8 (V-shaped: rank 0 holds stages 0 and 7, rank 2 stages 2 and 5). Rank
    # 0 waits longest for its gathers: stage 0's first forward starts the step, 3 layers of
    # 1.53 ms against 0.29 ms of forward each: 1.53 + 2 x 1.25 = 4.03 ms. Ranks 1 and 3
    # wait about 1 ms for their second stage's (issued after their first's), less than
    # 4.03. The closed form added each wait to its own rank alone; but every rank's first
    # forwards depend on rank 0's, so every rank starts 4.03 ms later (which covers the
    # others' waits) and the step ends with rank 2, which ends last: the latest rank's end
    # plus rank 0's wait, longer than the closed form's (rank 0's end plus its wait).
    walked, after = walked_and_after(("ib", 4, "zbv", 4, 2, 4, 2, "tp-pp-dp"), 1, True, 8)
    ends, waits = closed_form_waits(after)
    assert waits[0] == pytest.approx(4.03e-3, abs=0.01e-3) and max(waits[rank] for rank in (1, 2, 3)) < 1.1e-3
    assert max(ends, key=ends.get) == 2
    assert walked.metrics.makespan == pytest.approx(ends[2] + waits[0], rel=1e-12, abs=0.0)
    assert walked.metrics.makespan > closed_form_step(after) + 0.1e-3
