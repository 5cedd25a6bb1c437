"""A flag the command does not take: one line on stderr, exit 2, naming the command, the
other commands that have the flag, and what to type here instead (argparse answered
with the top-level usage and "pipesim: error: unrecognized arguments")."""

from __future__ import annotations

import pytest

from pipesim.cli import main
from tests.test_cli_errors import assert_one_line_error


@pytest.mark.parametrize("argv,expected", [
    # plan's --gpus given to simulate: the layout's ranks are its GPUs
    (["simulate", "--pp", "4", "-m", "8", "--gpus", "16"],
     ("pipesim simulate: error: simulate has no --gpus (a flag of plan)", "--pp x --dp x --tp x --cp",
      "--topology ib or ethernet takes --nodes")),
    # the = form names the same flag; a second unknown flag is listed after it
    (["simulate", "--pp", "4", "-m", "8", "--gpus=16", "--batch-size", "3"],
     ("simulate has no --gpus", "also unknown here: --batch-size")),
    (["simulate", "--pp", "4", "--global-batch", "64"],
     ("simulate has no --global-batch (a flag of plan)", "--dp x --microbatches x --microbatch-size")),
    # a misspelling: the nearest of the command's own flags
    (["simulate", "--pp", "4", "--microbatch", "8"],
     ("simulate has no --microbatch; did you mean --microbatches?;",)),
    (["run", "--pp", "2", "--microbatchs", "4"], ("run has no --microbatchs; did you mean --microbatches?;",)),
    # simulate's --pp given to plan: plan searches it
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--pp", "2"],
     ("plan has no --pp (a flag of ", "and 5 more)", "plan searches pp itself")),
    # nothing near and nobody's flag: the command and its --help, no guess
    (["sweep", "--foo"], ("pipesim sweep: error: sweep has no --foo; see pipesim sweep --help",)),
])
def test_an_unknown_flag_is_one_line_saying_what_instead(capsys, argv: list[str], expected: tuple[str, ...]) -> None:
    status = main(argv)
    assert status == 2
    captured = capsys.readouterr()
    assert_one_line_error(status, captured.err, *expected)
    assert "usage:" not in captured.err and captured.out == ""


def test_runs_hidden_stand_ins_are_not_counted_as_its_flags(capsys) -> None:
    """``run`` parses simulate's and plan's flags only to refuse them (``pipesim.cli.refused``):
    simulate's line for ``--gpus`` names plan, not run."""
    main(["simulate", "--pp", "2", "--gpus", "4"])
    line = capsys.readouterr().err
    assert "(a flag of plan)" in line and "run" not in line.split(";")[0]


def test_a_top_level_flag_is_still_argparses(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--no-such-flag"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
