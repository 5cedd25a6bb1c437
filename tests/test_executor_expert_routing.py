"""DeepSeek's router as its configs describe it: group-limited routing (``n_group``,
``topk_group``, ``topk_method``), ``routed_scaling_factor``, and DeepSeek-V3's
auxiliary-loss-free balancing (the selection bias moved after each step). Expected
choices and biases are worked by hand; pipelined runs on gloo, float64, equal the
one-process reference's losses, gradients, weights and biases."""

from __future__ import annotations

import json
import math

import pytest
import torch

from executor.architectures.build import shrink_note, shrunk_spec
from executor.architectures.moe import Router
from executor.config import ConfigError, RunConfig
from executor.expert_balance import update_selection_biases
from executor.models import build_model
from executor.recompute import apply_recompute
from executor.reference import reference_run
from pipesim.model.errors import ModelSpecError
from pipesim.model.experts import MixtureOfExperts
from pipesim.model.hf_config import spec_from_hf_config
from tests.hf_fixtures import CONFIGS
from tests.launched_cases import LaunchedCases, assert_equals_reference, assert_weights_equal_reference

pytestmark = pytest.mark.timeout(300)


def logit(probability: float) -> float:
    return math.log(probability / (1 - probability))


def sigmoid_router(scores: list[float], top_k: int, groups: int, kept: int, scoring: str,
                   scaling: float = 1.0, bias: list[float] | None = None) -> tuple[Router, torch.Tensor]:
    """A sigmoid router whose gate is the identity and whose one token's logits give
    ``scores`` after the sigmoid."""
    experts = len(scores)
    router = Router(experts, experts, top_k, "sigmoid", True, groups, kept, scoring, scaling).double()
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(experts))
        if bias is not None:
            router.selection_bias.copy_(torch.tensor(bias))
    return router, torch.tensor([[logit(score) for score in scores]], dtype=torch.float64)


# four groups of two; the best expert (0.9) sits in a group whose best two sum to 1.0
SCORES = [0.9, 0.1, 0.6, 0.58, 0.55, 0.54, 0.2, 0.2]


def test_top2_sum_keeps_the_groups_of_the_best_pairs_not_the_best_expert() -> None:
    router, token = sigmoid_router(SCORES, top_k=2, groups=4, kept=2, scoring="top2-sum", scaling=2.5)
    weights, chosen = router(token)
    # group sums 1.0, 1.18, 1.09, 0.4: groups 1 and 2 kept, experts 2..5; the best two 0.6 and 0.58
    assert chosen.tolist() == [[2, 3]]
    assert weights[0].tolist() == pytest.approx([2.5 * 0.6 / 1.18, 2.5 * 0.58 / 1.18], abs=1e-12)


def test_max_scoring_keeps_the_groups_of_the_best_experts() -> None:
    router, token = sigmoid_router(SCORES, top_k=2, groups=4, kept=2, scoring="max")
    _, chosen = router(token)
    # group maxima 0.9, 0.6, 0.55, 0.2: groups 0 and 1 kept; the best two there 0.9 and 0.6
    assert chosen.tolist() == [[0, 2]]


def test_one_group_is_no_limit() -> None:
    router, token = sigmoid_router(SCORES, top_k=2, groups=1, kept=1, scoring="top2-sum")
    assert router(token)[1].tolist() == [[0, 2]]


def test_experts_outside_the_kept_groups_never_outrank_negative_biased_scores() -> None:
    # biased scores -0.2, -0.3 | -0.8, -0.85: group 0 kept; a zero fill for group 1 would win
    router, token = sigmoid_router([0.3, 0.2, 0.1, 0.05], top_k=2, groups=2, kept=1, scoring="top2-sum",
                                   bias=[-0.5, -0.5, -0.9, -0.9])
    weights, chosen = router(token)
    assert sorted(chosen[0].tolist()) == [0, 1]
    assert sorted(weights[0].tolist()) == pytest.approx([0.2 / 0.5, 0.3 / 0.5], abs=1e-12)  # scores, not biased


def test_the_bias_moves_by_the_rate_towards_the_mean_load() -> None:
    router = Router(4, 4, 1, "sigmoid").double()
    router.layer = 1
    router.expert_load.copy_(torch.tensor([5, 1, 3, 3]))  # mean 3: expert 0 over, 1 under, 2 and 3 at it
    loads = update_selection_biases([router], 0.01, (2, 4), torch.device("cpu"))
    assert router.selection_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0], abs=1e-15)
    assert loads[1].tolist() == [5, 1, 3, 3] and loads[0].tolist() == [0, 0, 0, 0]
    assert router.expert_load.tolist() == [0, 0, 0, 0]  # counting starts again


def test_loads_are_summed_over_ranks_before_the_sign() -> None:
    router = Router(4, 4, 1, "sigmoid").double()
    router.layer = 0
    router.expert_load.copy_(torch.tensor([4, 0, 0, 0]))  # this rank alone: expert 0 over the mean
    update_selection_biases([router], 0.5, (1, 4), torch.device("cpu"),
                            all_reduce=lambda loads: loads.add_(torch.tensor([[0, 6, 6, 6]])))
    # summed 4, 6, 6, 6: mean 5.5, so expert 0 is under it and the others over
    assert router.selection_bias.tolist() == [0.5, -0.5, -0.5, -0.5]


def moe_stage(recompute: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    config = RunConfig(pp=1, model="deepseek-v3", layers=2, hidden=16, heads=4, seq_len=8, vocab=32, batch_size=2,
                       microbatches=1, dtype="float64", experts=4, ffn_hidden=32)
    model = build_model(config)
    stage = model.build_stage(0, 1).double()
    apply_recompute(stage, recompute)
    inputs, targets = model.make_batch(0, 2)
    return stage, model.loss_sum(stage(inputs), targets), inputs


@pytest.mark.parametrize("recompute", ["full", "selective", "norm-mla-up"])
def test_a_recomputed_forward_counts_its_routing_once(recompute: str) -> None:
    plain, loss, _ = moe_stage("none")
    loss.backward()
    again, loss, _ = moe_stage(recompute)
    loss.backward()  # the recompute routes every token a second time, inside the backward
    (router,) = (module for module in again.modules() if isinstance(module, Router))
    (reference,) = (module for module in plain.modules() if isinstance(module, Router))
    assert router.expert_load.sum().item() == 2 * 8 * router.top_k  # 2 sequences of 8 tokens, k copies each
    assert torch.equal(router.expert_load, reference.expert_load)


def hf(name: str, **changes) -> dict:
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    return {key: value for key, value in {**config, **changes}.items() if value is not None}


def test_deepseek_configs_read_the_routing_exactly() -> None:
    v3 = spec_from_hf_config(hf("deepseek-v3")).moe
    assert (v3.expert_groups, v3.node_limit, v3.group_scoring, v3.routed_scaling) == (8, 4, "top2-sum", 2.5)
    assert spec_from_hf_config(hf("deepseek-v3", routed_scaling_factor=1.5)).moe.routed_scaling == 1.5
    greedy = spec_from_hf_config(hf("deepseek-v3", topk_method="greedy")).moe
    assert (greedy.expert_groups, greedy.node_limit) == (1, None)
    v2 = spec_from_hf_config(hf("deepseek-v2-lite", topk_method="group_limited_greedy", n_group=8, topk_group=3,
                                routed_scaling_factor=16.0)).moe
    assert (v2.expert_groups, v2.node_limit, v2.group_scoring, v2.routed_scaling) == (8, 3, "max", 16.0)
    # V2 scales only weights it leaves unnormalised (its modelling code's else branch)
    normalised = spec_from_hf_config(hf("deepseek-v2-lite", norm_topk_prob=True, routed_scaling_factor=16.0)).moe
    assert normalised.routed_scaling == 1.0


@pytest.mark.parametrize(("changes", "message"), [
    ({"n_group": 7}, "expert_groups 7 must divide the 256"),
    ({"topk_group": 9}, "node_limit 9 must be a count of the 8 expert groups"),
    ({"n_group": 128, "topk_group": 2}, "node_limit 2 groups of 2 experts hold fewer than the 8"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor must be a number > 0, got 0"),
])
def test_impossible_group_routing_is_refused_naming_the_value(changes: dict, message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        spec_from_hf_config(hf("deepseek-v3", **changes))


def test_top2_sum_needs_two_experts_a_group() -> None:
    with pytest.raises(ModelSpecError, match="top2-sum needs 2 experts a group"):
        MixtureOfExperts(experts=8, experts_per_token=2, expert_ffn=8, node_limit=4, expert_groups=8,
                         group_scoring="top2-sum")


def test_shrinking_keeps_the_share_of_groups_a_token_uses() -> None:
    config = RunConfig(model="deepseek-v3", layers=4, hidden=64, heads=4)
    moe = shrunk_spec(config).moe
    # 8 experts in groups of two (top2-sum needs two): 4 groups, half of them kept as in V3
    assert (moe.experts, moe.experts_per_token, moe.expert_groups, moe.node_limit) == (8, 4, 4, 2)
    assert "expert groups 8->4, groups per token 4->2" in shrink_note(config)
    one = shrunk_spec(RunConfig(model="deepseek-v3", layers=4, hidden=64, heads=4, experts=2)).moe
    assert (one.expert_groups, one.node_limit) == (1, None)  # one group of two: no limit left


def test_the_bias_rate_is_refused_where_no_router_has_a_bias() -> None:
    with pytest.raises(ConfigError, match="mixtral-8x7b's router has no selection bias"):
        RunConfig(model="mixtral-8x7b", layers=2, hidden=64, heads=4, expert_bias_rate=0.01).check()
    with pytest.raises(ConfigError, match="--expert-bias-rate must be a finite number >= 0"):
        RunConfig(model="deepseek-v3", layers=4, hidden=64, heads=4, expert_bias_rate=-1.0).check()
    with pytest.raises(ConfigError, match="--expert-bias-rate shapes an architecture"):
        RunConfig(model="gpt", expert_bias_rate=0.01).check()


def test_the_reference_moves_the_biases_and_a_zero_rate_keeps_them() -> None:
    base = {"pp": 1, "model": "deepseek-v3", "layers": 3, "hidden": 16, "heads": 4, "seq_len": 8, "vocab": 37,
            "batch_size": 4, "microbatches": 2, "steps": 3, "dtype": "float64", "experts": 4, "ffn_hidden": 32}
    moved = reference_run(RunConfig(**base, expert_bias_rate=0.05))["params"]
    kept = reference_run(RunConfig(**base, expert_bias_rate=0.0))["params"]
    biases = [name for name in moved if name.endswith("selection_bias")]
    # layer 0 dense (a shrunk model keeps at most half its dense layers), 1 and 2 routed
    assert biases == [f"0.blocks.{layer}.feed_forward.router.selection_bias" for layer in (1, 2)]
    for bias in biases:
        # each of 3 steps moved every expert by 0.05, 0 or -0.05: a multiple of 0.05 at most 0.15 away
        steps = moved[bias] / 0.05
        assert torch.allclose(steps, steps.round(), atol=1e-9) and 1 <= steps.abs().max() <= 3
        assert not kept[bias].any()


# Pipelined float64 runs with a bias step large enough to change the routing from step 2
SMALL = {"hidden": 16, "heads": 4, "seq_len": 8, "vocab": 37, "batch_size": 8, "steps": 3, "dtype": "float64",
         "optimizer": "adamw", "lr": 0.02, "return_grads": True, "experts": 4, "ffn_hidden": 32,
         "model": "deepseek-v3", "layers": 4, "microbatches": 2, "expert_bias_rate": 0.05, "schedule": "1f1b"}
CASES = LaunchedCases(SMALL, {4: {
    "pp2-dp2": {"pp": 2, "dp": 2},
    "pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2},
    "pp2-tp2-sp": {"pp": 2, "tp": 2, "sequence_parallel": True},
    "pp2-cp2-full-recompute": {"pp": 2, "cp": 2, "recompute": "full"},
    "dualpipe-pp2-dp2-zero3": {"pp": 2, "dp": 2, "zero": 3, "schedule": "dualpipe", "virtual_stages": 2,
                               "microbatches": 4},
}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_pipelined_runs_move_the_biases_as_the_reference(name: str) -> None:
    result, reference = CASES.result(name), reference_run(CASES.config(name))
    assert_equals_reference(result, reference)
    assert_weights_equal_reference(result, reference)  # the selection biases among them
    biases = [name for name in reference["params"] if name.endswith("selection_bias")]
    assert len(biases) == 2 and all(reference["params"][bias].any() for bias in biases)  # they moved
