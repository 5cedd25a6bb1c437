"""``pipesim compare --ep`` prices the expert-parallel all-to-alls from the links it
benchmarked, as it does P2P and the tp collectives: the executor times each dispatch and
combine inside its compute action (``ALLTOALL_EP(action)`` on the ``ep`` stream), the
calibration steps take them out of the measured compute and give the simulator the bytes
(``moe_layers``, ``dispatch_bytes``), and the simulator charges them over the fitted
links. Checked by hand against a fitted topology whose bandwidth and latency are chosen."""

from __future__ import annotations

import argparse

import pytest

from executor.gather import INSIDE_KINDS, decode, encode, inside_event
from executor.inside_timing import EP_KIND
from executor.options import add_run_arguments, config_from_args
from executor.run_costs import compute_seconds, stage_bytes
from pipesim.cli.compare import replicas
from pipesim.cluster.comm_fit import fits_by_operation, topology_document
from pipesim.cluster.files import topology_from_dict
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.step import run_simulation
from schedules.action import Action, ActionKind
from schedules.generators import generate
from schedules.trace import Trace, TraceEvent

BANDWIDTH, LATENCY = 1e8, 2e-5  # bytes/s and s of the send/recv the benchmark "measured"


def fitted_topology(ranks: int):
    """The topology compare builds from a send/recv benchmark whose timings are exactly
    ``LATENCY + bytes / BANDWIDTH``."""
    result = {"world": ranks, "backend": "gloo", "device": "cpu",
              "rows": [{"operation": "sendrecv", "bytes": size, "seconds": LATENCY + size / BANDWIDTH}
                       for size in (1e3, 1e5, 1e6)]}
    return topology_from_dict(topology_document(result, fits_by_operation(result)), name="measured links")


def run_config(*flags: str):
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return config_from_args(parser.parse_args(list(flags)))


@pytest.mark.parametrize("ep", [2, 4])
def test_each_all_to_all_costs_a_piece_over_the_fitted_bandwidth_plus_its_latency(ep: int) -> None:
    # pp 2 x dp 4 on 8 benchmarked ranks, ep groups cut from the dp replicas (as the run's)
    config = run_config("--model", "mixtral-8x7b", "--pp", "2", "--dp", "4", "--ep", str(ep), "-m", "2")
    moe_layers, dispatch = 2, 16384.0
    stage = StageCost(fwd=1e-3, bwd=2e-3, act_bytes=8192.0, moe_layers=moe_layers, dispatch_bytes=dispatch)
    schedule = generate("1f1b", 2, 2)
    result = run_simulation(schedule, Costs((stage, stage)), fitted_topology(8), parallel=replicas(config))
    # each member sends 1/ep of its copies to each of the others, every pair over its own
    # fitted link: the busiest link carries dispatch / ep, then one latency
    one = dispatch / ep / BANDWIDTH + LATENCY
    held = [event for event in result.trace.events if event.stream == "ep"]
    assert len(held) == 2 * 2 * 2  # 2 ranks x 2 microbatches x (F, B)
    for event in held:
        assert event.duration == pytest.approx(2 * moe_layers * one, rel=1e-12)  # dispatch + combine per layer


def test_the_calibration_gives_the_simulator_the_bytes_of_each_stages_all_to_alls() -> None:
    # mixtral shrunk to 4 layers of hidden 64 (2 a stage, every one MoE, top-2), microbatches
    # of 2 sequences of 16 tokens, float32: 32 tokens x 2 copies x 64 x 4 bytes
    config = run_config("--model", "mixtral-8x7b", "--pp", "2", "--dp", "2", "--ep", "2", "-m", "2")
    assert (config.layers, config.hidden, config.seq_len, config.replica_batch_size) == (4, 64, 16, 4)
    entries = stage_bytes(config, 2)
    assert [(entry["moe_layers"], entry["dispatch_bytes"]) for entry in entries] == [(2.0, 16384.0)] * 2
    assert "moe_layers" not in stage_bytes(run_config("--model", "mixtral-8x7b", "--pp", "2", "-m", "2"), 2)[0]


def test_the_all_to_alls_inside_an_action_are_taken_out_of_its_compute() -> None:
    forward = Action(0, ActionKind.F, 0)
    events = [TraceEvent.of(0, forward, 0.0, 1.0, "compute"),
              inside_event(0, forward, 0.2, 0.3, EP_KIND), inside_event(0, forward, 0.6, 0.75, EP_KIND)]
    trace = Trace(events)
    assert compute_seconds(trace, collectives_apart=True)[0, ActionKind.F] == pytest.approx(0.75)
    assert compute_seconds(trace, collectives_apart=False)[0, ActionKind.F] == pytest.approx(1.0)


def test_all_to_all_events_travel_to_rank_0_as_they_were_recorded() -> None:
    schedule = generate("1f1b", 2, 2)
    program = schedule.programs[0]
    backward = Action(0, ActionKind.B, 1)
    events = [TraceEvent.of(0, program[0], 0.0, 1.0, "compute"), inside_event(0, program[0], 0.25, 0.5, EP_KIND),
              inside_event(0, backward, 2.0, 2.5, EP_KIND), inside_event(0, backward, 2.5, 2.75, "TP")]
    assert decode(0, program, encode(program, events)) == events
    assert INSIDE_KINDS == ("TP", EP_KIND, "CP_KV")
    assert events[1].action == "ALLTOALL_EP(0F0)" and events[1].stream == "ep"


@pytest.mark.timeout(120)
def test_a_run_times_its_all_to_alls_and_its_calibration_takes_them_out_of_the_compute() -> None:
    from executor.launch import launch  # noqa: PLC0415 - starts gloo ranks
    from executor.run_costs import calibration_configs, calibration_document  # noqa: PLC0415

    config = run_config("--model", "mixtral-8x7b", "--pp", "1", "--dp", "2", "--ep", "2", "-m", "2",
                        "--layers", "2", "--backend", "gloo")
    calibrated = launch(calibration_configs(config, 1))
    trace = calibrated[0]["trace"]
    held = [event for event in trace.events if event.stream == "ep"]
    # two MoE layers, 2 microbatches: dispatch and combine in every F and (their
    # backward) in every B
    assert len(held) == 2 * 2 * 2 * 2 and {event.kind for event in held} == {EP_KIND}
    compute = {(event.rank, event.action): event for event in trace.events if event.stream == "compute"}
    for event in held:  # each inside the action it names
        action = compute[event.rank, event.action[len(EP_KIND) + 1:-1]]
        assert action.start <= event.start <= event.end <= action.end
    document = calibration_document(config, generate("1f1b", 1, 2), calibrated)
    for entry in document["stages"]:
        assert entry["moe_layers"] == 2.0 and entry["dispatch_bytes"] == 2 * 16 * 2 * 64 * 4  # mb 2 x seq 16, top-2
        forwards = [event for event in compute.values() if event.stage == entry["stage"] and event.kind == "F"]
        exchanged = sum(event.duration for event in held if event.stage == entry["stage"]
                        and event.action.startswith(f"{EP_KIND}({entry['stage']}F"))
        # one calibration step: its mean forward, less the all-to-alls inside the forwards
        expected = (sum(event.duration for event in forwards) - exchanged) / len(forwards)
        assert entry["fwd"] == pytest.approx(expected, rel=1e-9) and exchanged > 0
