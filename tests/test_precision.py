"""Training as people train: optimizer defaults, bf16 autocast over float32 master
weights, fp16 with dynamic loss scaling, and the dp gradient reduction's type.

Expected values come from hand calculation (AdamW's decoupled decay on a zero gradient,
a two-replica mean rounded through bf16) or from torch itself (``torch.amp.GradScaler``
as the loss-scaling reference, the one-process reference run), never from the code
under test. Every multi-process case is a 2-process gloo job on a tiny model.
"""

from __future__ import annotations

import argparse
import math
import os

import pytest
import torch
import torch.distributed as dist

from executor.config import ConfigError, RunConfig
from executor.launch import elastic_run, launch
from executor.models import MlpModel, build_model, build_optimizer
from executor.options import add_run_arguments, config_from_args
from executor.precision import LossScaler
from executor.reference import reference_run
from schedules.action import B

pytestmark = pytest.mark.timeout(240)


# -- optimizer defaults ---------------------------------------------------------------

def test_adamw_defaults_decay_matrices_only() -> None:
    """One AdamW step on zero gradients moves nothing but the decay: a matrix is scaled
    by exactly (1 - lr * wd) = 1 - 3e-4 * 0.1, a bias or norm weight is left alone."""
    config = RunConfig(model="gpt", pp=1, layers=1, hidden=8, heads=2, optimizer="adamw")
    stage = build_model(config).build_stage(0, 1)
    optimizer = build_optimizer(config, stage.parameters())
    assert {group["lr"] for group in optimizer.param_groups} == {3e-4}
    assert {group["betas"] for group in optimizer.param_groups} == {(0.9, 0.95)}
    before = {name: p.detach().clone() for name, p in stage.named_parameters()}
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    params = dict(stage.named_parameters())
    for name in ("embed.tokens.weight", "blocks.0.qkv.weight", "blocks.0.fc2.weight", "head.1.weight"):
        assert torch.equal(params[name].detach(), before[name] * (1 - 3e-4 * 0.1)), name
    for name in ("blocks.0.qkv.bias", "blocks.0.norm1.weight", "blocks.0.norm2.bias", "head.0.weight"):
        assert torch.equal(params[name].detach(), before[name]), name


def test_sgd_keeps_its_own_default() -> None:
    config = RunConfig(optimizer="sgd")
    optimizer = build_optimizer(config, [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))])
    assert [(group["lr"], group["weight_decay"]) for group in optimizer.param_groups] == [(0.01, 0.0), (0.01, 0.0)]
    assert RunConfig(optimizer="adamw", lr=1e-3, weight_decay=0.0).learning_rate == 1e-3


def test_flags_default_to_the_optimizers_own_values_and_help_says_so() -> None:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "sgd 0.01, adamw 0.0003" in text and "sgd 0, adamw 0.1" in text
    config = config_from_args(parser.parse_args(["--optimizer", "adamw"]))
    assert (config.lr, config.learning_rate, config.decay) == (None, 3e-4, 0.1)
    config = config_from_args(parser.parse_args(["--lr", "0.5", "--grad-reduce-dtype", "bfloat16"]))
    assert (config.learning_rate, config.reduce_dtype) == (0.5, "bfloat16")


@pytest.mark.parametrize(("field", "value", "flag"), [("lr", -0.1, "--lr"), ("weight_decay", -0.1, "--weight-decay"),
                                                      ("weight_decay", math.nan, "--weight-decay"),
                                                      ("grad_reduce_dtype", "int8", "--grad-reduce-dtype")])
def test_bad_optimizer_or_precision_values_name_the_flag(field: str, value, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        RunConfig(**{field: value}).check()


def test_mixed_precision_keeps_float32_master_weights() -> None:
    for dtype, master in (("bfloat16", torch.float32), ("float16", torch.float32), ("float64", torch.float64)):
        stage = build_model(RunConfig(model="gpt", hidden=8, heads=2, dtype=dtype)).build_stage(0, 2)
        assert {p.dtype for p in stage.parameters()} == {master}, dtype


# -- bf16 autocast: default AdamW runs learn, and bf16 tracks fp32 ----------------------

SMALL_GPT = dict(model="gpt", pp=2, layers=4, hidden=256, optimizer="adamw", steps=10)
_runs: dict[str, dict] = {}


def small_gpt_runs() -> dict[str, dict]:
    """fp32 and bf16 at the defaults, and fp32 at the former default lr (0.01), in one job."""
    if not _runs:
        configs = {"float32": RunConfig(**SMALL_GPT), "bfloat16": RunConfig(**SMALL_GPT, dtype="bfloat16"),
                   "float32-lr0.01": RunConfig(**SMALL_GPT, lr=0.01)}
        _runs.update(zip(configs, launch(list(configs.values())), strict=True))
    return _runs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_adamw_lowers_the_loss(dtype: str) -> None:
    losses = small_gpt_runs()[dtype]["losses"]
    assert len(losses) == 10
    assert losses[-1] < losses[0]
    assert sum(losses[-3:]) < sum(losses[:3])


def test_bf16_tracks_fp32_within_two_percent() -> None:
    runs = small_gpt_runs()
    fp32, bf16 = runs["float32"]["losses"], runs["bfloat16"]["losses"]
    worst = max(abs(b - f) / f for b, f in zip(bf16, fp32, strict=True))
    assert worst < 0.02
    assert bf16 != fp32  # the bf16 run really computed in bf16


def test_default_lr_ends_lower_than_the_former_sgd_default() -> None:
    """The issue's finding: AdamW at 0.01 (an SGD value) ends above where it would at 3e-4."""
    runs = small_gpt_runs()
    assert runs["float32"]["losses"][-1] < runs["float32-lr0.01"]["losses"][-1]


def test_pipelined_bf16_equals_the_one_process_bf16_reference() -> None:
    """Same casts in the pipeline as in one process: the curves agree to bf16-level
    accumulation differences (microbatches vs one batch), far tighter than bf16 vs fp32."""
    config = RunConfig(**{**SMALL_GPT, "pp": 1, "steps": 4}, dtype="bfloat16")
    reference = reference_run(config)["losses"]
    assert small_gpt_runs()["bfloat16"]["losses"][:4] == pytest.approx(reference, rel=2e-3)


# -- fp16: dynamic loss scaling, every rank skipping together ------------------------

class OverflowingMlp(MlpModel):
    """The built-in MLP whose *last* stage gets an inf weight gradient in step
    ``OVERFLOW_STEP``: only that stage's rank sees it, so the other rank skips the step
    only if the overflow flag is shared over the job."""

    OVERFLOW_STEP = 2

    def make_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.step = step
        return super().make_batch(step, batch_size)

    def build_stage(self, stage: int, num_stages: int) -> torch.nn.Module:
        module = super().build_stage(stage, num_stages)
        if stage == num_stages - 1:
            weight = module.blocks[-1][0].weight
            weight.register_hook(lambda grad: torch.full_like(grad, math.inf) if self.step == self.OVERFLOW_STEP
                                 else None)
        return module


def test_fp16_loss_scaling_skips_the_overflowing_step_on_every_rank() -> None:
    config = RunConfig(pp=2, hidden=32, batch_size=8, microbatches=4, steps=6, dtype="float16", optimizer="adamw",
                       lr=1e-2)
    (result,) = launch(config, OverflowingMlp(config))
    reference = reference_run(config, OverflowingMlp(config))
    assert reference["skipped_steps"] == [2]  # torch.amp.GradScaler's verdict
    assert result["skipped_steps"] == [2]  # rank 0 holds stage 0, whose own gradients were finite
    assert result["loss_scale"] == reference["loss_scale"] == 2.0**15
    # Had any rank stepped in step 2, every later loss would differ from GradScaler's run.
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-3)
    assert result["losses"][-1] < result["losses"][0]


@pytest.mark.parametrize("growth_interval", [1, 3])
def test_loss_scaler_follows_grad_scaler(growth_interval: int) -> None:
    """Step by step, the same scale, the same skipped steps and the same unscaled
    gradients as ``torch.amp.GradScaler`` on a one-process model."""
    overflows = [False, True, False, False, False, True, True, False, False, False]
    ours = LossScaler(enabled=True, growth_interval=growth_interval)
    theirs = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.0)
    for overflow in overflows:
        assert ours.scale == theirs.get_scale()
        grad = torch.tensor([1.5, -2.0, math.inf if overflow else 0.25])
        param.grad = grad * theirs.scale(torch.ones(()))  # the scaled gradient of loss = grad . param
        ours_grad = grad * ours.scale
        found = ours.unscale([ours_grad])
        theirs.unscale_(optimizer)
        assert found == overflow
        if not overflow:
            assert torch.equal(ours_grad, param.grad) and torch.equal(ours_grad, grad)
        theirs.step(optimizer)
        theirs.update()
        ours.update(found)
    assert ours.scale == theirs.get_scale()


# -- the dp gradient reduction's type ---------------------------------------------------

def reduce_on_two_replicas(reduce_dtype: str | None) -> dict:
    """Rank r sets gradient g_r on a one-layer stage, averages it with GradientAverager
    over a 2-process gloo group, and reports the types all_reduce was given."""
    from executor import data_parallel  # noqa: PLC0415

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seen = []
    all_reduce = data_parallel.dist.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    data_parallel.dist.all_reduce = recording
    try:
        stage = torch.nn.Linear(4, 4)
        for index, param in enumerate(stage.parameters()):
            generator = torch.Generator().manual_seed(10 * rank + index)
            param.grad = torch.randn(param.shape, generator=generator)
        dtype = getattr(torch, reduce_dtype) if reduce_dtype else None
        averager = data_parallel.GradientAverager({0: stage}, (B(0, 0),), dist.group.WORLD, 2,
                                                  reduce_dtype=dtype)
        averager.after_action(B(0, 0))
        averager.finish()
        return {"seen": seen, "grads": [p.grad.clone() for p in stage.parameters()]}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reduce_dtype", [None, "bfloat16"])
def test_grad_reduce_dtype_is_what_goes_on_the_wire(reduce_dtype: str | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = elastic_run(reduce_on_two_replicas, (reduce_dtype,), 2, 1)
    expected_wire = torch.bfloat16 if reduce_dtype else torch.float32
    for rank in (0, 1):
        assert results[rank]["seen"] == [expected_wire]
        for index, grad in enumerate(results[rank]["grads"]):
            shape = grad.shape
            g0 = torch.randn(shape, generator=torch.Generator().manual_seed(index))
            g1 = torch.randn(shape, generator=torch.Generator().manual_seed(10 + index))
            if reduce_dtype is None:  # float32: exactly the float32 mean
                assert torch.equal(grad, (g0 + g1) / 2)
            else:  # each replica's gradient and the sum rounded to bf16, then halved
                total = (g0.bfloat16().float() + g1.bfloat16().float()).bfloat16().float()
                assert torch.equal(grad, total / 2)
                assert not torch.equal(grad, (g0 + g1) / 2)
