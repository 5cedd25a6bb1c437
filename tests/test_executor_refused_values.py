"""``python -m executor`` refuses the values only the simulator takes in one line, exit
status 2, as ``pipesim run`` does: the same values, the same sentence, never argparse's
"invalid choice" and never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor.__main__ import main as executor_main
from tests.test_run_flags import RUN, simulate_only_values

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("flag", "value"), simulate_only_values())
def test_every_value_run_refuses_the_executor_refuses_in_one_line(flag: str, value: str, capsys) -> None:
    # simulate_only_values() reads simulate's and plan's own parsers, so a value added
    # there and not to the executor's list fails here.
    assert executor_main(["--pp", "1", flag, value]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    own = ", ".join(map(str, RUN[flag].choices))
    assert lines[0] == (f"python -m executor: error: {flag} {value} is simulate-only: python -m executor does not "
                        f"execute it (the executor executes {flag} {own}); see docs/executor.md for what the "
                        f"executor executes")
    assert captured.out == ""


def test_the_executor_refuses_no_value_run_takes(capsys) -> None:
    # --recompute selective is executed by both: it reaches the config, not the refusal
    # (the bad --pp after it is what stops this run before any process starts).
    assert executor_main(["--recompute", "selective", "--pp", "0"]) == 2
    assert capsys.readouterr().err.strip() == "python -m executor: error: --pp must be at least 1, got 0"


def test_a_value_no_command_takes_is_still_argparses_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_status:
        executor_main(["--recompute", "everything"])
    assert exit_status.value.code == 2
    assert ("invalid choice: 'everything' (choose from 'none', 'selective', 'full', 'per-op', 'norm-mla-up')"
            in capsys.readouterr().err)


def test_the_module_exits_2_with_the_one_line_refusal() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "executor", "--p2p", "torch-runtime"], capture_output=True,
                          text=True, env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m executor: error: --p2p torch-runtime is simulate-only: python -m executor does not execute "
        "it (the executor executes --p2p rendezvous, buffered); see docs/executor.md for what the "
        "executor executes"]
    assert done.stdout == ""


def test_executor_help_lists_the_values_it_refuses(capsys) -> None:
    with pytest.raises(SystemExit):
        executor_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--recompute {none,selective,full,per-op,norm-mla-up}" in text
    assert "--zero3-collectives, --p2p torch-runtime." in text  # after the refused flags


def test_under_torchrun_only_rank_0_says_why(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", "1")
    assert executor_main(["--p2p", "torch-runtime"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert executor_main(["--p2p", "torch-runtime"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
