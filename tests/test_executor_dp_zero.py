"""Data parallelism as DDP and ZeRO run it: bucket reductions overlapped with the backward
that fills them, ZeRO-1/2's sharded optimizer and ZeRO-3 (FSDP2), on gloo, float64,
equal to the one-process reference.

One 4-process launch (dp 2 x pp 2, and dp 2 x tp 2) runs every case; each test reads its
case's result.
"""

from __future__ import annotations

from collections import Counter

import pytest

from executor.config import ConfigError, RunConfig
from executor.launch import launch
from executor.reference import reference_run
from schedules.generators import generate
from tests.test_executor import split_backward

pytestmark = pytest.mark.timeout(240)

TINY_BUCKETS = 0.0005  # MiB: a few parameters a bucket, so every stage has many buckets
# (zero, schedule, variant): "IW" splits every backward into I and W, "whole" keeps one
# bucket per stage (DDP's 25 MiB), "tp-sp" is dp 2 x tp 2 with sequence parallelism and no
# pipeline (tp-split DTensor parameters; the norms' gradients are partial sums over tp).
CASES = [(0, "1f1b", ""), (1, "1f1b", ""), (2, "1f1b", ""), (2, "1f1b", "IW"), (1, "interleaved-1f1b", "whole"),
         (2, "1f1b", "tp-sp"), (3, "interleaved-1f1b", "")]
# ZeRO-3 is FSDP2's: its collectives serve each unit's actions (tests/test_executor_fsdp_trace.py).
TRACED = [case for case in CASES if case[0] < 3]
_results: dict[tuple, dict] = {}


def case_config(zero: int, schedule: str, variant: str) -> RunConfig:
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    microbatches = 2
    custom = split_backward(generate(schedule, 2, microbatches, virtual)) if variant == "IW" else None
    tp = 2 if variant == "tp-sp" else 1
    return RunConfig(schedule=schedule, pp=2 // tp, dp=2, tp=tp, sequence_parallel=tp > 1, microbatches=microbatches,
                     virtual_stages=virtual, model="gpt", hidden=8, heads=2, layers=2 * virtual + 1, seq_len=4,
                     vocab=11, batch_size=10, steps=2, dtype="float64", optimizer="adamw", lr=0.05,
                     return_grads=True, zero=zero, dp_bucket_mb=25.0 if variant == "whole" else TINY_BUCKETS,
                     custom_schedule=custom)


def result_of(case: tuple) -> dict:
    if not _results:
        _results.update(zip(CASES, launch([case_config(*c) for c in CASES]), strict=True))
    return _results[case]


def case_id(case: tuple) -> str:
    zero, schedule, variant = case
    return f"zero{zero}-{schedule}" + (f"-{variant}" if variant else "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_losses_gradients_and_weights_equal_the_one_process_reference(case: tuple) -> None:
    config = case_config(*case)
    result, reference = result_of(case), reference_run(config)
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    assert sorted(result["params"]) == sorted(reference["params"])
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name
    for name, weight in reference["params"].items():  # after both AdamW steps
        assert (result["params"][name] - weight).abs().max().item() < 1e-10, name


@pytest.mark.parametrize("case", TRACED, ids=case_id)
def test_each_bucket_is_reduced_during_the_backward_that_fills_it(case: tuple) -> None:
    zero, schedule, variant = case
    config = case_config(*case)
    events = result_of(case)["trace"].events
    backwards: dict[int, list] = {}
    for event in events:
        if event.stream == "compute" and event.kind in ("B", "W"):
            backwards.setdefault(event.stage, []).append((event.start, event.end))
    reductions = [e for e in events if e.stream == "dp" and e.kind != "ALLGATHER_PARAMS"]
    assert {e.kind for e in reductions} == {"REDUCE_SCATTER_DP" if zero else "ALLREDUCE_DP"}
    per_stage = Counter(e.stage for e in reductions)
    assert set(per_stage) == set(range(config.num_stages))
    if zero == 2:  # every backward (each microbatch's) reduce-scatters every bucket
        buckets = {stage: len({e.action for e in reductions if e.stage == stage}) for stage in per_stage}
        assert per_stage == {stage: count * config.microbatches for stage, count in buckets.items()}
    else:  # the last backward only: each bucket once
        assert all(count == len({e.action for e in reductions if e.stage == stage})
                   for stage, count in per_stage.items())
    for event in reductions:
        if zero < 2:  # it starts inside the stage's last backward, not after it
            assert event.start >= max(backwards[event.stage])[0] - 1e-9
    if variant != "whole":  # several buckets a stage: the first leaves while that backward still runs
        for stage, spans in backwards.items():
            first = min(e.start for e in reductions if e.stage == stage)
            assert first < max(spans)[1]
    gathers = Counter(e.stage for e in events if e.kind == "ALLGATHER_PARAMS")
    if zero:  # one parameter all-gather per bucket after the optimizer, nothing else
        assert gathers == Counter({stage: len({e.action for e in reductions if e.stage == stage})
                                   for stage in per_stage})
    else:
        assert not gathers


# tp shards the parameters unevenly by kind: the pipelined cases count the replicas' halves.
@pytest.mark.parametrize("case", [case for case in CASES if case[2] != "tp-sp"], ids=case_id)
def test_zero_shards_the_optimizer_over_the_replicas(case: tuple) -> None:
    zero, _, variant = case
    config = case_config(*case)
    held = result_of(case)["optimizer_elements"]
    reference = reference_run(config)
    # Global rank r is pipeline rank r // 2 and replica r % 2 (tp 1): ranks 2k and 2k + 1
    # hold the same stages.
    num_stages, pp = config.num_stages, config.pp
    for pipeline_rank in range(pp):
        stages = [stage for stage in range(num_stages) if stage % pp == pipeline_rank]
        weights = [w for name, w in reference["params"].items() if int(name.split(".")[0]) in stages]
        elements = sum(w.numel() for w in weights)
        pair = held[2 * pipeline_rank], held[2 * pipeline_rank + 1]
        if zero == 3:  # FSDP: each parameter cut along its first dimension, the rows split about evenly
            assert sum(pair) == elements and all(0 < part < elements for part in pair)
        elif zero:  # the two replicas' shards partition the stages' parameters, about half each
            assert sum(pair) == elements
            # Each bucket splits into halves that differ by at most one element (padding);
            # a bucket holds one parameter or more (one per stage when they are 25 MiB).
            buckets = len(stages) if variant == "whole" else len(weights)
            assert all(abs(part - elements / 2) <= buckets / 2 for part in pair)
        else:
            assert pair == (elements, elements)


@pytest.mark.parametrize(("changes", "message"), [
    ({"zero": 1, "dp": 1}, "it needs --dp > 1"),
    ({"zero": 4}, "--zero 4 is not one of: 0, 1, 2, 3"),
])
def test_bad_zero_is_refused_naming_the_flag(changes: dict, message: str) -> None:
    base = {"pp": 2, "dp": 2, "batch_size": 8, "microbatches": 2}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(**{**base, **changes}).check()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_measured_static_memory_is_what_the_zero_table_predicts(case: tuple) -> None:
    from executor.report import summary  # noqa: PLC0415
    from pipesim.cli.run import predict_static_memory  # noqa: PLC0415

    zero = case[0]
    document = summary(result_of(case))
    lines = predict_static_memory(document, case_config(*case))
    # AdamW in float64: weights 8 + gradients 8 + two moments 16 bytes a parameter, sharded
    # as Rajbhandari et al.'s Table 1 says: 32, 24, 20, 16 bytes over dp 2 for ZeRO 0-3.
    assert f"{(32, 24, 20, 16)[zero]} bytes per parameter" in lines[0]
    for row in document["memory"]:
        assert row["static"] == pytest.approx(row["predicted_static"], rel=0.02), row
