"""Running a pipesim command in-process the way a user would, for tests that read its
``--json`` output."""

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
