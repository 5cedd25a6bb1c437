"""``pipesim draw`` redraws saved Traces (simulated or measured), and ``--plotly``
chooses between an offline page and a small one that loads plotly.js from the CDN."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipesim.cli import main

ROOT = Path(__file__).resolve().parents[1]
CDN_SCRIPT = 'src="https://cdn.plot.ly/'


def test_draw_a_simulated_trace(tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--fwd", "1e-3", "--bwd", "2e-3",
                 "--trace", str(trace)]) == 0
    capsys.readouterr()
    html, chrome = tmp_path / "g.html", tmp_path / "c.json"
    assert main(["draw", str(trace), "--html", str(html), "--chrome-trace", str(chrome)]) == 0
    printed = capsys.readouterr().out
    # 1F1B with free links: (m + p - 1)(F + B) = 11 x 3 ms; bubble (p - 1)/(m + p - 1) = 3/11
    assert f"{trace}: 4 ranks" in printed and "makespan 33 ms" in printed and "bubble fraction 27.3%" in printed
    events = json.loads(trace.read_text())["events"]
    complete = [event for event in json.loads(chrome.read_text())["traceEvents"] if event.get("ph") == "X"]
    assert len(complete) == len(events)
    page = html.read_text()
    assert CDN_SCRIPT not in page and "plotly" in page.lower()


def test_plotly_cdn_writes_a_small_page(tmp_path, capsys):
    inline, cdn = tmp_path / "inline.html", tmp_path / "cdn.html"
    assert main(["simulate", "--html", str(inline)]) == 0
    assert main(["simulate", "--html", str(cdn), "--plotly", "cdn"]) == 0
    assert CDN_SCRIPT in cdn.read_text() and CDN_SCRIPT not in inline.read_text()
    assert inline.stat().st_size > 3_000_000 > 200_000 > cdn.stat().st_size
    for command in (["sweep", "--quiet"], ["show"], ["topology", "show", "nvlink"]):
        path = tmp_path / f"{command[0]}.html"
        assert main([*command, "--html", str(path), "--plotly", "cdn"]) == 0
        assert CDN_SCRIPT in path.read_text(), command
    assert main(["demo", "--out", str(tmp_path / "demo"), "--plotly", "cdn"]) == 0
    for chart in (tmp_path / "demo").glob("*.html"):
        assert CDN_SCRIPT in chart.read_text(), chart


def test_draw_several_traces_on_one_axis(tmp_path, capsys):
    paths = []
    for name in ("gpipe", "1f1b"):
        paths.append(tmp_path / f"{name}.json")
        assert main(["simulate", "--schedule", name, "--pp", "2", "-m", "4", "--trace", str(paths[-1])]) == 0
    capsys.readouterr()
    assert main(["draw", *map(str, paths), "--html", str(tmp_path / "both.html"), "--title", "two"]) == 0
    printed = capsys.readouterr().out.splitlines()
    # gpipe and 1f1b share the closed form (m + p - 1)(F + B) = 5 x 3 ms at the default costs
    assert [line.split(":")[0] for line in printed[:2]] == [str(path) for path in paths]
    assert all("makespan 15 ms" in line for line in printed[:2])


@pytest.mark.timeout(180)
def test_draw_a_trace_written_by_torchrun_executor(tmp_path):
    """The file ``torchrun ... -m executor --trace`` writes (rank 0 gathers every rank)."""
    trace = tmp_path / "measured.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "executor",
         "--pp", "2", "--microbatches", "4", "--trace", str(trace), "--timeout", "60"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=170,
    )
    assert started.returncode == 0, started.stderr[-2000:]
    drawn = subprocess.run([sys.executable, "-m", "pipesim", "draw", str(trace), "--html", str(tmp_path / "m.html")],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    assert f"{trace}: 2 ranks" in drawn.stdout
    # 1F1B at pp=2, m=4: each rank runs 4 forwards and 4 backwards
    events = json.loads(trace.read_text())["events"]
    assert sum(event["kind"] in ("F", "B") for event in events) == 2 * 8
