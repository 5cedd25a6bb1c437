"""Where each rank is in its program, readable after the rank is gone.

A rank killed by a signal cannot say what it was doing, so every rank writes its
current step and action into a small memory-mapped file before running the action; the
launcher reads the files to name the action of a rank that died. Writing into the map is
a memory copy, cheap enough to do on every action.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from schedules.action import Action

SLOT = 64  # bytes: "step 12 action 13SEND_F127" fits with room to spare


def progress_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.progress"


class ProgressWriter:
    """Keeps one rank's ``step N action A`` line current in its progress file."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        path = progress_path(directory, rank)
        with open(path, "wb") as file:
            file.write(b" " * SLOT)
        self.file = open(path, "r+b")  # noqa: SIM115 - held open for the rank's lifetime
        self.map = mmap.mmap(self.file.fileno(), SLOT)
        self.step = 0

    def write(self, text: str) -> None:
        self.map[:SLOT] = text.encode()[:SLOT].ljust(SLOT)

    def on_action(self, action: Action) -> None:
        self.write(f"step {self.step} action {action}")

    def close(self) -> None:
        self.map.close()
        self.file.close()


def read_progress(directory: str | Path | None, rank: int) -> str | None:
    """The last line rank ``rank`` wrote, or None if it wrote none."""
    if directory is None:
        return None
    path = progress_path(directory, rank)
    if not path.exists():
        return None
    text = path.read_bytes().decode(errors="replace").strip()
    return text or None


def progress_dir_from_env() -> str | None:
    """``PIPESIM_PROGRESS_DIR``: set by the launcher; torchrun users may set it too."""
    directory = os.environ.get("PIPESIM_PROGRESS_DIR")
    return directory if directory and os.path.isdir(directory) else None
