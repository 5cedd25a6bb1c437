"""Bidirectional DualPipe executed: two copies of the model along one pipeline, fed from
both ends (``executor.copies``). For pp in {2, 4} on gloo, float64, with an uneven batch
and an uneven layer split, and pp 2 beside dp 2: every step's loss, every gradient and
the weights after the last step equal the one-process reference to 1e-10 (each copy sees
half the microbatches; the all-reduce with the mirror rank gives each the whole batch's
gradient), each rank runs exactly its program, and the memory it holds is what ``run``
predicts within 10%. ``profile`` and ``compare`` refuse it in one line."""

from __future__ import annotations

import pytest

from executor.config import RunConfig, build_schedule
from executor.copies import data_index, model_stage
from executor.launch import launch
from executor.reference import reference_run
from pipesim.cli import main
from pipesim.cli.run_memory import peak_lines
from schedules.trace import Trace
from tests.program_checks import assert_each_rank_ran_its_program

pytestmark = pytest.mark.timeout(300)

CASES = [(2, "mlp", 1), (4, "mlp", 1), (2, "gpt", 1), (2, "gpt", 2)]
_launched: dict[tuple[int, str, int], dict] = {}


def case_config(pp: int, model: str, dp: int = 1) -> RunConfig:
    """4p microbatches (2p from each end, dualpipe's least) over a batch of 8p + 1 per
    replica, uneven (dp 2: one more sequence to split), one layer more than stages (an
    uneven split), AdamW over 3 steps."""
    microbatches = 4 * pp
    return RunConfig(schedule="dualpipe", pp=pp, dp=dp, microbatches=microbatches, virtual_stages=2, model=model,
                     layers=pp + 1, hidden=8, heads=2, seq_len=4, vocab=11, batch_size=dp * (2 * microbatches + 1),
                     steps=3, dtype="float64", optimizer="adamw", lr=0.05, return_grads=True)


def result_of(case: tuple[int, str, int]) -> dict:
    if case not in _launched:
        (_launched[case],) = launch([case_config(*case)])
    return _launched[case]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"p{case[0]}-{case[1]}-dp{case[2]}")
def test_dualpipe_matches_one_process_reference(case: tuple[int, str, int]) -> None:
    config = case_config(*case)
    result, reference = result_of(case), reference_run(config)
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-10, rel=0)
    assert sorted(result["grads"]) == sorted(reference["grads"])  # model stages, both copies named alike
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max().item() < 1e-10, name
    for name, weight in reference["params"].items():
        assert (result["params"][name] - weight).abs().max().item() < 1e-10, name


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"p{case[0]}-{case[1]}-dp{case[2]}")
def test_each_rank_runs_its_program(case: tuple[int, str, int]) -> None:
    """(The copies' gradient all-reduce after the program is on the dp lane: not an action of it.)"""
    trace = result_of(case)["trace"]
    actions = Trace([event for event in trace.events if event.stream != "dp"], trace.meta)
    assert_each_rank_ran_its_program(build_schedule(case_config(*case)), actions)


def test_the_copies_map_to_model_stages_and_halves_of_the_batch() -> None:
    """pp 4: pipeline stages 0-3 are copy 0's model stages 0-3, stages 4-7 copy 1's;
    copy 1's microbatch i is the step's microbatch 8 + i (8 from each end)."""
    schedule = build_schedule(case_config(4, "mlp"))  # (one replica's pipeline)
    assert [model_stage(schedule, stage) for stage in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert schedule.microbatches == 8 and data_index(schedule, 5, 3) == 11 and data_index(schedule, 2, 3) == 3
    assert schedule.first_stages == {0, 4} and schedule.last_stages == {3, 7}  # each copy reads data, takes a loss
    # rank r holds model stage r of copy 0 and model stage pp - 1 - r of copy 1
    assert [sorted(model_stage(schedule, stage) for stage in schedule.stages_of(rank)) for rank in range(4)] == \
        [[0, 3], [1, 2], [1, 2], [0, 3]]


def test_the_copies_gradient_all_reduce_is_on_the_dp_lane_and_memory_is_predicted() -> None:
    result = result_of((2, "gpt", 1))
    trace = result["trace"]
    reductions = [event for event in trace.events if event.stream == "dp"]
    assert sorted({event.rank for event in reductions}) == [0, 1] and len(reductions) == 4  # two stages a rank
    assert trace.meta["copies"] == 2
    lines = peak_lines({"memory": result["memory"]}, case_config(2, "gpt"))
    errors = [float(line.split("(")[1].split("%")[0]) for line in lines if "peak measured" in line]
    assert len(errors) == 2 and all(abs(error) <= 10 for error in errors), lines


@pytest.mark.parametrize("command", ["profile", "compare"])
def test_profile_and_compare_refuse_it_in_one_line(command: str, capsys, tmp_path) -> None:
    out = ["--out", str(tmp_path / "costs.json")] if command == "profile" else []
    assert main([command, "--schedule", "dualpipe", "--pp", "2", "-m", "4", "--model", "gpt", "--layers", "2",
                 "--hidden", "8", "--heads", "2", "--seq-len", "4", "--batch-size", "8", "--backend", "gloo",
                 *out]) == 2
    error = capsys.readouterr().err.strip()
    assert f"{command} --schedule dualpipe: {command} measures the stages of one copy of the model" in error
    assert "\n" not in error
