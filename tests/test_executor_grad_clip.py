"""Gradient clipping by the global norm (``--clip-grad``): the norm counts every element
once however the job spreads and copies the gradient (pipeline stages, tp splits and
replicas, dp averages, ZeRO shards, ep's experts, DualPipe's copies, tied embeddings),
so a pipelined float64 run's norms and weights equal the one-process reference's, which
equals torch's own ``clip_grad_norm_``."""

from __future__ import annotations

import pytest
import torch

from executor.config import ConfigError, RunConfig
from executor.grad_clip import clip_gradients, tp_copies
from executor.models import build_model, build_optimizer
from executor.reference import reference_run
from pipesim.model.spec import BUNDLED_CONFIGS
from tests.launched_cases import LaunchedCases, assert_equals_reference, assert_weights_equal_reference

pytestmark = pytest.mark.timeout(300)
QWEN3_TIED = str(BUNDLED_CONFIGS / "qwen3-0.6b.json")


def test_the_norm_counts_a_tensor_held_twice_once() -> None:
    grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    # this rank and one other hold the same tensor: each counts half, the all-reduce adds the other half
    norm = clip_gradients([(grad, 2)], 1.0, all_reduce=lambda total: total.mul_(2))
    assert norm == pytest.approx(5.0, abs=1e-12)
    assert grad.tolist() == pytest.approx([3 / (5 + 1e-6), 4 / (5 + 1e-6)], abs=1e-12)
    small = torch.tensor([0.3, 0.4], dtype=torch.float64)
    assert clip_gradients([(small, 1)], 1.0) == pytest.approx(0.5) and small.tolist() == [0.3, 0.4]  # under: kept


def test_a_parameter_tensor_parallelism_leaves_whole_is_held_by_every_tp_rank() -> None:
    assert tp_copies(torch.nn.Parameter(torch.zeros(2)), 4) == 4


def test_the_reference_clips_as_torch_does() -> None:
    config = RunConfig(model="gpt", pp=1, layers=2, hidden=16, heads=4, seq_len=8, vocab=37, batch_size=4,
                       microbatches=1, steps=3, dtype="float64", optimizer="sgd", lr=0.5, clip_grad=0.05)
    reference = reference_run(config)
    model = build_model(config)
    stage = model.build_stage(0, 1)
    optimizer = build_optimizer(config, stage.parameters())
    norms = []
    for step in range(config.steps):
        inputs, targets = model.make_batch(step, config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        (model.loss_sum(stage(inputs), targets) / config.batch_size).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(stage.parameters(), config.clip_grad).item())
        optimizer.step()
    assert reference["grad_norms"] == pytest.approx(norms, abs=1e-12, rel=0)
    assert all(norm > config.clip_grad for norm in norms)  # every step clipped
    for name, param in stage.named_parameters():
        assert torch.allclose(reference["params"][f"0.{name}"], param, atol=1e-12), name


def test_a_norm_that_clips_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match="--clip-grad must be a finite number > 0"):
        RunConfig(clip_grad=0.0).check()


BASE = {"model": "llama3-8b", "layers": 2, "hidden": 16, "heads": 4, "kv_heads": 2, "seq_len": 8, "vocab": 37,
        "batch_size": 8, "microbatches": 2, "steps": 2, "dtype": "float64", "optimizer": "sgd", "lr": 0.5,
        "clip_grad": 0.05, "return_grads": True, "schedule": "1f1b", "pp": 2}
MIXTRAL = {"model": "mixtral-8x7b", "experts": 4, "ffn_hidden": 32}
CASES = LaunchedCases(BASE, {4: {
    "dp2": {"dp": 2},
    "dp2-zero1": {"dp": 2, "zero": 1},
    "dp2-zero2": {"dp": 2, "zero": 2},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
    "cp2": {"cp": 2},
    "mixtral-dp2-ep2": {**MIXTRAL, "dp": 2, "ep": 2},
    "mixtral-dp2-ep2-zero1": {**MIXTRAL, "dp": 2, "ep": 2, "zero": 1},
    "dualpipe-dp2": {"schedule": "dualpipe", "virtual_stages": 2, "dp": 2, "microbatches": 4},
    "tied-dp2-zero1": {"model": QWEN3_TIED, "kv_heads": None, "dp": 2, "zero": 1},
}})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_pipelined_runs_clip_as_the_reference(name: str) -> None:
    result, reference = CASES.result(name), reference_run(CASES.config(name))
    assert all(norm > BASE["clip_grad"] for norm in reference["grad_norms"])  # clipping acts on every step
    assert result["grad_norms"] == pytest.approx(reference["grad_norms"], abs=1e-10, rel=0)
    assert_equals_reference(result, reference)
    assert_weights_equal_reference(result, reference)
