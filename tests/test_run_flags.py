"""``pipesim run`` takes or refuses, in one line, every flag ``simulate`` and ``plan`` have:
never argparse's "unrecognized arguments", never a flag silently dropped."""

from __future__ import annotations

import argparse

import pytest

from executor.options import config_from_args
from pipesim.cli import build_parser, main, subparsers_of


def flags_of(command: str) -> dict[str, argparse.Action]:
    (parser,) = [p for p in subparsers_of(build_parser(command)) if p.prog.endswith(command)]
    return {flag: action for action in parser._actions for flag in action.option_strings}


# What run executes: its own flags, not the stand-ins that refuse the others.
RUN = {flag: action for flag, action in flags_of("run").items() if action.dest != "refused_flags"}
OTHERS = {**flags_of("plan"), **flags_of("simulate")}
NOT_IN_RUN = sorted(flag for flag in OTHERS if flag not in RUN)


def test_there_are_flags_run_does_not_take() -> None:
    # The cost model and the search are not executed by run.
    assert {"--topology", "--fwd", "--gpus", "--fsdp"} <= set(NOT_IN_RUN)
    # ... and the ones it does execute are not among them (context and expert parallelism included).
    assert not {"--dp", "--tp", "--cp", "--ep", "--zero", "--recompute", "--bucket-mb",
                "--sequence-parallel"} & set(NOT_IN_RUN)


@pytest.mark.parametrize("flag", NOT_IN_RUN)
def test_a_flag_run_does_not_execute_is_refused_in_one_line(flag: str, capsys) -> None:
    takes_value = OTHERS[flag].nargs != 0
    argv = ["run", "--pp", "1", flag, *(["2"] if takes_value else [])]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"pipesim run: error: {flag} is ")
    assert "-only" in lines[0] and "unrecognized" not in lines[0]
    assert captured.out == ""


def test_the_refusal_names_the_first_such_flag_and_says_simulate_only(capsys) -> None:
    assert main(["run", "--pp", "1", "--fwd", "2", "--act-bytes", "2"]) == 2
    assert "--fwd is simulate-only" in capsys.readouterr().err
    assert main(["run", "--pp", "1", "--gpus", "8"]) == 2
    assert "--gpus is plan-only" in capsys.readouterr().err


def test_run_help_lists_what_it_refuses(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "refused in one line" in text and "--topology," in text


def simulate_only_values() -> list[tuple[str, str]]:
    """(flag, value): the choices simulate's or plan's flag accepts that run's same flag
    does not list (read from the parsers' own choices, not from pipesim.cli.refused)."""
    return sorted((flag, value) for flag, action in OTHERS.items()
                  if flag in RUN and action.choices and RUN[flag].choices is not None
                  for value in action.choices if value not in list(RUN[flag].choices))


def test_run_executes_every_recompute_mode_the_simulator_models() -> None:
    from pipesim.model.spec import RECOMPUTE  # noqa: PLC0415

    assert not [value for flag, value in simulate_only_values() if flag == "--recompute"]
    assert sorted(RUN["--recompute"].choices) == sorted(RECOMPUTE)  # norm-mla-up included
    assert ("--p2p", "torch-runtime") in simulate_only_values()


@pytest.mark.parametrize(("flag", "value"), simulate_only_values())
def test_a_value_run_does_not_execute_is_refused_in_one_line(flag: str, value: str, capsys) -> None:
    assert main(["run", "--pp", "1", flag, value]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"pipesim run: error: {flag} {value} is simulate-only: pipesim run does not execute "
                               f"it (run executes {flag} {', '.join(map(str, RUN[flag].choices))})")
    assert "invalid choice" not in lines[0] and captured.out == ""


def test_p2p_torch_runtime_refusal_names_what_run_supports(capsys) -> None:
    assert main(["run", "--model", "deepseek-v3", "--p2p", "torch-runtime"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pipesim run: error: --p2p torch-runtime is simulate-only: pipesim run does not execute it (run executes "
        "--p2p rendezvous, buffered); see docs/executor.md for what run executes")


def test_a_value_no_command_takes_is_still_argparses_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_status:
        main(["run", "--pp", "1", "--recompute", "everything"])
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'everything' (choose from 'none', 'selective', 'full', 'per-op', 'norm-mla-up')" in err


def test_run_help_lists_the_values_it_refuses_and_its_own_choices(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--recompute {none,selective,full,per-op,norm-mla-up}" in text
    assert "--p2p torch-runtime" in text


def test_the_default_batch_feeds_every_replica_a_sample_a_microbatch() -> None:
    def batch(*argv: str) -> int:
        (parser,) = [p for p in subparsers_of(build_parser("run")) if p.prog.endswith("run")]
        return config_from_args(parser.parse_args(list(argv))).batch_size

    assert batch("--pp", "2") == 8  # 8 microbatches of one sample
    assert batch("--pp", "2", "-m", "4") == 8  # never below 8
    assert batch("--pp", "2", "--dp", "2") == 16  # 2 replicas x 8 microbatches
    assert batch("--pp", "2", "--dp", "2", "--batch-size", "32") == 32
