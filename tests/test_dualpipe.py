"""Bidirectional DualPipe (``--schedule dualpipe``): DeepSeek's figures, its placement of
two copies of the model, and what the copies cost in memory and in the step.

Closed forms are DeepSeek's (DualPipe README, "Pipeline Bubbles and Memory Usage
Comparison"): bubble ``(PP/2 - 1)(F&B + B - 3W)`` against 1F1B's ``(PP - 1)(F + B)``,
activations of ``PP + 1`` microbatches per device, parameters twice. Like the
zero-bubble paper's schedules they take forward, input-gradient and weight-gradient
passes of equal length (``B = 2F``, ``W = F``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.config import RunConfig
from pipesim.cli import main
from pipesim.cluster import presets
from pipesim.cluster.mapping import map_ranks
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import uniform_costs
from pipesim.sim.parallel import comm_plan
from pipesim.sim.step import run_simulation
from schedules import generate, lower, validate
from schedules.csv_io import schedule_to_csv
from schedules.generators import PLANNED_SCHEDULES, SCHEDULE_NAMES, ScheduleUnavailableError
from schedules.p2p import P2P_SEMANTICS
from tests.test_generators_property import program_peak_stash


def _with_pair_cost(costs, overlapped: float | None):
    if overlapped is None:
        return costs
    return dataclasses.replace(costs, stages=tuple(dataclasses.replace(stage, overlap_fb=overlapped)
                                                   for stage in costs.stages))


@pytest.mark.parametrize("pp", [2, 4, 6, 8, 10])
@pytest.mark.parametrize("extra", [0, 1, 3])
@pytest.mark.parametrize("pair", [None, 2.0, 2.4])  # F&B: F + B (not overlapped), B (fully hidden), between
def test_bubble_is_deepseeks_closed_form(pp, extra, pair):
    forward, backward, weight = 1.0, 2.0, 1.0
    microbatches = 2 * pp + 2 * extra
    schedule = generate("dualpipe", pp, microbatches, 2)
    costs = _with_pair_cost(uniform_costs(schedule, forward, backward, weight), pair)
    step = run_simulation(schedule, costs, ideal_topology(pp)).metrics.makespan
    together = pair or forward + backward
    # every rank runs m forwards and m backwards of a 1/pp stage, its overlapped pairs as F&B
    busy = [microbatches * (forward + backward) - len(fused) * (forward + backward - together)
            for fused in schedule.fused]
    assert max(step - work for work in busy) == pytest.approx((pp / 2 - 1) * (together + backward - 3 * weight))
    one_f_one_b = generate("1f1b", pp, microbatches, 1)
    baseline = run_simulation(one_f_one_b, uniform_costs(one_f_one_b, forward, backward), ideal_topology(pp))
    assert baseline.metrics.makespan - microbatches * (forward + backward) == pytest.approx(
        (pp - 1) * (forward + backward))


def test_pp8_m20_against_1f1b_by_hand():
    """DeepSeek's example size: 20 microbatches (10 each way) on 8 ranks, F=1, B=2, W=1,
    no overlap saving: 20 x 3 + 3 x (3 + 2 - 3) = 66 against 1F1B's 20 x 3 + 7 x 3 = 81."""
    schedule = generate("dualpipe", 8, 20, 2)
    assert schedule.microbatches == 10 and schedule.step_microbatches == 20
    assert run_simulation(schedule, uniform_costs(schedule, 1, 2, 1), ideal_topology(8)).metrics.makespan == 66


@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_peak_activations_are_pp_plus_one_microbatches(pp):
    schedule = generate("dualpipe", pp, 4 * pp, 2)
    assert max(program_peak_stash(program) for program in schedule.programs) == pp + 1
    result = run_simulation(schedule, uniform_costs(schedule, 1, 2, 1), ideal_topology(pp))
    # reported in shares of the rank's model (two stages of 1/pp each)
    assert max(rank.peak_inflight_microbatches for rank in result.metrics.ranks) == pytest.approx((pp + 1) / 2)
    assert schedule.meta["memory_microbatches"] == (pp + 1) / 2


@st.composite
def sizes(draw):
    pp = 2 * draw(st.integers(1, 6))
    microbatches = 2 * pp + 2 * draw(st.integers(0, 8))
    return pp, microbatches


@settings(max_examples=25, deadline=None)
@given(sizes())
def test_every_microbatch_runs_once_on_its_copys_ranks_and_the_schedule_validates(size):
    pp, microbatches = size
    schedule = generate("dualpipe", pp, microbatches, 2)
    each_way = microbatches // 2
    assert (schedule.copies, schedule.microbatches, schedule.num_stages) == (2, each_way, 2 * pp)
    for stage in range(pp):  # copy 0's stage s on rank s, copy 1's on rank pp - 1 - s
        assert schedule.placement[stage] == stage
        assert schedule.placement[pp + stage] == pp - 1 - stage
    for rank, program in enumerate(schedule.programs):
        passes: dict[tuple[int, int], list[str]] = {}
        for stage, kind, microbatch in program:
            passes.setdefault((stage, microbatch), []).append(kind)
        assert sorted(passes) == [(stage, microbatch) for stage in (rank, 2 * pp - 1 - rank)
                                  for microbatch in range(each_way)]
        assert all(kinds in (["F", "B"], ["F", "I", "W"]) for kinds in passes.values())
    validate(schedule)
    lowered = lower(schedule)
    for semantics in P2P_SEMANTICS:
        validate(lowered, semantics)
    assert [len(pairs) for pairs in lowered.fused] == [len(pairs) for pairs in schedule.fused]
    # no data crosses the seam: copy 1 starts at its own end while copy 0 starts at the other
    trace = run_simulation(schedule, uniform_costs(schedule, 1, 2, 1), ideal_topology(pp)).trace
    first = {(event.rank, event.action): event.start for event in trace.events}
    assert first[0, "0F0"] == 0 and first[pp - 1, f"{pp}F0"] == 0


@pytest.mark.parametrize(("pp", "microbatches", "chunks", "words"), [
    (3, 12, 2, "even number of pipeline ranks, got pp=3"),
    (4, 9, 2, "even count of at least 2 x pp = 8, got 9"),
    (4, 6, 2, "even count of at least 2 x pp = 8, got 6"),
    (4, 8, 1, "two stages per rank (one of each copy of the model); virtual stages=1"),
])
def test_sizes_without_a_dualpipe_are_refused_by_name(pp, microbatches, chunks, words):
    with pytest.raises(ScheduleUnavailableError, match=words.replace("(", r"\(").replace(")", r"\)")):
        generate("dualpipe", pp, microbatches, chunks)


def test_cli_refuses_an_odd_pipeline_in_one_line(capsys):
    assert main(["simulate", "--schedule", "dualpipe", "--pp", "3", "--microbatches", "12"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "dualpipe needs an even number of pipeline ranks, got pp=3" in error


def test_two_copies_hold_twice_the_parameters_and_sum_their_gradients(tmp_path):
    """Rank r holds copy 0's stage r and copy 1's stage pp-1-r, each a whole 1/pp of the
    model: per rank, 1F1B's stage r plus its stage pp-1-r. Its gradients are all-reduced
    with rank pp-1-r's (the other copy of the same layers): one bucket over two GPUs behind
    one NVSwitch, S/B + 2 x latency by the ring formula (n = 2)."""
    pp, param_bytes = 4, 8e6  # under one 25 MB bucket
    schedule = lower(generate("dualpipe", pp, 2 * pp, 2))
    costs = uniform_costs(schedule, 1.0, 2.0, 1.0, param_bytes=param_bytes)
    baseline = uniform_costs(generate("1f1b", pp, 2 * pp, 1), 1.0, 2.0, 1.0, param_bytes=param_bytes)
    for rank in range(pp):
        held = sum(costs.stages[stage].param_bytes for stage in schedule.stages_of(rank))
        assert held == baseline.stages[rank].param_bytes + baseline.stages[pp - 1 - rank].param_bytes == 2 * param_bytes
    topology = presets.nvlink(1)
    plan = comm_plan(schedule, costs, topology, map_ranks(topology, dp=1, pp=pp, tp=1))
    route = topology.route("n0.gpu0", "n0.gpu3")
    assert route.latency == pytest.approx(3e-6) and route.bandwidth == pytest.approx(360e9)
    for stage in range(2 * pp):
        assert plan.dp_bucket_seconds[stage] == pytest.approx((param_bytes / 360e9 + 2 * 3e-6,))
    out = tmp_path / "step.json"
    assert main(["simulate", "--schedule", "dualpipe", "--pp", "4", "--microbatches", "8", "--fwd", "1",
                 "--bwd", "2", "--wgrad", "1", "--param-bytes", "8e6", "--topology", "nvlink", "--no-dp-overlap",
                 "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["microbatches"] == 8
    # the two stages' reductions after the pipeline, on every rank
    for rank in document["ranks"]:
        assert rank["dp"] == pytest.approx(2 * (param_bytes / 360e9 + 2 * 3e-6))


def test_the_two_copies_of_a_model_stage_reduce_in_one_collective_that_holds_the_links_once():
    """Model stage X's gradients live on rank X (copy 0) and rank pp-1-X (copy 1) and are
    summed in one all-reduce over both: the engine runs it on both ranks' dp channels
    but holds its links once (copy 0's stage), so the two copies, ready at the same moment
    by the schedule's mirror symmetry, start together instead of one waiting for the
    other; two model stages on the same pair of ranks are two collectives and still take
    turns on the links."""
    from pipesim.sim.parallel import ParallelConfig

    pp, param_bytes = 4, 36e10  # one bucket of 1 s at NVLink's 360 GB/s: long beside the unit-second actions
    schedule = lower(generate("dualpipe", pp, 2 * pp, 2))
    costs = uniform_costs(schedule, 1.0, 2.0, 1.0, param_bytes=param_bytes)
    topology = presets.nvlink(1)
    plan = comm_plan(schedule, costs, topology, map_ranks(topology, dp=1, pp=pp, tp=1), bucket_bytes=1e15)
    assert sorted(plan.dp_links) == list(range(pp))  # copy 0's stages hold the links
    assert sorted(plan.dp_bucket_seconds) == list(range(2 * pp))  # every stage's rank takes part
    result = run_simulation(schedule, costs, topology, parallel=ParallelConfig(bucket_bytes=1e15))
    reductions = {event.stage: event for event in result.trace.events if event.kind == "ALLREDUCE_DP"}
    one = param_bytes / 360e9 + 2 * 3e-6  # the ring of two (test above)
    for stage in range(pp):
        copy0, copy1 = reductions[stage], reductions[pp + stage]
        assert (copy0.rank, copy1.rank) == (stage, pp - 1 - stage)
        assert copy0.start == pytest.approx(copy1.start)
        assert copy0.duration == pytest.approx(one) and copy1.duration == pytest.approx(one)
    # model stages 1 and 2 both reduce over ranks 1 and 2: one after the other
    first, second = sorted((reductions[1], reductions[2]), key=lambda event: event.start)
    assert second.start >= first.end - 1e-12


def test_the_executor_refuses_layouts_beside_it_and_the_csv_form_refuses_it_in_one_line(tmp_path):
    RunConfig(schedule="dualpipe", pp=2, microbatches=4, virtual_stages=2, layers=4).check()  # runs (tests below)
    zero3 = dict(schedule="dualpipe", pp=2, dp=2, microbatches=4, virtual_stages=2, layers=4, batch_size=8,
                 model="gpt", hidden=8, heads=2, zero=3)
    RunConfig(**zero3).check()  # runs (tests/test_executor_zero3_split_backward.py), with tp and ep too
    RunConfig(**{**zero3, "tp": 2}).check()
    with pytest.raises(ValueError, match="dualpipe holds 2 copies of the model, which the CSV form"):
        schedule_to_csv(generate("dualpipe", 2, 4, 2), tmp_path / "dualpipe.csv")


def test_listed_for_simulate_and_sweep_but_not_searched_by_plan():
    assert "dualpipe" in SCHEDULE_NAMES and "dualpipev" in SCHEDULE_NAMES
    assert "dualpipe" not in PLANNED_SCHEDULES and "dualpipev" in PLANNED_SCHEDULES


def test_the_critical_path_never_steps_across_the_seam():
    """Copy 1's first stage (stage pp) takes its input from no one, though stage pp - 1
    sits on the same rank: the walk back along a step's critical path stops there."""
    from pipesim.sim.critical_path import path_links
    from schedules.engine import compile_program
    from schedules.program_arrays import B_CODE, F_CODE, I_CODE

    pp = 4
    schedule = lower(generate("dualpipe", pp, 2 * pp, 2))  # kept: the program reads it
    program = compile_program(schedule, "rendezvous")
    links = path_links(program)
    stage, kind = program.compute_stage, program.compute_kind
    forward, backward = kind == F_CODE, (kind == B_CODE) | (kind == I_CODE)
    assert (links.producer[forward & (stage % pp == 0)] == -1).all()  # stages 0 and pp start a copy
    assert (links.producer[backward & (stage % pp == pp - 1)] == -1).all()  # stages pp-1 and 2pp-1 end one
    inside = forward & (stage == pp + 1)  # copy 1's second stage reads copy 1's first
    assert inside.any() and (stage[links.producer[inside]] == pp).all()


def test_a_model_is_split_into_one_copys_stages_and_both_copies_get_them(tmp_path, capsys):
    """Both copies get one copy's 4 stages (embedding on stages 0 and pp, the head on pp - 1
    and 2pp - 1), each what 1F1B's stage of the same layers holds, so the step's tokens
    are the m microbatches of both directions. The split balances ranks, rank r running
    stages r and 3 - r (pipesim.model.stage_split): with the output layer and its loss worth
    h = 2 to 3 layers on stage 3, ranks 0 and 3 fit 15 layers under 15 + h and ranks 1 and
    2 17 (17 + h would leave 33), 32 in all; 15 goes 9 to stage 0 and 6 to stage 3 (9
    against 6 + h), 17 goes 8 and 9 (the later stage first): 9, 8, 9, 6, where 1F1B's
    stage-by-stage split is 8, 9, 9, 6."""
    stages = {}
    for name in ("dualpipe", "1f1b"):
        out = tmp_path / f"{name}.json"
        assert main(["simulate", "--schedule", name, "--pp", "4", "--microbatches", "8", "--model", "llama3-8b",
                     "--topology", "ib", "--nodes", "1", "--json", str(out)]) == 0
        document = json.loads(out.read_text())
        stages[name] = document["stage_costs"]
        assert document["microbatches"] == 8
    assert len(stages["dualpipe"]) == 8 and len(stages["1f1b"]) == 4
    layer = (stages["1f1b"][1]["fwd"] + stages["1f1b"][1]["bwd"]) / stages["1f1b"][1]["layers"]
    head = (stages["1f1b"][3]["fwd"] + stages["1f1b"][3]["bwd"]) / layer - stages["1f1b"][3]["layers"]
    assert 2 < head < 3
    assert [stage["layers"] for stage in stages["dualpipe"]] == [9, 8, 9, 6] * 2
    assert [stage["layers"] for stage in stages["1f1b"]] == [8, 9, 9, 6]
    out = tmp_path / "same-split.json"
    assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--model", "llama3-8b",
                 "--topology", "ib", "--nodes", "1", "--layers-per-stage", "9,8,9,6", "--json", str(out)]) == 0
    same = json.loads(out.read_text())["stage_costs"]
    capsys.readouterr()
    for stage in range(4):
        assert stages["dualpipe"][stage] == stages["dualpipe"][4 + stage] == same[stage]
    assert main(["simulate", "--schedule", "dualpipe", "--pp", "4", "--microbatches", "8", "--model", "llama3-8b",
                 "--layers-per-stage", "4,4,4,4,4,4,4,4"]) == 2
    assert ("--layers-per-stage lists 8 stages but each of dualpipe's 2 copies of the model has 4 (pp)"
            in capsys.readouterr().err)


@pytest.mark.parametrize("semantics", ["rendezvous", "buffered", "torch-runtime"])
def test_the_compiled_engine_and_its_simpy_specification_agree_on_dualpipe(semantics):
    """Bit for bit, on a dp 2 x tp 2 job over two InfiniBand nodes with activations and
    gradients to move: the seam and the overlapped pairs are read alike by both."""
    import numpy as np

    from pipesim.sim.engine import step_timing
    from schedules import engine
    from schedules import engine_reference as reference

    if engine._compiled is None:
        pytest.skip("the compiled engine is not built")
    schedule = lower(generate("dualpipe", 4, 12, 2))
    costs = uniform_costs(schedule, 1e-3, 2e-3, 0.7e-3, act_bytes=5e7, param_bytes=1e8)
    topology = presets.ib(4)
    mapping = map_ranks(topology, dp=2, pp=4, tp=2)
    timing = step_timing(schedule, costs, topology, mapping.pipeline(), comm_plan(schedule, costs, topology, mapping))
    program = engine.compile_program(schedule, semantics)
    inputs = engine.step_inputs(program, timing)
    compiled = engine.run_inputs(program, inputs)
    specified = reference.run_reference(program, inputs.seconds, inputs.hold, inputs.wires, inputs.comm_overhead,
                                        inputs.channels)
    assert not compiled.stuck
    for name in ("ready", "start", "end", "posted", "departed", "arrival", "rank_clock", "rank_done"):
        assert np.array_equal(getattr(compiled, name), getattr(specified, name), equal_nan=True), name


def test_expert_gradients_are_summed_over_both_copies_holders():
    """With expert parallelism, a stage's routed experts reduce over the expert data-parallel
    group of each copy's rank: copy 0's rank s and copy 1's rank pp - 1 - s."""
    from pipesim.model.costs import StageCost
    from pipesim.sim.parallel import _expert_gradients, stage_dp_group

    pp = 4
    topology = presets.ib(2)
    mapping = map_ranks(topology, dp=4, pp=pp, tp=1, ep=2)
    schedule = generate("dualpipe", pp, 2 * pp, 2)
    cost = StageCost(fwd=1.0, bwd=2.0, params=100, expert_params=60, param_bytes=200.0)
    for stage in range(2 * pp):
        copy_stage = stage % pp
        holders = (copy_stage, pp - 1 - copy_stage)
        share, group = _expert_gradients(schedule, stage, cost, mapping)
        assert share == 0.6
        assert group == [device for rank in holders for device in mapping.expert_dp_group(rank, 0)]
        assert len(group) == 2 * len(mapping.expert_dp_group(0, 0))
        assert stage_dp_group(schedule, stage, mapping) == [device for rank in holders
                                                       for device in mapping.dp_cp_group(rank, 0)]
