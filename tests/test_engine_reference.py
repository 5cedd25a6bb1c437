"""The compiled engine against its specification, the SimPy model (``schedules.engine_reference``):
on random schedules, costs, clusters, placements, tp/dp plans and every semantics, the
same moments, bit for bit, and the same stuck ranks."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipesim.cluster import presets
from pipesim.cluster.mapping import map_ranks
from pipesim.model.costs import Costs, StageCost, uniform_costs
from pipesim.sim.engine import rank_devices_of, step_timing
from pipesim.sim.parallel import comm_plan
from schedules import engine, generate, lower
from schedules import engine_reference as reference
from schedules.action import Action, ActionKind, parse_action
from schedules.generators import GENERATORS, MULTI_CHUNK, ScheduleUnavailableError
from schedules.generators.combined import combined_1f1b
from schedules.schedule import Schedule

CLUSTERS = {  # name -> (preset, nodes); pcie shares its switch and socket links between rank pairs
    "ideal": ("ideal", 1), "nvlink": ("nvlink", 1), "pcie": ("pcie", 1), "ib": ("ib", 2), "ethernet": ("ethernet", 2),
}
MOMENTS = engine.ENGINE_OUTPUTS
COMBINED = "combined interleaved-1f1b"  # --ep-overlap's order, drawn beside the generators'

pytestmark = pytest.mark.skipif(engine._compiled is None, reason="the compiled engine is not built")


def both(schedule: Schedule, timing: engine.StepTiming, semantics: str) -> tuple[engine.StepRun, engine.StepRun]:
    """The compiled engine's run and the SimPy model's, on the same inputs."""
    program = engine.compile_program(schedule, semantics)
    inputs = engine.step_inputs(program, timing)
    compiled = engine._run_compiled(program, inputs)
    return compiled, reference.run_reference(program, inputs.seconds, inputs.hold, inputs.wires, inputs.comm_overhead,
                                             inputs.channels)


def assert_same_moments(compiled: engine.StepRun, specified: engine.StepRun) -> None:
    for name in MOMENTS:
        assert np.array_equal(getattr(compiled, name), getattr(specified, name), equal_nan=True), name


@st.composite
def cases(draw, gathers: bool = False, layer_gathers: bool = False):
    """A random schedule, cluster and cost set, with a dp x tp plan half the time; with
    ``gathers`` always, under ZeRO-1 or 2 with the parameter gathers in the walk, stages
    of 1 to 4 layers; with ``layer_gathers`` always, under ZeRO-3 with every forward's and
    backward's per-layer gathers in the walk."""
    gathers = gathers or layer_gathers
    # V-shaped and overlapped pairs included, and combined 1F1B's (schedules.generators.combined)
    name = draw(st.sampled_from([*sorted(set(GENERATORS) - {"zb-auto"}), COMBINED]))
    pp = draw(st.integers(1, 8))
    microbatches = draw(st.integers(1, 12))
    chunks = draw(st.integers(1, 3)) if name in MULTI_CHUNK or name == COMBINED else 1
    try:
        if name == COMBINED:
            lowered = lower(combined_1f1b("interleaved-1f1b", pp, microbatches, chunks))
        else:
            lowered = lower(generate(name, pp, microbatches, chunks))
    except ScheduleUnavailableError:
        lowered = lower(generate("1f1b", pp, microbatches))
    preset, nodes = CLUSTERS[draw(st.sampled_from(sorted(CLUSTERS)))]
    topology = presets.PRESETS[preset](nodes)
    devices = None
    if not topology.ideal and draw(st.booleans()):  # ranks on scattered devices: other links shared
        devices = draw(st.permutations(topology.devices))[: lowered.pp]
    if draw(st.booleans()):  # uniform costs: many ties, where the order of equal-time moments decides
        costs = uniform_costs(lowered, 1e-3, 2e-3, wgrad=draw(st.sampled_from([0.0, 0.5e-3])),
                              act_bytes=draw(st.sampled_from([0, 1e6, 5e7, 1e9])))
    else:
        seconds = st.floats(1e-5, 5e-3)
        stages = tuple(
            StageCost(fwd=draw(seconds), bwd=draw(st.floats(2e-3, 5e-3)), wgrad=draw(st.floats(0.0, 1e-3)),
                      act_bytes=draw(st.sampled_from([0.0, 1e5, 3e7, 4e8])),
                      param_bytes=draw(st.sampled_from([0.0, 1e8])), layers=2, tp_message_bytes=1e6)
            for _ in range(lowered.num_stages)
        )
        overheads = st.sampled_from([0.0, 2e-6, 1e-5])
        costs = Costs(stages, action_overhead=draw(overheads), comm_overhead=draw(overheads))
    plan = None
    if gathers or draw(st.booleans()):  # a dp x tp job: tp holds and the other replicas' transfers on shared links
        # and the gradient reductions on each rank's dp channel, on links of their own or
        # (NVLink, PCIe, a node per rank) shared with the pipeline's sends
        if gathers:  # parameters everywhere, layers of their own per stage (a gather per layer)
            costs = dataclasses.replace(costs, stages=tuple(
                dataclasses.replace(stage, param_bytes=draw(st.sampled_from([1e7, 1e8, 1e9])),
                                    layers=draw(st.integers(1, 4))) for stage in costs.stages))
        elif not any(stage.param_bytes for stage in costs.stages):
            costs = dataclasses.replace(costs, stages=tuple(dataclasses.replace(stage, param_bytes=1e8, layers=2)
                                                            for stage in costs.stages))
        dp = draw(st.sampled_from([2, 4]))
        topology, order, tp = draw(st.sampled_from([
            (presets.ib(4 * dp), "tp-dp-pp", 2), (presets.ib(4 * dp), "tp-pp-dp", 2),
            (presets.ib(8 * dp), "tp-dp-pp", 8),
            (presets.nvlink(1), "tp-dp-pp", 1), (presets.pcie(1), "dp-pp-tp", 1)]))
        if len(topology.devices) < dp * lowered.pp * tp:  # a single-node preset too small for the job
            topology, order, tp = presets.ib(4 * dp), "tp-dp-pp", 2
        mapping = map_ranks(topology, dp=dp, pp=lowered.pp, tp=tp, order=order)
        devices = mapping.pipeline()
        plan = comm_plan(lowered, costs, topology, mapping, bucket_bytes=draw(st.sampled_from([3e7, 1e9])),
                         overlap_dp=draw(st.booleans()),
                         zero=3 if layer_gathers else draw(st.sampled_from([1, 2]) if gathers else st.integers(0, 3)))
    timing = step_timing(lowered, costs, topology, rank_devices_of(lowered, topology, devices), plan)
    semantics = draw(st.sampled_from(["rendezvous", "buffered", "free", "torch-runtime"]))
    return (lowered.compute_only() if semantics == "free" else lowered), timing, semantics


@settings(max_examples=250, deadline=None)
@given(cases())
def test_the_compiled_engine_computes_what_the_simpy_model_specifies(case):
    assert_walks_agree(*case)


def assert_walks_agree(schedule, timing, semantics) -> None:
    """The compiled walk finishes and gives every moment the SimPy specification gives."""
    compiled, specified = both(schedule, timing, semantics)
    assert not compiled.stuck
    assert_same_moments(compiled, specified)


@settings(max_examples=80, deadline=None)
@given(cases(gathers=True))
def test_the_parameter_gathers_in_both_walks_are_the_same(case):
    # ZeRO-1 and 2's gathers from the step's start, holding the links of their rings (on
    # NVLink and PCIe those of the pipeline's sends too), the first forwards held by them
    assert case[1].reductions.gathers
    assert_walks_agree(*case)


@settings(max_examples=80, deadline=None)
@given(cases(layer_gathers=True))
def test_zero3s_per_action_gathers_in_both_walks_are_the_same(case):
    # ZeRO-3's gathers before every forward and backward, issued as the rank reaches each,
    # behind the reductions on the channel and holding the links of their rings (on
    # NVLink and PCIe those of the pipeline's sends too)
    assert case[1].reductions.layer_gathers
    assert_walks_agree(*case)


@pytest.mark.parametrize("semantics", ["rendezvous", "buffered"])
def test_a_large_interleaved_step_is_the_same_in_both(semantics):
    lowered = lower(generate("interleaved-1f1b", 16, 64, 2))
    costs = uniform_costs(lowered.num_stages, 10e-3, 20e-3, act_bytes=64e6, virtual_stages=2)
    topology = presets.ib(2)
    timing = step_timing(lowered, costs, topology, rank_devices_of(lowered, topology, None))
    assert_same_moments(*both(lowered, timing, semantics))


def test_an_interleaved_torch_runtime_step_over_nvlink_is_the_same_in_both():
    # found by the property test above: rank 0 posts a receive from rank 1 and then one
    # from rank 3 at the same moment, both into its one NVLink port; the first posted
    # must take the link first though its stream took it up after the second's
    lowered = lower(generate("interleaved-1f1b", 4, 10, 2))
    costs = uniform_costs(lowered, 1e-3, 2e-3, act_bytes=1e6)  # F 0.5 ms, B 1 ms a chunk
    topology = presets.nvlink(1)
    timing = step_timing(lowered, costs, topology, rank_devices_of(lowered, topology, None))
    [(links, occupancy, latency)] = timing.wires[0]  # rank 0 to rank 1: its port out, rank 1's in
    assert links == (0, 1) and occupancy == pytest.approx(2.78e-6, rel=1e-3) and latency == pytest.approx(3e-6)
    assert_same_moments(*both(lowered, timing, "torch-runtime"))


def test_groups_that_start_together_reserve_links_in_posting_order():
    # Three ranks, one stage each; each rank has one link out and one in, and a transfer
    # holds both for 1 s and arrives 0.5 s later. Rank 1 posts 1SEND_F0 (to rank 2) at
    # 12.5, runs 1F1 until 22.5, then posts 1RECV_B0 (from rank 2) and 1RECV_F2 (from
    # rank 0): their senders are waiting already, so both leave at 22.5 into rank 1's one
    # link in. Under torch's runtime each runs on its rank pair's stream; the compiled
    # walk, having run rank 1 ahead, takes up 1RECV_B0 (behind 1SEND_F0) after 1RECV_F2.
    # The first posted still goes first: 1RECV_B0 arrives at 24, 1RECV_F2 at 25.
    def program(text: str) -> tuple[Action, ...]:
        return tuple(parse_action(word) for word in text.split())

    schedule = Schedule(pp=3, microbatches=3, placement=(0, 1, 2), programs=(
        program("0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2"),
        program("1RECV_F0 1RECV_F1 1F0 1SEND_F0 1F1 1RECV_B0 1RECV_F2 1SEND_F1 1B0 1SEND_B0 1RECV_B1 1F2 1SEND_F2 "
                "1B1 1SEND_B1 1RECV_B2 1B2 1SEND_B2"),
        program("2RECV_F0 2F0 2B0 2SEND_B0 2RECV_F1 2F1 2B1 2SEND_B1 2RECV_F2 2F2 2B2 2SEND_B2"),
    ))
    seconds = np.array([[1.0, 2.0, 2.0, 0.0], [10.0, 20.0, 20.0, 0.0], [1.0, 2.0, 2.0, 0.0]])
    # per stage, forward then backward: rank r's link out is 2r, its link in 2r + 1
    wires = [[((0, 3), 1.0, 0.5)], [], [((2, 5), 1.0, 0.5)], [((2, 1), 1.0, 0.5)], [], [((4, 3), 1.0, 0.5)]]
    compiled, specified = both(schedule, engine.StepTiming(seconds, wires=wires), "torch-runtime")
    assert not compiled.stuck
    assert_same_moments(compiled, specified)
    grad, activation = (2 * 2 + 1) * 3 + 0, (0 * 2 + 0) * 3 + 2  # (sending stage * 2 + direction) * 3 + microbatch
    assert compiled.departed[grad] == compiled.departed[activation] == 22.5
    assert (compiled.arrival[grad], compiled.arrival[activation]) == (24.0, 25.0)


@pytest.mark.parametrize("semantics", ["rendezvous", "buffered"])
def test_a_deadlock_leaves_the_same_ranks_stuck_in_both(semantics):
    # both ranks receive before they compute what the other needs: under rendezvous neither
    # group can complete; under buffered the sends are never posted
    recv_f, send_b = Action(1, ActionKind.RECV_F, 0), Action(1, ActionKind.SEND_B, 0)
    recv_b, send_f = Action(0, ActionKind.RECV_B, 0), Action(0, ActionKind.SEND_F, 0)
    schedule = Schedule(
        pp=2, microbatches=1, placement=(0, 1),
        programs=((recv_b, Action(0, "B", 0), Action(0, "F", 0), send_f),
                  (recv_f, Action(1, "B", 0), Action(1, "F", 0), send_b)),
    )
    compiled, specified = both(schedule, engine.StepTiming.uniform(2, 1.0, 2.0), semantics)
    assert compiled.stuck == [0, 1]
    assert_same_moments(compiled, specified)


def test_a_same_rank_input_that_comes_later_never_runs_in_either():
    # V placement: stage 1 sits on rank 0 with stage 0, and its forward comes first
    schedule = Schedule(pp=1, microbatches=1, placement=(0, 0),
                        programs=((Action(1, "F", 0), Action(0, "F", 0), Action(1, "B", 0), Action(0, "B", 0)),))
    compiled, specified = both(schedule, engine.StepTiming.uniform(2, 1.0, 2.0), "free")
    assert compiled.stuck == [0] and compiled.stuck_item.tolist() == [0]
    assert_same_moments(compiled, specified)


def links_shared_between_transfers(timing: engine.StepTiming) -> bool:
    """Whether two of the step's wires (stage boundaries and directions), or a wire and a
    gradient reduction, cross one link."""
    owners: dict[int, int] = {}
    for wire, routes in enumerate(timing.wires):
        for links, _, _ in routes or ():
            for link in links:
                if owners.setdefault(link, wire) != wire:
                    return True
    # a gradient reduction on a transfer's link: the same race with the reduction
    reductions = timing.reductions
    return reductions is not None and any(link in owners for links in reductions.links.values() for link in links)


# The drawn cases share links often since they carry gradient reductions: most are
# filtered out by design, so the health check's filtering alarm is expected here.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(cases())
def test_buffered_is_never_slower_than_rendezvous_on_the_same_program(case):
    schedule, timing, semantics = case
    # Where transfers of different boundaries share a link, leaving earlier can take the
    # link ahead of a transfer the step needed sooner (first come, first served): a
    # buffered step can then end later by a hair (seen: 0.002% on 1F1B over PCIe), so the
    # rule is held where links are not shared.
    assume(semantics not in ("free", "torch-runtime") and not links_shared_between_transfers(timing))
    rendezvous = engine.run(schedule, timing, "rendezvous")
    buffered = engine.run(schedule, timing, "buffered")
    # a less constrained rule cannot end later: sends never wait for their receive,
    # receives wait only where their data is needed
    assert buffered.makespan <= rendezvous.makespan * (1 + 1e-12)


def test_without_the_compiled_walk_the_engine_runs_the_simpy_model(monkeypatch):
    lowered = lower(generate("zbv", 4, 8, 2))
    timing = engine.StepTiming.uniform(lowered.num_stages, 1.0, 2.0, 0.8, hop=0.3)
    compiled = engine.run(lowered, timing, "rendezvous")
    monkeypatch.setattr(engine, "_compiled", None)
    fallback = engine.run(lowered, timing, "rendezvous")
    assert_same_moments(compiled, fallback)


def test_the_documented_extension_runs_and_slows_the_step():
    # docs/simulator.md, "Extending a simulation": a straggling rank and a failing link
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "simulator.md").read_text()
    section = text[text.index("### Extending a simulation"):]
    code = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 9)]
    assert not re.findall(r"\b\w+\._\w+", code)  # the public extension point, no private names
    namespace: dict = {}
    exec(compile(code.replace("print(slow.makespan)", "makespan = slow.makespan"), "simulator.md", "exec"),
         namespace)
    plain = engine.run(namespace["schedule"], namespace["timing"], "rendezvous")
    assert namespace["makespan"] > plain.makespan * 1.1  # rank 2 alone is 30% slower on its share


@pytest.mark.parametrize("semantics", ["rendezvous", "buffered", "torch-runtime"])
def test_the_extension_point_unchanged_is_the_engine(semantics):
    """``SimpyStep.of`` with no rule changed times the step as the compiled engine does."""
    schedule = lower(generate("dualpipev", 2, 4, 2))
    topology = presets.PRESETS["pcie"]()
    costs = uniform_costs(schedule, 1e-3, 2e-3, 1e-3, act_bytes=32e6)
    timing = step_timing(schedule, costs, topology, rank_devices_of(schedule, topology, None))
    assert_same_moments(engine.run(schedule, timing, semantics),
                        reference.SimpyStep.of(schedule, timing, semantics).run())


def test_a_walk_built_from_other_names_is_refused(monkeypatch):
    """The compiled walk reads its inputs by position: names in another order than
    ``EngineInputs`` mean a stale build, refused with how to rebuild."""
    class Stale:
        INPUTS = tuple(reversed(engine.EngineInputs._fields))
        OUTPUTS = engine.ENGINE_OUTPUTS

    monkeypatch.setattr(engine, "_compiled", Stale)
    with pytest.raises(ImportError, match="rebuild the walk"):
        engine._check_compiled_names()
