"""Measured memory per rank (CPU: the tensors the executor holds, by kind) against hand
counts: parameters and AdamW's state from the parameter count, and the activations the
schedule keeps in flight (GPipe m microbatches on every rank, 1F1B p on the first and
one on the last), on gloo, float64."""

from __future__ import annotations

import pytest

from executor.config import RunConfig
from executor.launch import launch
from executor.reference import reference_run
from executor.report import summary, summary_lines

pytestmark = pytest.mark.timeout(240)

FLOAT64 = 8
CASES = [("gpipe", "none", "adamw"), ("1f1b", "none", "adamw"), ("1f1b", "full", "adamw"), ("1f1b", "none", "sgd")]
_results: dict[tuple, dict] = {}


def case_config(schedule: str, recompute: str, optimizer: str) -> RunConfig:
    return RunConfig(schedule=schedule, pp=2, microbatches=4, model="gpt", hidden=16, heads=2, layers=4, seq_len=8,
                     vocab=32, batch_size=8, steps=2, dtype="float64", optimizer=optimizer, recompute=recompute)


def memory_of(case: tuple) -> list[dict]:
    if not _results:
        _results.update(zip(CASES, launch([case_config(*c) for c in CASES]), strict=True))
    return _results[case]["memory"]


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_parameters_and_optimizer_state_are_counted_exactly(case: tuple) -> None:
    memory = memory_of(case)
    weights = reference_run(case_config(*case))["params"]
    for rank in (0, 1):  # pp 2, one stage each
        elements = sum(w.numel() for name, w in weights.items() if name.startswith(f"{rank}."))
        row = memory[rank]
        assert row["source"] == "tracked"
        assert row["params"] == elements * FLOAT64
        # AdamW keeps two moments per weight (its step counters are scalars); SGD nothing.
        assert row["optimizer"] == (2 * elements * FLOAT64 if case[2] == "adamw" else 0)
        assert row["peak"] >= row["params"] + row["optimizer"] + row["activations"]


def test_activations_in_flight_follow_the_schedule() -> None:
    gpipe, one_f_one_b = memory_of(CASES[0]), memory_of(CASES[1])
    # Every microbatch is the same size, so each keeps the same activations: GPipe holds
    # all m = 4 at once on both ranks, 1F1B p = 2 on rank 0 and 1 on the last rank.
    assert gpipe[0]["activations_peak"] == pytest.approx(2 * one_f_one_b[0]["activations_peak"], rel=1e-12)
    assert gpipe[1]["activations_peak"] == pytest.approx(4 * one_f_one_b[1]["activations_peak"], rel=1e-12)


def test_full_recompute_keeps_fewer_activations() -> None:
    plain, recomputed = memory_of(CASES[1]), memory_of(CASES[2])
    for rank in (0, 1):
        assert 0 < recomputed[rank]["activations_peak"] < plain[rank]["activations_peak"]


def test_memory_is_in_the_json_and_the_text() -> None:
    memory_of(CASES[0])
    result = _results[CASES[0]]
    document = summary(result)
    assert [row["rank"] for row in document["memory"]] == [0, 1]
    text = "\n".join(summary_lines(result, document))
    assert "measured memory" in text and "rank 1: peak" in text


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_split_backward_leaves_no_graph_behind(schedule: str) -> None:
    """The tracker's pack hook hands autograd a detached tensor: handing back the tensor
    itself made a saved output and its own node a cycle that a retained graph (I and W
    run with ``retain_graph``) never broke, so every split microbatch's activations
    outlived the run. After a run in this process, no tensor of its graphs is alive."""
    import gc
    import warnings

    import torch

    from executor.worker import run_local

    def graph_tensors() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on every live object touches deprecated torch aliases
            warnings.simplefilter("ignore", FutureWarning)
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)

    before = graph_tensors()
    run_local(RunConfig(schedule=schedule, pp=1, virtual_stages=2, microbatches=4, model="gpt", hidden=16, heads=2,
                        layers=4, seq_len=8, vocab=32, batch_size=8, steps=2, backend="gloo"))
    assert graph_tensors() == before
