"""``pipesim compare --cp`` (ring attention) prices the K/V exchanges from the links it
benchmarked: the executor times, inside each compute action, every wait for a block
(``CP_KV(action)`` on the ``cp`` stream) and the attention core of every ring step; the
calibration takes the waits out of the measured compute and gives the simulator the
bytes (``attention_layers``, ``kv_bytes``) and the attention's seconds it sets the
transfers against; the simulator charges each step's transfer over the fitted links.
Checked by hand against a fitted topology whose bandwidth and latency are chosen."""

from __future__ import annotations

import pytest

from executor.gather import decode, encode, inside_event
from executor.inside_timing import CP_KIND, EP_KIND
from executor.run_costs import add_ring, compute_seconds, stage_bytes
from pipesim.cli.compare import replicas
from pipesim.model.costs import Costs, StageCost
from pipesim.sim.comm_overlap import OVERLAP_SLOWDOWN
from pipesim.sim.step import run_simulation
from schedules.action import Action, ActionKind
from schedules.generators import generate
from schedules.trace import Trace, TraceEvent
from tests.test_compare_ep_links import BANDWIDTH, LATENCY, fitted_topology, run_config


def ring_holds(cp: int, layers: int, kv_bytes: float, attention: float) -> dict[str, float]:
    """The simulated step's cp hold after rank 0's first forward and first backward."""
    config = run_config("--model", "llama3-8b", "--pp", "2", "--cp", str(cp), "-m", "2")
    stage = StageCost(fwd=1e-3, bwd=2e-3, act_bytes=8192.0, attention_layers=layers, kv_bytes=kv_bytes,
                      attention_fwd=attention, attention_bwd=attention)
    result = run_simulation(generate("1f1b", 2, 2), Costs((stage, stage)), fitted_topology(2 * cp),
                            parallel=replicas(config))
    return {event.action: event.duration for event in result.trace.events if event.stream == "cp" and event.rank == 0}


@pytest.mark.parametrize("cp", [2, 4])
def test_a_transfer_the_attention_cannot_hide_costs_the_block_over_the_fitted_link(cp: int) -> None:
    layers, block = 2, 2048.0
    held = ring_holds(cp, layers, block, attention=0.0)
    one, two = block / BANDWIDTH + LATENCY, 2 * block / BANDWIDTH + LATENCY  # each rank to its successor, own link
    # forward: cp - 1 blocks passed on; backward: the block, cp - 2 blocks with their gradients, the gradients
    assert held["CP_KV(0F0)"] == pytest.approx(layers * (cp - 1) * one, rel=1e-12)
    assert held["CP_KV(0B0)"] == pytest.approx(layers * (2 * one + (cp - 2) * two), rel=1e-12)


def test_attention_longer_than_the_transfer_hides_it_but_for_the_slowdown() -> None:
    layers, block, attention = 2, 2048.0, 0.01  # a step's share, 5 ms, well over a transfer's 40.5 us
    held = ring_holds(2, layers, block, attention)
    transfer = block / BANDWIDTH + LATENCY
    # the compute beside the transfer loses transfer * k / (1 + k) (pipesim.sim.comm_overlap)
    assert held["CP_KV(0F0)"] == pytest.approx(layers * transfer * OVERLAP_SLOWDOWN / (1 + OVERLAP_SLOWDOWN))


def test_the_calibration_gives_the_simulator_each_stages_keys_and_values() -> None:
    # llama3-8b shrunk to 4 layers of hidden 64, 4 heads of 16 and 1 key/value head;
    # microbatches of 2 sequences of 16 tokens, 8 on each of 2 cp ranks, float32:
    # 2 x 8 tokens x (key 16 + value 16) x 4 bytes
    config = run_config("--model", "llama3-8b", "--pp", "2", "--cp", "2", "-m", "4")
    assert (config.layers, config.hidden, config.heads, config.seq_len) == (4, 64, 4, 16)
    entries = stage_bytes(config, 2)
    assert [(entry["attention_layers"], entry["kv_bytes"]) for entry in entries] == [(2.0, 2 * 8 * 32 * 4.0)] * 2
    gathered = stage_bytes(run_config("--model", "llama3-8b", "--pp", "2", "--cp", "2", "-m", "4",
                                      "--cp-comm", "all-gather"), 2)
    assert "kv_bytes" not in gathered[0]  # not timed apart: it stays in the measured compute


def test_the_attention_each_step_computed_is_given_per_layer() -> None:
    entries = [{"stage": 0, "attention_layers": 2.0}, {"stage": 1, "attention_layers": 4.0}]
    steps = [{"0F": 0.2, "0B": 0.4, "1F": 0.8, "1I": 1.2}, {"0F": 0.4, "0B": 0.6, "1F": 0.4, "1I": 2.0},
             {"0F": 0.3, "0B": 9.0, "1F": 0.6, "1I": 1.6}]
    add_ring(entries, steps)
    assert (entries[0]["attention_fwd"], entries[0]["attention_bwd"]) == pytest.approx((0.3 / 2, 0.6 / 2))
    assert (entries[1]["attention_fwd"], entries[1]["attention_bwd"]) == pytest.approx((0.6 / 4, 1.6 / 4))


def test_the_waits_inside_an_action_are_taken_out_of_its_compute_and_travel_as_recorded() -> None:
    forward, backward = Action(0, ActionKind.F, 0), Action(0, ActionKind.B, 0)
    events = [TraceEvent.of(0, forward, 0.0, 1.0, "compute"), inside_event(0, forward, 0.4, 0.5, CP_KIND),
              inside_event(0, forward, 0.6, 0.8, EP_KIND), TraceEvent.of(0, backward, 2.0, 3.0, "compute"),
              inside_event(0, backward, 2.5, 2.75, CP_KIND)]
    seconds = compute_seconds(Trace(events), collectives_apart=True)
    assert seconds[0, ActionKind.F] == pytest.approx(0.7) and seconds[0, ActionKind.B] == pytest.approx(0.75)
    program = generate("1f1b", 1, 1).programs[0]
    assert decode(0, program, encode(program, events)) == events
    assert events[1].action == "CP_KV(0F0)" and events[1].stream == "cp"


@pytest.mark.timeout(120)
def test_a_run_times_its_ring_and_its_calibration_prices_it() -> None:
    from executor.launch import launch  # noqa: PLC0415 - starts gloo ranks
    from executor.run_costs import calibration_configs, calibration_document  # noqa: PLC0415

    config = run_config("--model", "llama3-8b", "--pp", "1", "--cp", "2", "-m", "2", "--layers", "2",
                        "--backend", "gloo")
    calibrated = launch(calibration_configs(config, 1))
    trace = calibrated[0]["trace"]
    waits = [event for event in trace.events if event.stream == "cp"]
    # 2 layers x 2 microbatches: one wait in each forward (cp - 1 blocks), two in each backward (cp steps)
    assert len(waits) == 2 * 2 * (1 + 2) and {event.kind for event in waits} == {CP_KIND}
    compute = {event.action: event for event in trace.events if event.stream == "compute"}
    for event in waits:
        action = compute[event.action[len(CP_KIND) + 1:-1]]
        assert action.start <= event.start <= event.end <= action.end
    attention = calibrated[0]["attention_seconds"]
    assert set(attention) == {"0F", "0B"} and all(seconds > 0 for seconds in attention.values())
    (entry,) = calibration_document(config, generate("1f1b", 1, 2), calibrated)["stages"]
    assert entry["attention_fwd"] == pytest.approx(attention["0F"] / 2)
    assert entry["attention_bwd"] == pytest.approx(attention["0B"] / 2)
    forwards = [event for event in compute.values() if event.kind == "F"]
    waited = sum(event.duration for event in waits if "F" in event.action)
    assert entry["fwd"] == pytest.approx((sum(event.duration for event in forwards) - waited) / len(forwards))
    # the run's summary counts the waits as cp communication, as the simulator's does
    from executor.report import summary, summary_lines  # noqa: PLC0415

    document = summary(calibrated[0])
    assert document["comm"]["cp"]["total"] == pytest.approx(sum(event.duration for event in waits))
    assert any("cp " in line and "(ring waits)" in line for line in summary_lines(calibrated[0], document))
