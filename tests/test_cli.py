"""The ``pipesim`` command end to end: the issue's example commands, their files and
their errors."""

from __future__ import annotations

import csv
import json

import pytest

from pipesim.cli import main
from schedules import generate
from schedules.csv_io import schedule_from_csv


def run_cli(*argv: str) -> int:
    return main([str(arg) for arg in argv])


def test_simulate_writes_json_trace_chrome_and_html(tmp_path, capsys):
    out = tmp_path
    status = run_cli(
        "simulate", "--schedule", "1f1b", "--pp", 4, "--microbatches", 8, "--fwd", 1e-3, "--bwd", 2e-3,
        "--topology", "nvlink", "--act-bytes", 64e6, "--html", out / "g.html", "--json", out / "r.json",
        "--trace", out / "t.json", "--chrome-trace", out / "c.json",
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "step time" in printed and "bubble fraction" in printed and "peak in-flight" in printed
    result = json.loads((out / "r.json").read_text())
    for key in ("schedule", "pp", "microbatches", "virtual_stages", "makespan", "bubble_fraction", "ranks"):
        assert key in result
    assert result["schedule"] == "1f1b" and result["pp"] == 4 and result["microbatches"] == 8
    assert [rank["rank"] for rank in result["ranks"]] == [0, 1, 2, 3]
    assert result["ranks"][0]["peak_inflight_microbatches"] == 4
    # NVLink with 64 MB activations is slower than the free-link closed form, but not by much
    assert 11 * 3e-3 < result["makespan"] < 11 * 3e-3 * 1.2
    trace = json.loads((out / "t.json").read_text())
    assert {"rank", "action", "kind", "stage", "microbatch", "start", "end", "stream"} <= set(trace["events"][0])
    assert "traceEvents" in json.loads((out / "c.json").read_text())
    html = (out / "g.html").read_text()
    assert "<script src=" not in html and "plotly" in html.lower()


def test_sweep_writes_csv_and_html(tmp_path):
    status = run_cli(
        "sweep", "--schedule", "gpipe,1f1b,interleaved-1f1b", "--pp", 4, "--microbatches", "4,8,6",
        "--virtual-stages", 2, "--csv", tmp_path / "s.csv", "--html", tmp_path / "s.html", "--quiet",
    )
    assert status == 0
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert len(rows) == 9
    one_f_one_b = {int(row["microbatches"]): float(row["makespan"]) for row in rows if row["schedule"] == "1f1b"}
    assert one_f_one_b[8] == pytest.approx((8 + 4 - 1) * 3e-3)
    assert (tmp_path / "s.html").exists()


def test_export_then_simulate_schedule_file(tmp_path, capsys):
    path = tmp_path / "1f1b.csv"
    assert run_cli("export", "--schedule", "1f1b", "--pp", 4, "--microbatches", 8, "--out", path) == 0
    assert schedule_from_csv(path).programs == generate("1f1b", 4, 8).programs
    assert run_cli("simulate", "--schedule-file", path, "--fwd", 1, "--bwd", 2, "--topology", "ideal",
                   "--json", tmp_path / "r.json") == 0
    assert json.loads((tmp_path / "r.json").read_text())["makespan"] == pytest.approx(33.0)


def test_simulate_split_backward_schedule_file(tmp_path):
    # a hand-written zero-bubble style order with I and W on 2 ranks
    path = tmp_path / "zb.csv"
    path.write_text("0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n")
    assert run_cli("simulate", "--schedule-file", path, "--fwd", 1, "--bwd", 2, "--wgrad", 1,
                   "--json", tmp_path / "r.json") == 0
    result = json.loads((tmp_path / "r.json").read_text())
    # rank 1: F0 at 1, I0 to 3, F1 to 4, I1 to 5, W0, W1 to 7; rank 0 then ends with I1 at 6, W0, W1 at 8
    assert result["makespan"] == pytest.approx(8.0)


def test_show_prints_programs_and_timeline(capsys):
    assert run_cli("show", "--schedule", "interleaved-1f1b", "--pp", 4, "--microbatches", 8,
                   "--virtual-stages", 2) == 0
    printed = capsys.readouterr().out
    assert "rank 0: 0F0 0F1 0F2 0F3 4F0" in printed
    assert printed.count("rank 3:") == 2  # the program listing and the timeline row


@pytest.mark.parametrize(
    "argv,message",
    [
        (["simulate", "--schedule", "zb-v"], "unknown schedule 'zb-v'"),
        (["simulate", "--topology", "nvlinc"], "unknown topology 'nvlinc'"),
        (["simulate", "--schedule", "interleaved-1f1b", "--pp", "4", "--microbatches", "9"], "do not split into"),
        (["simulate", "--pp", "16", "--topology", "nvlink"], "needs 16 devices but topology nvlink has 8"),
        (["simulate", "--costs", "/nonexistent/costs.json"], "no such file: /nonexistent/costs.json"),
        (["sweep", "--microbatches", "8,x"], "'x' in '8,x' is not a valid int"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(argv, message, capsys):
    assert run_cli(*argv) == 2
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error


def test_demo_writes_charts(tmp_path, capsys):
    assert run_cli("demo", "--out", tmp_path) == 0
    for name in ("gantt-gpipe.html", "gantt-1f1b.html", "gantt-interleaved-1f1b.html", "gantt-all.html",
                 "sweep.html"):
        assert (tmp_path / name).stat().st_size > 100_000


def test_sweep_with_model_dp_tp_reports_memory(tmp_path):
    status = run_cli(
        "sweep", "--schedule", "1f1b,gpipe", "--model", "gpt3-1.3b", "--seq-len", 1024, "--microbatch-size", 1,
        "--pp", 4, "--dp", 2, "--microbatches", "4,16", "--topology", "nvlink", "--json", tmp_path / "s.json",
        "--quiet",
    )
    assert status == 0
    rows = json.loads((tmp_path / "s.json").read_text())
    memory = {(row["schedule"], row["microbatches"]): row["peak_memory_bytes"] for row in rows}
    # 1F1B holds at most pp stashes, GPipe all m: GPipe's peak grows with m, 1F1B's does not
    assert memory["gpipe", 16] > memory["gpipe", 4]
    assert memory["1f1b", 16] == pytest.approx(memory["1f1b", 4])
    assert all(row["oom"] is False for row in rows)
