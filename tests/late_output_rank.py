"""A rank function for ``tests/test_executor_failure_report.py``: it arranges output at
its process's exit (after torch's launcher has handed the process's stderr back to the
console) and then fails, as a rank does whose C++ runtime reports from its teardown."""

from __future__ import annotations

import atexit
import os

LATE = b"late output from the failed rank's teardown\n"


def fail_with_output_at_exit() -> None:
    atexit.register(os.write, 2, LATE)
    raise RuntimeError("planned failure of the rank")
