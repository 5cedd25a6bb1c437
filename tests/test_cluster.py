"""Cluster model end to end: P2P on files, rank mapping, tp/dp collectives in a step,
the command line's new flags and outputs."""

from __future__ import annotations

import json

import pytest

from pipesim.cli import main
from pipesim.cluster.files import topology_from_dict
from pipesim.cluster.mapping import map_ranks
from pipesim.cluster.presets import ib, nvlink, pcie
from pipesim.cluster.topology import TopologyError, ideal_topology
from pipesim.model.costs import Costs, StageCost, uniform_costs
from pipesim.sim.engine import simulate
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from schedules import generate

FWD, BWD = 1.0, 2.0

# Hand figures of the presets' links (pipesim/cluster/presets.py; DESIGN.md "Reference links"):
# two GPUs of one NVSwitch node meet over two NVLink 4 hops, 450 GB/s at 0.8 efficiency,
# 1.5 us each; two GPUs on one PCIe Gen4 switch over two 31.5 GB/s hops at 0.8.
NVLINK_PAIR_BW, NVLINK_PAIR_LATENCY = 450e9 * 0.8, 2 * 1.5e-6
PCIE_PAIR_BW = 31.5e9 * 0.8


def ring_all_reduce_by_hand(n: int, num_bytes: float, bandwidth: float, latency: float) -> float:
    """nccl-tests PERFORMANCE.md: 2(n-1)/n * S/B + 2(n-1) * alpha."""
    return 2 * (n - 1) / n * num_bytes / bandwidth + 2 * (n - 1) * latency

CHAIN = {  # g0 -> sw -> g1, two hops with different figures
    "devices": [{"name": "g0"}, {"name": "g1"}],
    "switches": [{"name": "sw"}],
    "links": [
        {"src": "g0", "dst": "sw", "bandwidth": 4e9, "latency": 1e-3},
        {"src": "sw", "dst": "g1", "bandwidth": 2e9, "latency": 2e-3},
    ],
}


def test_p2p_over_two_hops_pays_both_latencies_and_the_slowest_bandwidth(tmp_path):
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(CHAIN))
    act_bytes = 1e9
    result = run_simulation(generate("gpipe", 2, 1), uniform_costs(2, FWD, BWD, act_bytes=act_bytes),
                            topology_from_dict(json.loads(path.read_text())))
    sends = [event for event in result.trace.events if event.stream == "send"]
    assert [event.duration for event in sends] == pytest.approx([3e-3 + act_bytes / 2e9] * 2)
    assert result.metrics.makespan == pytest.approx(FWD + BWD + FWD + BWD + 2 * (3e-3 + 0.5))


def test_two_transfers_sharing_a_link_queue_first_come_first_served():
    # stage 0's forwards end at 0.25 and 0.5; each activation holds g0->sw->g1 for 2e9 / 2e9 = 1 s
    costs = uniform_costs(2, 0.25, 0.5, act_bytes=2e9)
    trace = simulate(generate("gpipe", 2, 2), costs, topology_from_dict(CHAIN), rank_devices=["g0", "g1"],
                     p2p="buffered")
    forwards = sorted((event.start, event.end) for event in trace.events if event.kind == "SEND_F")
    assert forwards[0] == pytest.approx((0.25, 0.25 + 1.0 + 3e-3))
    # the second leaves at 0.5 but waits for the first to leave the links at 1.25
    assert forwards[1] == pytest.approx((0.5, 1.25 + 1.0 + 3e-3))


def test_megatron_mapping_keeps_tp_groups_inside_a_node():
    mapping = map_ranks(ib(4), dp=2, pp=4, tp=4)
    for dp in range(2):
        for pp in range(4):
            group = mapping.tp_group(dp, pp)
            assert len({device.split(".")[0] for device in group}) == 1
    assert mapping.tp_group(0, 0) == ["n0.gpu0", "n0.gpu1", "n0.gpu2", "n0.gpu3"]
    assert mapping.dp_group(0, 0) == ["n0.gpu0", "n0.gpu4"]
    assert mapping.pipeline() == ["n0.gpu0", "n1.gpu0", "n2.gpu0", "n3.gpu0"]
    other = map_ranks(ib(4), dp=2, pp=4, tp=4, order="tp-pp-dp")
    assert other.pipeline() == ["n0.gpu0", "n0.gpu4", "n1.gpu0", "n1.gpu4"]
    assert other.dp_group(0, 0) == ["n0.gpu0", "n2.gpu0"]


def test_bad_mapping_and_too_few_devices_are_clear_errors():
    with pytest.raises(TopologyError, match="dp=2 x pp=4 x tp=4 needs 32 devices but topology nvlink has 8"):
        map_ranks(nvlink(), dp=2, pp=4, tp=4)
    with pytest.raises(ValueError, match="--rank-order 'tp-pp' must name tp, dp and pp once each"):
        map_ranks(nvlink(), order="tp-pp")
    with pytest.raises(ValueError, match="--tp must be >= 1"):
        map_ranks(nvlink(), tp=0)
    assert len(map_ranks(ideal_topology(), dp=4, pp=4, tp=8).devices) == 128


def tp_dp_costs(num_stages: int, layers: int = 2, message: float = 64e6, param_bytes: float = 1e9) -> Costs:
    stage = StageCost(fwd=FWD, bwd=BWD, param_bytes=param_bytes, layers=layers, tp_message_bytes=message)
    return Costs(stages=(stage,) * num_stages, step_overhead=0.1)


def test_tp_collectives_follow_each_compute_action_on_a_tp_stream():
    topology = nvlink()
    config = ParallelConfig(dp=1, tp=2)
    result = run_simulation(generate("1f1b", 4, 8), tp_dp_costs(4), topology, parallel=config)
    # two all-reduces per layer, two layers, each over the NVLink pair of the tp group
    per_action = 2 * 2 * ring_all_reduce_by_hand(2, 64e6, NVLINK_PAIR_BW, NVLINK_PAIR_LATENCY)
    tp_events = [event for event in result.trace.events if event.stream == "tp"]
    assert len(tp_events) == 2 * 4 * 8
    assert all(event.duration == pytest.approx(per_action) for event in tp_events)
    # uniform stages, free-ish links: 1F1B's closed form with tp time added to F and B
    optimizer = 0.1
    expected = (8 + 4 - 1) * (FWD + BWD + 2 * per_action) + optimizer
    assert result.metrics.makespan == pytest.approx(expected, rel=1e-3)
    assert result.comm[0]["tp"]["total"] == pytest.approx(16 * per_action)
    assert result.comm[0]["tp"]["exposed"] == pytest.approx(16 * per_action)


@pytest.mark.parametrize("overlap", [True, False])
def test_dp_all_reduce_in_buckets_during_or_after_the_last_backward(overlap):
    topology = ib(2)
    config = ParallelConfig(dp=2, tp=1, overlap_dp=overlap, overlap_slowdown=0.0)  # the bucket rule alone
    costs = tp_dp_costs(4, layers=0, message=0.0)
    result = run_simulation(generate("1f1b", 4, 8), costs, topology, parallel=config)
    # tp-dp-pp order: each stage's two replicas are neighbours in node 0, an NVLink pair.
    # 1 GB in 25 MiB buckets: 38 full ones and a 3.85 MB rest, each paying the ring's
    # 2(n-1) latencies; together the bandwidth term of one 1 GB message.
    bucket, rest = 25 * 2**20, 1e9 - 38 * 25 * 2**20
    assert 0 < rest < bucket
    seconds = 2 * (2 - 1) / 2 * 1e9 / NVLINK_PAIR_BW + 39 * 2 * (2 - 1) * NVLINK_PAIR_LATENCY
    last_bucket = rest / NVLINK_PAIR_BW + 2 * NVLINK_PAIR_LATENCY
    dp_events = [event for event in result.trace.events if event.stream == "dp"]
    # with overlap each bucket fills at its own moment; without, all 39 are full when the
    # rank ends and run back to back: one event per rank
    assert len(dp_events) == (4 * 39 if overlap else 4)
    last_backward = {rank: max((e for e in result.trace.of_rank(rank) if e.kind == "B"), key=lambda e: e.end)
                     for rank in range(4)}
    for rank in range(4):
        mine = sorted((event for event in dp_events if event.rank == rank), key=lambda event: event.start)
        assert sum(event.duration for event in mine) == pytest.approx(seconds)
        backward = last_backward[rank]
        if overlap:  # bucket i is full (i+1)/39-ish of the way through the last backward
            assert mine[0].start == pytest.approx(backward.start + bucket / 1e9 * (backward.end - backward.start))
            assert mine[-1].start == pytest.approx(backward.end)  # the rest fills at the very end
        else:
            assert mine[0].start >= backward.end
    step_end = max(event.end for event in dp_events) + 0.1
    assert result.metrics.makespan == pytest.approx(step_end)
    comm = result.comm
    # with overlap only the last bucket (full when the backward ends) is left exposed on
    # the last rank, which finishes first, less the 3 us its last (empty) send holds the
    # rank until it arrives (rendezvous); without overlap the whole reduction is exposed
    expected_exposed = last_bucket - NVLINK_PAIR_LATENCY if overlap else seconds
    assert comm[3]["dp"]["exposed"] == pytest.approx(expected_exposed)
    assert comm[0]["dp"]["total"] == pytest.approx(seconds)


def test_interleaved_overlap_hides_a_chunk_all_reduce_under_compute():
    topology = ib(2)
    costs = tp_dp_costs(8, layers=0, message=0.0)
    schedule = generate("interleaved-1f1b", 4, 8, 2)
    on = run_simulation(schedule, costs, topology, parallel=ParallelConfig(dp=2, overlap_dp=True))
    off = run_simulation(schedule, costs, topology, parallel=ParallelConfig(dp=2, overlap_dp=False))
    assert on.metrics.makespan < off.metrics.makespan
    assert on.comm[0]["dp"]["exposed"] < on.comm[0]["dp"]["total"]
    exposed_on = sum(rank["dp"]["exposed"] for rank in on.comm)
    exposed_off = sum(rank["dp"]["exposed"] for rank in off.comm)
    assert exposed_on < exposed_off
    assert exposed_off == pytest.approx(sum(rank["dp"]["total"] for rank in off.comm))


# Replica 0 of pipeline rank 0 is g0 and replica 1 is g1 (tp-dp-pp order); their only
# shortest route crosses a fast and a slow hop. Pipeline rank 1's replicas g2, g3 share one link.
DP_PAIRS = {
    "devices": [{"name": f"g{index}"} for index in range(4)],
    "switches": [{"name": "sw"}],
    "links": [
        {"src": "g0", "dst": "sw", "bandwidth": 4e9, "latency": 1e-3},
        {"src": "sw", "dst": "g1", "bandwidth": 1e9, "latency": 2e-3},
        {"src": "g2", "dst": "g3", "bandwidth": 8e9, "latency": 1e-3},
        {"src": "g0", "dst": "g2", "bandwidth": 100e9, "latency": 5e-3},
        {"src": "g1", "dst": "g3", "bandwidth": 100e9, "latency": 5e-3},
    ],
}


def test_dp_all_reduce_of_a_stage_is_the_ring_formula_on_its_groups_slowest_link():
    param_bytes = 1e8
    costs = tp_dp_costs(2, layers=0, message=0.0, param_bytes=param_bytes)
    config = ParallelConfig(dp=2, bucket_bytes=1e9)  # one bucket: one latency term
    result = run_simulation(generate("1f1b", 2, 2), costs, topology_from_dict(DP_PAIRS), parallel=config)
    seconds = {event.stage: event.duration for event in result.trace.events if event.stream == "dp"}
    n = 2
    # ring all-reduce 2(n-1)/n * S/B + 2(n-1) * alpha; B the slowest hop, alpha the route's latency
    assert seconds[0] == pytest.approx(2 * (n - 1) / n * param_bytes / 1e9 + 2 * (n - 1) * 3e-3)
    assert seconds[1] == pytest.approx(2 * (n - 1) / n * param_bytes / 8e9 + 2 * (n - 1) * 1e-3)


def test_tp_collectives_on_pcie_cost_more_than_on_nvlink_by_the_bandwidth_ratio():
    message = 4e9  # large enough that the microsecond latencies do not matter
    costs = tp_dp_costs(2, layers=1, message=message, param_bytes=0.0)
    per_topology = {}
    # a tp pair is two GPUs on one NVSwitch (nvlink) or on one PCIe switch (pcie)
    for topology, bandwidth in ((nvlink(), NVLINK_PAIR_BW), (pcie(), PCIE_PAIR_BW)):
        result = run_simulation(generate("1f1b", 2, 2), costs, topology, parallel=ParallelConfig(tp=2))
        durations = {event.duration for event in result.trace.events if event.stream == "tp"}
        assert len(durations) == 1 or max(durations) == pytest.approx(min(durations))
        per_topology[topology.name] = (max(durations), bandwidth)
    (nv_seconds, nv_bandwidth), (pcie_seconds, pcie_bandwidth) = per_topology["nvlink"], per_topology["pcie"]
    assert pcie_seconds > nv_seconds
    assert pcie_seconds / nv_seconds == pytest.approx(nv_bandwidth / pcie_bandwidth, rel=1e-3)


def test_simulate_model_on_a_cluster_writes_the_new_json_fields(tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(["simulate", "--model", "gpt3-13b", "--seq-len", "2048", "--microbatch-size", "1", "--pp", "4",
                 "--dp", "2", "--tp", "4", "--topology", "ib", "--nodes", "4", "--json", str(out)])
    assert code == 0
    document = json.loads(out.read_text())
    assert document["dp"] == 2 and document["tp"] == 4 and document["oom"] is False
    assert len(document["comm"]) == 4
    assert set(document["comm"][0]) == {"p2p", "dp", "tp"}
    assert document["comm"][0]["tp"]["total"] > 0 and document["comm"][0]["dp"]["total"] > 0
    assert all(rank["peak_memory_bytes"] > 0 for rank in document["ranks"])
    summary = capsys.readouterr().out
    assert "collectives (total / exposed" in summary and "peak mem" in summary


def test_simulate_errors_for_impossible_plans(capsys):
    assert main(["simulate", "--model", "gpt3-13b", "--pp", "4", "--dp", "2", "--tp", "4", "--topology", "nvlink"]) == 2
    assert "needs 32 devices but topology nvlink has 8" in capsys.readouterr().err
    assert main(["simulate", "--model", "gpt3-1.3b", "--pp", "4", "--layers-per-stage", "6,6,6,5"]) == 2
    assert "sums to 23 but the model has 24 layers" in capsys.readouterr().err


def test_topology_show_prints_and_draws(tmp_path, capsys):
    html = tmp_path / "ib.html"
    assert main(["topology", "show", "ib", "--nodes", "2", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "topology ib: 16 devices" in out and "ib_switch" in out
    text = html.read_text()
    assert "plotly" in text and "n1.gpu7" in text


@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (2, 1)])
def test_other_shards_and_replicas_share_a_pcie_switch_with_the_simulated_pipeline(dp, tp):
    # pcie, tp-dp-pp order: pipeline rank 0 is gpu0 (+ gpu1 as its second shard or
    # replica), rank 1 is gpu2 (+ gpu3). gpu0 -> gpu2 and gpu1 -> gpu3 both climb
    # pcie_switch0 -> cpu0 -> pcie_switch1: four 1 us hops at 31.5 GB/s x 0.8. Sent at
    # the same moment, the second transfer waits for the first on the shared links
    # (first come, first served), so the stage's data is complete after 2 S / B.
    act_bytes = 1e9
    bandwidth, latency = PCIE_PAIR_BW, 4e-6
    costs = Costs(stages=(StageCost(fwd=FWD, bwd=BWD, act_bytes=act_bytes),) * 2)
    result = run_simulation(generate("gpipe", 2, 1), costs, pcie(), parallel=ParallelConfig(dp=dp, tp=tp))
    hop = latency + 2 * act_bytes / bandwidth
    assert result.metrics.makespan == pytest.approx(2 * (FWD + BWD) + 2 * hop)
    alone = run_simulation(generate("gpipe", 2, 1), costs, pcie())
    assert alone.metrics.makespan == pytest.approx(2 * (FWD + BWD) + 2 * (latency + act_bytes / bandwidth))
    # the wait beyond the simulated pipeline's own transfer is exposed communication
    assert result.metrics.ranks[0].exposed_comm == pytest.approx(hop)


def test_shards_on_nvswitch_have_links_of_their_own():
    # every GPU has its own link into the NVSwitch: tp=2 changes no P2P time
    costs = Costs(stages=(StageCost(fwd=FWD, bwd=BWD, act_bytes=1e9),) * 2)
    shards = run_simulation(generate("gpipe", 2, 1), costs, nvlink(), parallel=ParallelConfig(tp=2))
    alone = run_simulation(generate("gpipe", 2, 1), costs, nvlink())
    assert shards.metrics.makespan == pytest.approx(alone.metrics.makespan)
    assert alone.metrics.makespan == pytest.approx(2 * (FWD + BWD) + 2 * (NVLINK_PAIR_LATENCY + 1e9 / NVLINK_PAIR_BW))


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp", "dp-pp-tp", "pp-tp-dp"])
def test_a_dp_group_is_every_replicas_device_of_that_shard(order):
    # read off with the dp stride: the same as asking each replica (dp 3, pp 2, tp 2 on 12 GPUs)
    mapping = map_ranks(ib(2), dp=3, pp=2, tp=2, order=order)
    for stage in range(2):
        for shard in range(2):
            assert mapping.dp_group(stage, shard) == [mapping.device(replica, stage, shard) for replica in range(3)]
