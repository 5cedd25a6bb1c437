"""ZeRO-3's collectives inside the actions' costs (``--zero3-collectives in-costs``,
``pipesim.sim.zero``): the simulator charges nothing for them beside the actions, against
hand calculations and the prefetching default; the flag's refusals; and ``compare
--zero 3`` on gloo predicting with it (4 tiny gloo ranks)."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cli.calibration_files import parallel_flags
from pipesim.cluster.files import topology_from_dict
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from pipesim.sim.zero import ZERO3_COLLECTIVES, ZERO_STAGES
from schedules import generate

MB = 1e6
# four devices, every pair joined by 10 GB/s each way without latency: over a dp pair a
# layer's 25 MB gather or reduce-scatter takes 25 MB / 2 / 10 GB/s = 1.25 ms
MESH = {"devices": [{"name": f"g{index}", "memory_bytes": 80e9} for index in range(4)],
        "links": [{"src": f"g{a}", "dst": f"g{b}", "bandwidth": 10e9, "latency": 0.0}
                  for a in range(4) for b in range(a + 1, 4)]}


def stages(count: int) -> Costs:
    """``count`` stages of F = 4 ms, B = 10 ms, 100 MB of parameters in 4 layers, no
    activation to send; a 1 ms optimizer step."""
    stage = StageCost(fwd=4e-3, bwd=10e-3, param_bytes=100 * MB, layers=4)
    return Costs(stages=(stage,) * count, step_overhead=1e-3)


def in_costs(dp: int = 2) -> ParallelConfig:
    return ParallelConfig(dp=dp, zero=3, zero3_collectives="in-costs")


def test_one_stage_in_costs_is_its_actions_back_to_back_then_the_optimizer():
    # 1F1B on one stage, 2 microbatches: F0 0..4, B0 4..14, F1 14..18, B1 18..28 ms, the
    # optimizer 28..29: the actions' costs already hold the collectives. The same step
    # prefetching (tests/test_zero.py, by hand) waits 9 ms for the dp channel: 38 ms.
    result = run_simulation(generate("1f1b", 1, 2), stages(1), topology_from_dict(MESH), parallel=in_costs())
    compute = sorted((event.start, event.end) for event in result.trace.events if event.stream == "compute")
    assert [moment for span in compute for moment in span] == pytest.approx(
        [0.0, 4e-3, 4e-3, 14e-3, 14e-3, 18e-3, 18e-3, 28e-3])
    assert result.metrics.makespan == pytest.approx(29e-3)
    assert not [event for event in result.trace.events if event.stream == "dp"]
    overlapped = run_simulation(generate("1f1b", 1, 2), stages(1), topology_from_dict(MESH),
                                parallel=ParallelConfig(dp=2, zero=3, overlap_slowdown=0.0))
    assert overlapped.metrics.makespan == pytest.approx(38e-3)


def test_two_stages_in_costs_is_the_1f1b_closed_form_with_no_gather_reduce_scatter_or_slowdown():
    # (m + p - 1)(F + B) = 5 x 14 ms with free transfers, then the 1 ms optimizer; the
    # prefetching default on the same links charges the gathers the first layers wait
    # for, the reduce-scatters after the last backward and their slowdown of the compute
    schedule = generate("1f1b", 2, 4)
    result = run_simulation(schedule, stages(2), topology_from_dict(MESH), parallel=in_costs())
    assert result.metrics.makespan == pytest.approx(5 * 14e-3 + 1e-3)
    kinds = {event.kind for event in result.trace.events}
    assert not kinds & {"ALLGATHER_PARAMS", "REDUCE_SCATTER_DP", "DP_SLOWDOWN", "ALLREDUCE_DP"}
    assert result.to_dict()["zero3_collectives"] == "in-costs"
    overlapped = run_simulation(schedule, stages(2), topology_from_dict(MESH), parallel=ParallelConfig(dp=2, zero=3))
    assert {"ALLGATHER_PARAMS", "REDUCE_SCATTER_DP", "DP_SLOWDOWN"} <= {event.kind for event in overlapped.trace.events}
    assert overlapped.metrics.makespan > 71e-3 + 2 * 1.25e-3  # at least the first gather and last reduce-scatter


def test_in_costs_needs_zero_3():
    with pytest.raises(ValueError, match="--zero3-collectives in-costs .* this step is --zero 2: add --zero 3"):
        ParallelConfig(dp=2, zero=2, zero3_collectives="in-costs")
    with pytest.raises(ValueError, match="--zero3-collectives 'sync' is not one of: overlapped, in-costs"):
        ParallelConfig(dp=2, zero=3, zero3_collectives="sync")


@settings(max_examples=40, deadline=None)
@given(zero=st.sampled_from(ZERO_STAGES), collectives=st.sampled_from([*ZERO3_COLLECTIVES, "", "In-Costs", "sync"]))
def test_the_flag_is_taken_exactly_where_it_means_something(zero, collectives):
    valid = collectives == "overlapped" or (collectives == "in-costs" and zero == 3)
    if valid:
        assert ParallelConfig(dp=2, zero=zero, zero3_collectives=collectives).zero3_collectives == collectives
    else:
        with pytest.raises(ValueError, match="--zero3-collectives"):
            ParallelConfig(dp=2, zero=zero, zero3_collectives=collectives)


def mesh(devices: int) -> dict:
    return {"devices": [{"name": f"g{index}", "memory_bytes": 80e9} for index in range(devices)],
            "links": [{"src": f"g{a}", "dst": f"g{b}", "bandwidth": 10e9, "latency": 1e-5}
                      for a in range(devices) for b in range(a + 1, devices)]}


@settings(max_examples=25, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]), pp=st.sampled_from([2, 3]),
       rounds=st.integers(1, 3), forward=st.floats(1e-4, 1e-2), backward=st.floats(1e-4, 2e-2),
       optimizer=st.floats(0, 1e-2))
def test_in_costs_charges_the_step_nothing_beyond_one_replicas_pipeline(schedule, pp, rounds, forward, backward,
                                                                          optimizer):
    # whatever the schedule and costs, a dp 2 ZeRO-3 step with the collectives in the
    # costs is the pipeline of one replica alone (dp 1: no data-parallel collective at all)
    # and its optimizer; every link its own, so the other replica's transfers share none
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    plan = generate(schedule, pp, pp * rounds, virtual_stages=virtual)
    stage = StageCost(fwd=forward, bwd=backward, act_bytes=1e5, param_bytes=50 * MB, layers=2)
    costs = Costs(stages=(stage,) * plan.num_stages, step_overhead=optimizer)
    topology = topology_from_dict(mesh(2 * pp))
    zero3 = run_simulation(plan, costs, topology, parallel=in_costs())
    alone = run_simulation(plan, costs, topology, parallel=ParallelConfig(dp=1))
    assert zero3.metrics.makespan == pytest.approx(alone.metrics.makespan, rel=1e-12)
    assert not [event for event in zero3.trace.events if event.stream == "dp"]


SIMULATE = ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--dp", "2"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--zero3-collectives", "in-costs"], "this step is --zero 0: add --zero 3 or drop the flag"),
    (["--zero", "3", "--zero3-collectives", "in-costs"], "their time must be in measured stage times; give --costs"),
    (["--zero", "3", "--zero3-collectives", "sync"], "invalid choice: 'sync'"),
])
def test_simulate_refuses_in_costs_where_it_cannot_be_right_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) if "sync" in flags else contextlib.nullcontext():  # argparse's own refusal
        assert main([*SIMULATE, *flags]) == 2
    error = capsys.readouterr().err
    assert message in error
    if "sync" not in flags:
        assert error.count("\n") == 1


def test_simulate_with_a_costs_file_and_in_costs_predicts_the_closed_form(tmp_path, capsys):
    stage = {"fwd": 4e-3, "bwd": 10e-3, "param_bytes": 100 * MB, "layers": 4}
    (tmp_path / "costs.json").write_text(json.dumps({"stages": [stage, stage], "step_overhead": 1e-3}))
    (tmp_path / "mesh.json").write_text(json.dumps(MESH))
    command = [*SIMULATE, "--zero", "3", "--costs", str(tmp_path / "costs.json"), "--topology",
               str(tmp_path / "mesh.json"), "--json", str(tmp_path / "out.json")]
    assert main([*command, "--zero3-collectives", "in-costs"]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["makespan"] == pytest.approx(71e-3)
    assert main(command) == 0  # the default prefetches and overlaps: longer
    assert json.loads((tmp_path / "out.json").read_text())["makespan"] > 73e-3


def test_compare_writes_the_flag_its_simulate_command_needs():
    # compare's reproduction line (pipesim.cli.calibration_files.simulate_command)
    assert parallel_flags(in_costs())[-2:] == ["--zero3-collectives", "in-costs"]
    assert "--zero3-collectives" not in parallel_flags(ParallelConfig(dp=2, zero=3))


TINY_ZERO3 = ["--schedule", "1f1b", "--pp", "2", "--dp", "2", "--zero", "3", "--model", "gpt", "--layers", "2",
              "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "8", "--microbatches", "2",
              "--backend", "gloo"]


@pytest.mark.timeout(240)
def test_compare_zero3_on_gloo_predicts_the_collectives_inside_the_measured_actions(tmp_path, capsys):
    link = {"bandwidth": 1e9, "latency": 1e-4, "medium": "gloo measured"}
    links = {"devices": [{"name": f"rank{rank}"} for rank in range(4)],
             "links": [{"src": f"rank{a}", "dst": f"rank{b}", **link} for a in range(4) for b in range(a + 1, 4)]}
    (tmp_path / "links.json").write_text(json.dumps(links))
    assert main(["compare", *TINY_ZERO3, "--steps", "2", "--warmup-steps", "1", "--calibration-steps", "1",
                 "--topology", str(tmp_path / "links.json"), "--json", str(tmp_path / "compare.json"),
                 "--trace", str(tmp_path / "measured.json"), "--predicted-trace", str(tmp_path / "predicted.json"),
                 "--quiet"]) == 0
    measured = json.loads((tmp_path / "measured.json").read_text())["events"]
    # the run: FSDP2's gathers and reduce-scatters, each inside the compute action it serves
    collectives = [event for event in measured if event["stream"] == "dp"]
    assert {event["kind"] for event in collectives} == {"ALLGATHER_PARAMS", "REDUCE_SCATTER_DP"}
    compute = {(event["rank"], event["action"]): event for event in measured if event["stream"] == "compute"}
    for event in collectives:
        action = compute[event["rank"], event["action"][event["action"].index("(") + 1:-1]]
        assert action["start"] <= event["start"] <= event["end"] <= action["end"]
    # the prediction: those actions at their calibrated costs (each drawn with the runtime's
    # per-action overhead before it), and nothing charged for the collectives beside them
    # (no gather waited for, no reduce-scatter, no slowdown, no all-reduce)
    predicted = json.loads((tmp_path / "predicted.json").read_text())["events"]
    assert not [event for event in predicted if event["stream"] == "dp"]
    costs = json.loads((tmp_path / "compare.json").read_text())["costs"]
    for event in predicted:
        if event["stream"] == "compute":
            seconds = costs["stages"][event["stage"]]["fwd" if event["kind"] == "F" else "bwd"]
            assert event["end"] - event["start"] == pytest.approx(seconds + costs["action_overhead"])


def test_compare_zero3_on_gloo_refuses_a_stage_profile_in_one_line(capsys):
    # the stage profile times one replica's stages alone, without FSDP's collectives
    assert main(["compare", *TINY_ZERO3, "--calibration", "stages"]) == 2
    error = capsys.readouterr().err
    assert "--calibration stages times whole pipeline stages, not --zero 3 shards" in error
    assert error.count("\n") == 1
