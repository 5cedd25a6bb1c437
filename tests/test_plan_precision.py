"""``pipesim plan --fp8 / --comm-sms``: every layout planned as ``pipesim simulate`` runs it
with the same flags, refused in one line where simulate refuses them; and a plan's rows
name their model, so ``pipesim run --plan plan.json --row N`` builds the plan's model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipesim.cli import build_parser, main
from pipesim.cli.plan_row import config_from_plan_row
from pipesim.job import Job, simulate_job
from pipesim.plan.request import PlanRequest, plan

pytestmark = pytest.mark.timeout(180)

# one node of H100s, a layout space of a handful: tp 2 with sequence parallelism, one schedule
SMALL = dict(model="gpt3-1.3b", gpus=8, global_batch=16, topology="nvlink", schedules=("1f1b",),
             microbatch_sizes=(2,), recompute=("none",), zero=(1,), sequence_parallel=(True,),
             constraints=("tp=2", "pp=1"), top=1, workers=1)


def simulated_step(row: dict, **flags) -> float:
    """The step ``pipesim simulate`` gives the row's layout with ``flags``: built from
    the row's fields, not by the plan's evaluator."""
    job = Job(model=row["model"], schedule=row["schedule"], pp=row["pp"], microbatches=row["microbatches"],
              virtual_stages=row["virtual_stages"], microbatch_size=row["microbatch_size"], tp=row["tp"],
              dp=row["dp"], zero=row["zero"], recompute=row["recompute"],
              sequence_parallel=row["sequence_parallel"], topology="nvlink", nodes=1, **flags)
    return simulate_job(job).metrics.makespan


@pytest.fixture(scope="module")
def bf16_row() -> dict:
    (row,) = plan(PlanRequest(**SMALL)).rows
    return row


def test_fp8_plans_each_layout_as_simulate_fp8_does(bf16_row):
    (row,) = plan(PlanRequest(**SMALL, fp8=True)).rows
    assert row["layout"] == bf16_row["layout"]
    assert row["step_time"] == pytest.approx(simulated_step(row, fp8=True), rel=1e-9)
    assert bf16_row["step_time"] == pytest.approx(simulated_step(bf16_row), rel=1e-9)
    assert row["step_time"] < 0.9 * bf16_row["step_time"]  # the weight GEMMs run faster in FP8


def test_fp8_current_scaling_plans_each_layout_as_simulate_does(bf16_row):
    (delayed,) = plan(PlanRequest(**SMALL, fp8=True)).rows
    (row,) = plan(PlanRequest(**SMALL, fp8="current")).rows
    assert row["step_time"] == pytest.approx(simulated_step(row, fp8="current"), rel=1e-9)
    assert delayed["step_time"] < row["step_time"] < bf16_row["step_time"]  # the amax passes cost HBM time
    with pytest.raises(ValueError, match="--fp8 is on or off .* or a scaling \\(delayed, current\\), got 'dynamic'"):
        plan(PlanRequest(**SMALL, fp8="dynamic"))


def test_comm_sms_plans_each_layout_as_simulate_does(bf16_row):
    (row,) = plan(PlanRequest(**SMALL, comm_sms=20)).rows
    assert row["layout"] == bf16_row["layout"]
    assert row["step_time"] == pytest.approx(simulated_step(row, comm_sms=20), rel=1e-9)
    assert row["step_time"] > bf16_row["step_time"]  # 20 of 132 SMs kept off the GEMMs


def test_the_command_passes_fp8_and_comm_sms_to_the_plan(tmp_path, bf16_row):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "16", "--topology", "nvlink",
                 "--schedules", "1f1b", "--microbatch-sizes", "2", "--recompute", "none", "--zero", "1",
                 "--sequence-parallel", "on", "--constraint", "tp=2", "--constraint", "pp=1", "--top", "1",
                 "--workers", "1", "--quiet", "--fp8", "--comm-sms", "20", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["ranked"]
    assert row["step_time"] == pytest.approx(simulated_step(row, fp8=True, comm_sms=20), rel=1e-9)


@pytest.mark.parametrize(("flags", "message"), [
    (["--fp8", "--gpu", "a100-80gb"], "--fp8: a100-80gb has no FP8 tensor cores"),
    (["--comm-sms", "132"], "--comm-sms 132: h100 has 132 SMs; keep 0 to 131"),
    (["--comm-sms", "-1"], "--comm-sms must be a whole number of SMs >= 0, got -1"),
    (["--comm-sms", "two"], "argument --comm-sms: invalid int value: 'two'"),
])
def test_bad_precision_flags_are_refused_in_one_line(flags, message, capsys):
    try:
        code = main(["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "16", "--topology", "nvlink",
                     "--quiet", *flags])
    except SystemExit as exit_info:  # argparse's own refusals
        code = exit_info.code
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 or "usage" in error[0], error
    assert message in error[-1]


def test_fp8_with_a_profiled_compute_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--fp8 conflicts with --compute-model fitted.json"):
        plan(PlanRequest(**{**SMALL, "compute_model": "fitted.json", "fp8": True}))


# rows that name their model, and run --plan building it


def test_rows_name_a_preset_by_name_and_a_config_by_its_absolute_path(tmp_path, monkeypatch, bf16_row):
    assert bf16_row["model"] == "gpt3-1.3b"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256,
                                  "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512,
                                  "vocab_size": 1000, "max_position_embeddings": 512}))
    monkeypatch.chdir(tmp_path)
    (row,) = plan(PlanRequest(**{**SMALL, "model": "config.json", "constraints": ("tp=2", "pp=1")})).rows
    assert row["model"] == str(config.resolve())


def planned(argv: list[str]):
    return config_from_plan_row(build_parser("run").parse_args(["run", *argv]))


def write_plan(tmp_path: Path, **row) -> str:
    layout = dict(schedule="1f1b", pp=1, tp=2, dp=1, virtual_stages=1, microbatch_size=2, microbatches=2,
                  recompute="none", zero=0, sequence_parallel=True, layout="1f1b pp1 tp2 dp1 mbs2 m2 sp")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"ranked": [{**layout, **row}]}))
    return str(path)


def test_run_builds_the_rows_model_with_whole_kv_heads_per_tp_rank(tmp_path):
    path = write_plan(tmp_path, model="llama3-8b")
    config, line = planned(["--plan", path, "--row", "1"])
    assert config.model == "llama3-8b"
    # the run's 4 heads keep Llama 3 8B's grouping (32 / 8): 1 kv head, raised to tp 2; heads a multiple of both
    assert config.kv_heads == 2 and config.heads % 2 == 0 and config.heads % config.kv_heads == 0
    assert "model shrunk to llama3-8b" in line and "do not name" not in line
    # the run may repeat the plan's model, not change it
    assert planned(["--plan", path, "--row", "1", "--model", "llama3-8b"])[0].model == "llama3-8b"
    with pytest.raises(ValueError, match=r"--model gpt conflicts with --plan .*: row 1 was planned for llama3-8b; "
                                         r"drop --model"):
        planned(["--plan", path, "--row", "1", "--model", "gpt"])


def test_a_row_without_a_model_runs_the_runs_model(tmp_path):
    path = write_plan(tmp_path)
    config, line = planned(["--plan", path, "--row", "1"])
    assert config.model == "gpt" and "the plan's rows do not name its model" in line
    assert planned(["--plan", path, "--row", "1", "--model", "llama3-8b"])[0].model == "llama3-8b"
