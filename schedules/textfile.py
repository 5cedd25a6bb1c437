"""Reading a file a user named (a schedule CSV, a costs or topology file, a trace), and
writing one whole.

Every loader goes through ``read_text`` so a wrong path gets the same one-line answer
everywhere — "no such file: PATH", "PATH is a directory", "PATH is not a text file" —
naming the file and what it was meant to be, instead of a raw ``[Errno 2]`` or a
``'utf-8' codec can't decode`` that does not say which file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


class UserFileError(ValueError):
    """A file the user named cannot be read as what it was given for."""


def check_readable(path: str | Path, what: str = "file") -> Path:
    """``path`` as a ``Path`` once it is known to be an existing, readable regular file."""
    path = Path(path)
    if not path.exists():
        raise UserFileError(f"no such file: {path}" + (f" (the {what})" if what != "file" else ""))
    if path.is_dir():
        raise UserFileError(f"{path} is a directory; expected a {what}")
    if not path.is_file():  # reading a FIFO, a device or a socket would wait for a writer forever
        raise UserFileError(f"{path} is not a regular file (a pipe, device or socket); expected a {what}")
    if not os.access(path, os.R_OK):
        raise UserFileError(f"cannot read {path}: permission denied")
    return path


def read_text(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of ``path``; ``what`` (e.g. "schedule CSV") goes into the errors."""
    path = check_readable(path, what)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UserFileError(f"cannot read {path}: {error.strerror or error}") from None
    if b"\x00" in data[:8192]:
        raise UserFileError(f"{path} is a binary file, not a {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserFileError(
            f"{path} is not a UTF-8 text file (byte 0x{data[error.start]:02x} at offset {error.start}); "
            f"expected a {what}"
        ) from None


def describe_yaml_error(error: Exception) -> str:
    """A YAML parser error as one short phrase with its line and column (PyYAML's own
    text spans several lines and quotes the input back)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return " ".join(str(problem).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {' '.join(str(problem).split())}"


def write_whole(path: str | Path, write: Callable[[IO[str]], None]) -> None:
    """Write through ``write`` into a sibling file, then rename it over ``path``.

    Why: a reader in another process (each rank a user's script spawns re-runs its top
    level, saving and loading the same files at once) then sees the old file or the new
    one whole, never a truncated one; a write that fails leaves ``path`` as it was."""
    path = Path(path)
    try:
        handle = tempfile.NamedTemporaryFile("w", newline="", dir=path.parent, prefix=f".{path.name}.",
                                             suffix=".tmp", delete=False)
    except OSError as error:  # name the file asked for, not the sibling
        raise type(error)(error.errno, error.strerror, str(path)) from None
    try:
        with handle:
            write(handle)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(handle.name, 0o666 & ~umask)  # the mode open(path, "w") would have given it
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def write_text_whole(path: str | Path, text: str) -> None:
    """``Path.write_text`` that readers never see half done (``write_whole``)."""
    write_whole(path, lambda handle: handle.write(text))
