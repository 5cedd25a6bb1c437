"""3-D parallel numerics: dp replicas and tp-split stages around the pipeline, on gloo,
equal the one-process reference over the same global batch.

Launches dominate the cost on a 2-core CI machine, so every world size is launched once:
the 4-process job runs (dp=2, pp=2, tp=1) and (dp=1, pp=2, tp=2) configs, the
8-process job (dp=2, pp=2, tp=2); each test reads its config's result.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from executor.config import ConfigError, RunConfig
from executor.launch import launch
from executor.mesh import MeshPosition
from executor.reference import reference_run
from pipesim.cluster.mapping import map_ranks
from pipesim.cluster.presets import ideal
from schedules.generators import generate
from tests.test_executor import split_backward

pytestmark = pytest.mark.timeout(240)

SCHEDULES = ("1f1b", "interleaved-1f1b")
# (dp, pp, tp, schedule, variant): "sp" turns on sequence parallelism, "buckets" makes
# the dp buckets small enough that every stage's gradient takes several, "IW" splits
# every backward into I and W (the reduction then follows each stage's last W).
CASES = [(2, 2, 1, schedule, "") for schedule in SCHEDULES] + [(2, 2, 1, "1f1b", "IW")] + \
        [(1, 2, 2, schedule, "") for schedule in SCHEDULES] + [(1, 2, 2, "1f1b", "sp"), (1, 2, 2, "1f1b", "IW")] + \
        [(2, 2, 2, "1f1b", ""), (2, 2, 2, "interleaved-1f1b", "buckets")]
_launched: dict[int, dict] = {}


def case_config(dp: int, pp: int, tp: int, schedule: str, variant: str) -> RunConfig:
    """A tiny float64 gpt over a global batch of dp * (2m + 1) (uneven microbatches)."""
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    microbatches = pp
    custom = split_backward(generate(schedule, pp, microbatches, virtual)) if variant == "IW" else None
    return RunConfig(schedule=schedule, pp=pp, dp=dp, tp=tp, microbatches=microbatches, virtual_stages=virtual,
                     model="gpt", hidden=8, heads=2, layers=pp * virtual + 1, seq_len=4, vocab=11,
                     batch_size=dp * (2 * microbatches + 1), steps=3, dtype="float64", optimizer="adamw", lr=0.05,
                     return_grads=True, sequence_parallel=variant == "sp",
                     dp_bucket_mb=0.0005 if variant == "buckets" else 25.0, custom_schedule=custom)


def result_of(case: tuple) -> dict:
    """The result of one case, launching its world size's job on first use."""
    world = case[0] * case[1] * case[2]
    if world not in _launched:
        own = [c for c in CASES if c[0] * c[1] * c[2] == world]
        _launched[world] = dict(zip(own, launch([case_config(*c) for c in own]), strict=True))
    return _launched[world][case]


def case_id(case: tuple) -> str:
    dp, pp, tp, schedule, variant = case
    return f"dp{dp}-pp{pp}-tp{tp}-{schedule}" + (f"-{variant}" if variant else "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_3d_step_matches_one_process_reference(case: tuple) -> None:
    config = case_config(*case)
    result, reference = result_of(case), reference_run(config)
    assert sorted(result["grads"]) == sorted(reference["grads"])
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    assert (result["dp"], result["tp"], result["global_batch_size"]) == (config.dp, config.tp, config.batch_size)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_3d_trace_shows_dp_and_tp_communication(case: tuple) -> None:
    dp, pp, tp, schedule, variant = case
    trace = result_of(case)["trace"]
    assert (trace.meta["dp"], trace.meta["pp"], trace.meta["tp"]) == (dp, pp, tp)
    streams = Counter(event.stream for event in trace.events)
    assert (streams["dp"] > 0) == (dp > 1)
    assert (streams["tp"] > 0) == (tp > 1)
    last_backward = {}
    for event in trace.events:
        if event.stream == "compute" and event.kind in ("B", "W"):
            last_backward[event.stage] = max(last_backward.get(event.stage, (0.0, 0.0)), (event.start, event.end))
    for event in trace.events:
        if event.stream == "dp":
            # A bucket's reduction starts during its stage's last backward, once the bucket is full.
            assert event.start >= last_backward[event.stage][0] - 1e-9
            assert event.end >= event.start
    if variant == "buckets":  # several buckets a stage: the first leaves while the backward still runs
        for stage, (_, end) in last_backward.items():
            assert min(e.start for e in trace.events if e.stream == "dp" and e.stage == stage) < end
    stages = {event.stage for event in trace.events if event.stream == "dp"}
    if dp > 1:
        assert stages == set(range(pp * (2 if schedule == "interleaved-1f1b" else 1)))
        buckets = Counter(event.stage for event in trace.events if event.stream == "dp")
        assert (min(buckets.values()) > 1) == (variant == "buckets")


def test_mesh_numbers_ranks_as_the_cluster_model() -> None:
    mapping = map_ranks(ideal(), dp=2, pp=3, tp=2)
    for rank in range(12):
        position = MeshPosition.of_rank(rank, dp=2, pp=3, tp=2)
        assert mapping.global_rank(position.dp_index, position.pp_index, position.tp_index) == rank
        assert position.global_rank(position.pp_index) == rank
    assert MeshPosition.of_rank(5, dp=2, pp=3, tp=2).pipeline_ranks() == (1, 5, 9)


@pytest.mark.parametrize(("changes", "message"), [
    ({"tp": 3}, "--tp 3 must divide --heads 2"),
    ({"tp": 2, "model": "mlp"}, "use --model gpt"),
    ({"dp": 2, "batch_size": 5}, "split evenly across --dp 2"),
    ({"dp": 2, "batch_size": 6, "microbatches": 4}, "use --batch-size >= 8"),
    ({"sequence_parallel": True}, "--sequence-parallel needs --tp > 1"),
])
def test_3d_config_errors_name_the_values(changes: dict, message: str) -> None:
    settings = {"model": "gpt", "hidden": 8, "heads": 2, "batch_size": 8, **changes}
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        RunConfig(**settings).check()


def test_pipesim_run_3d_prints_the_batch_split_and_draws_dp_and_tp(tmp_path, capsys) -> None:
    from pipesim.cli import main  # noqa: PLC0415 - the command line on top of the executor

    out, html = tmp_path / "run.json", tmp_path / "run.html"
    code = main(["run", "--dp", "2", "--pp", "1", "--tp", "2", "--model", "gpt", "--layers", "2", "--hidden", "8",
                 "--heads", "2", "--seq-len", "4", "--vocab", "11", "--batch-size", "4", "--microbatches", "2",
                 "--json", str(out), "--html", str(html)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "dp=2 pp=1 tp=2 (world 4)" in printed
    assert "global batch 4: 2 per dp replica, in 2 microbatches per replica" in printed
    document = json.loads(out.read_text())
    assert (document["dp"], document["tp"], document["global_batch_size"], document["world_size"]) == (2, 2, 4, 4)
    assert document["comm"]["dp"]["total"] > 0 and document["comm"]["tp"]["total"] > 0
    chart = html.read_text()
    assert "ALLREDUCE_DP" in chart and "TP(0F0)" in chart
