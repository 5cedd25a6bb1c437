"""Bad input through the command line: one line on stderr naming what is wrong, a
non-zero exit, no traceback, and no work done before an output path is known to be
writable.

Most cases call ``main()`` in this process (fast); a few start ``python -m pipesim`` to
see exactly what a user's terminal shows (the pipe into ``head``, ``--version``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipesim import cli
from pipesim.cli import main
from schedules import generate
from schedules.csv_io import schedule_from_csv, schedule_to_csv

ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    status = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(status: int, err: str, *expected: str) -> None:
    """Non-zero exit, exactly one line on stderr, no traceback, each expected phrase in it."""
    assert status != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("pipesim ")
    for phrase in expected:
        assert phrase in lines[0], (phrase, lines[0])


def run_process(*argv: str, stdin_text: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipesim", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120, input=stdin_text)


@pytest.fixture()
def files(tmp_path):
    """A folder, a binary file, a malformed YAML file and a plain file to misuse."""
    folder = tmp_path / "folder"
    folder.mkdir()
    binary = tmp_path / "blob.csv"
    binary.write_bytes(bytes(range(256)) * 4)
    latin = tmp_path / "latin.json"
    latin.write_bytes("{\"stages\": \"caf\xe9\"}".encode("latin-1"))
    bad_yaml = tmp_path / "costs.yaml"
    bad_yaml.write_text("stages: [fwd: 1\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("not a folder\n")
    return {"folder": folder, "binary": binary, "latin": latin, "yaml": bad_yaml, "plain": plain, "tmp": tmp_path}


# --- input files --------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["simulate", "--schedule-file", "{folder}"], ["{folder} is a directory", "schedule CSV"]),
        (["simulate", "--costs", "{folder}"], ["{folder} is a directory", "costs file"]),
        (["simulate", "--topology", "{folder}"], ["{folder} is a directory", "topology file"]),
        (["topology", "show", "{folder}"], ["{folder} is a directory"]),
        (["simulate", "--schedule-file", "{binary}"], ["{binary} is a binary file"]),
        (["simulate", "--costs", "{binary}"], ["{binary} is a binary file"]),
        (["simulate", "--costs", "{latin}"], ["{latin} is not a UTF-8 text file", "byte 0xe9"]),
        (["simulate", "--costs", "{yaml}"], ["{yaml}: not valid YAML", "line 2"]),
        (["simulate", "--schedule-file", "{tmp}/missing.csv"], ["no such file: {tmp}/missing.csv"]),
        (["simulate", "--costs", "{tmp}/missing.json"], ["no such file: {tmp}/missing.json"]),
        (["topology", "show", "{tmp}/missing.yaml"], ["no such file: {tmp}/missing.yaml"]),
        (["draw", "{tmp}/missing.json", "--html", "{tmp}/x.html"], ["no such file: {tmp}/missing.json"]),
        (["draw", "{yaml}", "--html", "{tmp}/x.html"], ["{yaml}: not valid JSON"]),
    ],
)
def test_unusable_input_file_is_one_line_naming_it(capsys, files, argv, expected):
    status, _, err = run_cli(capsys, *(arg.format(**files) for arg in argv))
    assert status == 2
    assert_one_line_error(status, err, *(phrase.format(**files) for phrase in expected))
    assert "[Errno" not in err and "codec can't decode" not in err


@pytest.mark.skipif(IS_ROOT, reason="root reads files whatever their permissions")
def test_unreadable_file_is_named(capsys, files):
    secret = files["tmp"] / "secret.json"
    secret.write_text("{}")
    secret.chmod(0)
    status, _, err = run_cli(capsys, "simulate", "--costs", secret)
    assert_one_line_error(status, err, f"cannot read {secret}", "permission denied")


# --- output paths: checked before any work ----------------------------------------------

@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["simulate", "--json", "{folder}"], ["--json {folder} is a directory"]),
        (["simulate", "--html", "{folder}"], ["--html {folder} is a directory"]),
        (["simulate", "--trace", "{tmp}/nowhere/t.json"], ["--trace", "folder {tmp}/nowhere does not exist"]),
        (["simulate", "--chrome-trace", "{plain}/c.json"], ["--chrome-trace", "{plain} is not a folder"]),
        (["sweep", "--csv", "{folder}", "--quiet"], ["--csv {folder} is a directory"]),
        (["export", "--out", "{tmp}/nowhere/s.csv"], ["--out", "does not exist"]),
        (["show", "--html", "{folder}"], ["--html {folder} is a directory"]),
        (["demo", "--out", "{plain}"], ["--out {plain} is a file; give a folder"]),
        (["run", "--log-dir", "{plain}"], ["--log-dir {plain} is a file"]),
        (["run", "--json", "{folder}"], ["--json {folder} is a directory"]),
        (["profile", "--out", "{folder}"], ["--out {folder} is a directory"]),
        (["bench-comm", "--html", "{tmp}/nowhere/c.html"], ["--html", "does not exist"]),
        (["topology", "show", "nvlink", "--html", "{folder}"], ["--html {folder} is a directory"]),
        (["draw", "{tmp}/t.json", "--chrome-trace", "{folder}"], ["--chrome-trace {folder} is a directory"]),
    ],
)
def test_bad_output_path_is_refused_before_work(capsys, files, argv, expected):
    status, out, err = run_cli(capsys, *(arg.format(**files) for arg in argv))
    assert status == 2
    assert_one_line_error(status, err, *(phrase.format(**files) for phrase in expected))
    assert out == ""  # nothing was simulated, profiled or run first


@pytest.mark.skipif(IS_ROOT, reason="root writes files whatever their permissions")
def test_read_only_output_is_refused(capsys, files):
    target = files["tmp"] / "ro.json"
    target.write_text("{}")
    target.chmod(0o444)
    status, out, err = run_cli(capsys, "simulate", "--json", target)
    assert_one_line_error(status, err, f"--json {target}: the file is read-only")


def test_compare_checks_html_path_before_profiling():
    """The issue's case: ``compare --html /nonexistent/x.html`` used to fail after
    profile, bench and run. Now it fails at once, without even loading torch."""
    code = ("import sys; from pipesim.cli import main; status = main(['compare', '--html', "
            "'/nonexistent/x.html']); print('torch loaded' if 'torch' in sys.modules else 'no torch'); "
            "sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert done.stdout.strip() == "no torch"
    assert_one_line_error(done.returncode, done.stderr, "--html /nonexistent/x.html: folder /nonexistent")


# --- run flags: checked before launch ---------------------------------------------------

@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "--model", "gpt", "--heads", "0"], "--heads must be at least 1, got 0"),
        (["run", "--model", "gpt", "--vocab", "0"], "--vocab must be at least 1, got 0"),
        (["run", "--threads", "0"], "--threads must be at least 1, got 0"),
        (["run", "--lr", "nan"], "--lr must be a finite number, got nan"),
        (["run", "--lr", "-1"], "--lr must be >= 0"),
        (["run", "--timeout", "inf"], "--timeout must be a finite number, got inf"),
        (["run", "--timeout", "1e12"], "--timeout must be at most"),
        (["run", "--dp-bucket-mb", "nan"], "--dp-bucket-mb must be a finite number"),
        (["run", "--layout", "a,b"], "--layers-per-stage 'a,b' must be comma-separated layer counts"),
        (["run", "--layout", "0,4"], "--layout 0,4 gives stage 0 no layers"),
        (["run", "--layout", "1,2"], "must give 4 stage sizes"),
        (["run", "--inject-failure", "5:1B0:kill"], "rank 5 does not exist; the run has ranks 0 to 3"),
        (["run", "--inject-failure", "1:0F0:raise"], "rank 1 (pipeline rank 1) never runs 0F0"),
        (["run", "--inject-failure", "1:1B9:raise"], "never runs 1B9"),
        (["run", "--inject-failure", "one:1B0:kill"], "must be RANK:ACTION:MODE"),
        (["profile", "--virtual-stages", "2", "--out", "{tmp}/costs.json"],
         "--virtual-stages 2 conflicts with --schedule 1f1b"),
        (["simulate", "--fwd", "nan"], "--fwd must be a finite number >= 0, got nan"),
        (["simulate", "--bwd", "inf"], "--bwd must be a finite number >= 0, got inf"),
    ],
)
def test_bad_flag_is_refused_before_launch(capsys, files, argv, expected):
    status, out, err = run_cli(capsys, *(arg.format(**files) for arg in argv))
    assert status == 2
    assert_one_line_error(status, err, expected)
    assert "loss" not in out  # no step ran


def test_abbreviations_are_not_accepted(capsys):
    """With abbreviations on, argparse took ``simulate --dtype bfloat16`` as
    ``--dtype-bytes bfloat16``; now ``--dtype`` is simulate's own flag (as in run) and a
    prefix of a flag is never taken for it."""
    status = main(["simulate", "--dtyp", "bfloat16"])
    assert_one_line_error(status, capsys.readouterr().err, "simulate has no --dtyp; did you mean --dtype?")
    status = main(["simulate", "--fw", "1"])  # not --fwd
    assert_one_line_error(status, capsys.readouterr().err, "simulate has no --fw; did you mean --fwd?;")


# --- schedule files: the microbatch count -----------------------------------------------

def shifted_last_rank_csv(path: Path) -> Path:
    """1F1B at pp=4, m=8 with the last rank's microbatches numbered 1..8 instead of 0..7
    (the file the issue describes: ``3F1 … 3F8`` and no ``3F0``)."""
    schedule = generate("1f1b", 4, 8)
    rows = [[str(action) for action in program] for program in schedule.programs]
    rows[3] = [f"{action.stage}{action.kind}{action.microbatch + 1}" for action in schedule.programs[3]]
    path.write_text("\n".join(",".join(row) for row in rows) + "\n")
    return path


def test_microbatch_out_of_range_and_missing_are_named(capsys, tmp_path):
    path = shifted_last_rank_csv(tmp_path / "shifted.csv")
    status, _, err = run_cli(capsys, "simulate", "--schedule-file", path)
    assert_one_line_error(status, err, "stage 3 differs from the other 3 stages, which hold microbatches 0 to 7",
                          "3F8 (not on the others)", "3F0 (missing)")
    assert "0F8" not in err  # the old guess (largest index + 1 = 9) blamed rank 0


@pytest.mark.parametrize(("name", "pp", "microbatches", "virtual"),
                         [("1f1b", 4, 6, 1), ("gpipe", 3, 5, 1), ("interleaved-1f1b", 2, 4, 2)])
def test_microbatch_count_of_a_complete_file(tmp_path, name, pp, microbatches, virtual):
    path = tmp_path / "s.csv"
    schedule_to_csv(generate(name, pp, microbatches, virtual), path)
    assert schedule_from_csv(path).microbatches == microbatches
    assert schedule_from_csv(path, microbatches=microbatches).microbatches == microbatches
    with pytest.raises(ValueError, match=f"{microbatches - 1} \\(out of range\\)"):
        schedule_from_csv(path, microbatches=microbatches - 1)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]), pp=st.integers(2, 5),
       rounds=st.integers(1, 3), shift=st.integers(1, 3), data=st.data())
def test_a_stage_numbered_off_by_some_is_named(tmp_path_factory, name, pp, rounds, shift, data):
    """Whatever the schedule, renumbering one stage's microbatches by ``+shift`` keeps
    the count (distinct microbatches per stage) and names that stage's first index past
    the end and its first missing one."""
    virtual = 2 if name == "interleaved-1f1b" else 1
    microbatches = pp * rounds
    schedule = generate(name, pp, microbatches, virtual)
    stage = data.draw(st.integers(0, schedule.num_stages - 1), label="stage")
    rows = [[str(action) if action.stage != stage else f"{action.stage}{action.kind}{action.microbatch + shift}"
             for action in program] for program in schedule.programs]
    path = tmp_path_factory.mktemp("csv") / "shifted.csv"
    path.write_text("\n".join(",".join(row) for row in rows) + "\n")
    with pytest.raises(ValueError) as error:
        schedule_from_csv(path)
    message = str(error.value)
    first_past_the_end = max(microbatches, shift)  # indices now run shift .. microbatches - 1 + shift
    others = schedule.num_stages - 1
    if others > 1:  # the other stages agree: the odd one is named against them
        assert f"stage {stage} differs from the other {others} stages" in message
        assert f"{stage}F{first_past_the_end} (not on the others)" in message and f"{stage}F0 (missing)" in message
    else:
        assert f"{microbatches} microbatches" in message
        assert f"{stage}F{first_past_the_end} (out of range)" in message and f"{stage}F0 (missing)" in message


# --- the boundary itself ----------------------------------------------------------------

def test_unexpected_error_is_one_line_and_verbose_shows_it(capsys, monkeypatch):
    import pipesim.cli.show as show

    def broken(args):
        return 1 // 0

    monkeypatch.setattr(show, "handle", broken)
    status, _, err = run_cli(capsys, "show")
    assert status == 1
    assert_one_line_error(status, err, "internal error: ZeroDivisionError", "--verbose")
    with pytest.raises(ZeroDivisionError):
        main(["show", "--verbose"])


def test_version_and_bare_command():
    version = run_process("--version")
    assert version.returncode == 0 and version.stdout.startswith("pipesim ")
    bare = run_process()
    assert bare.returncode == 0
    assert "usage: pipesim" in bare.stdout and "simulate" in bare.stdout and "draw" in bare.stdout
    assert bare.stderr == ""


def test_output_piped_into_head_ends_quietly():
    """``pipesim show ... | head -1``: the reader goes away, nothing is printed to stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(f"{sys.executable} -m pipesim show --pp 16 -m 256 | head -1", shell=True,
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                          executable="/bin/bash")
    assert done.stdout.startswith("1f1b: pp=16")
    assert done.stderr == "", done.stderr


def test_every_subcommand_refuses_abbreviations_and_takes_verbose():
    parser = cli.build_parser()
    children = cli.subparsers_of(parser)
    assert {"simulate", "run", "draw", "show"} <= {child.prog.split()[-1] for child in children}
    for child in children:
        assert child.allow_abbrev is False, child.prog
        assert "--verbose" in child._option_string_actions, child.prog
        if "--html" in child._option_string_actions:
            assert "--plotly" in child._option_string_actions, child.prog
