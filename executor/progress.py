"""Where each rank is in its program, readable after the rank is gone.

A rank killed by a signal cannot say what it was doing, so every rank writes its
current step and action into a small memory-mapped file before running the action; the
launcher reads the files to name the action of a rank that died. Writing into the map is
a memory copy, cheap enough to do on every action.

Each line also says whether the rank was *running* (its own work) or *waiting* for
peers (a P2P group, a collective, the step's barrier), and when it got there. That is
how the launcher tells the rank that stopped first from the ranks that timed out waiting
for it: the first one to stop is a rank that was running, not one that was waiting, and
among several the one whose line is oldest. The rank whose watchdog fired first is
usually a waiting one, so it is never blamed for that alone.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

from schedules.action import Action

SLOT = 160  # bytes: "W 1764520000.123456 step 12 action 13SEND_F127+13RECV_B120 (waiting for rank 3)" fits
RUNNING, WAITING = "R", "W"


def progress_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.progress"


@dataclass(frozen=True)
class Progress:
    """One rank's last line: what it was on, whether it was waiting for peers, and since
    when (seconds since the epoch, comparable across the ranks of one machine)."""

    where: str
    waiting: bool
    since: float


class ProgressWriter:
    """Keeps one rank's ``step N action A`` line current in its progress file."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        path = progress_path(directory, rank)
        with open(path, "wb") as file:
            file.write(b" " * SLOT)
        self.file = open(path, "r+b")  # noqa: SIM115 - held open for the rank's lifetime
        self.map = mmap.mmap(self.file.fileno(), SLOT)
        self.step = 0
        self.where = ""

    def write(self, state: str, where: str) -> None:
        self.where = where
        self.map[:SLOT] = f"{state} {time.time():.6f} {where}".encode()[:SLOT].ljust(SLOT)

    def on_action(self, action: Action) -> None:
        """The rank starts ``action`` (its own work until it says it waits)."""
        self.write(RUNNING, f"step {self.step} action {action}")

    def waiting(self, what: str, peers: tuple[int, ...] = ()) -> None:
        """The rank blocks on ``what`` (an action, a group, a collective) for ``peers``."""
        suffix = f" (waiting for rank {', '.join(map(str, sorted(set(peers))))})" if peers else " (waiting)"
        self.write(WAITING, f"step {self.step} {what}{suffix}")

    def running(self) -> None:
        """The wait is over: the rank runs again at the place it waited."""
        self.write(RUNNING, self.where.split(" (waiting")[0])

    def close(self) -> None:
        self.map.close()
        self.file.close()


def read_progress(directory: str | Path | None, rank: int) -> Progress | None:
    """The last line rank ``rank`` wrote, or None if it wrote none."""
    if directory is None:
        return None
    path = progress_path(directory, rank)
    if not path.exists():
        return None
    text = path.read_bytes().decode(errors="replace").strip()
    state, _, rest = text.partition(" ")
    since, _, where = rest.partition(" ")
    if state not in (RUNNING, WAITING) or not where:
        return None
    try:
        return Progress(where, state == WAITING, float(since))
    except ValueError:
        return None


def progress_dir_from_env() -> str | None:
    """``PIPESIM_PROGRESS_DIR``: set by the launcher; torchrun users may set it too."""
    directory = os.environ.get("PIPESIM_PROGRESS_DIR")
    return directory if directory and os.path.isdir(directory) else None
