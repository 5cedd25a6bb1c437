"""``benchmarks/compare_schedules.py``: its rows (ten schedule rows, 1F1B pp 2 with dp 2
and with tp 2), ``--passes``, ``--compare-args`` and the table it builds from the runs'
``compare --json`` summaries, on synthetic summaries (the benchmark itself needs a quiet
machine and minutes)."""

from __future__ import annotations

import pytest

from benchmarks import compare_schedules as bench
from benchmarks.compare_schedules import MODEL, Row, command, main, rows_of, table_lines

ms = 1e-3


def summary(measured_ms: float, predicted_ms: float, iqr: float = 0.02, load: float = 1.0) -> dict:
    """The fields of a ``compare --json`` summary the table reads; the error by hand."""
    return {"measured_step_time": measured_ms * ms, "predicted_step_time": predicted_ms * ms,
            "error": (predicted_ms - measured_ms) / measured_ms, "measured_step_time_spread": {"relative_spread": iqr},
            "load_average": load, "cores": 2}


def test_the_default_rows_are_ten_schedule_rows_then_dp2_and_tp2() -> None:
    rows = rows_of([2, 4], ["dp2", "tp2"])
    assert len(rows) == 12
    assert [row.name for row in rows[-2:]] == ["1f1b dp2", "1f1b tp2"]
    assert {(row.schedule, row.pp) for row in rows[:10]} == {(schedule, pp) for pp in (2, 4)
                                                            for schedule in bench.SCHEDULES}
    dp2, tp2 = (command(row) for row in rows[-2:])
    assert dp2[:6] == ["compare", "--schedule", "1f1b", "--pp", "2", "--dp"] and dp2[6] == "2"
    assert tp2[5:7] == ["--tp", "2"]
    for argv in (dp2, tp2):  # the same model as the schedule rows
        assert argv[-len(MODEL):] == list(MODEL)


def test_compare_args_come_last_and_json_after_them() -> None:
    argv = command(Row("zbv", 4), ("--steps", "11"), "/tmp/out.json")
    assert argv[-4:] == ["--steps", "11", "--json", "/tmp/out.json"]
    assert "--virtual-stages" in argv


def test_commands_print_every_row_with_the_compare_args(capsys) -> None:
    assert main(["--commands", "--compare-args", "--steps 11 --warmup-steps 2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 12
    assert all(line.startswith("pipesim compare --schedule ") for line in lines)
    assert all(line.endswith("--backend gloo --steps 11 --warmup-steps 2") for line in lines)
    assert lines[10].startswith("pipesim compare --schedule 1f1b --pp 2 --dp 2 --model gpt")
    assert lines[11].startswith("pipesim compare --schedule 1f1b --pp 2 --tp 2 --model gpt")


@pytest.mark.parametrize(("argv", "rows"), [(["--layouts", "none"], 10), (["--pp", "2", "--layouts", "tp2"], 6),
                                            (["--pp", "4"], 7), (["--layouts", "tp2,dp2,tp2"], 12)])
def test_layouts_and_sizes_choose_the_rows(argv, rows, capsys) -> None:
    assert main([*argv, "--commands"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == rows


@pytest.mark.parametrize(("argv", "message"), [
    (["--passes", "0"], "argument --passes: expected a whole number >= 1, got 0"),
    (["--passes", "two"], "argument --passes: expected a whole number >= 1, got 'two'"),
    (["--layouts", "dp3"], "argument --layouts: unknown layout 'dp3': expected 'none' or a comma-separated list of "
                           "dp2, tp2"),
    (["--compare-args", "--json x.json"], "argument --compare-args: --json is set by this script"),
    (["--compare-args", "--steps '11"], "argument --compare-args: No closing quotation"),
    (["--compare-args", "--no-such-flag 1"], "argument --compare-args: pipesim compare refuses '--no-such-flag 1': "
                                             "pipesim: error: unrecognized arguments: --no-such-flag 1"),
    (["--pp", "1"], "argument --pp: compare needs a pipeline: expected >= 2, got 1"),
])
def test_bad_arguments_are_one_line_with_status_2(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_status:
        main([*argv, "--commands"])
    assert exit_status.value.code == 2
    captured = capsys.readouterr()
    error = [line for line in captured.err.splitlines() if not line.startswith(("usage:", " "))]
    assert len(error) == 1 and error[0].startswith(f"compare_schedules.py: error: {message}"), captured.err
    assert captured.out == ""


ROWS = [Row("1f1b", 2), Row("1f1b", 2, "tp2")]
# passes[k][i]: pass k's run of ROWS[i] (measured ms, predicted ms)
PASSES = [[summary(100, 105, iqr=0.01, load=0.5), summary(200, 220, iqr=0.03, load=1.5)],
          [summary(110, 99, iqr=0.04, load=2.5), summary(200, 180, iqr=0.02, load=1.0)],
          [summary(90, 90, iqr=0.02, load=1.0), summary(250, 250, iqr=0.01, load=3.0)]]


def test_a_row_is_the_median_of_its_passes_with_each_passes_error() -> None:
    lines = table_lines(ROWS, PASSES)
    # by hand: 1f1b medians 100 ms measured (90, 100, 110) and 99 ms predicted (90, 99, 105),
    # error -1.0%; passes +5.0%, -10.0%, +0.0%; widest IQR 4.0%, highest load 2.5
    assert lines[2] == "| 1f1b | 2 | 100.00 | 99.00 | -1.0% | +5.0% -10.0% +0.0% | 4.0% | 2.5 on 2 cores |"
    # tp2: medians 200 and 220 ms, +10.0%; passes +10.0%, -10.0%, +0.0%
    assert lines[3] == "| 1f1b tp2 | 2 | 200.00 | 220.00 | +10.0% | +10.0% -10.0% +0.0% | 3.0% | 3.0 on 2 cores |"


def test_the_summary_gives_the_rows_and_each_pass() -> None:
    lines = table_lines(ROWS, PASSES)
    # rows |-1.0%|, |+10.0%|: median 5.5%, worst 10.0%; pass 1 5% and 10%, pass 2 10% and
    # 10%, pass 3 0% and 0%
    assert lines[-4:] == ["median |error| 5.5%, worst 10.0% over 2 rows, each the median of 3 passes "
                          "(target: 5% / 10%)",
                          "pass 1: median |error| 7.5%, worst 10.0%",
                          "pass 2: median |error| 10.0%, worst 10.0%",
                          "pass 3: median |error| 0.0%, worst 0.0%"]


def test_one_pass_is_its_own_median() -> None:
    lines = table_lines(ROWS, PASSES[:1])
    assert lines[2] == "| 1f1b | 2 | 100.00 | 105.00 | +5.0% | +5.0% | 1.0% | 0.5 on 2 cores |"
    assert lines[-2:] == ["median |error| 7.5%, worst 10.0% over 2 rows (target: 5% / 10%)",
                          "pass 1: median |error| 7.5%, worst 10.0%"]


def test_passes_run_every_row_before_the_next_pass(monkeypatch, capsys) -> None:
    runs = []

    def fake_run(row: Row, extra: tuple[str, ...], path: str) -> dict:
        runs.append((row.name, row.pp, extra, path.rsplit("/", 1)[-1]))
        return summary(100, 100 + len(runs))

    monkeypatch.setattr(bench, "run_row", fake_run)
    assert main(["--pp", "2", "--layouts", "dp2", "--passes", "2", "--compare-args", "--steps 7"]) == 0
    one_pass = [*[(schedule, 2, f"{schedule}-pp2-{{}}.json") for schedule in bench.SCHEDULES],
                ("1f1b dp2", 2, "1f1b-pp2-dp2-{}.json")]
    assert [(name, pp, path) for name, pp, _, path in runs] == [
        (name, pp, path.format(number)) for number in (1, 2) for name, pp, path in one_pass]
    assert {extra for _, _, extra, _ in runs} == {("--steps", "7")}
    captured = capsys.readouterr()
    # 1f1b: predicted 101 and 107 ms in passes 1 and 2: median 104, +4.0%
    assert "| 1f1b | 2 | 100.00 | 104.00 | +4.0% | +1.0% +7.0% |" in captured.out
    assert "pass 2/2: 1f1b dp2 pp 2: error +12.0%" in captured.err


def test_the_runtime_error_sums_the_ranks_and_is_blank_without_the_columns() -> None:
    # ranks 10 + 30 ms measured, 12 + 33 ms predicted: (45 - 40) / 40
    summary = {"ranks": [{"measured_runtime": 0.010, "predicted_runtime": 0.012},
                         {"measured_runtime": 0.030, "predicted_runtime": 0.033}]}
    assert bench.runtime_error(summary) == "+12.5%"
    assert bench.runtime_error({"ranks": [{"measured_busy": 1.0}]}) == "-"
