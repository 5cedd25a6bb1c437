"""``--ep-dispatcher``: Megatron-Core's all-to-all dispatcher against DeepEP's (Megatron-Core's
flex dispatcher): DeepEP sends a token once to each node that holds any of its experts and
fans it out there over NVLink, and its kernels read the rows by index, so only the
received rows are permuted into expert order and back. Bytes against hand calculation,
the node limit each dispatcher gives the all-to-all, the ep stream of simulated steps
(across two nodes a quarter of Qwen3-30B-A3B's eight copies cross; inside one node
nothing changes), and the flag's errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipesim.model.errors import ModelSpecError
from pipesim.model.experts import node_limited_share
from pipesim.model.operations import layer_operations
from pipesim.model.spec import BUNDLED_CONFIGS, load_model, model_spec
from pipesim.model.transformer_costs import dispatch_node_limit
from tests.cli_runs import assert_one_line_error, simulate_json

CONFIGS = BUNDLED_CONFIGS
QWEN3_30B = str(CONFIGS / "qwen3-30b-a3b.json")


def _permutation_bytes(spec, **kwargs) -> float:
    (permutations,) = [op for op in layer_operations(spec, **kwargs) if op.name == "token_permutations"]
    return permutations.bytes


def test_deepeps_permutations_by_hand():
    """Mixtral, b 2 s 4096 (T 8192), top 2, BF16: the received rows permuted into expert
    order and back, 2 x 2 x (2 x 8192) rows of 4096 x 2 bytes, whatever tp, ep or sequence
    parallelism (no permutation 1 before the dispatch, no weighted sum of its own)."""
    spec = replace(model_spec("mixtral-8x7b", microbatch_size=2, seq_len=4096), ep_dispatcher="deepep")
    expected = 2 * 2 * (2 * 8192) * 4096 * 2
    assert _permutation_bytes(spec) == expected
    assert _permutation_bytes(spec, ep=4) == expected
    assert _permutation_bytes(spec, tp=2, sequence_parallel=True) == expected
    # the all-to-all dispatcher's at ep 4: permutation 1 (2k rows of each token), unpermutation 1 (k + 1), the sort and
    # the unsort (2k each): more
    alltoall = model_spec("mixtral-8x7b", microbatch_size=2, seq_len=4096)
    assert _permutation_bytes(alltoall, ep=4) == ((2 * 2 + 2 + 1) * 8192 + 2 * 2 * 2 * 8192) * 4096 * 2


def test_the_node_limit_each_dispatcher_gives():
    """All-to-all: none (every routed copy crosses); DeepEP: one copy per node, so at most
    the ep group's nodes; a model's own node-limited routing (DeepSeek-V3's 4) under either."""
    qwen = load_model(QWEN3_30B)
    assert dispatch_node_limit(qwen, 16) == 0
    assert dispatch_node_limit(replace(qwen, ep_dispatcher="deepep"), 16) == 16
    deepseek = load_model(str(CONFIGS / "deepseek-v3.json"))
    assert dispatch_node_limit(deepseek, 64) == dispatch_node_limit(replace(deepseek, ep_dispatcher="deepep"), 64) == 4
    # over 2 nodes, a token's 8 copies cross as at most 2: a quarter of the bytes between nodes
    assert node_limited_share(dispatch_node_limit(replace(qwen, ep_dispatcher="deepep"), 16), 8, 2) == 0.25
    assert node_limited_share(dispatch_node_limit(qwen, 16), 8, 2) == 1.0


def test_across_two_nodes_a_quarter_of_the_copies_cross():
    """Qwen3-30B-A3B at ep 16 over two ib nodes: DeepEP's ep stream is the all-to-all's with
    its bytes between nodes cut to 2 of 8 copies, so between a quarter of it (the network
    alone) and the whole; inside one node (ep 8) the two dispatchers move the same bytes."""
    common = ["--model", QWEN3_30B, "--seq-len", "1024", "--pp", "1", "-m", "2", "--topology", "ib", "--gpu",
              "h100", "--fp8", "current"]
    across = [*common, "--dp", "16", "--ep", "16", "--nodes", "2"]
    alltoall = simulate_json(across)["ranks"][0]["ep"]
    deepep = simulate_json([*across, "--ep-dispatcher", "deepep"])["ranks"][0]["ep"]
    assert 0.25 * alltoall <= deepep < 0.3 * alltoall
    inside = [*common, "--dp", "8", "--ep", "8", "--nodes", "1"]
    assert simulate_json([*inside, "--ep-dispatcher", "deepep"])["ranks"][0]["ep"] == \
        pytest.approx(simulate_json(inside)["ranks"][0]["ep"])


def test_an_unknown_dispatcher_is_refused_in_the_spec():
    with pytest.raises(ModelSpecError, match="expert-parallel dispatcher 'nccl' is not one of alltoall, deepep"):
        replace(model_spec("mixtral-8x7b"), ep_dispatcher="nccl")


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "mixtral-8x7b", "--ep-dispatcher", "nccl"], "--ep-dispatcher 'nccl' is not one of: alltoall, deepep"),
    (["--model", "llama3-8b", "--ep-dispatcher", "deepep"], "--ep-dispatcher deepep: llama3-8b has no mixture of "
                                                            "experts"),
    (["--fwd", "1e-3", "--ep-dispatcher", "deepep"], "--ep-dispatcher deepep needs --model"),
])
def test_bad_ep_dispatcher_is_one_line_exit_2(capsys, args, message):
    assert_one_line_error(capsys, ["simulate", "--pp", "2", "-m", "2", *args], message)


def test_plan_carries_the_flag_to_every_layouts_model():
    from pipesim.job import model_spec_of
    from pipesim.plan.request import PlanRequest, checked

    base, _ = checked(PlanRequest(model="mixtral-8x7b", gpus=8, global_batch=8, ep_dispatcher="deepep"))
    assert model_spec_of(base).ep_dispatcher == "deepep"
    base, _ = checked(PlanRequest(model="mixtral-8x7b", gpus=8, global_batch=8))
    assert model_spec_of(base).ep_dispatcher == "alltoall"
