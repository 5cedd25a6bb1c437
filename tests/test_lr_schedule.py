"""The learning rate's warm-up and decay (``--lr-warmup``, ``--lr-decay``,
``--min-lr-ratio``): factors worked by hand after torchtitan's schedule, a step's rate
equal to a constant rate of that size, and a pipelined run's weights equal to the
one-process reference's under the schedule."""

from __future__ import annotations

import math

import pytest
import torch

from executor.config import ConfigError, RunConfig
from executor.lr_schedule import lr_factor
from executor.reference import reference_run
from tests.launched_cases import LaunchedCases, assert_run_and_weights_equal_reference

pytestmark = pytest.mark.timeout(300)


def test_warm_up_then_decay_by_hand() -> None:
    # 10 steps, 3 of warm-up: 1/4, 2/4, 3/4; then p = (s + 1 - 3) / 8 for s = 3..9
    assert [lr_factor(s, 10, 3) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75], abs=0)
    assert [lr_factor(s, 10, 3) for s in range(3, 10)] == [1.0] * 7  # no decay: constant
    assert lr_factor(3, 10, 3, "linear") == pytest.approx(1 - 1 / 8, rel=1e-15)
    assert lr_factor(9, 10, 3, "linear") == pytest.approx(1 - 7 / 8, rel=1e-15)
    assert lr_factor(3, 10, 3, "linear", 0.1) == pytest.approx(0.1 + 0.9 * 7 / 8, rel=1e-15)
    assert lr_factor(3, 10, 3, "cosine") == pytest.approx((1 + math.cos(math.pi / 8)) / 2, rel=1e-15)
    assert lr_factor(9, 10, 3, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * (1 + math.cos(7 * math.pi / 8)) / 2,
                                                              rel=1e-15)
    # the factor a scheduler moves to after the last step stays defined (and at the floor's side)
    assert lr_factor(10, 10, 3, "linear") == lr_factor(12, 10, 3, "linear") == pytest.approx(0.0, abs=1e-15)


SMALL = {"model": "llama3-8b", "layers": 2, "hidden": 16, "heads": 4, "kv_heads": 2, "seq_len": 8, "vocab": 37,
         "batch_size": 4, "microbatches": 2, "dtype": "float64", "pp": 1, "return_grads": True}


def test_a_warm_up_steps_rate_is_its_share_of_the_rate() -> None:
    # SGD, one step at the warm-up's first factor 1/3 of 0.3 moves the weights as 0.1 does
    warmed = reference_run(RunConfig(**SMALL, steps=1, optimizer="sgd", lr=0.3, lr_warmup=2))
    plain = reference_run(RunConfig(**SMALL, steps=1, optimizer="sgd", lr=0.3 / 3))
    for name, weight in plain["params"].items():
        torch.testing.assert_close(warmed["params"][name], weight, rtol=1e-14, atol=1e-15)
    full = reference_run(RunConfig(**SMALL, steps=1, optimizer="sgd", lr=0.3))
    assert any(not torch.allclose(full["params"][name], weight) for name, weight in plain["params"].items())


@pytest.mark.parametrize(("flags", "words"), [
    ({"lr_warmup": -1}, "--lr-warmup must be a number of steps >= 0, got -1"),
    ({"lr_decay": "exponential"}, "--lr-decay 'exponential' is not one of: none, linear, cosine"),
    ({"min_lr_ratio": 1.5}, "--min-lr-ratio must be a share of the learning rate, between 0 and 1, got 1.5"),
    ({"min_lr_ratio": math.nan}, "--min-lr-ratio must be a share of the learning rate, between 0 and 1, got nan"),
])
def test_bad_schedules_are_refused_naming_the_flag(flags: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        RunConfig(**SMALL, **flags).check()


CASES = LaunchedCases({**SMALL, "steps": 4, "optimizer": "adamw", "lr": 0.02, "lr_warmup": 2, "lr_decay": "cosine",
                       "min_lr_ratio": 0.1, "pp": 2}, {4: {
                           "pp2-dp2-zero1": {"dp": 2, "zero": 1},
                           "pp2-dp2-zero3": {"dp": 2, "zero": 3},
                       }})


@pytest.mark.parametrize("name", list(CASES.cases))
def test_pipelined_runs_under_the_schedule_equal_the_reference(name: str) -> None:
    assert_run_and_weights_equal_reference(CASES, name)
