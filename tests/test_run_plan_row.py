"""``pipesim run --plan plan.json --row N`` runs the layout a plan ranked, with the
parallel degrees kept and the model shrunk, and refuses in one line what it cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor.config import ConfigError
from executor.reference import reference_run
from pipesim.cli import build_parser, main
from pipesim.cli.plan_row import config_from_plan_row
from pipesim.model.spec import BUNDLED_CONFIGS

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """A real `pipesim plan --json` on 2 GPUs: rows with dp 2 + ZeRO 1/2/3 and tp 2 + sp."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", "--model", "gpt", "--gpus", "2", "--global-batch", "4", "--seq-len", "64",
                 "--topology", "ideal", "--top", "4", "--json", str(path), "--quiet", "--workers", "1",
                 "--schedules", "1f1b,gpipe"]) == 0
    return path


def rows_of(path: Path) -> list[dict]:
    return json.loads(path.read_text())["ranked"]


def planned(argv: list[str]):
    return config_from_plan_row(build_parser("run").parse_args(["run", *argv]))


def row_number(rows: list[dict], **wanted) -> int:
    return next(i + 1 for i, row in enumerate(rows) if all(row[k] == v for k, v in wanted.items()))


def test_the_rows_layout_is_kept_and_the_model_shrunk(plan_file: Path) -> None:
    rows = rows_of(plan_file)
    assert 3 in {row["zero"] for row in rows}  # ZeRO-3 rows run too (FSDP2)
    for number, row in enumerate(rows, start=1):
        config, line = planned(["--plan", str(plan_file), "--row", str(number), "--heads", "3", "--hidden", "24"])
        assert (config.schedule, config.pp, config.dp, config.tp, config.virtual_stages, config.microbatches) == \
               (row["schedule"], row["pp"], row["dp"], row["tp"], row["virtual_stages"], row["microbatches"])
        assert (config.zero, config.recompute, config.sequence_parallel) == \
               (row["zero"], row["recompute"], row["sequence_parallel"])
        assert config.batch_size == row["dp"] * row["microbatches"] * row["microbatch_size"]
        assert config.model == "gpt" and config.layers >= row["pp"] * row["virtual_stages"]
        # heads 3 cannot be split over tp 2: raised to 6 (hidden kept at 8 per head: 48).
        assert (config.heads, config.hidden) == ((6, 48) if row["tp"] == 2 else (3, 24))
        if row["sequence_parallel"]:
            assert config.seq_len % row["tp"] == 0
        assert line.startswith(f"plan row {number}: {row['layout']} kept") and "shrunk" in line


def test_the_run_clips_as_the_plan_priced(plan_file: Path, tmp_path: Path) -> None:
    """The plan priced gradient clipping at its default 1.0 and says so in every row; the
    run clips the same unless its own --clip-grad says otherwise. A row written before
    rows carried it runs without clipping (the executor's default); a bad value is refused."""
    document = json.loads(plan_file.read_text())
    assert {row["clip_grad"] for row in document["ranked"]} == {1.0}
    config, line = planned(["--plan", str(plan_file), "--row", "1"])
    assert config.clip_grad == 1.0 and line.endswith("gradients clipped to 1 as the plan priced")
    config, line = planned(["--plan", str(plan_file), "--row", "1", "--clip-grad", "0.5"])
    assert config.clip_grad == 0.5 and line.endswith("gradients clipped to 0.5")
    for value, expected in ((None, None), (0.0, None), (-1.0, "clip_grad -1.0 is not a norm >= 0"),
                            ("1", "clip_grad '1' is not a norm >= 0")):
        rows = [{key: item for key, item in row.items() if key != "clip_grad"} for row in document["ranked"]]
        if value is not None:
            rows[0]["clip_grad"] = value
        path = tmp_path / "edited.json"
        path.write_text(json.dumps({**document, "ranked": rows}))
        if expected is None:
            assert planned(["--plan", str(path), "--row", "1"])[0].clip_grad is None
        else:
            with pytest.raises(ConfigError, match=f"row 1's {expected}"):
                planned(["--plan", str(path), "--row", "1"])


def test_a_planned_row_runs_and_equals_the_one_process_reference(plan_file: Path, tmp_path: Path, capsys) -> None:
    rows = rows_of(plan_file)
    number = row_number(rows, dp=2, zero=1)
    argv = ["--plan", str(plan_file), "--row", str(number), "--dtype", "float64", "--steps", "2", "--layers", "2",
            "--hidden", "8", "--heads", "2", "--seq-len", "4", "--vocab", "11", "--optimizer", "adamw"]
    out = tmp_path / "run.json"
    assert main(["run", *argv, "--json", str(out), "--quiet"]) == 0
    assert f"plan row {number}: {rows[number - 1]['layout']} kept (world 2" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert (document["dp"], document["pp"], document["tp"]) == (2, rows[number - 1]["pp"], 1)
    config, _ = planned(argv)
    assert config.zero == 1
    assert document["losses"] == pytest.approx(reference_run(config)["losses"], abs=1e-10, rel=0)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_a_planned_zero3_row_with_a_split_backward_runs_and_equals_the_one_process_reference(
        schedule: str, tmp_path: Path, capsys) -> None:
    """A real plan of 4 GPUs over the zero-bubble schedules ranks pp 2 x dp 2 ZeRO-3 rows
    (FSDP2 under I and W); run executes the row and equals the reference."""
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt", "--gpus", "4", "--global-batch", "8", "--seq-len", "64",
                 "--topology", "ideal", "--top", "40", "--json", str(path), "--quiet", "--workers", "1",
                 "--schedules", schedule]) == 0
    rows = rows_of(path)
    number = row_number(rows, schedule=schedule, pp=2, dp=2, zero=3)
    argv = ["--plan", str(path), "--row", str(number), "--dtype", "float64", "--steps", "2", "--hidden", "8",
            "--heads", "2", "--seq-len", "4", "--vocab", "11", "--optimizer", "adamw"]
    out = tmp_path / "run.json"
    assert main(["run", *argv, "--json", str(out), "--quiet"]) == 0
    assert f"plan row {number}: {rows[number - 1]['layout']} kept (world 4" in capsys.readouterr().out
    config, _ = planned(argv)
    assert (config.schedule, config.zero) == (schedule, 3)
    document = json.loads(out.read_text())
    assert document["losses"] == pytest.approx(reference_run(config)["losses"], abs=1e-10, rel=0)


def refusal(argv: list[str], capsys) -> str:
    assert main(["run", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    return lines[0]


def test_what_run_cannot_execute_is_refused_in_one_line(plan_file: Path, tmp_path: Path, capsys) -> None:
    rows = rows_of(plan_file)
    edited = tmp_path / "auto.json"
    edited.write_text(json.dumps({"ranked": [{**rows[0], "schedule": "zb-auto"}]}))
    line = refusal(["--plan", str(edited)], capsys)
    assert "plan row 1" in line and "--schedule zb-auto builds its order from stage costs" in line
    assert "--row 9: " in refusal(["--plan", str(plan_file), "--row", "9"], capsys)
    assert "--pp conflicts with --plan" in refusal(["--plan", str(plan_file), "--pp", "2"], capsys)
    for edit, said in (({"microbatches": float("nan")}, "row 1: microbatches must be a whole number, got nan"),
                       ({"dp": 1.5}, "row 1: dp must be a whole number, got 1.5"),
                       ({"tp": None}, "row 1: tp must be a whole number, got None")):
        edited.write_text(json.dumps({"ranked": [{**rows[0], **edit}]}))
        assert said in refusal(["--plan", str(edited)], capsys)
    edited.write_text(json.dumps({"ranked": [{"schedule": "1f1b", "pp": 2}]}))
    assert "row 1: missing recompute, sequence_parallel, tp, dp" in refusal(["--plan", str(edited)], capsys)
    not_a_plan = tmp_path / "other.json"
    not_a_plan.write_text("{}")
    assert "no \"ranked\" list" in refusal(["--plan", str(not_a_plan)], capsys)


def test_a_planned_row_with_cp_and_ep_runs_and_equals_the_one_process_reference(tmp_path: Path, capsys) -> None:
    """A real plan of Mixtral on 4 GPUs with cp and ep tried: its cp 2 dp 2 ep 2 ZeRO-1 row
    runs with ring attention (what the plan priced) on a shrunk Mixtral, the model the
    row names (the run names none)."""
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "4", "--global-batch", "4", "--seq-len", "16384",
                 "--topology", "ideal", "--top", "40", "--json", str(path), "--quiet", "--workers", "1",
                 "--schedules", "1f1b", "--cp", "1,2", "--ep", "1,2"]) == 0
    rows = rows_of(path)
    number = row_number(rows, cp=2, dp=2, ep=2, zero=1, tp=1)
    argv = ["--plan", str(path), "--row", str(number), "--dtype", "float64", "--steps", "2", "--layers", "2",
            "--hidden", "16", "--seq-len", "8", "--vocab", "37", "--optimizer", "adamw"]
    config, line = planned(argv)
    assert (config.model, config.cp, config.ep, config.dp, config.zero, config.cp_comm) == \
           ("mixtral-8x7b", 2, 2, 2, 1, "p2p")
    assert "model shrunk to mixtral-8x7b" in line and "cp 2 by ring attention" in line
    assert "do not name its model" not in line
    out = tmp_path / "run.json"
    assert main(["run", *argv, "--json", str(out), "--quiet"]) == 0
    assert f"plan row {number}: {rows[number - 1]['layout']} kept (world 4" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert (document["cp"], document["ep"], document["dp"]) == (2, 2, 2)
    assert document["losses"] == pytest.approx(reference_run(config)["losses"], abs=1e-10, rel=0)


def test_a_config_rows_model_may_be_repeated_by_another_path(tmp_path: Path, monkeypatch) -> None:
    """A row names a config file by its absolute path (as plan writes it); the run's
    --model may name the same file relatively, and is refused naming another."""
    config_file = (BUNDLED_CONFIGS / "llama-3.1-8b.json").resolve()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"ranked": [{"schedule": "1f1b", "pp": 2, "tp": 1, "dp": 1, "virtual_stages": 1,
                                            "microbatch_size": 1, "microbatches": 2, "recompute": "none", "zero": 0,
                                            "sequence_parallel": False, "layout": "1f1b pp2 m2",
                                            "model": str(config_file)}]}))
    monkeypatch.chdir(config_file.parent)
    config, _ = planned(["--plan", str(path), "--model", f"./{config_file.name}"])
    assert (config.model, config.pp, config.microbatches) == (str(config_file), 2, 2)
    with pytest.raises(ValueError, match=f"--model llama3-8b conflicts with --plan {path}: row 1 was planned for "
                                         f"{config_file}; drop --model"):
        planned(["--plan", str(path), "--model", "llama3-8b"])


def test_a_row_whose_order_the_plan_built_from_costs_runs_that_order(tmp_path: Path, capsys) -> None:
    """zbv-auto builds its order from the layout's costs, which a run does not have: the
    plan writes the order it simulated beside the row (``order``) and the run runs exactly
    it, every rank's compute actions in the plan's order, the losses the one-process
    reference's. Before, every zbv-auto and zb-auto row was refused."""
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt", "--gpus", "2", "--global-batch", "8", "--seq-len", "64",
                 "--topology", "ideal", "--top", "1", "--json", str(path), "--quiet", "--workers", "1",
                 "--schedules", "zbv-auto", "--constraint", "pp=2"]) == 0
    capsys.readouterr()
    (row,) = rows_of(path)
    assert row["schedule"] == "zbv-auto" and row["order"]["name"] == "zbv-auto"
    argv = ["--plan", str(path), "--row", "1", "--dtype", "float64", "--steps", "2", "--layers", "4", "--hidden", "8",
            "--heads", "2", "--seq-len", "4", "--vocab", "11", "--optimizer", "adamw"]
    out = tmp_path / "run.json"
    assert main(["run", *argv, "--json", str(out), "--trace", str(tmp_path / "trace.json"), "--quiet"]) == 0
    assert "its order as the plan built it from the layout's costs" in capsys.readouterr().out
    config, _ = planned(argv)
    assert config.custom_schedule is not None and config.schedule == "zbv-auto"
    trace = json.loads((tmp_path / "trace.json").read_text())
    for rank, program in enumerate(row["order"]["programs"]):
        ran = [event["action"] for event in sorted(trace["events"], key=lambda event: event["start"])
               if event["rank"] == rank and event["stream"] == "compute"]
        assert ran == program, rank
    assert json.loads(out.read_text())["losses"] == pytest.approx(reference_run(config)["losses"], abs=1e-10, rel=0)


SCHEDULES = "gpipe,1f1b,interleaved-1f1b,zb-h1,zb-h2,zbv,interleaved-zb,looped-bfs,dualpipev,zb-auto,zbv-auto"


@pytest.mark.parametrize(("model", "extra", "top"), [("gpt", [], 400), ("deepseek-v2-lite", ["--ep", "1,2"], 600)])
def test_every_ranked_row_of_a_broad_plan_is_a_run_the_executor_takes(model: str, extra: list[str], top: int,
                                                                       tmp_path: Path, capsys) -> None:
    """Every layout a plan over every schedule it searches, cp 1 and 2, ZeRO 0 to 3, each
    recompute mode (DeepSeek-V2-Lite: norm-mla-up too, and ep 1 and 2) ranks on 4 GPUs
    becomes a checked run config: nothing the planner recommends is refused by run."""
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", model, "--gpus", "4", "--global-batch", "16", "--seq-len", "1024",
                 "--topology", "nvlink", "--top", str(top), "--json", str(path), "--quiet", "--workers", "1",
                 "--schedules", SCHEDULES, "--cp", "1,2", "--zero", "0,1,2,3", *extra]) == 0
    rows = rows_of(path)
    kinds = {(row["schedule"], row["zero"], row["recompute"], row.get("cp", 1), row.get("ep", 1)) for row in rows}
    assert len(rows) == top and len(kinds) > 100  # a broad sample of the space, not one corner
    searched = {"none", "selective", "full"} | ({"norm-mla-up"} if model == "deepseek-v2-lite" else set())
    assert searched <= {row["recompute"] for row in rows}
    assert {1, 2} <= {row.get("cp", 1) for row in rows} and {0, 1, 2, 3} <= {row["zero"] for row in rows}
    if model == "deepseek-v2-lite":  # combined 1F1B searched by default for experts, at pp 1 and interleaved
        assert {("1f1b", 1), ("interleaved-1f1b", 2)} <= {(row["schedule"], row["pp"]) for row in rows
                                                          if row["ep_overlap"]}
        assert 2 in {row["ep"] for row in rows if row["etp"]}  # parallel folding
    refused = []
    for number in range(1, len(rows) + 1):
        try:
            config, _ = planned(["--plan", str(path), "--row", str(number)])
        except ConfigError as error:
            refused.append(str(error))
        else:
            row = rows[number - 1]
            assert (config.ep_overlap, config.etp or 0) == (row["ep_overlap"], row["etp"]), number
    capsys.readouterr()
    assert refused == []
