"""Expert parallelism: which devices form each ep group (Megatron-Core's expert ranks cut
from the dp x cp ranks), the all-to-all's cost on the modelled links (nccl-tests' bus
bandwidth on a switch, a network port's pace across nodes, contention between groups),
experts and their optimizer state split over ep, the routed GEMMs of a rank's experts,
the all-to-alls in a step, DualPipeV's overlapped pairs hiding them, and the errors."""

from __future__ import annotations

import pytest

from pipesim.cluster.collectives import all_to_all
from pipesim.cluster.mapping import map_ranks, parse_rank_order
from pipesim.cluster.presets import ib, nvlink, pcie
from pipesim.cluster.topology import ideal_topology
from pipesim.model.costs import Costs, StageCost
from pipesim.model.errors import ModelSpecError
from pipesim.model.layout import check_layout
from pipesim.model.operations import layer_operations
from pipesim.model.spec import model_spec
from pipesim.model.transformer_costs import model_costs
from pipesim.sim.parallel import ParallelConfig
from pipesim.sim.step import run_simulation
from schedules.generators import generate
from tests.cli_runs import assert_one_line_error, simulate_json

NVLINK_BW = 450e9 * 0.8  # H100 NVSwitch port x efficiency
NVLINK_PAIR_LATENCY = 2 * 1.5e-6  # GPU -> NVSwitch -> GPU
IB_PORT_BW = 50e9 * 0.9  # NDR port x efficiency: the slowest link of an inter-node route
IB_PAIR_LATENCY = 1e-6 + 2.5e-6 + 2.5e-6 + 1e-6  # GPU -> NIC -> switch -> NIC -> GPU
PCIE_BW = 31.5e9 * 0.8


# --- which devices form each group -------------------------------------------------------

def test_ep_groups_are_runs_of_the_dp_x_cp_ranks_as_megatron_core_numbers_them():
    # 16 GPUs on two nodes, tp 2, cp 2, dp 2, pp 2, order tp-cp-dp-pp:
    # global rank = tp + 2 cp + 4 dp + 8 pp, device n{rank // 8}.gpu{rank % 8}
    mapping = map_ranks(ib(2), dp=2, pp=2, tp=2, cp=2, ep=2)
    assert mapping.order == ("tp", "cp", "dp", "pp")
    assert mapping.pipeline() == ["n0.gpu0", "n1.gpu0"]
    assert mapping.cp_group(0, 0, 0) == ["n0.gpu0", "n0.gpu2"]
    assert mapping.tp_group(0, 0) == ["n0.gpu0", "n0.gpu1"]
    # the ranks holding pipeline rank 0's shard 0: ranks 0, 2 (cp), 4, 6 (dp)
    assert mapping.dp_cp_group(0, 0) == ["n0.gpu0", "n0.gpu2", "n0.gpu4", "n0.gpu6"]
    assert mapping.dp_group(0, 0) == ["n0.gpu0", "n0.gpu4"]
    # expert ranks: tp innermost, then ep, then expert dp (Megatron-Core's expert rank generator)
    assert mapping.ep_groups(0, 0) == [["n0.gpu0", "n0.gpu2"], ["n0.gpu4", "n0.gpu6"]]
    assert mapping.ep_groups(1, 1) == [["n1.gpu1", "n1.gpu3"], ["n1.gpu5", "n1.gpu7"]]
    assert mapping.ep_group(0, 0) == ["n0.gpu0", "n0.gpu2"]
    assert mapping.expert_dp_group(0, 0) == ["n0.gpu0", "n0.gpu4"]
    # every pipeline of the job, the simulated one first
    pipelines = mapping.pipelines()
    assert len(pipelines) == 8 and pipelines[0] == ["n0.gpu0", "n1.gpu0"]
    assert sorted(device for pipeline in pipelines for device in pipeline) == sorted(mapping.devices)


def test_an_ep_group_crosses_nodes_when_the_replicas_do():
    # tp 8 fills a node: replicas 0 and 1 of pipeline rank 0 are n0.gpu0 and n1.gpu0
    mapping = map_ranks(ib(2), dp=2, pp=1, tp=8, ep=2)
    assert mapping.ep_group(0, 0) == ["n0.gpu0", "n1.gpu0"]
    assert mapping.ep_groups(0, 3) == [["n0.gpu3", "n1.gpu3"]]
    assert mapping.expert_dp_group(0, 0) == ["n0.gpu0"]  # ep = dp x cp: every rank holds its own experts


def test_rank_orders_place_cp_outside_tp_unless_named():
    assert parse_rank_order("tp-dp-pp") == ("tp", "cp", "dp", "pp")
    assert parse_rank_order("tp-pp-dp") == ("tp", "cp", "pp", "dp")
    assert parse_rank_order("tp-cp-ep-dp-pp") == ("tp", "cp", "dp", "pp")  # Megatron-Core's default spelling
    assert parse_rank_order("cp-tp-dp-pp") == ("cp", "tp", "dp", "pp")
    mapping = map_ranks(ideal_topology(), dp=2, pp=1, tp=2, cp=2, order="cp-tp-dp-pp")
    assert mapping.cp_group(0, 0, 0) == ["gpu0", "gpu1"] and mapping.tp_group(0, 0) == ["gpu0", "gpu2"]
    with pytest.raises(ValueError, match=r"^--rank-order 'tp-ep-cp-dp-pp': ep goes right inside dp"):
        parse_rank_order("tp-ep-cp-dp-pp")


def test_ep_must_cut_the_dp_x_cp_ranks_into_groups():
    with pytest.raises(ValueError, match=r"^--ep 3 must divide the dp x cp = 4 ranks that hold each dense shard "
                                         r".*: use one of 1, 2, 4, or raise --dp$"):
        map_ranks(ideal_topology(), dp=2, cp=2, ep=3)


# --- the all-to-all ----------------------------------------------------------------------

def test_all_to_all_inside_an_nvswitch_node_is_the_nccl_tests_formula():
    """Each GPU's port carries the n-1 pieces of S/n it sends: (n-1)/n S/B + alpha, the
    (n-1)/n bus-bandwidth factor of nccl-tests' AlltoAllGetBw."""
    topology = nvlink()
    size = 1e9
    assert all_to_all(topology, topology.devices, size) == pytest.approx(7 / 8 * size / NVLINK_BW
                                                                          + NVLINK_PAIR_LATENCY)
    assert all_to_all(topology, topology.devices[:4], size) == pytest.approx(3 / 4 * size / NVLINK_BW
                                                                              + NVLINK_PAIR_LATENCY)
    assert all_to_all(topology, topology.devices[:1], size) == 0.0
    assert all_to_all(ideal_topology(8), [f"gpu{index}" for index in range(8)], size) == 0.0


def test_all_to_all_across_two_nodes_runs_at_the_network_port():
    """16 GPUs on two rail-optimised nodes: a GPU sends 7 pieces of S/16 over NVLink and 8
    through its own NIC, so its port carries S/2 at 45 GB/s, the bottleneck (NVLink's 7/16 S
    at 360 GB/s is 6x faster). A ring-paced (n-1)/n S/B would say 15/16 S at 45 GB/s."""
    topology = ib(2)
    size = 1e9
    assert all_to_all(topology, topology.devices, size) == pytest.approx(size / 2 / IB_PORT_BW + IB_PAIR_LATENCY)
    # two GPUs on two nodes: each sends its other half over the network
    assert all_to_all(topology, ["n0.gpu0", "n1.gpu0"], size) == pytest.approx(size / 2 / IB_PORT_BW
                                                                                + IB_PAIR_LATENCY)


def test_groups_exchanging_at_once_share_the_links_they_cross():
    """pcie: gpu0, gpu1 behind switch 0 and gpu2, gpu3 behind switch 1 of socket 0. The ep
    groups [gpu0, gpu2] and [gpu1, gpu3] both cross switch0 -> cpu0 -> switch1: alone a group
    sends S/2 each way over it, together S."""
    topology = pcie()
    size = 1e9
    latency = 4 * 1e-6  # GPU -> switch -> CPU -> switch -> GPU
    alone = all_to_all(topology, ["gpu0", "gpu2"], size)
    together = all_to_all(topology, ["gpu0", "gpu2"], size, concurrent=[["gpu1", "gpu3"]])
    assert alone == pytest.approx(size / 2 / PCIE_BW + latency)
    assert together == pytest.approx(size / PCIE_BW + latency)
    # groups that share no link change nothing: NVSwitch gives every GPU its own port
    nv = nvlink()
    assert all_to_all(nv, nv.devices[:4], size, concurrent=[nv.devices[4:]]) == pytest.approx(
        all_to_all(nv, nv.devices[:4], size))


# --- the model on an ep rank -------------------------------------------------------------

def test_each_ep_rank_holds_its_share_of_the_experts_whole_numbers():
    """Mixtral on ep 8: one of the 8 experts (3 x 4096 x 14336) per rank, beside the
    attention (4096 x 4096 x 2 + 4096 x 1024 x 2), the router (4096 x 8) and two RMSNorms."""
    spec = model_spec("mixtral-8x7b")
    h, f = 4096, 14336
    attention = 2 * h * h + 2 * h * 1024
    expert = 3 * h * f
    assert spec.layer_params(0, tp=1, ep=8) == attention + h * 8 + expert + 2 * h
    assert spec.layer_params(0, tp=1, ep=2) == attention + h * 8 + 4 * expert + 2 * h
    assert spec.layer_params(0, tp=2, ep=4) == attention // 2 + h * 8 + 2 * expert // 2 + 2 * h
    costs = model_costs(spec, 4, [1e15] * 4, ep=8)
    for stage in costs.stages:
        assert stage.moe_layers == 8 and stage.expert_params == 8 * expert


def test_a_rank_runs_its_experts_as_fewer_taller_gemms():
    """DeepSeek-V3 at 4096 tokens: without ep each of 256 experts gets 8 x 4096 / 256 = 128
    rows; on ep 64 a rank holds 4 experts, each fed by the 64 ranks of its group:
    8 x 4096 x 64 / 256 = 8192 rows (the same 32,768 routed rows per rank)."""
    spec = model_spec("deepseek-v3")
    moe_layer = 3
    alone = {op.name: op for op in layer_operations(spec, tp=1, layer=moe_layer)}
    spread = {op.name: op for op in layer_operations(spec, tp=1, layer=moe_layer, ep=64)}
    assert (alone["expert_in"].count, alone["expert_in"].m) == (256, 128)
    assert (spread["expert_in"].count, spread["expert_in"].m) == (4, 8192)
    assert (spread["expert_in"].k, spread["expert_in"].n) == (7168, 2 * 2048)
    assert spread["expert_out"].count * spread["expert_out"].m == alone["expert_out"].count * alone["expert_out"].m
    # dense layers and the shared expert are untouched
    assert spread["shared_expert_in"] == alone["shared_expert_in"]


def test_ep_shards_the_experts_optimizer_state_over_the_expert_data_parallel_group():
    """Mixtral, pp 4 x dp 4 on two nodes, ep 4, ZeRO-1, 2 + 2 + 12 bytes per parameter: a
    stage's dense parameters keep their optimizer state / dp = / 4, its experts' (2 of 8
    per rank, held by no other rank) / (dp / ep) = / 1."""
    job_args = ["--model", "mixtral-8x7b", "--pp", "4", "-m", "4", "--dp", "4", "--ep", "4", "--zero", "1",
                "--topology", "ib", "--nodes", "2"]
    document = simulate_json(job_args)
    stage = document["stage_costs"][1]  # a middle stage: 8 layers, no embedding or head
    experts, params = stage["expert_params"], stage["params"]
    assert experts == 8 * 2 * 3 * 4096 * 14336
    expected = (params - experts) * (2 + 2 + 12 / 4) + experts * (2 + 2 + 12 / 1)
    assert document["ranks"][1]["memory"]["static_bytes"] == pytest.approx(expected)


# --- the all-to-alls in a step -----------------------------------------------------------

A2A_BYTES = 72e6  # one rank's routed copies: 3/4 of it leaves over its NVSwitch port


def _a2a_seconds() -> float:
    return 3 / 4 * A2A_BYTES / NVLINK_BW + NVLINK_PAIR_LATENCY  # ep 4 inside one node


def _moe_costs(num_stages: int, fwd: float, bwd: float, overlap_fb: float = 0.0) -> Costs:
    stage = StageCost(fwd=fwd, bwd=bwd, moe_layers=2, dispatch_bytes=A2A_BYTES, overlap_fb=overlap_fb)
    return Costs(stages=(stage,) * num_stages)


def test_each_moe_layer_dispatches_and_combines_in_its_forward_and_its_backward():
    """pp 2, dp 4, ep 4 on one node (pipeline rank 0 on gpu0-3, rank 1 on gpu4-7): a stage of
    2 MoE layers holds its rank 2 x 2 all-to-alls after every forward and every backward."""
    result = run_simulation(generate("1f1b", 2, 2), _moe_costs(2, 1e-3, 2e-3), nvlink(),
                            parallel=ParallelConfig(dp=4, ep=4))
    held = [event for event in result.trace.events if event.stream == "ep"]
    assert len(held) == 2 * 2 * 2  # stages x microbatches x (F, B)
    for event in held:
        assert event.duration == pytest.approx(4 * _a2a_seconds())
        assert event.kind == "ALLTOALL_EP"
    for rank in result.metrics.ranks:
        assert rank.ep == pytest.approx(2 * 2 * 4 * _a2a_seconds())
        assert rank.time().total == pytest.approx(result.metrics.makespan)
    assert result.comm[0]["ep"]["total"] == pytest.approx(2 * 2 * 4 * _a2a_seconds())


def test_dualpipev_pairs_hide_each_halfs_all_to_all_under_the_other_halfs_compute():
    """DualPipeV, pp 2, m 4: F = 0.2 ms, B = 0.4 ms, each half's all-to-alls A = 4 x 153 us
    = 612 us. An overlapped pair (F of one chunk, B of the other) costs C_F + C_B +
    max(0, A_F - C_B) + max(0, A_B - C_F): 0.2 + 0.4 + 0.212 + 0.412 ms, its uncovered
    all-to-all holding the rank after the pair; actions alone keep theirs."""
    fwd, bwd = 0.2e-3, 0.4e-3
    schedule = generate("dualpipev", 2, 4, 2)
    result = run_simulation(schedule, _moe_costs(4, fwd, bwd), nvlink(), parallel=ParallelConfig(dp=4, ep=4))
    a2a = 4 * _a2a_seconds()
    uncovered = max(0.0, a2a - bwd) + max(0.0, a2a - fwd)
    paired = {tuple(action) for rank in range(2) for pair in result.schedule.fused_pairs(rank) for action in pair}
    assert paired
    events = {(event.rank, event.action): event for event in result.trace.events}
    for event in result.trace.events:
        if event.stream != "compute":
            continue
        key = (event.stage, event.kind, event.microbatch)
        held = events.get((event.rank, f"ALLTOALL_EP({event.stage}{event.kind}{event.microbatch})"))
        alone = {"F": fwd, "B": bwd, "I": bwd}.get(event.kind, 0.0)  # no wgrad given: W = 0
        assert event.duration == pytest.approx(alone)  # overlapping hides communication, not compute
        if key in paired and event.kind == "F":
            assert held is None
        elif key in paired:
            assert held.duration == pytest.approx(uncovered)
            assert held.start == pytest.approx(event.end)
        elif event.kind in ("F", "B", "I"):
            assert held.duration == pytest.approx(a2a)


def test_a_measured_pair_cost_keeps_its_all_to_alls_inside():
    fwd, bwd = 0.2e-3, 0.4e-3
    result = run_simulation(generate("dualpipev", 2, 4, 2), _moe_costs(4, fwd, bwd, overlap_fb=0.5e-3), nvlink(),
                            parallel=ParallelConfig(dp=4, ep=4))
    paired = {tuple(action) for rank in range(2) for pair in result.schedule.fused_pairs(rank) for action in pair}
    held = {event.action for event in result.trace.events if event.stream == "ep"}
    assert held and not held & {f"ALLTOALL_EP({stage}{kind}{microbatch})" for stage, kind, microbatch in paired}
    pair_seconds = [event.duration for event in result.trace.events
                    if event.stream == "compute" and (event.stage, event.kind, event.microbatch) in paired]
    assert sum(pair_seconds) == pytest.approx(len(pair_seconds) / 2 * 0.5e-3)


def test_mixtral_on_ep_8_inside_a_node_pays_its_all_to_alls_per_layer():
    """Mixtral, pp 4 x dp 8 on 4 nodes, ep 8: each ep group is one node (the 8 replicas of a
    pipeline rank, tp 1). Per MoE layer a rank dispatches 2 x 8192 tokens of 4096 x 2 bytes
    = 134 MB: (7/8) x 134 MB / 360 GB/s + 3 us per all-to-all, 4 per layer and microbatch."""
    document = simulate_json(["--model", "mixtral-8x7b", "--pp", "4", "-m", "4", "--dp", "8", "--ep", "8",
                              "--topology", "ib", "--nodes", "4"])
    dispatch = 2 * 8192 * 4096 * 2
    assert document["stage_costs"][0]["dispatch_bytes"] == dispatch
    one = 7 / 8 * dispatch / NVLINK_BW + NVLINK_PAIR_LATENCY
    assert document["ranks"][0]["ep"] == pytest.approx(4 * 8 * 4 * one)  # microbatches x layers x all-to-alls
    assert document["ep"] == 8 and document["comm"][0]["ep"]["total"] == pytest.approx(4 * 8 * 4 * one)


# --- errors, before any work ---------------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["--model", "llama3-8b", "--dp", "8", "--ep", "8"],
     "--ep 8: llama3-8b has no routed experts to place (expert parallelism needs a mixture-of-experts model)"),
    (["--model", "mixtral-8x7b", "--dp", "3", "--ep", "3"],
     "--ep 3 does not divide the 8 routed experts of mixtral-8x7b: use one of 1, 2, 4, 8"),
    (["--model", "mixtral-8x7b", "--dp", "2", "--ep", "4"],
     "--ep 4 must divide the dp x cp = 2 ranks that hold each dense shard"),
    (["--fwd", "1e-3", "--dp", "4", "--ep", "4"], "--ep 4 needs --model"),
    (["--model", "mixtral-8x7b", "--dp", "4", "--ep", "4", "--tp", "2"],
     "--ep 4 with --tp 2 needs --sequence-parallel"),
    (["--model", "mixtral-8x7b", "--ep", "0"], "--ep must be a whole number >= 1, got 0"),
])
def test_bad_expert_layouts_are_one_line_errors_before_any_work(capsys, args, message):
    assert_one_line_error(capsys, ["simulate", "--pp", "2", "-m", "2", *args], message)


def test_check_layout_names_the_model_for_ep_on_a_dense_model():
    with pytest.raises(ModelSpecError, match="^--ep 2: gpt3-13b has no routed experts"):
        check_layout(model_spec("gpt3-13b"), ep=2)


def test_with_tp_the_expert_block_gathers_the_routed_copies_over_tp():
    """tp 2 with sequence parallelism, ep 2: a dense layer's tp collectives are an all-gather
    and a reduce-scatter of its activation M before and after attention and MLP; in an MoE
    layer Megatron-Core's all-to-all dispatcher gathers over tp the copies its 2 ranks
    received, 2 x D, in place of the MLP's M. Each gather or scatter over 2 GPUs: x/2 / B + alpha.
    (Exposed whole, as without --tp-comm-overlap: tests/test_comm_overlap.py overlaps them.)"""
    message, dispatch = 40e6, 100e6

    def gather_and_scatter(size: float) -> float:
        return 2 * (size / 2 / NVLINK_BW + NVLINK_PAIR_LATENCY)

    stage = StageCost(fwd=1e-3, bwd=2e-3, layers=2, tp_message_bytes=message, moe_layers=2, dispatch_bytes=dispatch)
    costs = Costs(stages=(stage,) * 2, sequence_parallel=True)
    result = run_simulation(generate("1f1b", 2, 1), costs, nvlink(),
                            parallel=ParallelConfig(tp=2, dp=2, ep=2, overlap_tp=False))
    tp = [event.duration for event in result.trace.events if event.stream == "tp"]
    per_layer = gather_and_scatter(message) + gather_and_scatter(2 * dispatch)  # attention's, then the experts'
    assert tp == pytest.approx([2 * per_layer] * 4)


def test_the_simpy_model_times_overlapped_pairs_with_all_to_alls_as_the_engine_does():
    """The hold of a pair's halves (``StepTiming.pair_hold``) reaches both walks alike."""
    from pipesim.sim.engine import step_timing
    from pipesim.sim.parallel import comm_plan
    from schedules.lowering import lower
    from tests.test_engine_reference import assert_same_moments, both

    topology = nvlink()
    schedule = lower(generate("dualpipev", 2, 4, 2))
    costs = _moe_costs(4, 0.2e-3, 0.4e-3)
    mapping = map_ranks(topology, dp=4, pp=2, ep=4)
    timing = step_timing(schedule, costs, topology, mapping.pipeline(), comm_plan(schedule, costs, topology, mapping))
    assert timing.pair_hold and any(held > 0 for held in timing.pair_hold.values())
    assert_same_moments(*both(schedule, timing, "rendezvous"))
