"""Results the ranks send back are held in the caller's own memory: a session that keeps
many runs' gradients and weights (the test suite's cached launches) must not hold a
file descriptor per tensor, or a later run's results cannot be received ("received 0
items of ancdata", once the process's descriptors run out)."""

from __future__ import annotations

import os

import pytest
import torch

from executor.config import RunConfig
from executor.launch import launch, unshared

pytestmark = pytest.mark.timeout(120)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_nested_tensors_are_copied_out_of_shared_memory() -> None:
    shared = torch.arange(4.0).share_memory_()
    own = torch.ones(2)
    value = unshared({"a": [shared, (own, 3)], "b": "text"})
    assert not value["a"][0].is_shared() and torch.equal(value["a"][0], shared)
    assert value["a"][1][0] is own and value["a"][1][1] == 3 and value["b"] == "text"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_kept_results_hold_no_descriptors() -> None:
    config = RunConfig(model="gpt", pp=2, layers=2, hidden=16, heads=2, seq_len=8, vocab=32, batch_size=4,
                       microbatches=2, steps=1, return_grads=True)
    kept = [launch(config)]
    before = open_descriptors()
    kept += [launch(config) for _ in range(3)]
    grads = kept[-1][0]["grads"]
    assert grads and not any(grad.is_shared() for grad in grads.values())
    # each run returns 30-odd tensors; shared, three runs would hold about a hundred descriptors more
    assert open_descriptors() - before < 20
