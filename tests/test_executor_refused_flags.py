"""``python -m executor`` refuses, in one line with exit status 2, every flag of ``pipesim
simulate``, ``plan`` and ``run`` that it does not take, naming the flag and the command
that takes it (the sentence ``pipesim run`` uses for simulate's flags); flags no command
takes are still argparse's "unrecognized arguments". The executor keeps its own table
(it may not import the command line); the first test holds it to the parsers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor.__main__ import build_parser
from executor.__main__ import main as executor_main
from executor.refused_flags import REFUSED_FLAGS
from pipesim.cli.refused import other_flags, values_taken
from tests.test_run_flags import RUN

ROOT = Path(__file__).resolve().parent.parent
EXECUTOR = {flag for action in build_parser()._actions if action.dest != "refused_flags"
            for flag in action.option_strings}


def test_the_table_is_every_flag_of_simulate_plan_and_run_the_executor_lacks() -> None:
    # Read from the commands' own parsers: a flag added to simulate, plan or run (and not
    # to the executor) fails here until REFUSED_FLAGS names it, with its nargs and owners.
    expected = {}
    for flag, (action, owners) in other_flags().items():
        if flag not in EXECUTOR:
            expected[flag] = (values_taken(action), ("run", *owners) if flag in RUN else owners)
    for flag, action in RUN.items():
        if flag not in EXECUTOR and flag not in expected:
            expected[flag] = (values_taken(action), ("run",))
    assert REFUSED_FLAGS == expected
    assert {"--topology", "--gpu", "--nodes", "--fsdp", "--html", "--plan"} <= set(REFUSED_FLAGS)
    assert not {"--pp", "--dp", "--tp", "--zero", "--recompute", "--json"} & set(REFUSED_FLAGS)


def argv_giving(flag: str) -> list[str]:
    """``flag`` with a value when it takes one (``2``: every refused flag parses it)."""
    return [flag, "2"] if REFUSED_FLAGS[flag][0] is None else [flag]


@pytest.mark.parametrize("flag", sorted(REFUSED_FLAGS))
def test_each_flag_the_executor_lacks_is_refused_in_one_line(flag: str, capsys) -> None:
    assert executor_main(["--pp", "1", *argv_giving(flag), "--microbatches", "2"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    owners = REFUSED_FLAGS[flag][1]
    if "run" in owners:
        assert lines[0].startswith(f"python -m executor: error: {flag} is a flag of pipesim run, not of python -m "
                                   f"executor: drop it, or start the ranks with pipesim run")
    else:
        only = "simulate-only" if "simulate" in owners else "plan-only"
        assert lines[0] == (f"python -m executor: error: {flag} is {only}: python -m executor does not execute it "
                            f"(it is a flag of pipesim {' and '.join(owners)}); drop it to run, or see "
                            f"docs/executor.md for what the executor executes")
    assert captured.out == ""


def test_the_module_refuses_topology_in_one_line_with_status_2() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "executor", "--topology", "foo.yaml", "--pp", "2"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m executor: error: --topology is simulate-only: python -m executor does not execute it (it is a "
        "flag of pipesim simulate and plan); drop it to run, or see docs/executor.md for what the executor executes"]
    assert done.stdout == ""


def test_the_wording_is_pipesim_runs(capsys) -> None:
    from pipesim.cli import main as pipesim_main  # noqa: PLC0415

    assert pipesim_main(["run", "--gpus", "8"]) == 2
    ran = capsys.readouterr().err.strip().removeprefix("pipesim run: error: ")
    assert executor_main(["--gpus", "8"]) == 2
    executed = capsys.readouterr().err.strip().removeprefix("python -m executor: error: ")
    assert executed == ran.replace("pipesim run does", "python -m executor does").replace(
        "what run executes", "what the executor executes")
    assert executed.startswith("--gpus is plan-only:")


def test_the_first_refused_flag_is_named_before_a_refused_value(capsys) -> None:
    assert executor_main(["--p2p", "torch-runtime", "--nodes", "2", "--fwd", "1"]) == 2
    assert capsys.readouterr().err.startswith("python -m executor: error: --nodes is simulate-only:")


def test_a_flag_no_command_takes_is_still_argparses_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_status:
        executor_main(["--pp", "2", "--no-such-flag", "3"])
    assert exit_status.value.code == 2
    assert "python -m executor: error: unrecognized arguments: --no-such-flag 3" in capsys.readouterr().err


def test_help_lists_the_refused_flags_but_not_as_options(capsys) -> None:
    with pytest.raises(SystemExit):
        executor_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    usage, epilog = text.split("are refused in one line:")
    assert "--topology" not in usage and "--html" not in usage
    assert "--topology," in epilog and "--html," in epilog and "--p2p torch-runtime" in epilog


def test_under_torchrun_only_rank_0_says_why(monkeypatch, capsys) -> None:
    monkeypatch.setenv("RANK", "1")
    assert executor_main(["--topology", "x.yaml"]) == 2
    assert capsys.readouterr().err == ""
