"""Running a pipesim command in-process the way a user would, for tests that read its
``--json`` output or its one-line refusal."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from pipesim.cli import main


def simulate_json(args: list[str]) -> dict:
    """``pipesim simulate ARGS --json FILE``'s result (the command must succeed)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        assert main(["simulate", *args, "--json", str(out)]) == 0
        return json.loads(out.read_text())


def assert_one_line_error(capsys, args: list[str], message: str) -> None:
    """``pipesim ARGS`` exits 2 with ``message`` in a one-line error and no traceback."""
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
