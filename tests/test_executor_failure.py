"""Failure handling: a rank that raises, dies or hangs fails the whole job quickly, and
the message names the rank and the action it was on. Also the command line paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.config import ConfigError, RunConfig
from executor.launch import PipelineRunError, launch
from pipesim.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = {"schedule": "1f1b", "pp": 2, "microbatches": 2, "hidden": 8, "layers": 2, "batch_size": 2}


@pytest.mark.timeout(60)
def test_rank_that_raises_fails_the_job_naming_rank_and_action() -> None:
    with pytest.raises(PipelineRunError) as failure:
        launch(RunConfig(**TINY, inject_failure="1:1B0:raise"))
    message = str(failure.value)
    assert message.startswith("rank 1 ")
    assert "1B0" in message and "failure injected" in message


@pytest.mark.timeout(60)
def test_rank_killed_with_sigkill_fails_the_cli_run(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pipesim", "run", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2",
               "--hidden", "8", "--layers", "2", "--batch-size", "2", "--inject-failure", "1:1F1:kill",
               "--json", str(tmp_path / "run.json")]
    started = time.monotonic()
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=55,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert finished.returncode != 0
    assert "rank 1 was killed by SIGKILL at step 0 action 1F1" in finished.stderr
    assert time.monotonic() - started < 50
    assert not (tmp_path / "run.json").exists()


@pytest.mark.timeout(60)
def test_hung_rank_fails_the_job_within_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(PipelineRunError) as failure:
        launch(RunConfig(**TINY, timeout=3.0, inject_failure="1:1B0:hang"))
    assert time.monotonic() - started < 40
    assert "rank 1" in str(failure.value) and "1B0" in str(failure.value)


def test_pp1_cli_run_is_the_one_process_reference(tmp_path: Path) -> None:
    out, trace, html = tmp_path / "run.json", tmp_path / "trace.json", tmp_path / "run.html"
    assert main(["run", "--pp", "1", "--microbatches", "3", "--batch-size", "6", "--hidden", "8", "--steps", "2",
                 "--json", str(out), "--trace", str(trace), "--html", str(html)]) == 0
    document = json.loads(out.read_text())
    for key in ("schedule", "pp", "microbatches", "virtual_stages", "world_size", "backend", "losses", "step_times"):
        assert key in document
    assert document["pp"] == 1 and len(document["losses"]) == 2 and len(document["step_times"]) == 2
    assert json.loads(trace.read_text())["meta"]["source"] == "measured"
    try:
        import viz.gantt  # noqa: F401
    except ImportError:
        return  # --html is skipped with a message until the chart module is installed
    assert html.exists()


def test_bad_flags_are_rejected_before_anything_runs() -> None:
    with pytest.raises(ConfigError, match="--batch-size 2 cannot be cut into 4 microbatches"):
        RunConfig(batch_size=2, microbatches=4).check()
    with pytest.raises(ConfigError, match="--layout"):
        RunConfig(layers=4, pp=2, layout=(1, 2)).check()
    assert main(["run", "--pp", "2", "--microbatches", "4", "--batch-size", "2"]) == 2


def test_invalid_schedule_is_rejected_before_any_process_starts() -> None:
    pytest.importorskip("schedules.validate", reason="schedules.validate has not landed on this branch yet")
    from schedules.action import Action
    from schedules.generators import generate

    broken = generate("1f1b", 2, 2)
    programs = [list(program) for program in broken.programs]
    programs[1] = [Action(1, "B", 0)] + [a for a in programs[1] if a != Action(1, "B", 0)]
    config = RunConfig(**TINY, custom_schedule=broken.with_programs(programs))
    with pytest.raises(ValueError, match="1B0"):
        launch(config)
