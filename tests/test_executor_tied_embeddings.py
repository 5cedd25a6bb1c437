"""Tied input and output embeddings (``tie_word_embeddings``): the last stage keeps a
copy of the table whose gradient is summed with the table's (Megatron-LM's embedding
group), so the run trains the tied model. The one-process reference with its two
copies equals a model whose output layer *is* the table; pipelined float64 runs on
gloo equal the reference with the copies on different ranks (with dp, ZeRO-1, -2, -3,
tp with sequence parallelism) and on one rank (V-shaped zbv, DualPipe)."""

from __future__ import annotations

import pytest
import torch

from executor.architectures.build import shrink_note
from executor.config import RunConfig
from executor.data_parallel import bucket_parameters
from executor.models import build_model, build_optimizer
from executor.reference import reference_run
from pipesim.model.spec import BUNDLED_CONFIGS
from tests.launched_cases import LaunchedCases, assert_run_and_weights_equal_reference, last_stage

pytestmark = pytest.mark.timeout(300)
CONFIGS = BUNDLED_CONFIGS
QWEN3_TIED = str(CONFIGS / "qwen3-0.6b.json")  # tie_word_embeddings: true
GPT2 = str(CONFIGS / "gpt2.json")  # tied by its family's default


def small(model: str, **changes) -> RunConfig:
    fields = {"model": model, "layers": 2, "hidden": 16, "heads": 4, "seq_len": 8, "vocab": 37, "batch_size": 4,
              "microbatches": 2, "steps": 3, "dtype": "float64", "optimizer": "adamw", "lr": 0.02, "pp": 1,
              "return_grads": True}
    return RunConfig(**{**fields, **changes})


def test_the_head_starts_as_a_copy_of_the_table() -> None:
    config = small(QWEN3_TIED, pp=2)
    model = build_model(config)
    first, last = model.build_stage(0, 2), model.build_stage(1, 2)
    assert torch.equal(first.embed.tokens.weight, last.head[-1].weight)
    untied = build_model(small(str(CONFIGS / "qwen3-8b.json"), pp=2))
    assert not torch.equal(untied.build_stage(0, 2).embed.tokens.weight, untied.build_stage(1, 2).head[-1].weight)
    assert "embeddings tied" in shrink_note(config)


def truly_tied_losses(config: RunConfig) -> list[float]:
    """The same model on one process with its output layer's weight the table itself
    (one parameter, autograd sums its two uses), trained by the same optimizer."""
    model = build_model(config)
    stage = model.build_stage(0, 1)
    stage.head[-1].weight = stage.embed.tokens.weight
    optimizer = build_optimizer(config, stage.parameters())  # the shared weight listed once
    losses = []
    for step in range(config.steps):
        inputs, targets = model.make_batch(step, config.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss_sum(stage(inputs), targets) / config.batch_size
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_two_copies_with_summed_gradients_train_the_tied_model() -> None:
    config = small(QWEN3_TIED)
    reference = reference_run(config)
    assert reference["losses"] == pytest.approx(truly_tied_losses(config), abs=1e-12, rel=0)
    grads = reference["grads"]
    assert torch.equal(grads["0.embed.tokens.weight"], grads["0.head.1.weight"])
    # untied, the two weights get different gradients (what the sum replaces)
    untied = reference_run(small(str(CONFIGS / "qwen3-8b.json")))["grads"]
    assert not torch.equal(untied["0.embed.tokens.weight"], untied["0.head.1.weight"])


def test_a_tied_copy_gets_a_bucket_of_its_own() -> None:
    stage = build_model(small(QWEN3_TIED)).build_stage(0, 1)
    table, output = stage.embed.tokens.weight, stage.head[-1].weight
    buckets = bucket_parameters(stage, 1e12, alone={id(table), id(output)})
    ids = [[id(param) for param in bucket] for bucket in buckets]
    assert [id(table)] in ids and [id(output)] in ids
    assert len(buckets) == 3  # the rest together, as one bucket holds everything without ``alone``
    assert len(bucket_parameters(stage, 1e12)) == 1


BASE = {"model": QWEN3_TIED, "layers": 2, "hidden": 16, "heads": 4, "seq_len": 8, "vocab": 37, "batch_size": 8,
        "microbatches": 2, "steps": 2, "dtype": "float64", "optimizer": "adamw", "lr": 0.02, "return_grads": True,
        "schedule": "1f1b", "pp": 2}
CASES = LaunchedCases(BASE, {
    2: {"pp2": {}, "zbv-pp2": {"schedule": "zbv", "virtual_stages": 2, "layers": 4}},
    4: {"pp2-dp2": {"dp": 2},
        "pp2-dp2-zero1": {"dp": 2, "zero": 1},
        "pp2-dp2-zero2": {"dp": 2, "zero": 2},
        "pp2-dp2-zero3": {"dp": 2, "zero": 3},
        "gpt2-pp2-tp2-sp": {"model": GPT2, "tp": 2, "sequence_parallel": True},
        "dualpipe-pp2-dp2-zero1": {"schedule": "dualpipe", "virtual_stages": 2, "dp": 2, "zero": 1,
                                   "microbatches": 4}},
})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_pipelined_tied_runs_equal_the_reference(name: str) -> None:
    reference = assert_run_and_weights_equal_reference(CASES, name)
    assert torch.equal(reference["params"]["0.embed.tokens.weight"],
                       reference["params"][f"{last_stage(reference)}.head.1.weight"])
