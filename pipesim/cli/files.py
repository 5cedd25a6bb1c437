"""Files the user names on the command line: inputs read with one kind of error, and
output paths checked before any work starts.

An output path that cannot be written (its folder missing, a directory given for a
file, no permission) is reported before a simulation, a profile or a run spends
minutes, not after. Every command gets the check from ``check_outputs``, which the
command line calls before the handler; a command says which of its flags write what
with ``parser.set_defaults(output_files=(...), output_dirs=(...))`` when they are not
among the usual ones below.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from schedules.textfile import UserFileError, check_readable, read_text

__all__ = ["PLOTLY_MODES", "UserFileError", "check_output_dir", "check_output_file", "check_outputs",
           "check_readable", "read_text"]

PLOTLY_MODES = ("inline", "cdn")  # the choices of --plotly (viz.html)

# argparse destinations that name a file a command writes, in every command that has them.
OUTPUT_FILE_FLAGS = ("json", "html", "trace", "chrome_trace", "csv", "predicted_trace", "out")
# ... and those that name a folder a command writes into (created if missing).
OUTPUT_DIR_FLAGS = ("log_dir",)


def flag_name(dest: str) -> str:
    """``chrome_trace`` -> ``--chrome-trace``."""
    return "--" + dest.replace("_", "-")


def check_output_file(path: str | Path, flag: str = "output") -> Path:
    """Raise ``UserFileError`` unless ``path`` can be written as a file: its folder
    exists and is writable, and ``path`` is not itself a folder."""
    path = Path(path)
    if str(path) == "" or path.is_dir():
        raise UserFileError(f"{flag} {path} is a directory; give a file name, e.g. {path / 'out'}")
    folder = path.parent
    if not folder.exists():
        raise UserFileError(f"{flag} {path}: folder {folder} does not exist")
    if not folder.is_dir():
        raise UserFileError(f"{flag} {path}: {folder} is not a folder")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserFileError(f"{flag} {path}: the file is read-only")
    if not path.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise UserFileError(f"{flag} {path}: cannot write into folder {folder} (permission denied)")
    return path


def check_output_dir(path: str | Path, flag: str = "output folder") -> Path:
    """Raise ``UserFileError`` unless ``path`` is, or can be created as, a writable folder."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise UserFileError(f"{flag} {path} is a file; give a folder (it is created if missing)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserFileError(f"{flag} {path}: cannot write into that folder (permission denied)")
        return path
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserFileError(f"{flag} {path}: {ancestor} is a file, so the folder cannot be created")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserFileError(f"{flag} {path}: cannot create it inside {ancestor} (permission denied)")
    return path


def check_outputs(args: argparse.Namespace) -> None:
    """Check every output path the parsed flags name, before the command does any work."""
    dirs = set(OUTPUT_DIR_FLAGS) | set(getattr(args, "output_dirs", ()))
    files = (set(OUTPUT_FILE_FLAGS) | set(getattr(args, "output_files", ()))) - dirs
    for dest in sorted(files):
        value = getattr(args, dest, None)
        if isinstance(value, (str, Path)):
            check_output_file(value, flag_name(dest))
    for dest in sorted(dirs):
        value = getattr(args, dest, None)
        if isinstance(value, (str, Path)):
            check_output_dir(value, flag_name(dest))
