"""The Python API in one process: a user's own stages, layouts, and the I/W split."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor import PipelineModel, RunConfig, reference_run, run_local
from executor.config import even_layout
from executor.models import build_model
from tests.test_executor import split_backward


class Scaled(nn.Module):
    """A user's layer: anything an ``nn.Module`` may be."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.linear(x)) * self.scale


class UserModel(PipelineModel):
    """Three user-defined stages, float64, classification loss on the last."""

    def build_stage(self, stage: int, num_stages: int) -> nn.Module:
        torch.manual_seed(100 + stage)
        return Scaled(6).double() if stage < num_stages - 1 else nn.Linear(6, 3).double()

    def boundary_shape(self, microbatch_size: int) -> tuple[int, ...]:
        return (microbatch_size, 6)

    def make_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 6, generator=generator, dtype=torch.float64), \
            torch.randint(3, (batch_size,), generator=generator)

    def loss_sum(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, target, reduction="sum")


def assert_matches(result: dict, reference: dict) -> None:
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    assert sorted(result["grads"]) == sorted(reference["grads"])
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name


def test_user_stages_run_and_match_reference() -> None:
    config = RunConfig(schedule="interleaved-1f1b", pp=1, microbatches=3, virtual_stages=3, batch_size=7,
                       steps=3, dtype="float64", return_grads=True, lr=0.1)
    assert_matches(run_local(config, UserModel()), reference_run(config, UserModel()))


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_zero_bubble_split_on_one_process(model: str) -> None:
    from schedules.generators import generate

    config = RunConfig(schedule="interleaved-1f1b", pp=1, microbatches=2, virtual_stages=3, model=model, layers=4,
                       hidden=8, heads=2, seq_len=3, vocab=7, batch_size=5, steps=2, dtype="float64",
                       return_grads=True, optimizer="adamw")
    custom = split_backward(generate("interleaved-1f1b", 1, 2, 3))
    config_iw = RunConfig(**{**config.__dict__, "custom_schedule": custom})
    assert_matches(run_local(config_iw), reference_run(config))


def test_layout_puts_every_layer_on_exactly_one_stage() -> None:
    assert even_layout(10, 4) == (2, 3, 3, 2)
    assert even_layout(5, 4) == (1, 2, 1, 1)
    assert sum(even_layout(17, 8)) == 17
    config = RunConfig(model="gpt", pp=2, virtual_stages=1, layers=5, hidden=8, heads=2, layout=(4, 1))
    model = build_model(config)
    first, last = model.build_stage(0, 2), model.build_stage(1, 2)
    assert (len(first.blocks), len(last.blocks)) == (4, 1)
    assert first.embed is not None and first.head is None and last.embed is None and last.head is not None
