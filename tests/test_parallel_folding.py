"""``--etp``: Megatron-Core's parallel folding, the routed experts on a mesh of their own
(expert tensor parallelism ``etp`` innermost, then ``ep``, then expert data parallelism)
over the same ``tp x cp x dp`` ranks of each pipeline stage. The groups against
Megatron-Core's own rank generator (``parallel_state.RankGenerator``, run for the layouts
below), the experts' GEMMs, parameters and stash by hand, the tensor-parallel collectives
a MoE block keeps (none at etp 1: the attention's pair alone), ``--etp`` equal to ``--tp``
changing nothing, and the flag's one-line errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim.cli import main
from pipesim.cluster.collectives import all_gather, reduce_scatter
from pipesim.cluster.mapping import map_ranks
from pipesim.cluster.presets import ib
from pipesim.cluster.topology import ideal_topology
from pipesim.model.activations import layer_stash_bytes, routed_copies_bytes
from pipesim.model.errors import ModelSpecError
from pipesim.model.layout import check_expert_tp
from pipesim.model.operations import layer_operations
from pipesim.model.spec import BUNDLED_CONFIGS, load_model
from pipesim.model.weights import layer_params
from pipesim.sim.expert_parallel import stage_ep_groups
from pipesim.sim.parallel import ParallelConfig
from tests.cli_runs import assert_one_line_error, simulate_json

QWEN3_30B = str(BUNDLED_CONFIGS / "qwen3-30b-a3b.json")


def _ranks(devices: list[str]) -> list[int]:
    return [int(device.removeprefix("gpu")) for device in devices]


def test_the_expert_mesh_is_megatron_cores():
    """16 GPUs, attention tp 2 x cp 2 x pp 2 (dp 2), Megatron-Core's order tp-cp-dp-pp.
    Its RankGenerator gives, for experts at etp 1 / ep 4: ep groups [0,1,2,3] and
    [4,5,6,7] in stage 0, expert dp [0,4]; at etp 2 / ep 2: ep [0,2] and [1,3], expert tp
    [0,1]; stage 1 the same shifted by 8."""
    topology = ideal_topology()
    folded = map_ranks(topology, dp=2, pp=2, tp=2, order="tp-cp-dp-pp", cp=2, ep=4, etp=1)
    assert [_ranks(group) for group in folded.ep_groups(0, 0)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _ranks(folded.expert_dp_group(0, 0)) == [0, 4]
    assert _ranks(folded.expert_tp_group(0)) == [0]
    assert [_ranks(group) for group in stage_ep_groups(folded, 1)] == [[8, 9, 10, 11], [12, 13, 14, 15]]
    halves = map_ranks(topology, dp=2, pp=2, tp=2, order="tp-cp-dp-pp", cp=2, ep=2, etp=2)
    assert not halves.folded  # etp = tp: the dense shard's dp x cp ranks, cut into runs of ep
    assert [_ranks(group) for group in halves.ep_groups(0, 0)] == [[0, 2], [4, 6]]
    assert [_ranks(group) for group in halves.ep_groups(0, 1)] == [[1, 3], [5, 7]]
    assert _ranks(halves.expert_tp_group(0)) == [0, 1]
    # tp 4 folded to etp 2: an expert tensor-parallel group of 2 inside each tp group of 4
    quarter = map_ranks(topology, dp=2, pp=1, tp=4, ep=2, etp=2)
    assert _ranks(quarter.expert_tp_group(0)) == [0, 1]
    assert [_ranks(group) for group in quarter.ep_groups(0, 1)] == [[1, 3], [5, 7]]
    assert _ranks(quarter.expert_dp_group(0, 0)) == [0, 4]


def test_folding_keeps_an_ep_group_on_one_node():
    """Qwen3-235B's layout in miniature: tp 2 x dp 8 per stage on 8-GPU nodes. Cut from dp
    alone (etp = tp) an ep group of 8 takes every other rank of two nodes; folded (etp 1)
    it is the 8 consecutive ranks of one node, on NVLink."""
    topology = ib(4)
    cut = map_ranks(topology, dp=8, pp=2, tp=2, ep=8)
    folded = map_ranks(topology, dp=8, pp=2, tp=2, ep=8, etp=1)
    assert len({topology.node_of(device) for device in cut.ep_group(0, 0)}) == 2
    assert len({topology.node_of(device) for device in folded.ep_group(0, 0)}) == 1
    assert len(folded.expert_dp_group(0, 0)) == 2  # tp x dp / (etp x ep) = 16 / 8


def test_expert_gemms_params_and_stash_by_hand():
    """Qwen3-30B-A3B (hidden 2048, 128 experts of width 768, top 8), one 4096-token
    sequence, tp 2 with sequence parallelism, ep 8. Folded to etp 1 a rank dispatches its
    2048 tokens and its 16 experts see the tokens of 8 ranks: 8 x 2048 x 8 / 128 = 1024
    rows each, at the full 768 columns (gate and up fused: 1536); at etp 2 (tp) 2048 rows
    at 384. Parameters: 16 experts x 3 x 2048 x 768 at etp 1, half of it at etp 2. The
    routed copies a rank keeps: its own 2048 tokens' at etp 1, the tp group's 4096's at 2."""
    spec = replace(load_model(QWEN3_30B, seq_len=4096), microbatch_size=1)
    folded = replace(spec, expert_tp=1)

    def expert_up(model):
        (gemm,) = [op for op in layer_operations(model, tp=2, sequence_parallel=True, ep=8, padded=False)
                   if op.name == "expert_in"]
        return gemm.m, gemm.n, gemm.count

    assert expert_up(folded) == (1024, 1536, 16)
    assert expert_up(spec) == (2048, 768, 16)
    routed = 16 * 3 * 2048 * 768
    dense = layer_params(spec, True, tp=2, ep=8) - routed // 2
    assert layer_params(folded, True, tp=2, ep=8) == dense + routed
    stash = (layer_stash_bytes(spec, 2, True, "none", True, 0)
             - layer_stash_bytes(folded, 2, True, "none", True, 0))
    assert stash == pytest.approx(4096 * routed_copies_bytes(spec) / 2)
    assert ParallelConfig(dp=8, tp=2, ep=8, etp=1).expert_holders(8) == 2
    assert ParallelConfig(dp=8, tp=2, ep=8).expert_holders(8) == 1


QWEN_STEP = ["--model", QWEN3_30B, "--seq-len", "4096", "--microbatch-size", "1", "--schedule", "1f1b", "--pp", "2",
             "-m", "4", "--tp", "2", "--dp", "8", "--sequence-parallel", "--topology", "ib", "--nodes", "4", "--gpu",
             "h100", "--zero", "1", "--no-tp-overlap"]


def test_a_folded_moe_block_runs_no_tensor_parallel_collective():
    """Every Qwen3-30B-A3B layer is a mixture of experts. Without expert parallelism its
    MLP runs the dense pair of collectives (an all-gather and a reduce-scatter of the
    sequence's activation) as the attention does; folded to etp 1 the experts take each
    rank's own tokens, so only the attention's pair is left: per rank, 4 microbatches x
    (forward + backward) x its layers x one pair fewer, exposed whole (--no-tp-overlap);
    the rest (the backward's regathers of the attention's input) is unchanged."""
    dense_pairs = simulate_json(QWEN_STEP)
    folded = simulate_json([*QWEN_STEP, "--etp", "1"])
    topology = ib(4, gpu="h100")
    mapping = map_ranks(topology, dp=8, pp=2, tp=2)
    for rank, stage in enumerate(dense_pairs["stage_costs"]):
        group, message = mapping.tp_group(0, rank), stage["tp_message_bytes"]
        pair = all_gather(topology, group, message) + reduce_scatter(topology, group, message)
        removed = dense_pairs["ranks"][rank]["tp"] - folded["ranks"][rank]["tp"]
        assert removed == pytest.approx(4 * 2 * stage["layers"] * pair, rel=1e-9)
    assert folded["etp"] == 1 and dense_pairs["etp"] == 2


def test_folded_shared_experts_keep_the_dense_pair():
    """Qwen1.5-MoE's layers each hold shared experts beside the routed ones. Megatron-Core
    splits them over tp as a dense MLP (``SharedExpertMLP`` on the tp group, the sequence
    gathered for them), also when the routed experts are folded to etp 1: each layer
    keeps one pair for its MLP, so the tp time is the unfolded step's."""
    qwen_moe = [*QWEN_STEP[2:], "--model", "qwen1.5-moe-a2.7b"]
    unfolded, folded = simulate_json(qwen_moe), simulate_json([*qwen_moe, "--etp", "1"])
    assert all(stage["moe_shared"] == 1.0 for stage in folded["stage_costs"])
    assert [rank["tp"] for rank in folded["ranks"]] == pytest.approx([rank["tp"] for rank in unfolded["ranks"]],
                                                                     rel=1e-12)
    assert all(rank["tp"] > 0 for rank in folded["ranks"])


def test_etp_equal_to_tp_changes_nothing():
    """``--etp`` at ``--tp`` is Megatron-Core's default: the same step to the last digit."""
    args = [*QWEN_STEP, "--ep", "8"]
    plain, same = simulate_json(args), simulate_json([*args, "--etp", "2"])
    assert same["makespan"] == plain["makespan"]
    assert same["ranks"] == plain["ranks"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--etp", "1"], "needs --sequence-parallel"),
    (["--etp", "4", "--sequence-parallel"], "--etp 4 above --tp 2"),
    (["--etp", "0", "--sequence-parallel"], "--etp must be a whole number >= 1, got 0"),
    (["--etp", "1", "--ep", "32", "--sequence-parallel"], "--etp 1 x --ep 32 = 32 must divide the tp x cp x dp = 16"),
])
def test_bad_etp_is_one_line(extra, message, capsys):
    args = ["simulate", "--model", QWEN3_30B, "--seq-len", "4096", "--pp", "2", "-m", "4", "--tp", "2", "--dp", "8",
            *extra]
    assert_one_line_error(capsys, args, message)


def test_etp_needs_a_mixture_of_experts_and_a_model(capsys):
    assert main(["simulate", "--model", "llama3-8b", "--tp", "2", "--sequence-parallel", "--etp", "1"]) == 2
    assert "has no routed experts to split" in capsys.readouterr().err
    assert main(["simulate", "--pp", "2", "--tp", "2", "--etp", "1"]) == 2
    assert "--etp 1 needs --model" in capsys.readouterr().err


def test_etp_must_divide_the_expert_width_and_tp():
    with pytest.raises(ModelSpecError, match="--etp 5 does not divide the expert MLP width 768"):
        check_expert_tp(replace(load_model(QWEN3_30B), expert_tp=5), 8, sequence_parallel=True)
    with pytest.raises(ModelSpecError, match="--etp 3 must divide --tp 4"):
        check_expert_tp(replace(load_model(QWEN3_30B), expert_tp=3), 4, sequence_parallel=True)


def test_run_refuses_etp_on_a_model_without_experts(capsys):
    # run executes --etp 1 and --etp tp (tests/test_executor_folding.py); the toy has no experts
    assert main(["run", "--pp", "2", "--etp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--etp 1 splits the routed experts of a mixture-of-experts model" in err and len(err.splitlines()) == 1


def test_the_docs_quote_the_folded_step_as_simulated():
    """docs/cluster-model.md's example (Qwen3-30B-A3B, tp 2, dp 8, ep 8, 1f1b pp 2 of 8
    microbatches on four ib nodes): the step and its ep time cut from dp and folded."""
    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "cluster-model.md").read_text().split())
    args = ["--model", QWEN3_30B, "--seq-len", "4096", "--microbatch-size", "1", "--schedule", "1f1b", "--pp", "2",
            "-m", "8", "--tp", "2", "--dp", "8", "--ep", "8", "--sequence-parallel", "--topology", "ib", "--nodes",
            "4", "--gpu", "h100", "--zero", "1"]
    cut, folded = simulate_json(args), simulate_json([*args, "--etp", "1"])
    assert (f"a 1f1b step of 8 microbatches takes {cut['makespan'] * 1e3:,.0f} ms cut from dp "
            f"({cut['ranks'][0]['ep'] * 1e3:.0f} ms of it ep all-to-alls across two nodes) and "
            f"{folded['makespan'] * 1e3:.0f} ms folded to `--etp 1` ({folded['ranks'][0]['ep'] * 1e3:.0f} ms of ep "
            f"inside a node)") in docs


@st.composite
def folded_layouts(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.integers(1, 6))
    etp = draw(st.sampled_from([size for size in (1, 2, 4) if tp % size == 0]))
    stage = tp * cp * dp
    ep = draw(st.sampled_from([size for size in range(1, stage + 1) if stage % (etp * size) == 0]))
    order = draw(st.sampled_from(["tp-cp-dp-pp", "tp-dp-pp", "tp-pp-dp"]))
    return tp, cp, dp, etp, ep, order


@settings(max_examples=60, deadline=None)
@given(folded_layouts())
def test_the_expert_mesh_partitions_every_stage(layout):
    """Any folded layout: each stage's ranks split into expert tensor-parallel shards x
    ep groups, every rank in exactly one ep group of ``ep`` members; the expert dp group
    of a rank holds ``tp cp dp / (etp ep)`` ranks, one from each ep group of its shard;
    members of an ep group lie ``etp`` apart in the stage's rank order (Megatron-Core's
    expert mesh: etp innermost, then ep)."""
    tp, cp, dp, etp, ep, order = layout
    mapping = map_ranks(ideal_topology(), dp=dp, pp=2, tp=tp, order=order, cp=cp, ep=ep, etp=etp)
    for stage in range(2):
        members = mapping.stage_members(stage)
        groups = stage_ep_groups(mapping, stage)
        assert sorted(device for group in groups for device in group) == sorted(members)
        assert all(len(group) == ep for group in groups)
        if mapping.folded:
            position = {device: index for index, device in enumerate(members)}
            for group in groups:
                gaps = {position[b] - position[a] for a, b in zip(group, group[1:], strict=False)}
                assert gaps <= {etp}
        for shard in range(mapping.expert_tp):
            assert len(mapping.expert_dp_group(stage, shard)) == tp * cp * dp // (etp * ep)
