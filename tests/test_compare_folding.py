"""``pipesim profile`` and ``pipesim compare`` measure a folded run (``--etp 1``) as the
executor runs it: its ep groups cut from every rank of a stage (the simulator's folded
mesh), its MoE layers running Megatron-Core's folded rule as ``simulate --etp 1`` models
it (no tp collective for the routed experts; the shared experts' dense pair,
``moe_shared``), its routed experts' parameters whole on each rank. The charges are
checked by hand against the pair of collectives a layer's sublayer runs."""

from __future__ import annotations

import json

import pytest

from executor.architectures.moe import MixtureOfExperts
from executor.models import build_model
from executor.run_costs import stage_bytes
from pipesim.cli import main
from pipesim.cli.compare import check_costs_match, replicas
from pipesim.cluster.collectives import all_gather, reduce_scatter
from pipesim.cluster.mapping import map_ranks
from pipesim.model.costs import Costs, CostsError, StageCost, costs_from_dict
from pipesim.sim.step import run_simulation
from schedules.generators import generate
from tests.cli_runs import assert_one_line_error
from tests.test_compare_calibration_files import printed_command
from tests.test_compare_ep_links import fitted_topology, run_config

FOLDED = ("--model", "mixtral-8x7b", "--layers", "4", "--hidden", "16", "--heads", "4", "--kv-heads", "2",
          "--experts", "4", "--seq-len", "8", "--pp", "2", "--tp", "2", "--sequence-parallel", "--etp", "1",
          "--ep", "2", "-m", "2")
MESSAGE = 4096.0  # bytes of one layer's tp collective (the microbatch's activation)


def tp_held(moe_tp_dense: float, moe_layers: float, moe_shared: float = 0.0, dispatch: bool = True) -> list[float]:
    """Seconds each action of a pp 2 x tp 2 run folded to etp 1 over ep 2 is held in tp
    collectives, two layers a stage (``moe_layers`` of them MoE)."""
    config = run_config(*FOLDED)
    stage = StageCost(fwd=1e-3, bwd=2e-3, act_bytes=8192.0, layers=2, tp_message_bytes=MESSAGE,
                      moe_layers=moe_layers, dispatch_bytes=16384.0 if moe_layers and dispatch else 0.0,
                      moe_tp_dense=moe_tp_dense, moe_shared=moe_shared)
    result = run_simulation(generate("1f1b", 2, 2), Costs((stage, stage), sequence_parallel=True), fitted_topology(4),
                            parallel=replicas(config))
    return [event.duration for event in result.trace.events if event.stream == "tp"]


def test_a_folded_moe_layer_is_charged_its_shared_experts_pair_only():
    topology = fitted_topology(4)
    group = map_ranks(topology, dp=1, pp=2, tp=2, ep=2, etp=1).tp_group(0, 0)
    pair = all_gather(topology, group, MESSAGE) + reduce_scatter(topology, group, MESSAGE)
    dense = tp_held(0.0, 0.0)
    assert len(dense) == 2 * 2 * 2 and all(held == pytest.approx(2 * 2 * pair, rel=1e-12) for held in dense)
    # a MoE block gathering and scattering the sequence as the dense MLP does: the same charge
    assert tp_held(1.0, 2.0) == pytest.approx(dense, rel=1e-12)
    # Megatron-Core's folded layer (etp 1), the executor's too, runs none for its routed experts:
    # only the attention's pair is left, with or without dispatch bytes (ep 1 sends nothing)
    assert tp_held(0.0, 2.0) == pytest.approx([held / 2 for held in dense], rel=1e-12)
    assert tp_held(0.0, 2.0, dispatch=False) == pytest.approx([held / 2 for held in dense], rel=1e-12)
    # shared experts, split over tp, run the dense MLP's pair
    assert tp_held(0.0, 2.0, moe_shared=1.0) == pytest.approx(dense, rel=1e-12)


def test_the_folded_runs_parallelism_is_the_simulators_folded_mesh():
    parallel = replicas(run_config(*FOLDED))
    assert (parallel.tp, parallel.ep, parallel.etp) == (2, 2, 1)
    assert replicas(run_config(*FOLDED[:-6], "-m", "2")).etp == 0  # no folding (nor ep): the experts over tp


def test_a_folded_runs_stages_say_what_the_executor_holds_and_gathers():
    config = run_config(*FOLDED)
    entries = stage_bytes(config, 2)
    stage = build_model(config).build_stage(0, 2)
    routed = sum(param.numel() for module in stage.modules() if isinstance(module, MixtureOfExperts)
                 for param in module.experts.parameters())
    dense = sum(param.numel() for param in stage.parameters()) - routed
    element = 4  # float32
    # the dense parameters split over tp 2, the routed experts whole on each rank, half of them (ep 2) here
    assert entries[0]["param_bytes"] == pytest.approx((dense / 2 + routed / 2) * element, rel=1e-12)
    assert (config.replica_batch_size, config.microbatches) == (8, 2)  # microbatches of 4 sequences
    for entry in entries:  # two MoE layers a stage: each rank sends its own 4 of a sequence's 8 tokens, top-2
        assert (entry["moe_layers"], entry["moe_shared"], entry.get("moe_tp_dense", 0.0)) == (2.0, 0.0, 0.0)
        assert entry["dispatch_bytes"] == 4 * 8 / 2 * 2 * 16 * element
        # each layer's backward gathers the attention's input again (the MLP gathered nothing)
        assert entry["tp_regathers"] == 1.0


def test_a_folded_runs_shared_experts_gather_as_a_dense_mlp():
    qwen = ("--model", "qwen1.5-moe-a2.7b", "--ffn-hidden", "16")
    folded = run_config(*qwen, *FOLDED[2:])
    for entry in stage_bytes(folded, 2):
        assert (entry["moe_layers"], entry["moe_shared"], entry["tp_regathers"]) == (2.0, 1.0, 2.0)
    # folding at ep 1: the MoE layers are still counted, no all-to-all bytes (nothing is sent)
    (entry, _) = stage_bytes(run_config(*FOLDED[:-4], "-m", "2"), 2)
    assert (entry["moe_layers"], entry["moe_shared"], entry["tp_regathers"]) == (2.0, 0.0, 1.0)


def test_costs_files_take_moe_shared_as_one_or_zero():
    stage = {"fwd": 1e-3, "bwd": 2e-3, "moe_shared": 1}
    assert costs_from_dict({"stages": [stage]}).stages[0].moe_shared == 1.0
    with pytest.raises(CostsError, match=r"stages\[0\].moe_shared is 1 .* or 0, got 2"):
        costs_from_dict({"stages": [{**stage, "moe_shared": 2}]})


def test_costs_files_take_moe_tp_dense_as_one_or_zero():
    stage = {"fwd": 1e-3, "bwd": 2e-3, "moe_tp_dense": 1}
    assert costs_from_dict({"stages": [stage]}).stages[0].moe_tp_dense == 1.0
    with pytest.raises(CostsError, match=r"stages\[0\].moe_tp_dense is 1 .* or 0, got 0.5"):
        costs_from_dict({"stages": [{**stage, "moe_tp_dense": 0.5}]})


def test_costs_measured_folded_are_refused_for_a_run_that_is_not():
    config = run_config(*FOLDED[:-6], "-m", "2")  # tp 2 with the experts split over it: etp 2
    with pytest.raises(ValueError, match=r"etp 1 \(this run: 2\)"):
        check_costs_match({"tp": 2, "etp": 1}, config, "folded.json")
    check_costs_match({"tp": 2, "etp": 2}, config, "unfolded.json")


def test_simulate_takes_etp_without_a_model_only_from_costs_timed_folded(tmp_path, capsys):
    stage = {"fwd": 1e-3, "bwd": 2e-3, "layers": 2, "tp_message_bytes": MESSAGE, "moe_layers": 2,
             "dispatch_bytes": 16384, "moe_tp_dense": 1}
    for name, meta in (("etp1.json", {"ep": 2, "etp": 1}), ("none.json", {"ep": 2})):
        (tmp_path / name).write_text(json.dumps({"stages": [stage, stage], "meta": meta, "sequence_parallel": True}))
    base = ["simulate", "--pp", "2", "--microbatches", "2", "--tp", "2", "--ep", "2", "--etp", "1",
            "--sequence-parallel", "--topology", "nvlink"]
    assert main([*base, "--costs", str(tmp_path / "etp1.json")]) == 0
    capsys.readouterr()
    assert_one_line_error(capsys, [*base, "--costs", str(tmp_path / "none.json")],
                          "compare --costs-out or profile --calibration run at --etp 1")


@pytest.mark.timeout(300)
def test_compare_runs_a_folded_layout_and_simulate_gives_its_prediction_back(tmp_path, capsys):
    paths = {name: tmp_path / name for name in ("compare.json", "costs.json", "links.json", "programs.csv")}
    assert main(["compare", *FOLDED, "--steps", "2", "--quiet", "--json", str(paths["compare.json"]),
                 "--costs-out", str(paths["costs.json"]), "--topology-out", str(paths["links.json"]),
                 "--schedule-out", str(paths["programs.csv"])]) == 0
    command = printed_command(capsys.readouterr().out)
    assert command[command.index("--etp") + 1] == "1" and command[command.index("--ep") + 1] == "2"
    document = json.loads(paths["compare.json"].read_text())
    assert main([*command, "--json", str(tmp_path / "simulated.json")]) == 0
    simulated = json.loads((tmp_path / "simulated.json").read_text())
    assert simulated["makespan"] == pytest.approx(document["predicted_step_time"], rel=1e-9, abs=0)
    costs = json.loads(paths["costs.json"].read_text())
    assert costs["meta"]["etp"] == 1 and all(stage["moe_shared"] == stage.get("moe_tp_dense", 0.0) == 0.0
                                             for stage in costs["stages"])
    # the all-to-alls and the tp collectives were timed in the run and priced in the prediction
    assert {"all_to_all", "all_gather"} <= set(document["calibrated_collectives"])


def test_unfolded_tp_ranks_route_their_shards_under_sequence_parallelism():
    # experts split over tp 2, ep 2 over the two replicas. With sequence parallelism each tp
    # rank routes its own shard, as Megatron-Core does: the copies of 4 of the 8 tokens of each
    # of its 2 sequences, top-2, gathered over tp around the experts (Megatron-Core's rule).
    # Without it every tp rank routes the gathered sequence: all 8 tokens' copies, and the MoE
    # block gathers and scatters the sequence as the dense MLP does.
    config = run_config(*FOLDED[:-6], "--dp", "2", "--ep", "2", "-m", "2")
    assert not config.folded and (config.replica_batch_size, config.microbatches) == (4, 2)
    (entry, _) = stage_bytes(config, 2)
    assert entry["dispatch_bytes"] == 2 * 4 * 2 * 16 * 4 and entry.get("moe_tp_dense", 0.0) == 0.0
    assert (entry["moe_shared"], entry["tp_regathers"]) == (0.0, 1.0)
    gathered = run_config(*(flag for flag in FOLDED[:-6] if flag != "--sequence-parallel"), "--dp", "2", "--ep", "2",
                          "-m", "2")
    (entry, _) = stage_bytes(gathered, 2)
    assert entry["dispatch_bytes"] == 2 * 8 * 2 * 16 * 4 and entry["moe_tp_dense"] == 1.0
