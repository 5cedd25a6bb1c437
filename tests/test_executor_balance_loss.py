"""The mixture-of-experts load-balancing loss (``balance_loss``: a config's
``router_aux_loss_coef`` or DeepSeek's ``aux_loss_alpha``), per sequence: its value
worked by hand, its gradient started where the layer ran equal to the loss added to the
model's, and pipelined float64 runs on gloo (tp with sequence parallelism, cp, ep,
ZeRO, a split backward, recompute, DualPipe) equal to the one-process reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from executor.architectures.build import shrink_note, shrunk_spec
from executor.architectures.moe import MixtureOfExperts, Router, set_balance_scale
from executor.config import ConfigError, RunConfig
from executor.reference import reference_run
from pipesim.model.errors import ModelSpecError
from pipesim.model.hf_config import spec_from_hf_config
from pipesim.model.spec import PRESETS
from tests.hf_fixtures import hf
from tests.launched_cases import LaunchedCases, assert_run_and_weights_equal_reference

pytestmark = pytest.mark.timeout(300)


def identity_router(experts: int, top_k: int, gating: str = "softmax") -> Router:
    """A router whose gate is the identity: a token's features are its logits."""
    router = Router(experts, experts, top_k, gating).double()
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(experts))
    return router


def loss_of(router: Router, rows: list[list[float]], sequences: int, coefficient: float = 1.0) -> float:
    _, chosen, scores = router.route(torch.tensor(rows, dtype=torch.float64))
    return router.balance_loss(scores, chosen, sequences, coefficient).item()


def test_a_softmax_routers_loss_by_hand() -> None:
    router = identity_router(2, 1)
    # one sequence, softmax 0.7/0.3 and 0.6/0.4: both tokens pick expert 0, f = (1, 0),
    # P = (0.65, 0.35): 2 * 0.65
    first = [[math.log(0.7), math.log(0.3)], [math.log(0.6), math.log(0.4)]]
    assert loss_of(router, first, 1, 0.02) == pytest.approx(0.02 * 1.3, rel=1e-12)
    # a second sequence picking expert 1 (0.2/0.8, 0.4/0.6): f = (0, 1), P = (0.3, 0.7): 1.4;
    # per sequence, summed: 2.7 (over both at once it would be 2 * (0.5 * 0.475 + 0.5 * 0.525) = 1)
    second = [[math.log(0.2), math.log(0.8)], [math.log(0.4), math.log(0.6)]]
    assert loss_of(router, first + second, 2) == pytest.approx(2.7, rel=1e-12)


def test_top_k_shares_count_every_choice() -> None:
    # 4 experts, top 2, one token: softmax of logits 4, 3, 2, 1 picks 0 and 1; f = (1/2, 1/2, 0, 0)
    router = identity_router(4, 2)
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    p = logits.softmax(-1)
    expected = 4 * (0.5 * p[0] + 0.5 * p[1]).item()
    assert loss_of(router, [logits.tolist()], 1) == pytest.approx(expected, rel=1e-12)


def test_a_sigmoid_routers_scores_are_normalised_per_token() -> None:
    router = identity_router(2, 1, "sigmoid")
    router.selection_bias.zero_()
    # sigmoid scores 0.8 and 0.4, normalised 2/3 and 1/3; expert 0 chosen: 2 * 2/3
    row = [math.log(0.8 / 0.2), math.log(0.4 / 0.6)]
    assert loss_of(router, [row], 1) == pytest.approx(4 / 3, rel=1e-12)


def small_moe(balance_loss: float) -> MixtureOfExperts:
    torch.manual_seed(0)
    return MixtureOfExperts(8, 4, 2, 16, shared_ffn=16, balance_loss=balance_loss).double()


def test_the_gradient_started_in_the_layer_is_the_added_losss() -> None:
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    weight = torch.randn(2, 5, 8, dtype=torch.float64)
    attached = small_moe(0.5)
    set_balance_scale([attached], 0.25)
    (attached(x) * weight).sum().backward()
    # the same layer without the loss, the loss added to the objective by hand
    plain = copy.deepcopy(attached)
    plain.balance_loss = 0.0
    plain.zero_grad(set_to_none=True)
    tokens = x.reshape(-1, 8)
    _, chosen, scores = plain.router.route(tokens)
    added = 0.25 * plain.router.balance_loss(scores, chosen, 2, 0.5)
    ((plain(x) * weight).sum() + added).backward()
    without = copy.deepcopy(plain)
    without.zero_grad(set_to_none=True)
    (without(x) * weight).sum().backward()
    for (name, mine), theirs in zip(attached.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(mine.grad, theirs.grad, atol=1e-14, rtol=0), name
    gate = dict(attached.named_parameters())["router.gate.weight"]
    assert (gate.grad - without.router.gate.weight.grad).abs().max() > 1e-3  # the loss moved the router


def test_configs_and_presets_name_their_coefficient() -> None:
    assert spec_from_hf_config(hf("mixtral-8x7b", router_aux_loss_coef=0.02)).moe.balance_loss == 0.02
    assert spec_from_hf_config(hf("deepseek-v3", aux_loss_alpha=0.001, seq_aux=True)).moe.balance_loss == 0.001
    assert spec_from_hf_config(hf("olmoe-1b-7b")).moe.balance_loss == 0.01
    assert spec_from_hf_config(hf("mixtral-8x7b")).moe.balance_loss == 0.0  # named nowhere: none
    assert PRESETS["mixtral-8x7b"].moe.balance_loss == 0.02
    assert PRESETS["deepseek-v3"].moe.balance_loss == 0.001
    with pytest.raises(ModelSpecError, match=r"^config: router_aux_loss_coef must be a number >= 0, got -1"):
        spec_from_hf_config(hf("mixtral-8x7b", router_aux_loss_coef=-1))
    with pytest.raises(ModelSpecError, match=r"^config: aux_loss_alpha must be a number >= 0, got 'x'"):
        spec_from_hf_config(hf("deepseek-v3", aux_loss_alpha="x"))


def test_the_flag_overrides_is_checked_and_said() -> None:
    base = {"model": "mixtral-8x7b", "layers": 2, "hidden": 16, "heads": 4, "kv_heads": 2, "experts": 4, "pp": 1}
    assert "load-balancing loss 0.02 per MoE layer, per sequence (the config's)" in shrink_note(RunConfig(**base))
    assert shrunk_spec(RunConfig(**base, balance_loss=0.5)).moe.balance_loss == 0.5
    assert "load-balancing" not in shrink_note(RunConfig(**base, balance_loss=0.0))
    for value in (-1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="--balance-loss must be a finite number >= 0"):
            RunConfig(**base, balance_loss=value).check()
    with pytest.raises(ConfigError, match="--balance-loss 0.1: llama3-8b has no mixture-of-experts layers"):
        RunConfig(**{**base, "model": "llama3-8b", "experts": None}, balance_loss=0.1).check()
    with pytest.raises(ConfigError, match="--balance-loss shapes an architecture"):
        RunConfig(model="gpt", layers=2, hidden=16, heads=4, pp=1, balance_loss=0.1).check()


# A coefficient large enough that the loss moves the routers far from the model loss alone
BASE = {"model": "mixtral-8x7b", "hidden": 16, "heads": 4, "kv_heads": 2, "seq_len": 8, "vocab": 37,
        "batch_size": 8, "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02, "return_grads": True,
        "experts": 4, "ffn_hidden": 32, "layers": 4, "microbatches": 4, "balance_loss": 1.0, "schedule": "1f1b",
        "pp": 2}
CASES = LaunchedCases(BASE, {4: {
    "pp2-dp2-zero1": {"dp": 2, "zero": 1},
    "pp2-dp2-ep2": {"dp": 2, "ep": 2},
    "pp2-tp2-sp": {"tp": 2, "sequence_parallel": True},
    "pp2-cp2-full-recompute": {"cp": 2, "recompute": "full"},
    "zbv-dp2": {"schedule": "zbv", "virtual_stages": 2, "dp": 2},
    "dualpipe-dp2-zero3": {"dp": 2, "zero": 3, "schedule": "dualpipe", "virtual_stages": 2},
    "deepseek-pp2-cp2": {"model": "deepseek-v3", "kv_heads": None, "cp": 2, "expert_bias_rate": 0.05},
}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_pipelined_runs_with_the_loss_equal_the_reference(name: str) -> None:
    assert_run_and_weights_equal_reference(CASES, name)


def test_the_reference_trains_with_the_loss() -> None:
    config = CASES.config("pp2-dp2-zero1")
    with_loss, without = reference_run(config), reference_run(RunConfig(**{**BASE, "balance_loss": 0.0}))
    routers = [name for name in with_loss["grads"] if name.endswith("router.gate.weight")]
    assert routers and all((with_loss["grads"][name] - without["grads"][name]).abs().max() > 1e-4
                           for name in routers)
    assert with_loss["losses"][0] == pytest.approx(without["losses"][0], abs=1e-12)  # the model's loss reported
