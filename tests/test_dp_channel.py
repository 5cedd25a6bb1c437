"""The gradient reductions in the engine's walk (``schedules.dp_channel``): each rank's dp
channel serves its collectives in issue order and holds the links their ring crosses.

Hand-computed steps check the rule where a reduction and a P2P transfer want one link
(in the compiled walk and in the SimPy specification alike); on layouts whose dp rings
share no link with the pipeline's sends, the step is the one the previous model gave:
the pipeline untouched, and the reductions first come, first served per rank after the
backwards that fill their buckets (an independent re-statement of that pass here)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pipesim.api import model_costs
from pipesim.cluster import presets
from pipesim.cluster.collectives import links_crossed
from pipesim.sim.engine import price_step
from pipesim.sim.parallel import DP_KIND, REDUCE_SCATTER_KIND, ParallelConfig, bucket_ready_fractions
from pipesim.sim.step import comm_plan_of, run_simulation
from schedules import dataflow, engine, generate, lower
from schedules import engine_reference as reference
from schedules.dp_channel import Reductions

pytestmark = pytest.mark.skipif(engine._compiled is None, reason="the compiled engine is not built")


def two_rank_step(reductions: Reductions | None, microbatches: int = 1,
                  p2p: str = "rendezvous") -> tuple[engine.StepRun, engine.StepRun]:
    """1F1B on two ranks, one microbatch (or ``microbatches``): F 1 s, B 2 s; stage 0's
    activations leave on link 0 and stage 1's gradients on link 1, each holding its link
    0.5 s (no latency). The compiled walk's run and the SimPy specification's, which
    must agree on every output."""
    schedule = lower(generate("1f1b", 2, microbatches))
    seconds = np.array([[1.0, 2.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0]])
    wires: list = [[], [], [], []]
    wires[dataflow.wire_of(0, dataflow.FORWARD)] = [((0,), 0.5, 0.0)]
    wires[dataflow.wire_of(1, dataflow.BACKWARD)] = [((1,), 0.5, 0.0)]
    timing = engine.StepTiming(seconds, wires=wires, reductions=reductions)
    program = engine.compile_program(schedule, p2p)
    inputs = engine.step_inputs(program, timing)
    compiled = engine.run_inputs(program, inputs)
    specified = reference.run_reference(program, inputs.seconds, inputs.hold, inputs.wires, inputs.comm_overhead,
                                        inputs.channels)
    for name in engine.ENGINE_OUTPUTS:
        assert np.array_equal(getattr(compiled, name), getattr(specified, name), equal_nan=True), name
    return compiled, specified


GRADIENT = dataflow.transfer_key(1, dataflow.BACKWARD, 0, 1)  # stage 1's gradient to stage 0


def test_without_reductions_the_gradient_arrives_after_its_half_second():
    # 0F0 [0, 1], activation [1, 1.5], 1F0 [1.5, 2.5], 1B0 [2.5, 4.5], gradient [4.5, 5], 0B0 [5, 7]
    step, _ = two_rank_step(None)
    assert (step.departed[GRADIENT], step.arrival[GRADIENT]) == (4.5, 5.0)
    assert step.makespan == 7.0


def test_a_reduction_on_the_senders_link_delays_the_send_by_exactly_its_overlap():
    # stage 1's one bucket is full half-way through 1B0 (2.5 + 0.5 * 2 = 3.5) and holds
    # link 1 for 3 s, to 6.5; the gradient leaves at 4.5 and must wait for the link: it
    # is delayed by 6.5 - 4.5 = 2 s, the time the two overlap, arriving at 7.0 instead
    # of 5.0; rank 0's backward follows it, 7 to 9
    step, _ = two_rank_step(Reductions({1: ((0.5, (3.0,)),)}, {1: (1,)}))
    assert (step.collective_ready.tolist(), step.collective_start.tolist(), step.collective_end.tolist()) == (
        [3.5], [3.5], [6.5])
    assert (step.departed[GRADIENT], step.arrival[GRADIENT]) == (4.5, 7.0)
    assert step.makespan == 9.0


def test_a_send_takes_the_link_between_two_buckets_of_a_run():
    # the same 3 s, as a run of four 0.75 s buckets from 3.5 (ends 4.25, 5.0, 5.75, 6.5):
    # the gradient, leaving at 4.5 during the second, waits only for that bucket's end
    # (5.0), holds link 1 to 5.5 and arrives then; the third bucket starts at 5.5, so the
    # run ends 0.5 s late, at 7.0; rank 0's backward runs 5.5 to 7.5
    step, _ = two_rank_step(Reductions({1: ((0.5, (0.75, 0.75, 0.75, 0.75)),)}, {1: (1,)}))
    assert (step.departed[GRADIENT], step.arrival[GRADIENT]) == (4.5, 5.5)
    assert (step.collective_start[0], step.collective_end[0]) == (3.5, 7.0)
    assert step.makespan == 7.5


def test_a_run_on_links_of_its_own_ends_at_its_buckets_exact_sum():
    # nothing else crosses link 7: the run is one step of math.fsum of its buckets
    buckets = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    step, _ = two_rank_step(Reductions({1: ((0.5, buckets),)}, {1: (7,)}))
    assert step.collective_end[0] == step.collective_start[0] + math.fsum(buckets)


def test_a_reduction_on_links_of_its_own_changes_nothing_in_the_pipeline():
    plain, _ = two_rank_step(None)
    step, _ = two_rank_step(Reductions({1: ((0.5, (3.0,)),)}, {1: (7,)}))
    assert np.array_equal(step.arrival, plain.arrival, equal_nan=True) and np.array_equal(step.end, plain.end)
    assert step.collective_end.tolist() == [6.5]


def test_a_send_leaving_with_the_reduction_takes_the_link_first():
    # the bucket fills at 1B0's end (4.5), when the gradient leaves: the transfer holds
    # link 1 to 5.0, then the reduction runs 5.0 to 8.0
    step, _ = two_rank_step(Reductions({1: ((1.0, (3.0,)),)}, {1: (1,)}))
    assert (step.arrival[GRADIENT], step.collective_start[0], step.collective_end[0]) == (5.0, 5.0, 8.0)


def test_a_ranks_reductions_run_one_after_another_in_issue_order():
    # two buckets full at a quarter and half of 1B0 (3.0 and 3.5), 1 s each on the one
    # channel: 3.0 to 4.0, then 4.0 to 5.0 (the second waits for the first, not its links)
    step, _ = two_rank_step(Reductions({1: ((0.25, (1.0,)), (0.5, (1.0,)))}, {1: (5,)}))
    assert step.collective_start.tolist() == [3.0, 4.0] and step.collective_end.tolist() == [4.0, 5.0]


@pytest.mark.parametrize(("every_backward", "ready"), [(True, 4.5), (False, 5.0)])
def test_without_overlap_reductions_wait_for_the_backward_or_the_step_end(every_backward, ready):
    # ZeRO-2 and 3: once 1B0 ends (4.5); ZeRO-0 and 1: once rank 1's step is done, its
    # last group (the gradient's send) completed at 5.0
    step, _ = two_rank_step(Reductions({1: ((0.5, (3.0,)),)}, {1: (9,)}, every_backward, overlap=False))
    assert step.collective_ready.tolist() == [ready] and step.collective_end.tolist() == [ready + 3.0]


def test_a_ring_crosses_the_links_of_each_neighbour_route():
    # two nodes: gpu0 of each, through their NICs and the switch, both ways
    topology = presets.ib(2)
    assert links_crossed(topology, ["n0.gpu0", "n1.gpu0"]) == (
        ("n0.gpu0", "n0.nic0"), ("n0.nic0", "ib_switch"), ("ib_switch", "n1.nic0"), ("n1.nic0", "n1.gpu0"),
        ("n1.gpu0", "n1.nic0"), ("n1.nic0", "ib_switch"), ("ib_switch", "n0.nic0"), ("n0.nic0", "n0.gpu0"))


# -- on a modelled cluster: links of their own give the previous model's step ---------------

def first_come_first_served(trace, plan, overlap: bool, every: bool) -> list[tuple]:
    """The previous model's reductions, restated: per stage, runs of buckets that fill at
    the same fraction of a releasing backward (each stage's last B or W, or every one),
    ready at that fraction, at the backward's end or at the rank's last pipeline moment
    (without overlap), reduced first come, first served per rank by (ready, stage, first
    bucket, microbatch). ``(rank, stage, microbatch, start, end)`` of each run."""
    columns = trace.columns
    pipeline = ~(columns.on_stream("dp") | columns.on_stream("step"))
    rank_end = {rank: float(columns.end[pipeline & (columns.rank == rank)].max()) for rank in np.unique(columns.rank)}
    backward = columns.on_stream("compute") & np.isin(columns.kind, [columns.kind_code("B"), columns.kind_code("W")])
    runs = []
    for stage, seconds in plan.dp_bucket_seconds.items():
        rows = np.flatnonzero(backward & (columns.stage == stage))
        rows = rows[np.argsort(columns.end[rows], kind="stable")]
        if not every:
            rows = rows[-1:]
        fractions = bucket_ready_fractions(plan.dp_bucket_bytes[stage], plan.stage_layers.get(stage, 0))
        groups = [(fraction, [i for i, f in enumerate(fractions) if f == fraction]) for fraction in
                  sorted(set(fractions))] if overlap else [(1.0, list(range(len(seconds))))]
        for row in rows.tolist():
            start, end, rank = float(columns.start[row]), float(columns.end[row]), int(columns.rank[row])
            for fraction, buckets in groups:
                ready = start + fraction * (end - start) if overlap else end if every else rank_end[rank]
                runs.append((ready, stage, buckets[0], int(columns.microbatch[row]), rank,
                             math.fsum(seconds[i] for i in buckets)))
    free: dict[int, float] = {}
    placed = []
    for ready, stage, _, microbatch, rank, length in sorted(runs):
        begin = max(ready, free.get(rank, 0.0))
        free[rank] = begin + length
        placed.append((rank, stage, microbatch, begin, begin + length))
    return sorted(placed)


LAYOUTS = [  # (preset, nodes, schedule, pp, v, dp, tp, rank order): pp over NVLink and dp over NICs, or the reverse
    ("ib", 4, "1f1b", 4, 1, 4, 2, "tp-pp-dp"),
    ("ib", 4, "interleaved-1f1b", 4, 2, 4, 2, "tp-dp-pp"),
    ("ethernet", 2, "zb-h1", 2, 1, 2, 4, "tp-pp-dp"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}-{layout[2]}-{layout[7]}")
# (not ZeRO-3: its per-layer gathers share the channel with the reductions and hold the
# actions, so the pipeline is not the one without them: tests/test_layer_gather_walk.py)
@pytest.mark.parametrize(("zero", "overlap"), [(0, True), (1, False), (2, True), (2, False), (0, False)])
def test_reductions_on_links_of_their_own_are_the_previous_first_come_first_served_step(layout, zero, overlap):
    preset, nodes, name, pp, v, dp, tp, order = layout
    schedule = generate(name, pp, 8, v)
    topology = presets.PRESETS[preset](nodes)
    costs = model_costs(schedule, "gpt3-1.3b", topology, tp=tp)
    # (the parameter gathers after the optimizer: under the next step's forwards they hold them,
    # tests/test_param_gather_walk.py)
    parallel = ParallelConfig(dp=dp, tp=tp, rank_order=order, zero=zero, overlap_dp=overlap,
                              overlap_param_gather=False)
    result = run_simulation(schedule, costs, topology, parallel=parallel)
    plan = comm_plan_of(result.schedule, costs, topology, result.mapping, parallel)
    priced = price_step(result.schedule, costs, topology, result.devices, plan)
    timing = priced.timing
    wire_links = {link for routes in timing.wires for links, _, _ in routes or () for link in links}
    dp_links = {link for links in timing.reductions.links.values() for link in links}
    assert dp_links and not wire_links & dp_links  # the case this test is about
    # the pipeline is the one run without the reductions
    with_channel = engine.run(result.schedule, timing, result.trace.meta["p2p"])
    without = engine.run(result.schedule, dataclasses.replace(timing, reductions=None), result.trace.meta["p2p"])
    for name in ("start", "end", "departed", "arrival", "rank_done"):
        assert np.array_equal(getattr(with_channel, name), getattr(without, name), equal_nan=True), name
    # and the reductions are the previous pass's, to the bit
    columns = result.trace.columns
    kind = columns.kind_code(REDUCE_SCATTER_KIND if zero else DP_KIND)
    reductions = np.flatnonzero(columns.kind == kind)
    simulated = sorted(zip(columns.rank[reductions].tolist(), columns.stage[reductions].tolist(),
                           columns.microbatch[reductions].tolist(), columns.start[reductions].tolist(),
                           columns.end[reductions].tolist(), strict=True))
    assert simulated and simulated == first_come_first_served(result.trace, plan, overlap, zero >= 2)


def test_reductions_through_the_pipelines_ports_delay_its_sends():
    # one NVLink node, pp 2 x dp 4: each GPU's one NVSwitch port carries its ring's
    # reductions and the pipeline's sends; ZeRO-2 reduce-scatters every backward's
    # gradients. Some send waits behind a reduction (its time on the wire grows past its
    # unloaded half-occupancy), and the step is longer than with the reductions on
    # links of their own. 25 layers (14 and 11) make stage 0 the slower, so its sends
    # leave while its reductions hold the port; with 24 the last stage's loss makes stage 1
    # the slower, and stage 0's sends wait for it instead.
    schedule = generate("1f1b", 2, 8)
    topology = presets.nvlink(1)
    costs = model_costs(schedule, "gpt3-1.3b", topology, layers=25)
    parallel = ParallelConfig(dp=4, zero=2, overlap_dp=False)
    result = run_simulation(schedule, costs, topology, parallel=parallel)
    plan = comm_plan_of(result.schedule, costs, topology, result.mapping, parallel)
    timing = price_step(result.schedule, costs, topology, result.devices, plan).timing
    apart = dataclasses.replace(timing, reductions=dataclasses.replace(
        timing.reductions, links={stage: tuple(1000 + link for link in links)
                                  for stage, links in timing.reductions.links.items()}))
    shared, separate = (engine.run(result.schedule, each, "rendezvous") for each in (timing, apart))
    [(_, occupancy, latency)] = timing.wires[dataflow.wire_of(0, dataflow.FORWARD)]
    on_wire = shared.arrival - shared.departed
    assert np.nanmax(on_wire) > occupancy + latency + 1e-9
    assert np.nanmax(separate.arrival - separate.departed) == pytest.approx(occupancy + latency)
    assert shared.makespan > separate.makespan
    assert result.metrics.makespan > separate.makespan
