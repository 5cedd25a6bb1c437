"""ZeRO-3 / FSDP's per-layer parameter gathers in the engine's walk
(``schedules.dp_channel``, ``Reductions.layer_gathers``): each forward and backward (B, or
I when split) of a gathering stage issues one gather per layer on its rank's dp channel
when the rank reaches it with its input there; they run back to back in channel order
with the reductions, each holding the stage's links; the action starts no earlier than
its first layer's gather ends and ends no earlier than its last one's end plus a layer.

Hand-computed steps check the rule, in the compiled walk and the SimPy specification
alike (every moment of both compared); on modelled layouts with the gathers alone on
their channel and links, the step is the closed form's, FSDP's one-ahead prefetch
(``pipesim.sim.zero.exposed_gather_seconds``), to the last bits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipesim.api import model_costs
from pipesim.cluster import presets
from pipesim.sim.engine import price_step
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import comm_plan_of, run_simulation
from pipesim.sim.zero import exposed_gather_seconds, gather_units
from schedules import dataflow, engine, generate, lower
from schedules.dp_channel import AT_ACTION, AT_FRACTION, Reductions, channel_arrays
from tests.test_dp_channel import two_rank_step

pytestmark = pytest.mark.skipif(engine._compiled is None, reason="the compiled engine is not built")


def row_of(step: engine.StepRun, stage: int, kind: str, microbatch: int = 0) -> int:
    program = step.program
    code = engine.KIND_CODES[kind]
    (row,) = np.flatnonzero((program.compute_stage == stage) & (program.compute_kind == code)
                            & (program.compute_microbatch == microbatch))
    return int(row)


def span(step: engine.StepRun, stage: int, kind: str, microbatch: int = 0) -> tuple[float, float]:
    row = row_of(step, stage, kind, microbatch)
    return float(step.start[row]), float(step.end[row])


def test_a_forward_and_a_backward_each_wait_for_their_layers_gathers_as_the_closed_form_says():
    # Stage 1 gathers two layers on link 7 (nothing else crosses it): 0.75 s each before
    # its forward (1 s, 0.5 s a layer), 0.5 s each before its backward (2 s, 1 s a layer).
    # 0F0 0..1, the activation on link 0 1..1.5: rank 1 reaches 1F0 with its input at 1.5
    # and issues both gathers: 1.5..2.25, 2.25..3.0. 1F0 starts no earlier than 2.25 and
    # ends no earlier than 3.0 + 0.5: 2.5..3.5 (closed form: 1.5 + 0.75 + (2 - 1) x
    # max(0, 0.75 - 0.5) = 2.5). 1B0 is reached at 3.5: gathers 3.5..4.0, 4.0..4.5; it
    # starts at 4.0 (its end 6.0 is past 4.5 + 1: the second gather hides under the first
    # layer). The gradient on link 1 6.0..6.5, 0B0 6.5..8.5.
    step, _ = two_rank_step(Reductions({}, {1: (7,)}, layer_gathers={(1, "F"): (0.75, 0.75), (1, "B"): (0.5, 0.5)}))
    assert step.channels.mode.tolist() == [AT_ACTION] * 4
    assert step.collective_ready.tolist() == [1.5, 1.5, 3.5, 3.5]
    assert step.collective_start.tolist() == [1.5, 2.25, 3.5, 4.0]
    assert step.collective_end.tolist() == [2.25, 3.0, 4.0, 4.5]
    assert span(step, 1, "F") == (2.5, 3.5) and span(step, 1, "B") == (4.0, 6.0)
    assert step.makespan == 8.5


def buffered_two_microbatch_step(reductions: Reductions) -> tuple[engine.StepRun, engine.StepRun]:
    """``test_dp_channel.two_rank_step``'s two ranks (F 1 s, B 2 s, each transfer 0.5 s
    on its own link) with two microbatches, sends leaving as they are posted (buffered)."""
    return two_rank_step(reductions, microbatches=2, p2p="buffered")


SECOND_ACTIVATION = dataflow.transfer_key(0, dataflow.FORWARD, 1, 2)  # stage 0's output of microbatch 1


def test_a_gather_on_the_link_an_activation_wants_delays_the_send_by_exactly_the_overlap():
    # Stage 1's forwards gather one layer of 1 s on link 0, the link stage 0's activations
    # cross. 0F0 0..1, its activation on link 0 1..1.5; 0F1 1..2. Rank 1 reaches 1F0 with
    # its input at 1.5 and gathers on link 0 1.5..2.5. The second activation leaves at 2
    # and finds link 0 taken: it waits the 0.5 s the two overlap, holds the link 2.5..3.0
    # and arrives at 3.0, not 2.5. 1F0 2.5..3.5, 1B0 3.5..5.5 (no gather before it), its
    # gradient on link 1 5.5..6.0; 1F1 is reached at 5.5 (its input there since 3.0), its
    # gather 5.5..6.5, so 1F1 6.5..7.5, 1B1 7.5..9.5, the gradient 9.5..10.0; rank 0's
    # backwards 6..8 and 10..12.
    step, _ = buffered_two_microbatch_step(Reductions({}, {1: (0,)}, layer_gathers={(1, "F"): (1.0,)}))
    without, _ = buffered_two_microbatch_step(Reductions({}, {1: (7,)}, layer_gathers={(1, "F"): (1.0,)}))
    assert (without.departed[SECOND_ACTIVATION], without.arrival[SECOND_ACTIVATION]) == (2.0, 2.5)
    assert (step.departed[SECOND_ACTIVATION], step.arrival[SECOND_ACTIVATION]) == (2.0, 3.0)
    assert step.collective_start.tolist() == [1.5, 5.5] and step.collective_end.tolist() == [2.5, 6.5]
    assert span(step, 1, "F", 1) == (6.5, 7.5)
    assert step.makespan == 12.0


def test_a_forwards_gathers_queue_behind_the_reduction_its_rank_issued_before():
    # As above with the gathers on link 7, and stage 1 reduce-scattering every backward's
    # gradient in one 3 s bucket, full half-way through it, on the same channel. 1B0
    # (3.5..5.5) issues its reduction at 4.5: 4.5..7.5. 1F1, reached at 5.5, issues its
    # gather then, but the channel serves it after the reduction: 7.5..8.5, so 1F1
    # 8.5..9.5 (2 s later than with the gather alone), 1B1 9.5..11.5 (its reduction
    # 10.5..13.5), the gradient 11.5..12.0, 0B1 12..14.
    reductions = Reductions({1: ((0.5, (3.0,)),)}, {1: (7,)}, every_backward=True,
                            layer_gathers={(1, "F"): (1.0,)})
    step, _ = buffered_two_microbatch_step(reductions)
    channels = step.channels
    assert channels.mode.tolist() == [AT_ACTION, AT_FRACTION, AT_ACTION, AT_FRACTION]  # row by row, gathers first
    assert step.collective_ready.tolist() == [1.5, 4.5, 5.5, 10.5]
    assert step.collective_start.tolist() == [1.5, 4.5, 7.5, 10.5]
    assert step.collective_end.tolist() == [2.5, 7.5, 8.5, 13.5]
    assert span(step, 1, "F", 1) == (8.5, 9.5)
    assert step.makespan == 14.0


def test_the_channel_lays_out_each_actions_layers_together_and_gates_it_on_them():
    # ZB-H1 on two ranks, split backward: F, I and W gather (2, 3 and 4 layers: counts
    # told apart), each action's layers together in program order
    schedule = lower(generate("zb-h1", 2, 3))
    program = engine.compile_program(schedule, "rendezvous")
    layers_of = {"F": 2, "I": 3, "W": 4}
    gathers = {(stage, kind): (1.0,) * layers for stage in (0, 1) for kind, layers in layers_of.items()}
    channels = channel_arrays(program, Reductions({}, {0: (0,), 1: (1,)}, layer_gathers=gathers))
    per_rank = 3 * (2 + 3 + 4)
    assert channels.count == 2 * per_rank and channels.channel_start.tolist() == [0, per_rank, 2 * per_rank]
    kinds = {code: kind for kind, code in engine.KIND_CODES.items()}
    for row in range(program.computes):
        first, last = int(channels.gate_first[row]), int(channels.gate_last[row])
        layers = layers_of[kinds[int(program.compute_kind[row])]]
        assert last - first + 1 == layers
        assert channels.row[first:last + 1].tolist() == [row] * layers
        assert channels.run[first:last + 1].tolist() == list(range(layers))
    assert (np.diff(channels.row[:per_rank]) >= 0).all() and (np.diff(channels.row[per_rank:]) >= 0).all()
    assert not len(channels.row_collectives)  # issued as their actions are reached, not by a release


def test_a_step_cannot_gather_both_from_its_start_and_before_each_action():
    schedule = lower(generate("1f1b", 2, 2))
    program = engine.compile_program(schedule, "rendezvous")
    with pytest.raises(ValueError, match="either from its start"):
        channel_arrays(program, Reductions({}, {0: (0,)}, gathers={0: (1.0,)}, layer_gathers={(0, "F"): (1.0,)}))
    with pytest.raises(ValueError, match="kind 'SEND_F'"):
        channel_arrays(program, Reductions({}, {0: (0,)}, layer_gathers={(0, "SEND_F"): (1.0,)}))


# -- on a modelled cluster: gathers alone on their channel give the closed form's step ------

ZERO3_LAYOUTS = [  # (preset, nodes, schedule, pp, v, dp, tp, rank order, microbatches)
    ("ib", 4, "1f1b", 4, 1, 4, 2, "tp-pp-dp", 8),
    ("ib", 4, "interleaved-1f1b", 4, 2, 4, 2, "tp-dp-pp", 8),
    ("ethernet", 2, "zb-h1", 2, 1, 2, 4, "tp-pp-dp", 6),
    ("ib", 4, "gpipe", 2, 1, 4, 4, "tp-pp-dp", 4),
    ("ib", 8, "interleaved-1f1b", 8, 3, 4, 2, "tp-dp-pp", 8),
    ("ib", 4, "zbv", 4, 2, 4, 2, "tp-pp-dp", 8),
    ("ib", 4, "zb-h2", 4, 1, 4, 2, "tp-pp-dp", 8),
]


def priced_zero3(layout: tuple) -> tuple:
    """The layout (``ZERO3_LAYOUTS``' fields) at ZeRO-3 with no slowdown, as simulate
    prices it: its costs, the simulation, the communication plan and the step's timing."""
    preset, nodes, name, pp, v, dp, tp, order, microbatches = layout
    schedule = generate(name, pp, microbatches, v)
    topology = presets.PRESETS[preset](nodes)
    costs = model_costs(schedule, "gpt3-1.3b", topology, tp=tp)
    parallel = ParallelConfig(dp=dp, tp=tp, rank_order=order, zero=3, overlap_slowdown=0.0)
    result = run_simulation(schedule, costs, topology, parallel=parallel)
    plan = comm_plan_of(result.schedule, costs, topology, result.mapping, parallel)
    return costs, result, plan, price_step(result.schedule, costs, topology, result.devices, plan).timing


def zero3_timings(layout: tuple) -> tuple[engine.StepTiming, engine.StepTiming, object]:
    """A ZeRO-3 step's timing as simulate prices it, its reductions left out (every
    action's gathers alone on the channel), and the same step with the closed form's
    hold after each action instead (``exposed_gather_seconds`` of its layers, restated
    here from the plan's gathers and the stage's forward or backward) and no channel;
    and the lowered schedule."""
    costs, result, plan, timing = priced_zero3(layout)
    durations = costs.durations()
    closed_hold = timing.hold.copy()
    for (stage, kind), layers in plan.layer_gather_seconds.items():
        assert len(layers) == gather_units(costs.stages[stage].layers) and len(set(layers)) == 1
        closed_hold[stage, engine.COMPUTE_KINDS.index(kind)] += exposed_gather_seconds(
            len(layers), layers[0], durations[stage, kind] / len(layers))
    reductions = dataclasses.replace(timing.reductions, runs={})
    wire_links = {link for routes in timing.wires for links, _, _ in routes or () for link in links}
    assert reductions.layer_gathers and not wire_links & {link for links in reductions.links.values()
                                                          for link in links}
    walked = dataclasses.replace(timing, reductions=reductions)
    closed = dataclasses.replace(timing, hold=closed_hold, reductions=None)
    return walked, closed, result.schedule


@pytest.mark.parametrize("layout", ZERO3_LAYOUTS, ids=lambda layout: f"{layout[0]}-{layout[2]}-v{layout[4]}")
@pytest.mark.parametrize("p2p", ["rendezvous", "buffered"])
def test_gathers_alone_on_their_channel_give_the_closed_forms_step(layout, p2p):
    walked, closed, schedule = zero3_timings(layout)
    step, previous = engine.run(schedule, walked, p2p), engine.run(schedule, closed, p2p)
    assert step.makespan == pytest.approx(previous.makespan, rel=1e-12, abs=0.0)
    # each action ends where the closed form let its rank go on: its end plus its hold for the gathers
    program = previous.program
    waited = (closed.hold - walked.hold)[program.compute_stage, program.compute_kind]
    assert np.allclose(step.end, previous.end + waited, rtol=1e-12, atol=0.0)
    assert np.allclose(step.arrival, previous.arrival, rtol=1e-12, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("layout", ZERO3_LAYOUTS, ids=lambda layout: f"{layout[0]}-{layout[2]}-v{layout[4]}")
def test_with_the_reductions_on_the_channel_the_step_is_never_shorter_than_the_closed_forms(layout):
    # The closed form let an action's gathers run on a channel of their own; in the walk they
    # share the rank's channel with its reduce-scatters, in issue order (one NCCL
    # communicator), so a forward reached while the backward before it is still reducing
    # waits for those reductions first: the step legitimately differs, and only upward
    # (1f1b +20.0%, zb-h1 +29.5%, gpipe +19.1%, interleaved v3 +3.3%, zbv +19.9%, zb-h2
    # +19.7%; interleaved v2, whose reductions end before the next action, unchanged).
    walked, closed, schedule = zero3_timings(layout)
    reductions = dataclasses.replace(walked.reductions, runs=closed_runs(layout))
    with_reductions = engine.run(schedule, dataclasses.replace(walked, reductions=reductions), "rendezvous")
    previous = engine.run(schedule, dataclasses.replace(closed, reductions=dataclasses.replace(
        reductions, layer_gathers={})), "rendezvous")
    assert with_reductions.makespan >= previous.makespan * (1 - 1e-12)
    queued = with_reductions.collective_start > with_reductions.collective_ready
    gathers = with_reductions.channels.mode == AT_ACTION
    if with_reductions.makespan > previous.makespan * (1 + 1e-9):  # longer only where gathers queued
        assert (queued & gathers).any()


def closed_runs(layout: tuple) -> dict:
    """The layout's reductions as simulate prices them (``zero3_timings`` leaves them out)."""
    return priced_zero3(layout)[3].reductions.runs
