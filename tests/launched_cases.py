"""Executor cases launched together, once a session, and compared with the one-process
reference: each world size's cases share one launch (starting process groups is most of
a multi-process test's time)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from executor.config import RunConfig
from executor.launch import launch


class LaunchedCases:
    """``cases_of_world[world][name]``: a case's RunConfig fields over ``base``."""

    def __init__(self, base: dict, cases_of_world: dict[int, dict[str, dict]]) -> None:
        self.base = base
        self.cases_of_world = cases_of_world
        self.cases = {name: case for cases in cases_of_world.values() for name, case in cases.items()}
        self.results: dict[str, dict] = {}

    def config(self, name: str) -> RunConfig:
        return RunConfig(**{**self.base, **self.cases[name]})

    def result(self, name: str) -> dict:
        """The launched result of case ``name`` (launching its world's cases on first use)."""
        if name not in self.results:
            names = list(next(cases for cases in self.cases_of_world.values() if name in cases))
            self.results.update(zip(names, launch([self.config(case) for case in names]), strict=True))
        return self.results[name]

    def tp_collectives_per_action(self, name: str) -> dict[str, set[int]]:
        """Per stage and kind (``"0F"``), the numbers of tp collectives the actions of case
        ``name`` held (the events of its trace's ``tp`` stream)."""
        counts = Counter(event.action for event in self.result(name)["trace"].events if event.stream == "tp")
        per_kind: dict[str, set[int]] = {}
        for action, count in counts.items():
            inner = action[action.index("(") + 1:action.index(")")]  # "TP(0F1)" -> "0F1"
            per_kind.setdefault(inner.rstrip("0123456789"), set()).add(count)
        return per_kind


def assert_weights_equal_reference(result: dict, reference: dict, tolerance: float = 1e-10) -> None:
    """Every weight after the run's last optimizer step within ``tolerance`` of the reference's."""
    for parameter, weight in reference["params"].items():
        assert (result["params"][parameter] - weight).abs().max().item() < tolerance, parameter


def assert_run_and_weights_equal_reference(cases: LaunchedCases, name: str) -> dict:
    """Case ``name``'s losses, gradients and final weights against the one-process
    reference's (float64: 1e-10); the reference's result, and its last model stage
    (``last_stage``), for what a test checks beyond."""
    from executor.reference import reference_run  # noqa: PLC0415 - torch's runs only where a test launches

    result, reference = cases.result(name), reference_run(cases.config(name))
    assert_equals_reference(result, reference)
    assert_weights_equal_reference(result, reference)
    return reference


def last_stage(reference: dict) -> int:
    """The last model stage a run's weights name (``"{stage}.{name}"``)."""
    return max(int(key.split(".")[0]) for key in reference["params"])


def assert_equals_reference(result: dict, reference: dict, tolerance: float = 1e-10) -> None:
    """Losses and every gradient within ``tolerance`` of the reference's, no gradient missing."""
    assert result["losses"] == pytest.approx(reference["losses"], abs=tolerance, rel=0)
    assert sorted(result["grads"]) == sorted(reference["grads"])
    for parameter, grad in reference["grads"].items():
        assert torch.allclose(result["grads"][parameter], grad, atol=tolerance, rtol=0), parameter

