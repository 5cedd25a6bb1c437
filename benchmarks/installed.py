"""The environment a benchmark runs a command in: Python's bytecode as an installed
package has it.

``pip install`` compiles every module to bytecode as it installs (``compileall``), so a
user's first ``pipesim`` command reads compiled modules; torch's, already installed, do
too. A machine that sets ``PYTHONDONTWRITEBYTECODE`` (containers often do) would instead
make every timed run compile pipesim's sources again (0.2-0.3 s of a command) while torch
reads its bytecode: not like with like. So the commands timed run with the bytecode
written once, before the clock starts, into a folder of their own
(``PYTHONPYCACHEPREFIX``), as an install would have written it; nothing else is warmed.
"""

from __future__ import annotations

import compileall
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipesim", "schedules", "executor", "viz")


def installed_env(cache: str | Path) -> dict[str, str]:
    """This process's environment with pipesim's modules compiled into ``cache`` and
    Python told to read (and write) bytecode there."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(cache)
    previous = sys.pycache_prefix
    sys.pycache_prefix = str(cache)
    try:
        for package in PACKAGES:
            compileall.compile_dir(ROOT / package, quiet=1)
    finally:
        sys.pycache_prefix = previous
    return env
