"""The simulator against closed forms: makespans, in-flight peaks and link costs."""

from __future__ import annotations

import json

import pytest

from pipesim.cluster.files import TopologyError, load_topology, topology_from_dict
from pipesim.cluster.presets import ib, nvlink, pcie
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import CostsError, load_costs, uniform_costs
from pipesim.sim.engine import simulate, transfer_wires
from pipesim.sim.parallel import CommPlan
from pipesim.sim.step import run_simulation
from schedules import generate, lower, step_metrics

FWD, BWD = 1.0, 2.0


def simulate_ideal(name: str, pp: int, microbatches: int, virtual_stages: int = 1):
    schedule = generate(name, pp, microbatches, virtual_stages)
    costs = uniform_costs(schedule.num_stages, FWD, BWD, virtual_stages=virtual_stages)
    return step_metrics(simulate(schedule, costs, ideal_topology()), virtual_stages)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,microbatches", [(1, 1), (2, 1), (2, 5), (4, 8), (4, 3), (8, 32), (5, 7)])
def test_gpipe_and_1f1b_makespan_is_closed_form(name, pp, microbatches):
    metrics = simulate_ideal(name, pp, microbatches)
    assert metrics.makespan == pytest.approx((microbatches + pp - 1) * (FWD + BWD), rel=1e-12)
    expected_bubble = (pp - 1) / (microbatches + pp - 1)
    assert metrics.bubble_fraction == pytest.approx(expected_bubble, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("pp,microbatches,chunks", [(2, 2, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2), (4, 4, 3)])
def test_interleaved_makespan_is_closed_form(pp, microbatches, chunks):
    metrics = simulate_ideal("interleaved-1f1b", pp, microbatches, chunks)
    expected = microbatches * (FWD + BWD) + (pp - 1) * (FWD + BWD) / chunks
    assert metrics.makespan == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("pp,microbatches", [(4, 8), (4, 4), (8, 17), (3, 30)])
def test_peak_inflight_rank0_gpipe_is_m_and_1f1b_is_p(pp, microbatches):
    assert simulate_ideal("gpipe", pp, microbatches).ranks[0].peak_inflight_microbatches == microbatches
    one_f_one_b = simulate_ideal("1f1b", pp, microbatches)
    assert one_f_one_b.ranks[0].peak_inflight_microbatches == pp
    # and the last rank holds only one microbatch at a time
    assert one_f_one_b.ranks[-1].peak_inflight_microbatches == 1


def test_busy_and_idle_add_up_to_makespan():
    metrics = simulate_ideal("1f1b", 4, 8)
    for rank in metrics.ranks:
        assert rank.busy == pytest.approx(8 * (FWD + BWD))
        assert rank.busy + rank.idle == pytest.approx(metrics.makespan)


TWO_DEVICES = {
    "devices": [{"name": "g0", "memory_bytes": 80e9}, {"name": "g1", "memory_bytes": 80e9}],
    "links": [{"src": "g0", "dst": "g1", "bandwidth": 10e9, "latency": 1e-3}],
}


def test_p2p_transfer_costs_latency_plus_bytes_over_bandwidth():
    topology = topology_from_dict(TWO_DEVICES)
    act_bytes = 5e9  # 0.5 s on the wire
    schedule = generate("gpipe", 2, 1)
    costs = uniform_costs(2, FWD, BWD, act_bytes=act_bytes)
    trace = simulate(schedule, costs, topology)
    hop = 1e-3 + act_bytes / 10e9
    assert step_metrics(trace).makespan == pytest.approx(2 * (FWD + BWD) + 2 * hop, rel=1e-12)
    sends = [event for event in trace.events if event.stream == "send"]
    assert [event.duration for event in sends] == pytest.approx([hop, hop])


def test_multi_hop_route_sums_latency_and_takes_slowest_bandwidth():
    topology = topology_from_dict({
        "devices": [{"name": "a"}, {"name": "b"}],
        "switches": [{"name": "sw"}],
        "links": [
            {"src": "a", "dst": "sw", "bandwidth": 20e9, "latency": 2e-6, "efficiency": 0.5},
            {"src": "sw", "dst": "b", "bandwidth": 40e9, "latency": 3e-6},
        ],
    })
    route = topology.route("a", "b")
    assert route.links == (("a", "sw"), ("sw", "b"))
    assert route.latency == pytest.approx(5e-6)
    assert route.bandwidth == pytest.approx(10e9)
    assert route.seconds(1e9) == pytest.approx(5e-6 + 0.1)


def test_two_transfers_over_one_link_are_served_first_come_first_served():
    topology = topology_from_dict({
        "devices": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
        "switches": [{"name": "sw"}],
        "links": [
            {"src": "a", "dst": "sw", "bandwidth": 1e9, "latency": 1e-6},
            {"src": "b", "dst": "sw", "bandwidth": 1e9, "latency": 1e-6},
            {"src": "sw", "dst": "c", "bandwidth": 1e9, "latency": 1e-6},
        ],
    })
    # free compute: both microbatches' activations leave a at 0 and queue on a->sw->c
    costs = uniform_costs(2, 0.0, 0.0, act_bytes=1e9)
    trace = simulate(generate("gpipe", 2, 2), costs, topology, rank_devices=["a", "c"], p2p="buffered")
    forwards = {event.microbatch: event.start for event in trace.events if event.action in ("1F0", "1F1")}
    assert forwards[0] == pytest.approx(1.0 + 2e-6)
    assert forwards[1] == pytest.approx(2.0 + 2e-6)  # the second waited for the link
    # the gradients go back c->sw->a, links of their own: each only waits for its own data
    sends = sorted((event.start, event.end) for event in trace.events if event.kind == "SEND_B")
    assert sends[0][1] - sends[0][0] == pytest.approx(1.0 + 2e-6)
    # the same send of another pipeline (b -> c) shares sw->c: the data is there when both are
    wires = transfer_wires(lower(generate("gpipe", 2, 1)), costs, topology, ["a", "c"], {("a", "c"): [("b", "c")]})
    (own_links, _, _), (twin_links, _, _) = wires[0]
    assert set(own_links) & set(twin_links)  # sw->c, numbered once
    shared = simulate(generate("gpipe", 2, 1), costs, topology, rank_devices=["a", "c"], p2p="buffered",
                      plan=CommPlan(twin_transfers={("a", "c"): [("b", "c")]}))
    assert next(event.start for event in shared.events if event.action == "1F0") == pytest.approx(2.0 + 2e-6)


def test_1f1b_on_pcie_is_slower_than_nvlink_with_large_activations_and_equal_with_tiny():
    def step_time(topology, act_bytes):
        schedule = generate("1f1b", 4, 8)
        costs = uniform_costs(4, 1e-3, 2e-3, act_bytes=act_bytes)
        return run_simulation(schedule, costs, topology).metrics.makespan

    assert step_time(pcie(), 256e6) > 1.2 * step_time(nvlink(), 256e6)
    assert step_time(pcie(), 1.0) == pytest.approx(step_time(nvlink(), 1.0), rel=1e-3)


def test_receive_wait_splits_into_bubble_then_exposed_communication():
    topology = topology_from_dict(TWO_DEVICES)
    trace = simulate(generate("gpipe", 2, 1), uniform_costs(2, FWD, BWD, act_bytes=5e9), topology)
    metrics = step_metrics(trace)
    hop = 1e-3 + 0.5
    # rank 1 waits F for rank 0's forward (bubble), then one hop with the data in flight;
    # after its backward it cannot end its step before its gradient has arrived (one
    # more hop in flight, rendezvous), then idles while rank 0 runs B.
    assert metrics.ranks[1].exposed_comm == pytest.approx(2 * hop)
    assert metrics.ranks[1].bubble == pytest.approx(FWD + BWD)
    # rank 0 waits for the hop out, rank 1's F and B (bubble), then the hop back (exposed)
    assert metrics.ranks[0].bubble == pytest.approx(hop + FWD + BWD)
    assert metrics.ranks[0].exposed_comm == pytest.approx(hop)


@pytest.mark.parametrize("p2p", ["rendezvous", "buffered"])
def test_trace_holds_every_lowered_action_once(p2p):
    schedule = lower(generate("interleaved-1f1b", 4, 8, 2))
    trace = simulate(schedule, uniform_costs(8, FWD, BWD, virtual_stages=2), nvlink(), p2p=p2p)
    for rank, program in enumerate(schedule.programs):
        actions = sorted(event.action for event in trace.of_rank(rank) if event.stream != "wait")
        assert actions == sorted(str(action) for action in program)


def test_costs_file_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "costs.yaml"
    yaml_file.write_text("stages:\n  - {fwd: 1.0, bwd: 2.0, act_bytes: 10}\n  - {fwd: 3.0, bwd: 4.0, wgrad: 1.0}\n")
    costs = load_costs(yaml_file, 2)
    assert [stage.fwd for stage in costs.stages] == [1.0, 3.0]
    json_file = tmp_path / "costs.json"
    json_file.write_text(json.dumps({"stages": [{"fwd": 1, "bwd": 2}], "action_overhead": 0.5}))
    costs = load_costs(json_file, 3)
    assert costs.num_stages == 3 and costs.action_overhead == 0.5
    metrics = step_metrics(simulate(generate("1f1b", 3, 2), costs, ideal_topology()))
    assert metrics.makespan == pytest.approx((2 + 3 - 1) * (1 + 2 + 2 * 0.5))


def test_costs_file_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stages": [{"fwd": 1}]}))
    with pytest.raises(CostsError, match=r"stages\[0\] is missing \['bwd'\]"):
        load_costs(bad)
    bad.write_text(json.dumps({"stages": [{"fwd": 1, "bwd": 1}, {"fwd": 1, "bwd": 1}]}))
    with pytest.raises(CostsError, match="2 stages but the schedule has 4"):
        load_costs(bad, 4)
    with pytest.raises(CostsError, match="cannot exceed"):
        uniform_costs(2, 1.0, 1.0, wgrad=2.0)


@pytest.mark.parametrize(
    "data,message",
    [
        ({"devices": [{"name": "g0"}], "links": [{"src": "g0", "dst": "gX", "bandwidth": 1, "latency": 0}]},
         "unknown device or switch 'gX'"),
        ({"devices": [{"name": "g0"}, {"name": "g1"}], "links": [{"src": "g0", "dst": "g1", "latency": 0}]},
         r"links\[0\] is missing 'bandwidth'"),
        ({"devices": [{"name": "g0"}, {"name": "g1"}],
          "links": [{"src": "g0", "dst": "g1", "bandwidth": -5, "latency": 0}]},
         "'bandwidth' must be > 0"),
        ({"devices": [{"name": "g0"}, {"name": "g1"}, {"name": "g2"}],
          "links": [{"src": "g0", "dst": "g1", "bandwidth": 1, "latency": 0}]},
         "'g2' is not connected"),
        ({"devices": [{"name": "g0"}, {"name": "g1"}],
          "links": [{"src": "g0", "dst": "g1", "bandwidth": 1, "latency": 0, "directed": True}]},
         "not connected .* in both directions"),
    ],
)
def test_bad_topology_files_are_rejected_clearly(data, message):
    with pytest.raises(TopologyError, match=message):
        topology_from_dict(data)


def test_topology_file_and_presets_load(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(
        "devices: [{name: g0, memory_bytes: 80e9}, {name: g1, memory_bytes: 80e9}]\n"
        "links:   [{src: g0, dst: g1, bandwidth: 10e9, latency: 1e-3}]\n"
    )
    topology = load_topology(str(path))
    assert topology.devices == ["g0", "g1"]
    assert topology.route("g1", "g0").seconds(10e9) == pytest.approx(1.001)
    assert len(load_topology("ib", 3).devices) == 24
    with pytest.raises(TopologyError, match="unknown topology 'nvlinc'"):
        load_topology("nvlinc")


def test_too_few_devices_is_an_error_naming_a_fix():
    with pytest.raises(TopologyError, match="has 8 devices but the plan needs 16.*--topology ib --nodes 2"):
        simulate(generate("1f1b", 16, 16), uniform_costs(16, 1, 2), nvlink())
    assert len(ib(2).devices) == 16
