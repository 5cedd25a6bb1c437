"""What a failed run tells its user: the rank that stopped first is blamed (not the one
whose timeout fired first), the default output is one summary line plus the failing
rank's own error line with no traceback, and runs that cannot start on the visible GPUs
are refused before any process starts.

The blame tests build the launcher's inputs by hand (failure records and progress
files as the ranks write them), so each situation is exact; the CLI tests run real
ranks on gloo.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from executor.config import ConfigError
from executor.launch import describe_failure
from executor.process import check_devices
from executor.progress import ProgressWriter, read_progress

ROOT = Path(__file__).resolve().parent.parent


def failure(exitcode: int, message: str = "") -> SimpleNamespace:
    """A failure record as torch's elastic launcher gives it."""
    names = {-signal.SIGTERM: "SIGTERM", -signal.SIGKILL: "SIGKILL", -signal.SIGABRT: "SIGABRT"}
    return SimpleNamespace(exitcode=exitcode, message=message, signal_name=lambda: names[exitcode])


def write(directory: Path, rank: int, step: int, *, action: str | None = None, waiting: str | None = None,
          peers: tuple[int, ...] = ()) -> None:
    writer = ProgressWriter(directory, rank)
    writer.step = step
    if action is not None:
        from schedules.action import parse_action

        writer.on_action(parse_action(action))
    if waiting is not None:
        writer.waiting(waiting, peers)
    writer.close()


def test_progress_line_round_trips(tmp_path: Path) -> None:
    write(tmp_path, 3, 2, action="1F0", waiting="action 1SEND_F0+1RECV_B0", peers=(2, 2))
    line = read_progress(tmp_path, 3)
    assert line.waiting and line.where == "step 2 action 1SEND_F0+1RECV_B0 (waiting for rank 2)"
    assert abs(line.since - time.time()) < 60
    assert read_progress(tmp_path, 4) is None


def test_a_hung_rank_is_blamed_before_the_rank_that_timed_out_waiting_for_it(tmp_path: Path) -> None:
    # rank 0 reached its receive first and timed out there; rank 1 stopped later, inside 1B0.
    write(tmp_path, 0, 0, waiting="action 0RECV_B0", peers=(1,))
    time.sleep(0.01)
    write(tmp_path, 1, 0, action="1B0")
    message = describe_failure({0: failure(1, "RankFailedError: rank 0 failed in step 0 on action 0RECV_B0 "
                                              "(waiting for rank 1): RuntimeError: Timed out waiting 10000ms")},
                               str(tmp_path))
    summary, error = message.splitlines()
    assert summary.startswith("rank 1 stopped at step 0 action 1B0")
    assert "rank 0" in summary  # named after it, as a consequence
    assert error.startswith("rank 0 failed in step 0 on action 0RECV_B0")


def test_a_watchdog_abort_of_a_waiting_rank_is_not_the_cause(tmp_path: Path) -> None:
    # NCCL's watchdog kills a waiting rank with SIGABRT; the hung rank is stopped by the launcher.
    write(tmp_path, 0, 0, waiting="in the loss all-reduce")
    write(tmp_path, 1, 0, action="1F1")
    message = describe_failure({0: failure(-signal.SIGABRT), 1: failure(-signal.SIGTERM)}, str(tmp_path))
    assert message.startswith("rank 1 stopped at step 0 action 1F1")
    assert "rank 0 was killed by SIGABRT" in message


def test_of_two_ranks_that_raised_the_one_that_stopped_first_is_blamed(tmp_path: Path) -> None:
    write(tmp_path, 2, 0, action="2F0")
    time.sleep(0.01)
    write(tmp_path, 0, 0, action="0B1")
    message = describe_failure({0: failure(1, "RankFailedError: rank 0 failed in step 0 on action 0B1: "
                                              "ValueError: late"),
                                2: failure(1, "RankFailedError: rank 2 failed in step 0 on action 2F0: "
                                              "ValueError: early")}, str(tmp_path))
    summary, error = message.splitlines()
    assert summary.startswith("rank 2 exited with code 1 at step 0 action 2F0")
    assert error == "rank 2 failed in step 0 on action 2F0: ValueError: early"


def test_a_killed_rank_is_blamed_with_no_error_line(tmp_path: Path) -> None:
    write(tmp_path, 0, 0, waiting="action 0RECV_F1", peers=(1,))
    write(tmp_path, 1, 0, action="1F1")
    message = describe_failure({1: failure(-signal.SIGKILL)}, str(tmp_path))
    assert message.splitlines()[0].startswith("rank 1 was killed by SIGKILL at step 0 action 1F1")
    assert len(message.splitlines()) == 1


def test_more_nccl_ranks_than_gpus_are_refused_naming_both_counts(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"2 ranks on this node need 2 GPUs .* but 1 is visible.*--backend gloo"):
        check_devices("auto", 2)
    check_devices("auto", 1)
    check_devices("gloo", 8)  # CPU ranks need no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="0 are visible"):
        check_devices("nccl", 2)


def run_cli(*flags: str, timeout: float = 110) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    finished = subprocess.run([sys.executable, "-m", "pipesim", "run", *flags], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return finished, time.monotonic() - started


TINY = ("--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--hidden", "8", "--layers", "2",
        "--batch-size", "2")


@pytest.mark.timeout(170)
def test_dp_tp_hang_ends_within_the_timeout_naming_the_hung_rank(tmp_path: Path) -> None:
    finished, _ = run_cli("--dp", "2", "--tp", "2", "--pp", "1", "--model", "gpt", "--hidden", "16",
                          "--heads", "4", "--layers", "2", "--batch-size", "4", "--microbatches", "2",
                          "--inject-failure", "1:0F1:hang", "--timeout", "10", "--log-dir", str(tmp_path),
                          timeout=160)
    ended = time.time()
    assert finished.returncode == 1
    # From the moment rank 1 hung (it says when, in its own log), not from the start:
    # starting four ranks on a busy 2-core machine takes a varying half minute.
    (hung,) = [line for path in tmp_path.rglob("stderr.log") for line in path.read_text().splitlines()
               if "--inject-failure hangs before 0F1" in line]
    seconds = ended - float(hung.rsplit(" at ", 1)[1])
    assert seconds < 10 + 30, f"the job ended {seconds:.0f} s after rank 1 hung"
    # The summary names the hung rank. (Once in a loaded full suite, a rank that gloo's
    # timeout aborted wrote the C++ runtime's "terminate called ..." and a thread dump to
    # the console before it, from its teardown: the test below.)
    summary = [line for line in finished.stderr.splitlines() if line.startswith("pipesim run: failed:")]
    assert summary and summary[0].startswith("pipesim run: failed: rank 1 stopped at step 0 action 0F1"), \
        finished.stderr
    assert "Traceback" not in finished.stderr + finished.stdout


LATE_OUTPUT_LAUNCH = """
from executor.launch import RankLogs, elastic_run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from tests.late_output_rank import fail_with_output_at_exit

if __name__ == "__main__":
    logs = RankLogs({log_dir!r}, verbose=False)
    try:
        elastic_run(fail_with_output_at_exit, (), 2, 1, logs)
    except ChildFailedError as error:
        for rank, failure in sorted(error.failures.items()):
            print(rank, failure.exitcode, failure.message["message"])
    finally:
        logs.close()
"""


@pytest.mark.timeout(120)
def test_a_failed_ranks_teardown_writes_nothing_to_the_console(tmp_path: Path) -> None:
    """A rank whose process writes to stderr at its exit (as gloo's C++ runtime and the
    fault handler do when a failed rank is torn down after a peer's socket went away)
    writes nothing to the console: it ends before torch's launcher hands its stderr back
    (``executor.rank_exit``); its error reaches the launcher as before, exit code 1 and
    the exception's line, and its traceback stays in its log."""
    from tests.late_output_rank import LATE  # noqa: PLC0415

    script = tmp_path / "launch.py"
    script.write_text(LATE_OUTPUT_LAUNCH.format(log_dir=str(tmp_path / "logs")))
    finished = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=110,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert LATE.decode().strip() not in finished.stdout + finished.stderr
    reported = finished.stdout.splitlines()  # the launcher reports the first failure it saw
    assert reported and all(line.split(" ", 1)[1] == "1 RuntimeError: planned failure of the rank"
                            for line in reported), finished.stdout + finished.stderr
    logged = [path.read_text() for path in (tmp_path / "logs").rglob("stderr.log")]
    assert logged and any("Traceback" in text and "planned failure" in text for text in logged)


@pytest.mark.timeout(120)
def test_failed_run_prints_summary_and_error_line_and_tracebacks_only_when_verbose() -> None:
    quiet, _ = run_cli(*TINY, "--inject-failure", "1:1B0:raise")
    assert quiet.returncode == 1
    lines = quiet.stderr.strip().splitlines()
    assert lines[0].startswith("pipesim run: failed: rank 1 exited with code 1 at step 0 action 1B0")
    assert lines[1] == ("rank 1 failed in step 0 on action 1B0: RuntimeError: failure injected by "
                        "--inject-failure 1:1B0:raise")
    assert lines[2].startswith("(each rank's output: ")
    assert len(lines) == 3 and "Traceback" not in quiet.stdout
    log_dir = Path(lines[2].removeprefix("(each rank's output: ").split(";")[0])
    assert any("Traceback" in path.read_text() for path in log_dir.rglob("*.log"))
    verbose, _ = run_cli(*TINY, "--inject-failure", "1:1B0:raise", "--verbose")
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr
    assert "rank 1 failed in step 0 on action 1B0" in verbose.stderr
