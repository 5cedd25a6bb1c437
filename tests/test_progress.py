"""Live progress: lines on stderr when it is a terminal (a pseudo-terminal here), none
when it is piped or with --quiet, and run's per-step lines read from the ranks'
progress files as the steps complete."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

from executor.progress import ProgressWriter
from pipesim.cli.progress import Progress, StepWatcher, completed_steps

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["run", "--pp", "2", "-m", "2", "--batch-size", "4", "--hidden", "8", "--layers", "2", "--steps", "3",
            "--timeout", "30"]


def run_on_terminal(argv: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run ``python -m pipesim ARGV`` with stdout and stderr on a pseudo-terminal."""
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "pipesim", *argv], stdout=follower, stderr=follower,
                               stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the follower side closed: the process is gone
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    status = process.wait(timeout=max(deadline - time.monotonic(), 1))
    return status, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def run_piped(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pipesim", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_prints_only_on_a_terminal_and_not_when_quiet():
    terminal, pipe, quiet = FakeTerminal(), io.StringIO(), FakeTerminal()
    for stream, is_quiet in ((terminal, False), (pipe, False), (quiet, True)):
        progress = Progress("run", quiet=is_quiet, stream=stream)
        with progress.phase("profiling"):
            pass
    assert [line.split(" (")[0] for line in terminal.getvalue().splitlines()] == [
        "[pipesim run] profiling ...", "[pipesim run] profiling done"]
    assert pipe.getvalue() == "" and quiet.getvalue() == ""


def test_completed_steps_is_the_slowest_ranks_step(tmp_path):
    """A rank writing ``step N`` has finished steps 0..N-1; the run has finished what its
    slowest rank has."""
    writers = [ProgressWriter(tmp_path, rank) for rank in range(3)]
    assert completed_steps(tmp_path, 3) is None  # no rank has written yet
    for rank, step in enumerate((2, 1, 3)):
        writers[rank].step = step
        writers[rank].waiting("barrier", (0,))
    assert completed_steps(tmp_path, 3) == 1
    assert completed_steps(tmp_path, 4) is None  # rank 3 never wrote
    for writer in writers:
        writer.close()


def test_step_watcher_reports_each_step_once_as_the_ranks_move(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPESIM_PROGRESS_DIR", raising=False)
    stream = FakeTerminal()
    progress = Progress("run", stream=stream)
    writers = [ProgressWriter(tmp_path, rank) for rank in range(2)]
    with StepWatcher(progress, ranks=2, steps=3):
        monkeypatch.setenv("PIPESIM_PROGRESS_DIR", str(tmp_path))  # as the launcher does
        for step in (0, 1, 2):
            for writer in writers:
                writer.step = step
                writer.waiting("barrier")
            deadline = time.monotonic() + 5
            while stream.getvalue().count("done") < step and time.monotonic() < deadline:
                time.sleep(0.01)
            assert stream.getvalue().count("done") == step  # steps before this one, no more
    lines = [line.split(" (")[0] for line in stream.getvalue().splitlines()]
    assert lines == [f"[pipesim run] step {k}/3 done" for k in (1, 2, 3)]
    for writer in writers:
        writer.close()


def test_run_shows_a_line_per_step_on_a_terminal_and_none_when_piped():
    status, shown = run_on_terminal(TINY_RUN)
    assert status == 0, shown
    for step in (1, 2, 3):
        assert f"[pipesim run] step {step}/3 done" in shown, shown
    assert "[pipesim run] starting 2 ranks for 3 steps" in shown
    piped = run_piped(TINY_RUN)
    assert piped.returncode == 0, piped.stderr
    assert "[pipesim" not in piped.stdout + piped.stderr
    assert "step 2: loss" in piped.stdout  # the result itself is unchanged


def test_quiet_silences_progress_on_a_terminal():
    status, shown = run_on_terminal([*TINY_RUN, "--steps", "1", "--quiet"])
    assert status == 0, shown
    assert "[pipesim" not in shown and "step 0: loss" in shown


def test_bench_comm_shows_its_phase_on_a_terminal_and_not_when_piped():
    argv = ["bench-comm", "--sizes", "1KB..2KB", "--ops", "sendrecv"]
    status, shown = run_on_terminal(argv)
    assert status == 0, shown
    assert "[pipesim bench-comm] measuring sendrecv at 2 sizes on 2 ranks ..." in shown
    assert "[pipesim bench-comm] measuring sendrecv at 2 sizes on 2 ranks done" in shown
    piped = run_piped(argv)
    assert piped.returncode == 0, piped.stderr
    assert "[pipesim" not in piped.stdout + piped.stderr and "fit sendrecv" in piped.stdout


def test_sweep_lines_per_point_on_a_terminal_only():
    argv = ["sweep", "--schedule", "gpipe,1f1b", "--pp", "2", "-m", "2,4"]
    status, shown = run_on_terminal(argv)
    assert status == 0, shown
    for index in range(1, 5):
        assert f"[{index}/4]" in shown, shown
    piped = run_piped(argv)
    assert piped.returncode == 0 and "[1/4]" not in piped.stderr + piped.stdout
    # gpipe pp=2 m=2 with the default F = 1 ms, B = 2 ms: (m + pp - 1)(F + B) = 9 ms
    assert "[1/4] gpipe pp=2 m=2 v=1: step 0.009 s" in shown
