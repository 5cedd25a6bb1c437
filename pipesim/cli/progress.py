"""Live progress for the long commands (run, profile, bench-comm, compare, plan).

Progress goes to stderr and only when stderr is a terminal, so a piped or captured
command's output stays exactly its result; ``--quiet`` silences it on a terminal too.
No third-party progress library: a status line per phase or step is all these
commands need, and the project keeps its dependency list short.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROGRESS_DIR_VARIABLE = "PIPESIM_PROGRESS_DIR"  # set by executor.launch for its ranks
POLL_SECONDS = 0.05


class Progress:
    """Prints ``[pipesim CMD] message (elapsed)`` lines on a terminal, nothing otherwise."""

    def __init__(self, command: str, quiet: bool = False, stream=None) -> None:
        self.command = command
        self.stream = sys.stderr if stream is None else stream
        self.enabled = not quiet and _is_terminal(self.stream)
        self.start = time.monotonic()

    def line(self, message: str) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        print(f"[pipesim {self.command}] {message} ({elapsed:.1f} s)", file=self.stream, flush=True)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``name ...`` before and ``name done`` after the block."""
        self.line(f"{name} ...")
        yield
        self.line(f"{name} done")


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def progress_from_args(command: str, args) -> Progress:
    return Progress(command, quiet=getattr(args, "quiet", False))


def add_quiet_arg(parser) -> None:
    if "--quiet" not in parser._option_string_actions:
        parser.add_argument("--quiet", action="store_true",
                            help="no progress lines (they are shown only when stderr is a terminal)")


def completed_steps(directory: str | Path, ranks: int) -> int | None:
    """Steps every rank has finished, from the ranks' progress files (``step N action A``:
    a rank at step N has finished steps 0..N-1); None before every rank has written."""
    from executor.progress import read_progress  # noqa: PLC0415 - torch-free module

    steps = []
    for rank in range(ranks):
        line = read_progress(directory, rank)
        text = line.where if line is not None else ""
        if not text.startswith("step "):
            return None
        try:
            steps.append(int(text.split()[1]))
        except (IndexError, ValueError):
            return None
    return min(steps)


class StepWatcher:
    """Reports ``step k/N done`` as the ranks of a launched run move on, by polling the
    progress files the ranks keep (``executor.progress``). The launcher names their
    directory in ``PIPESIM_PROGRESS_DIR`` when it starts the ranks; the watcher waits for
    a new value, so a directory left from an earlier launch is never read."""

    def __init__(self, progress: Progress, ranks: int, steps: int) -> None:
        self.progress, self.ranks, self.steps = progress, ranks, steps
        self.reported = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.previous_dir = os.environ.get(PROGRESS_DIR_VARIABLE)

    def __enter__(self) -> StepWatcher:
        if self.progress.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join()
        if exc[0] is None:
            self.report_up_to(self.steps)

    def report_up_to(self, done: int) -> None:
        while self.reported < min(done, self.steps):
            self.reported += 1
            self.progress.line(f"step {self.reported}/{self.steps} done")

    def poll(self) -> None:
        while not self.stop_event.wait(POLL_SECONDS):
            directory = os.environ.get(PROGRESS_DIR_VARIABLE)
            if not directory or directory == self.previous_dir or not os.path.isdir(directory):
                continue
            done = completed_steps(directory, self.ranks)
            if done is not None:
                self.report_up_to(done)
